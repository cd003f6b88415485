"""A deliberately plain numpy float32 Llama/Qwen2 forward pass (HF conventions: rotate_half RoPE,
GQA, SwiGLU, optional q/k/v biases, tied or stored lm_head), used as the oracle for random
checkpoints. Recomputes the whole prefix each step: slow, obvious, independent of the engine."""
import os

import numpy as np

from fdtest import read_json  # noqa: E402  (also puts scripts/ on sys.path)
import safetensors_np  # noqa: E402


def load(dir_):
    cfg = read_json(os.path.join(dir_, "config.json"))
    idx = os.path.join(dir_, "model.safetensors.index.json")
    files = sorted(set(read_json(idx)["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    w = {}
    for f in files:
        w.update(safetensors_np.load_file(os.path.join(dir_, f)))
    return cfg, {k: v.astype(np.float32) for k, v in w.items()}


def rms(x, g, eps):
    return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def logits(cfg, w, ids):
    """Logits [len(ids), vocab] of a causal pass over ids."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    T = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.arange(T, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(t):  # t [T, heads, hd]
        a, b = t[..., : hd // 2], t[..., hd // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    for il in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{il}."
        xn = rms(x, w[p + "input_layernorm.weight"], eps)
        proj = {}
        for n in "qkv":
            proj[n] = xn @ w[p + f"self_attn.{n}_proj.weight"].T
            if p + f"self_attn.{n}_proj.bias" in w:
                proj[n] = proj[n] + w[p + f"self_attn.{n}_proj.bias"]
        q = rope(proj["q"].reshape(T, nh, hd))
        k = rope(proj["k"].reshape(T, nkv, hd))
        v = proj["v"].reshape(T, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = s + np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + att @ w[p + "self_attn.o_proj.weight"].T
        xn = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = xn @ w[p + "mlp.gate_proj.weight"].T
        u = xn @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T


def greedy(cfg, w, prompt_ids, n):
    """(generated ids, top-1 logit per step) for n greedy steps."""
    ids, out, tops = list(prompt_ids), [], []
    for _ in range(n):
        lg = logits(cfg, w, ids)[-1]
        t = int(np.argmax(lg))
        out.append(t)
        tops.append(float(lg[t]))
        ids.append(t)
    return out, tops
