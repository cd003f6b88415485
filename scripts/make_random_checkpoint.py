#!/usr/bin/env python3
"""Write a Hugging Face-style Llama / Qwen2 / Qwen3 / Mistral checkpoint with random weights, or a
mixture-of-experts Qwen3-MoE / Qwen2-MoE / Mixtral one (per-expert names, or --stacked-experts).

The directory gets config.json, model.safetensors (or N shards plus
model.safetensors.index.json), the tokenizer files copied from
--tokenizer-from, and optionally version.yaml. Weights come from
numpy.random.default_rng(--seed) in a fixed tensor order, so the same seed and
shape give the same values whatever --dtype or --shards is chosen. Weights are
scaled (std 1/sqrt(fan_in), unit-variance embeddings) so that a random model
still produces varied, non-degenerate tokens.

Examples:
  make_random_checkpoint.py --preset tiny-qwen2 --out /tmp/ck_q
  make_random_checkpoint.py --preset tiny-llama-bf16-sharded --out /tmp/ck_s
  make_random_checkpoint.py --preset llama-110m --out /tmp/ck_110m --step 7
  make_random_checkpoint.py --preset llama-1b-bf16-sharded --out /tmp/ck_1b
  make_random_checkpoint.py --preset qwen3-like --out /tmp/ck_q3
  make_random_checkpoint.py --arch llama --rope-scaling '{"rope_type": "linear", "factor": 2}' --out /tmp/ck
  make_random_checkpoint.py --out /tmp/ck --hidden 128 --layers 4 --heads 4 --dtype F16
  make_random_checkpoint.py --preset qwen3-moe-like --out /tmp/ck_moe --stacked-experts
  make_random_checkpoint.py --preset tiny-mimo --out /tmp/ck_mimo          # Qwen2 + 1 MTP layer
  make_random_checkpoint.py --preset tiny-mimo --mtp-mimic --out /tmp/ck_m # MTP layer = layer 0's copy
Needs numpy only (Debian: /usr/bin/python3 with python3-numpy).
"""
import argparse
import glob
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_np import save_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(REPO, "models", "stories260K")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")
TORCH_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# Shape used when neither a preset nor a flag sets a value.
BASE = dict(arch="llama", hidden=64, intermediate=172, layers=2, heads=8,
            kv_heads=None, head_dim=None, vocab=512, max_pos=512,
            rope_theta=10000.0, rms_eps=1e-5, dtype="F32", shards=1, tie=True,
            no_lm_head=False, rope_scaling=None, sliding_window=None, embed_std=1.0,
            experts=None, top_k=None, moe_intermediate=None, shared_intermediate=None,
            norm_topk=None, sparse_step=None, mlp_only_layers=None, stacked_experts=False,
            mtp_layers=1, mtp_mimic=False, mtp_hidden_scale=0.0)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM",
                 "mimo": "MiMoForCausalLM"}
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
PRESETS = {
    "tiny-mimo": dict(arch="mimo", hidden=64, intermediate=176, layers=2,
                      heads=4, kv_heads=2, vocab=512, dtype="F32"),
    "tiny-qwen2": dict(arch="qwen2", hidden=64, intermediate=176, layers=2,
                       heads=4, kv_heads=2, vocab=512, dtype="F32"),
    "tiny-llama-bf16-sharded": dict(arch="llama", hidden=64, intermediate=172,
                                    layers=3, heads=8, kv_heads=4, vocab=512,
                                    dtype="BF16", shards=3, tie=False),
    "llama-110m": dict(arch="llama", hidden=768, intermediate=2048, layers=12,
                       heads=12, kv_heads=12, vocab=32000, max_pos=1024,
                       dtype="F32", tie=True),
    # TinyLlama-1.1B shape (~1.1B params, ~2.2 GB of BF16 in 4 shards), for the
    # weight-control bench (tests/bench/run_control_bench.sh).
    "llama-1b-bf16-sharded": dict(arch="llama", hidden=2048, intermediate=5632,
                                  layers=22, heads=32, kv_heads=4, vocab=32000,
                                  max_pos=2048, dtype="BF16", shards=4,
                                  tie=False),
    # fd_bench's Llama-3- and Qwen3-shaped decode (tests/bench/run_bench.sh), llama-110m's size:
    # Llama-3.2: GQA 4:1 of head_dim 64, rope_scaling llama3, theta 5e5, tied; Qwen3: head_dim
    # 128 with q_dim = 2 x hidden, GQA 2:1, q_norm/k_norm, theta 1e6, tied.
    "llama3-110m": dict(arch="llama", hidden=768, intermediate=2688, layers=12, heads=12,
                        kv_heads=3, head_dim=64, vocab=32000, max_pos=2048,
                        rope_theta=500000.0, tie=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "qwen3-110m": dict(arch="qwen3", hidden=768, intermediate=2304, layers=12, heads=12,
                       kv_heads=6, head_dim=128, vocab=32000, max_pos=2048,
                       rope_theta=1000000.0, rms_eps=1e-6, tie=True),
    # The real configs' shapes scaled down (same head ratios, head_dim, theta, scaling type,
    # tying) to the 512-token stories260K vocabulary, for tests/e2e/test_architectures.py.
    # Llama-3.2-1B: 32/8 heads of 64, theta 5e5, rope_scaling llama3 (factor 32, 1/4, 8192
    # scaled to 64 so that it changes the positions a test reaches), tied.
    "llama3.2-like": dict(arch="llama", hidden=256, intermediate=1024, layers=2,
                          heads=4, kv_heads=1, head_dim=64, vocab=512, max_pos=2048,
                          rope_theta=500000.0, tie=True, embed_std=0.1,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    # Qwen2.5-0.5B: 14/2 heads of 64, theta 1e6, tied, an inactive sliding_window.
    "qwen2.5-like": dict(arch="qwen2", hidden=112, intermediate=608, layers=2, heads=7,
                         kv_heads=1, head_dim=16, vocab=512, max_pos=1024,
                         rope_theta=1000000.0, rms_eps=1e-6, tie=True, embed_std=0.1, sliding_window=32768),
    # Qwen3-0.6B: 16/8 heads of head_dim 128 != hidden/heads, q_norm/k_norm, theta 1e6, tied.
    "qwen3-like": dict(arch="qwen3", hidden=64, intermediate=192, layers=2, heads=4,
                       kv_heads=2, head_dim=128, vocab=512, max_pos=1024,
                       rope_theta=1000000.0, rms_eps=1e-6, tie=True, embed_std=0.1),
    # Mistral-7B-v0.3: 32/8 heads of 128, theta 1e6, untied, sliding_window null.
    "mistral-like": dict(arch="mistral", hidden=128, intermediate=448, layers=2, heads=4,
                         kv_heads=1, head_dim=32, vocab=512, max_pos=1024,
                         rope_theta=1000000.0, tie=False),
    # Mixture of experts, the real configs' shapes scaled down (tests/e2e/test_moe.py).
    # Qwen3-30B-A3B: 32/4 heads of 128, 128 experts top-8 of width 768, norm_topk_prob, theta
    # 1e6, untied; here 16 experts top-4, layer 1 dense (mlp_only_layers) to exercise it, and
    # GQA 2:1 (not 8:1) so that tp 2 divides the KV heads.
    "qwen3-moe-like": dict(arch="qwen3_moe", hidden=64, intermediate=96, layers=3, heads=4,
                           kv_heads=2, head_dim=32, vocab=512, max_pos=1024,
                           rope_theta=1000000.0, rms_eps=1e-6, tie=False, embed_std=0.1,
                           experts=16, top_k=4, moe_intermediate=32, norm_topk=True,
                           sparse_step=1, mlp_only_layers=[1]),
    # Qwen1.5-MoE-A2.7B: 16 heads (MHA), q/k/v biases, 60 experts top-4 of 1408 plus a shared
    # expert of 5632 behind sigmoid(shared_expert_gate), norm_topk_prob false, untied.
    "qwen2-moe-like": dict(arch="qwen2_moe", hidden=64, intermediate=128, layers=2, heads=4,
                           kv_heads=4, head_dim=16, vocab=512, max_pos=1024,
                           rope_theta=1000000.0, rms_eps=1e-6, tie=False, embed_std=0.1,
                           experts=12, top_k=4, moe_intermediate=32, shared_intermediate=128,
                           norm_topk=False, sparse_step=1),
    # The MoE decode bench (docs/benchmarks.md, issue 23): Qwen3-30B-A3B's routing (128 experts,
    # top-8, norm_topk_prob) and head layout (q_dim = 2 x hidden, head_dim 128) scaled to hidden
    # 512 (expert width 768 x 512/2048 = 192), 6 layers, BF16: 226 MB of experts, 8/128 active.
    "qwen3-30b-a3b-bench": dict(arch="qwen3_moe", hidden=512, intermediate=1536, layers=6, heads=8,
                                kv_heads=1, head_dim=128, vocab=8192, max_pos=4096,
                                rope_theta=1000000.0, rms_eps=1e-6, tie=False, embed_std=0.1,
                                dtype="BF16", experts=128, top_k=8, moe_intermediate=192,
                                norm_topk=True, sparse_step=1),
    # Mixtral-8x7B: 32/8 heads of 128, 8 experts top-2 of width intermediate_size, always
    # renormalised, theta 1e6, untied (GQA 2:1 here, for tp 2).
    "mixtral-like": dict(arch="mixtral", hidden=64, intermediate=96, layers=2, heads=4,
                         kv_heads=2, head_dim=16, vocab=512, max_pos=1024,
                         rope_theta=1000000.0, rms_eps=1e-5, tie=False, embed_std=0.1,
                         experts=8, top_k=2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named shape; explicit flags override its values")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), help="default llama")
    p.add_argument("--hidden", type=int, help="hidden size (default 64)")
    p.add_argument("--intermediate", type=int, help="MLP size (default 172)")
    p.add_argument("--layers", type=int, help="decoder layers (default 2)")
    p.add_argument("--heads", type=int, help="attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, help="default hidden/heads")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 512)")
    p.add_argument("--max-pos", type=int, help="max positions (default 512)")
    p.add_argument("--rope-theta", type=float, help="default 10000.0")
    p.add_argument("--rms-eps", type=float, help="default 1e-5")
    p.add_argument("--dtype", choices=["F32", "BF16", "F16"], help="default F32")
    p.add_argument("--shards", type=int, help="number of safetensors files (default 1)")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction,
                   help="tie_word_embeddings (default --tie)")
    p.add_argument("--no-lm-head", action="store_true", default=None,
                   help="with --tie, omit lm_head.weight (default: write a copy "
                        "of the embeddings)")
    p.add_argument("--rope-scaling", type=json.loads,
                   help="config.json rope_scaling as JSON (default none)")
    p.add_argument("--sliding-window", type=int,
                   help="config.json sliding_window (Mistral: active; Qwen: with "
                        "use_sliding_window false)")
    p.add_argument("--embed-std", type=float,
                   help="std of the embeddings (default 1.0; a tied model generates "
                        "varied tokens with ~0.1)")
    p.add_argument("--experts", type=int, help="MoE: num_experts / num_local_experts")
    p.add_argument("--top-k", type=int, help="MoE: num_experts_per_tok")
    p.add_argument("--moe-intermediate", type=int, help="MoE (Qwen): moe_intermediate_size")
    p.add_argument("--shared-intermediate", type=int,
                   help="Qwen2-MoE: shared_expert_intermediate_size")
    p.add_argument("--norm-topk", action=argparse.BooleanOptionalAction,
                   help="MoE (Qwen): norm_topk_prob")
    p.add_argument("--sparse-step", type=int, help="MoE (Qwen): decoder_sparse_step")
    p.add_argument("--mlp-only-layers", type=json.loads, help="MoE (Qwen): JSON list")
    p.add_argument("--stacked-experts", action="store_true", default=None,
                   help="MoE: write experts stacked (experts.gate_up_proj [E, 2I, H], "
                        "experts.down_proj [E, H, I]) instead of per expert")
    p.add_argument("--mtp-layers", type=int, help="MiMo: num_nextn_predict_layers (default 1)")
    p.add_argument("--mtp-mimic", action="store_true", default=None,
                   help="MiMo: MTP layer = a copy of decoder layer 0 fed the token only (input_proj = [0 | I], "
                        "unit norms): its drafts then often match the target (a draft that gets accepted)")
    p.add_argument("--mtp-hidden-scale", type=float,
                   help="MiMo --mtp-mimic: input_proj's hidden half = this x a random [H, H] (default 0: token only)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--tokenizer-from", default=DEFAULT_TOKENIZER,
                   help="directory to copy tokenizer files from "
                        "(default <repo>/models/stories260K; '' to skip)")
    p.add_argument("--step", type=int, help="also write version.yaml with 'step: N'")
    a = p.parse_args(argv)
    # Resolve each shape value: explicit flag > preset > BASE.
    cfg = dict(BASE, **PRESETS.get(a.preset, {}))
    for key in BASE:
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    cfg["kv_heads"] = cfg["kv_heads"] or cfg["heads"]
    if cfg["head_dim"] is None:
        if cfg["hidden"] % cfg["heads"]:
            p.error("--hidden must be divisible by --heads (or give --head-dim)")
        cfg["head_dim"] = cfg["hidden"] // cfg["heads"]
    if cfg["heads"] % cfg["kv_heads"]:
        p.error("--heads must be a multiple of --kv-heads")
    if cfg["no_lm_head"] and not cfg["tie"]:
        p.error("--no-lm-head needs tied embeddings (--tie)")
    if not 1 <= cfg["shards"] <= max(cfg["layers"], 1):
        p.error("--shards must be between 1 and --layers")  # no empty shard
    return a, cfg


def tensor_groups(cfg, rng):
    """Yield (group, {name: float32 array}) in a fixed order, one group at a
    time: "embed", then each layer index, then "final". Values drawn lazily."""
    h, hd, kvh = cfg["hidden"], cfg["head_dim"], cfg["kv_heads"]
    q_out, kv_out, inter = cfg["heads"] * hd, kvh * hd, cfg["intermediate"]

    def normal(shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def linear(out_f, in_f):  # PyTorch layout [out, in], std 1/sqrt(fan_in)
        return normal((out_f, in_f), 1.0 / np.sqrt(in_f))

    def norm(n):
        return 1.0 + normal((n,), 0.1)

    embed = normal((cfg["vocab"], h), cfg["embed_std"])
    yield "embed", {"model.embed_tokens.weight": embed}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": norm(h),
             p + "self_attn.q_proj.weight": linear(q_out, h),
             p + "self_attn.k_proj.weight": linear(kv_out, h),
             p + "self_attn.v_proj.weight": linear(kv_out, h)}
        if cfg["arch"] in ("qwen3", "qwen3_moe"):
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        if cfg["arch"] in ("qwen2", "qwen2_moe", "mimo"):
            t[p + "self_attn.q_proj.bias"] = normal((q_out,), 0.1)
            t[p + "self_attn.k_proj.bias"] = normal((kv_out,), 0.1)
            t[p + "self_attn.v_proj.bias"] = normal((kv_out,), 0.1)
        t[p + "self_attn.o_proj.weight"] = linear(h, q_out)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        if is_moe_layer(cfg, i):
            t.update(moe_block(cfg, p, linear))
        else:
            t[p + "mlp.gate_proj.weight"] = linear(inter, h)
            t[p + "mlp.up_proj.weight"] = linear(inter, h)
            t[p + "mlp.down_proj.weight"] = linear(h, inter)
        if i == 0:
            layer0 = {k[len(p):]: v for k, v in t.items()}  # the MTP block's shapes (and --mtp-mimic's values)
        yield i, t
    final = {"model.norm.weight": norm(h)}
    if cfg["arch"] == "mimo":  # MiMo's MTP layers (vLLM mimo_mtp.py names), after the model
        for m in range(cfg["mtp_layers"]):
            p = f"model.mtp_layers.{m}."
            final[p + "token_layernorm.weight"] = norm(h)
            final[p + "hidden_layernorm.weight"] = norm(h)
            final[p + "input_proj.weight"] = linear(h, 2 * h)  # columns: hidden | token embedding
            for name, arr in layer0.items():
                if cfg["mtp_mimic"]:
                    final[p + name] = arr.copy()
                elif arr.ndim == 2:
                    final[p + name] = linear(*arr.shape)
                else:
                    final[p + name] = norm(arr.shape[0]) if "layernorm" in name else normal(arr.shape, 0.1)
            final[p + "final_layernorm.weight"] = norm(h)
            if cfg["mtp_mimic"]:
                if not cfg["mtp_hidden_scale"]:  # token only: its norm as layer 0's input sees it
                    final[p + "token_layernorm.weight"] = np.ones(h, np.float32)
                    final[p + "hidden_layernorm.weight"] = np.ones(h, np.float32)
                hid = linear(h, h) * np.float32(cfg["mtp_hidden_scale"])  # 0: the hidden state is ignored
                final[p + "input_proj.weight"] = np.concatenate([hid, np.eye(h, dtype=np.float32)], axis=1)
                final[p + "final_layernorm.weight"] = final["model.norm.weight"].copy()
    if not cfg["tie"]:
        final["lm_head.weight"] = linear(cfg["vocab"], h)
    elif not cfg["no_lm_head"]:
        final["lm_head.weight"] = embed.copy()
    yield "final", final


def is_moe_layer(cfg, i):
    """transformers' rule: Mixtral every layer; Qwen-MoE unless in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    if cfg["arch"] == "mixtral":
        return True
    if cfg["arch"] not in MOE_ARCHS:
        return False
    return i not in (cfg["mlp_only_layers"] or []) and (i + 1) % (cfg["sparse_step"] or 1) == 0


def moe_block(cfg, p, linear):
    """The sparse block's tensors of layer prefix p: router, experts (per expert in expert order,
    or stacked), Qwen2-MoE's shared expert and gate."""
    h, E = cfg["hidden"], cfg["experts"]
    mixtral = cfg["arch"] == "mixtral"
    ff = cfg["intermediate"] if mixtral else cfg["moe_intermediate"]
    b = p + ("block_sparse_moe." if mixtral else "mlp.")
    g_name, u_name, d_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    t = {b + "gate.weight": linear(E, h)}
    experts = [(linear(ff, h), linear(ff, h), linear(h, ff)) for _ in range(E)]
    if cfg["stacked_experts"]:
        t[b + "experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in experts])
        t[b + "experts.down_proj"] = np.stack([d for _, _, d in experts])
    else:
        for e, (g, u, d) in enumerate(experts):
            t[b + f"experts.{e}.{g_name}.weight"] = g
            t[b + f"experts.{e}.{u_name}.weight"] = u
            t[b + f"experts.{e}.{d_name}.weight"] = d
    if cfg["arch"] == "qwen2_moe":
        sf = cfg["shared_intermediate"]
        t[b + "shared_expert.gate_proj.weight"] = linear(sf, h)
        t[b + "shared_expert.up_proj.weight"] = linear(sf, h)
        t[b + "shared_expert.down_proj.weight"] = linear(h, sf)
        t[b + "shared_expert_gate.weight"] = linear(1, h)
    return t


def shard_of(group, cfg):
    """Shard index of a group: layers spread evenly and in order; the
    embeddings go to the first shard, final norm / lm_head to the last."""
    n, layers = cfg["shards"], cfg["layers"]
    if group == "embed":
        return 0
    if group == "final":
        return n - 1
    return group * n // layers  # n <= layers: every shard gets a layer


def write_config(out, cfg):
    arch = cfg["arch"]
    conf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": cfg["vocab"],
        "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["intermediate"],
        "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["kv_heads"],
        "head_dim": cfg["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_pos"],
        "rms_norm_eps": cfg["rms_eps"],
        "rope_theta": cfg["rope_theta"],
        "tie_word_embeddings": cfg["tie"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": TORCH_DTYPE[cfg["dtype"]],
    }
    if cfg["rope_scaling"] is not None:
        conf["rope_scaling"] = cfg["rope_scaling"]
    if arch in ("llama", "qwen3", "qwen3_moe"):
        conf["attention_bias"] = False
    if arch == "llama":
        conf["mlp_bias"] = False
    if arch == "mixtral":
        conf.update(num_local_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"],
                    router_aux_loss_coef=0.02, output_router_logits=False, router_jitter_noise=0.0)
    if arch in ("qwen3_moe", "qwen2_moe"):
        conf.update(num_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"],
                    moe_intermediate_size=cfg["moe_intermediate"], norm_topk_prob=bool(cfg["norm_topk"]),
                    decoder_sparse_step=cfg["sparse_step"] or 1,
                    mlp_only_layers=cfg["mlp_only_layers"] or [], router_aux_loss_coef=0.001,
                    output_router_logits=False)
    if arch == "qwen2_moe":
        conf.update(shared_expert_intermediate_size=cfg["shared_intermediate"], qkv_bias=True)
    if arch == "mimo":
        conf["num_nextn_predict_layers"] = cfg["mtp_layers"]
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mimo"):  # as the real configs: the window is off
        conf["use_sliding_window"] = False
        conf["sliding_window"] = cfg["sliding_window"]
        conf["max_window_layers"] = cfg["layers"]
    if arch in ("mistral", "mixtral"):
        conf["sliding_window"] = cfg["sliding_window"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")


def main(argv=None):
    a, cfg = parse_args(argv)
    out = a.out
    os.makedirs(out, exist_ok=True)
    # Drop weights left by an earlier run with another shard count.
    for old in glob.glob(os.path.join(out, "model*.safetensors*")):
        os.remove(old)

    rng = np.random.default_rng(a.seed)
    n = cfg["shards"]
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    meta = {"format": "pt"}
    weight_map, pending, shard = {}, {}, 0
    params = data_bytes = 0

    def flush():  # write the pending tensors as shard `shard`, then free them
        nonlocal data_bytes
        data_bytes += save_file(pending, os.path.join(out, names[shard]),
                                metadata=meta, dtype=cfg["dtype"])
        weight_map.update({k: names[shard] for k in pending})
        pending.clear()

    for group, tensors in tensor_groups(cfg, rng):
        s = shard_of(group, cfg)
        while shard < s:  # this group starts a later shard
            flush()
            shard += 1
        pending.update(tensors)
        params += sum(t.size for t in tensors.values())
    while shard < n:
        flush()
        shard += 1

    if n > 1:
        index = {"metadata": {"total_size": data_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    write_config(out, cfg)

    if a.tokenizer_from:
        if not os.path.isdir(a.tokenizer_from):
            print(f"warning: tokenizer dir {a.tokenizer_from} not found; "
                  "no tokenizer copied", file=sys.stderr)
        for fname in TOKENIZER_FILES:
            src = os.path.join(a.tokenizer_from, fname)
            if os.path.isfile(src):  # copyfile: don't inherit read-only modes
                shutil.copyfile(src, os.path.join(out, fname))
    if a.step is not None:
        with open(os.path.join(out, "version.yaml"), "w") as f:
            f.write(f"step: {a.step}\n")

    file_bytes = sum(os.path.getsize(os.path.join(out, x)) for x in names)
    tied_copy = cfg["tie"] and not cfg["no_lm_head"]  # lm_head == embeddings
    print(f"wrote {out}: {cfg['arch']} {cfg['dtype']}, {params:,} params"
          f"{' (incl. tied lm_head copy)' if tied_copy else ''}, "
          f"{file_bytes:,} bytes in {n} safetensors file(s)")


if __name__ == "__main__":
    main()
