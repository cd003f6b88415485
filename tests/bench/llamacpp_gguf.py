#!/usr/bin/env python3
"""Convert a Hugging Face Llama checkpoint (config.json + *.safetensors, BF16 or F32) to GGUF for
llama.cpp, with llama.cpp's own gguf-py (pure Python + numpy; convert_hf_to_gguf.py needs
transformers and torch-free tokenizer libraries that Debian lacks). Issue 28 peer comparison.

  /usr/bin/python3 tests/bench/llamacpp_gguf.py --checkpoint DIR --gguf-py SRC/gguf-py \\
      --out model.gguf [--dtype bf16|f32]

What it writes, following convert_hf_to_gguf.py's LlamaModel (llama.cpp v0.4.0):
- architecture "llama"; context length, embedding / feed-forward lengths, block count, head
  counts, rope dimension and base, RMS-norm epsilon from config.json.
- tensors token_embd, blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,
  ffn_up,ffn_down}, output_norm, output (output is token_embd's copy when tied). q and k rows are
  permuted from HF's rotate-half order to GGML's interleaved rope (LlamaModel.permute). Matrices
  keep the checkpoint's dtype with --dtype bf16 (BF16 bits copied, never re-rounded) or are
  widened exactly to F32 with --dtype f32; 1-D norm weights are F32 (as convert_hf_to_gguf does).
- a minimal SentencePiece ("llama") vocabulary: the checkpoint's tokenizer.json pieces (its
  <0xNN> byte pieces typed BYTE, specials CONTROL) padded with unused "[PAD<i>]" pieces up to
  vocab_size. Only token ids are used by the benchmarks, never text.
Errors: a config that is not Llama-shaped, a missing tensor, or a dtype other than BF16/F32 stops
with a message naming it.
"""
import argparse
import glob
import json
import os
import struct
import sys

import numpy as np

ST_DTYPES = {"BF16": np.uint16, "F32": np.float32}


def read_safetensors(directory):
    """{name: (dtype string, shape tuple, raw numpy array)} for every *.safetensors in directory;
    BF16 arrays are uint16 bit patterns."""
    out = {}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        sys.exit(f"llamacpp_gguf: no *.safetensors in {directory}")
    for path in files:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            base = 8 + n
        blob = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dt = info["dtype"]
            if dt not in ST_DTYPES:
                sys.exit(f"llamacpp_gguf: tensor {name} has dtype {dt}; only BF16 and F32 are supported")
            lo, hi = info["data_offsets"]
            arr = np.frombuffer(blob[base + lo: base + hi], dtype=ST_DTYPES[dt]).reshape(info["shape"])
            out[name] = (dt, tuple(info["shape"]), arr)
    return out


def to_f32(dt, arr):
    """Exact f32 values of a BF16 (uint16 bits) or F32 array."""
    if dt == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def permute(w, n_head):
    """HF rotate-half row order -> GGML interleaved rope order (convert_hf_to_gguf LlamaModel.permute);
    w: [n_head * head_dim, n_in]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocab(checkpoint, n_vocab, gguf):
    tokens, scores, types = [], [], []
    tj = os.path.join(checkpoint, "tokenizer.json")
    pieces = {}
    specials = set()
    if os.path.exists(tj):
        t = json.load(open(tj))
        v = t["model"]["vocab"]
        pieces = dict(v) if isinstance(v, dict) else {p: i for i, (p, _) in enumerate(v)}
        specials = {a["id"] for a in t.get("added_tokens", []) if a.get("special")}
    by_id = {i: p for p, i in pieces.items()}
    for i in range(n_vocab):
        p = by_id.get(i)
        if p is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in specials:
            tokens.append(p)
            types.append(gguf.TokenType.UNKNOWN if p == "<unk>" else gguf.TokenType.CONTROL)
        elif p.startswith("<0x") and p.endswith(">") and len(p) == 6:
            tokens.append(p)
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(p)
            types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i))
    return tokens, scores, types


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf  # noqa: E402  (llama.cpp's own package)

    cfg = json.load(open(os.path.join(a.checkpoint, "config.json")))
    if cfg.get("model_type") != "llama":
        sys.exit(f"llamacpp_gguf: config.json model_type {cfg.get('model_type')!r}, expected 'llama'")
    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    hidden, n_vocab = cfg["hidden_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim", hidden // n_head)
    st = read_safetensors(a.checkpoint)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(os.path.basename(os.path.normpath(a.checkpoint)))
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if a.dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    tokens, scores, types = vocab(a.checkpoint, n_vocab, gguf)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)

    def get(name):
        if name not in st:
            sys.exit(f"llamacpp_gguf: tensor {name} missing from {a.checkpoint}")
        return st[name]

    def put(gname, hf_name, perm_heads=None):
        dt, shape, arr = get(hf_name)
        if len(shape) == 1 or a.dtype == "f32" or dt == "F32":
            x = to_f32(dt, arr)
            if perm_heads:
                x = permute(x, perm_heads)
            w.add_tensor(gname, np.ascontiguousarray(x))
            return
        x = np.asarray(arr)  # uint16 BF16 bits, copied as they are
        if perm_heads:
            x = permute(x, perm_heads)
        x = np.ascontiguousarray(x)
        w.add_tensor(gname, x.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)

    put("token_embd.weight", "model.embed_tokens.weight")
    for i in range(n_layer):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", n_head)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", n_kv)
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight" if "lm_head.weight" in st else "model.embed_tokens.weight")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"llamacpp_gguf: wrote {a.out} ({a.dtype}, {os.path.getsize(a.out):,} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
