"""A PyTorch (python3-torch 1.13, CPU) Llama forward written from transformers' modeling_llama
(LlamaRMSNorm, LlamaRotaryEmbedding's default rope, rotate_half, repeat_kv, eager attention
with the softmax in float32, LlamaMLP), used as the reference for the numerics of
--compute-dtype. Three ways to run the linear layers (`mode`):

  "float32"      every tensor float32: what the default mode computes (the numpy oracle's numbers)
  "bf16_inputs"  each linear's input and weight rounded to bfloat16 (round to nearest even),
                 multiplied and summed in float32, output float32: the definition of
                 --compute-dtype bfloat16 (only the summation order differs)
  "bf16_inputs_f64"  the same with the products summed in float64 (then rounded to float32):
                 another valid summation order. Rounding each linear's input to bf16 amplifies
                 the last-bit differences of a summation order (an input a hair either side of a
                 rounding boundary moves by a whole bf16 step), so the gap between these two is
                 the noise floor any bf16-input implementation is measured against
  "autocast"     float32 parameters under torch.autocast("cpu", dtype=torch.bfloat16): what a
                 trainer running bf16 autocast computes (linears AND the attention matmuls in bf16,
                 their outputs rounded to bf16, norms and softmax in float32)

Weights come from the checkpoint as float32 (a BF16 checkpoint's values exactly)."""
import os

import numpy as np
import torch
import torch.nn.functional as F

from fdtest import read_json  # noqa: E402  (also puts scripts/ on sys.path)
import safetensors_np  # noqa: E402

MODES = ("float32", "bf16_inputs", "bf16_inputs_f64", "autocast")


def load(dir_):
    """(config dict, {name: float32 torch tensor})."""
    cfg = read_json(os.path.join(dir_, "config.json"))
    idx = os.path.join(dir_, "model.safetensors.index.json")
    files = sorted(set(read_json(idx)["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    w = {}
    for f in files:
        for k, v in safetensors_np.load_file(os.path.join(dir_, f)).items():
            w[k] = torch.from_numpy(np.ascontiguousarray(v.astype(np.float32)))
    return cfg, w


def _rms_norm(x, weight, eps):
    # LlamaRMSNorm.forward: variance in float32, then back to the input dtype, times the weight
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def logits(cfg, w, ids, mode="float32"):
    """Logits [len(ids), vocab] float32 of a causal pass over `ids` in `mode` (see MODES)."""
    assert mode in MODES, mode
    assert cfg["architectures"][0] == "LlamaForCausalLM", "Llama only"
    rs = cfg.get("rope_scaling") or {}
    assert rs.get("rope_type", rs.get("type", "default")) == "default", "default rope only"

    def linear(x, weight, bias=None):
        if mode in ("bf16_inputs", "bf16_inputs_f64"):
            x, weight = x.bfloat16().float(), weight.bfloat16().float()
        if mode == "bf16_inputs_f64":
            return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
        return F.linear(x, weight, bias)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or h // nh
        eps = cfg["rms_norm_eps"]
        theta = cfg.get("rope_theta", 10000.0)
        T = len(ids)
        x = w["model.embed_tokens.weight"][torch.tensor(ids, dtype=torch.long)][None]  # [1, T, h]
        # LlamaRotaryEmbedding (default): inv_freq, then cos/sin of cat(freqs, freqs), in float32
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, T, hd]
        mask = torch.full((T, T), float("-inf")).triu(1)
        for il in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{il}."
            xn = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = linear(xn, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = linear(xn, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = linear(xn, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(1, T, nh, hd).transpose(1, 2)
            k = k.view(1, T, nkv, hd).transpose(1, 2)
            v = v.view(1, T, nkv, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin  # apply_rotary_pos_emb
            k = k * cos + _rotate_half(k) * sin
            k = k.repeat_interleave(nh // nkv, dim=1)  # repeat_kv
            v = v.repeat_interleave(nh // nkv, dim=1)
            s = torch.matmul(q, k.transpose(2, 3)) / (hd ** 0.5) + mask
            s = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            att = torch.matmul(s, v).transpose(1, 2).reshape(1, T, nh * hd)
            x = x + linear(att, w[p + "self_attn.o_proj.weight"])
            xn = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            g = linear(xn, w[p + "mlp.gate_proj.weight"])
            u = linear(xn, w[p + "mlp.up_proj.weight"])
            x = x + linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])
        x = _rms_norm(x, w["model.norm.weight"], eps)
        head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
        return linear(x, head)[0].float()


def logprobs_of(cfg, w, ids, mode):
    """[len(ids) - 1] float64 logprob of ids[i] after ids[:i] (the daemon's echo scores, first dropped)."""
    lg = logits(cfg, w, ids, mode).double()
    lp = torch.log_softmax(lg, dim=-1)
    return np.array([float(lp[i - 1, ids[i]]) for i in range(1, len(ids))])
