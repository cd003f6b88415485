"""A deliberately plain numpy float32 Llama/Qwen2/Qwen3/Mistral forward pass (HF conventions:
rotate_half RoPE with rope_scaling default/linear/dynamic/llama3, GQA, SwiGLU, optional q/k/v
biases, Qwen3's per-head q_norm/k_norm before RoPE, tied or stored lm_head), used as the oracle
for random checkpoints. Recomputes the whole prefix each step: slow, obvious, independent of the
engine. The RoPE frequencies transcribe transformers' modeling_rope_utils
(_compute_default/linear_scaling/dynamic_ntk/llama3_parameters)."""
import math
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


def rope_inv_freq(cfg):
    """[head_dim / 2] float32 inverse frequencies, as transformers computes them."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    rs = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rs.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd)).astype(np.float32)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv = inv / np.float32(rs["factor"])
    elif kind == "dynamic":
        # base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2)) with
        # seq_len = max(seq_len, max_position_embeddings): 1 ** x below max_position_embeddings
        seq_len = cfg["max_position_embeddings"]
        base = theta * ((rs["factor"] * seq_len / cfg["max_position_embeddings"]) - (rs["factor"] - 1)) ** (hd / (hd - 2))
        inv = (1.0 / base ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd)).astype(np.float32)
    elif kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, out).astype(np.float32)
    else:
        assert kind == "default", kind
    return inv


def block(cfg, w, p, x, mlp=None, il=0, kv_round=None):
    """One decoder block (weights under prefix p, e.g. "model.layers.3.") over x [T, hidden] at
    positions 0..T-1, causal. mlp(il, xn) -> [T, hidden] or None replaces its feed-forward.
    kv_round(a) -> a, if given, is applied to K (after RoPE) and V before attention: what a KV
    cache stores (e.g. rounding to bf16 for --kv-cache-dtype bfloat16)."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    eps = cfg["rms_norm_eps"]
    T = len(x)
    inv = rope_inv_freq(cfg)
    qk_norm = cfg["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    ang = np.arange(T, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(t):  # t [T, heads, hd]
        a, b = t[..., : hd // 2], t[..., hd // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    xn = rms(x, w[p + "input_layernorm.weight"], eps)
    proj = {}
    for n in "qkv":
        proj[n] = xn @ w[p + f"self_attn.{n}_proj.weight"].T
        if p + f"self_attn.{n}_proj.bias" in w:
            proj[n] = proj[n] + w[p + f"self_attn.{n}_proj.bias"]
    q, k = proj["q"].reshape(T, nh, hd), proj["k"].reshape(T, nkv, hd)
    if qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
        q = rms(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = rope(q), rope(k)
    v = proj["v"].reshape(T, nkv, hd)
    if kv_round is not None:
        k, v = kv_round(k), kv_round(v)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = s + np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)[None]
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    att = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
    x = x + att @ w[p + "self_attn.o_proj.weight"].T
    xn = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    y = mlp(il, xn) if mlp else None
    if y is not None:
        return x + y
    g = xn @ w[p + "mlp.gate_proj.weight"].T
    u = xn @ w[p + "mlp.up_proj.weight"].T
    return x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T


def head(cfg, w):
    """The LM head [vocab, hidden] (the embeddings when tied)."""
    return w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]


def hidden(cfg, w, ids, mlp=None, kv_round=None):
    """The final-normed hidden states [len(ids), hidden] of a causal pass over ids."""
    x = w["model.embed_tokens.weight"][ids]
    for il in range(cfg["num_hidden_layers"]):
        x = block(cfg, w, f"model.layers.{il}.", x, mlp, il, kv_round)
    return rms(x, w["model.norm.weight"], cfg["rms_norm_eps"])


def logits(cfg, w, ids, mlp=None, kv_round=None):
    """Logits [len(ids), vocab] of a causal pass over ids. mlp(il, xn) -> [T, hidden] or None
    replaces layer il's feed-forward block (np_moe.py's sparse MoE blocks); None = SwiGLU MLP.
    kv_round: see block()."""
    return hidden(cfg, w, ids, mlp, kv_round) @ head(cfg, w).T


def mtp_drafts(cfg, w, ids, k):
    """MiMo's MTP layer 0 as vLLM's mimo_mtp.py defines it, drafting k tokens after ids (the
    last one not yet in the KV cache), vLLM's reuse of the one layer for k > 1. Row q (position
    q) reads a hidden state and the embedding of the token at q + 1 (zeroed at position 0):
    x = input_proj([hidden_layernorm(h) | token_layernorm(e)]), a decoder block, final_layernorm,
    the target's head, greedy. Rows 0..L-1 read the target's final-normed hidden states and
    ids[1:]; draft j+1 comes from one more row reading the previous row's output and draft j."""
    eps = cfg["rms_norm_eps"]
    p = "model.mtp_layers.0."
    hs, toks, out = [hidden(cfg, w, ids)[:-1]], list(ids[1:]), []
    for _ in range(k):
        e = w["model.embed_tokens.weight"][toks].copy()
        e[0] = 0.0
        x = np.concatenate([rms(np.concatenate(hs), w[p + "hidden_layernorm.weight"], eps),
                            rms(e, w[p + "token_layernorm.weight"], eps)], axis=1)
        y = rms(block(cfg, w, p, x @ w[p + "input_proj.weight"].T), w[p + "final_layernorm.weight"], eps)
        d = int(np.argmax(y[-1] @ head(cfg, w).T))
        out.append(d)
        hs.append(y[-1:])
        toks.append(d)
    return out


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


def mtp_draft_counts(cfg, w, seq, n_prompt, m, k):
    """(proposed, accepted) draft tokens of a greedy MTP run that generated seq[n_prompt:] (m
    tokens) with k drafts per step, simulated with mtp_drafts: a step drafts min(k, m - n_gen - 1)
    tokens from the prefix through the last accepted token and accepts while they equal seq."""
    L, n_gen, proposed, accepted = n_prompt, 1, 0, 0  # seq[L]: the last token, not yet in the KV cache
    while n_gen < m:
        kk = min(k, m - n_gen - 1)
        a = 0
        if kk >= 1:
            drafts = mtp_drafts(cfg, w, seq[:L + 1], kk)
            while a < kk and drafts[a] == seq[L + 1 + a]:
                a += 1
            proposed, accepted = proposed + kk, accepted + a
        L, n_gen = L + a + 1, n_gen + a + 1
    return proposed, accepted
