"""A plain numpy float32 forward of the mixture-of-experts architectures, written from
transformers' definitions (modeling_qwen3_moe.py Qwen3MoeSparseMoeBlock, modeling_qwen2_moe.py
Qwen2MoeSparseMoeBlock, modeling_mixtral.py MixtralSparseMoeBlock, and their DecoderLayer's
choice of sparse vs dense layers), on top of np_llama's attention (Qwen3-MoE: q/k norms;
Qwen2-MoE: q/k/v biases; Mixtral: Mistral's). The oracle for random MoE checkpoints: slow,
obvious, independent of the engine. Reads the experts per expert or stacked
(experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) as the checkpoint holds them."""
import numpy as np

import np_llama


def arch(cfg):
    return cfg["architectures"][0]


def is_sparse(cfg, il):
    """Qwen{2,3}MoeDecoderLayer: sparse unless in mlp_only_layers, every decoder_sparse_step-th
    layer; MixtralDecoderLayer: always."""
    if arch(cfg) == "MixtralForCausalLM":
        return True
    n = cfg.get("num_experts", 0)
    return il not in (cfg.get("mlp_only_layers") or []) and n > 0 and (il + 1) % cfg.get("decoder_sparse_step", 1) == 0


def expert(w, b, e, mixtral):
    """(gate [I, H], up [I, H], down [H, I]) of expert e under block prefix b."""
    if b + "experts.gate_up_proj" in w:
        gu = w[b + "experts.gate_up_proj"][e]
        half = gu.shape[0] // 2
        return gu[:half], gu[half:], w[b + "experts.down_proj"][e]
    g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return (w[b + f"experts.{e}.{g}.weight"], w[b + f"experts.{e}.{u}.weight"], w[b + f"experts.{e}.{d}.weight"])


def renormalises(cfg):
    """MixtralSparseMoeBlock always divides the top-k weights by their sum; the Qwen blocks when
    norm_topk_prob."""
    return arch(cfg) == "MixtralForCausalLM" or cfg.get("norm_topk_prob", False)


def silu(g):
    return g / (1 + np.exp(-g))


def sparse_block(cfg, w, il, x, routes=None):
    """The sparse MoE block of layer il on xn [T, hidden]; appends [T, top_k] expert ids to routes."""
    mixtral = arch(cfg) == "MixtralForCausalLM"
    b = f"model.layers.{il}." + ("block_sparse_moe." if mixtral else "mlp.")
    E = cfg["num_local_experts"] if mixtral else cfg["num_experts"]
    k = cfg["num_experts_per_tok"]
    router_logits = x @ w[b + "gate.weight"].T                       # [T, E]
    z = router_logits - router_logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)                 # softmax in float32
    sel = np.argsort(-p, axis=-1, kind="stable")[:, :k]              # torch.topk: descending
    wts = np.take_along_axis(p, sel, axis=-1)
    if renormalises(cfg):
        wts = wts / wts.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(E):                                               # the expert_hit loop, ascending
        tok, slot = np.nonzero(sel == e)
        if len(tok) == 0:
            continue
        g, u, d = expert(w, b, e, mixtral)
        xe = x[tok]
        y = (silu(xe @ g.T) * (xe @ u.T)) @ d.T
        out[tok] += y * wts[tok, slot][:, None]                       # index_add_
    if arch(cfg) == "Qwen2MoeForCausalLM":
        s = b + "shared_expert."
        shared = (silu(x @ w[s + "gate_proj.weight"].T) * (x @ w[s + "up_proj.weight"].T)) @ w[s + "down_proj.weight"].T
        gate = 1 / (1 + np.exp(-(x @ w[b + "shared_expert_gate.weight"].T)))  # [T, 1]
        out = out + gate * shared
    if routes is not None:
        routes.append(sel)
    return out


def logits(cfg, w, ids, routes=None):
    """Logits [len(ids), vocab]; `routes` (a list) gets each sparse layer's [T, top_k] ids."""
    return np_llama.logits(cfg, w, ids, mlp=lambda il, xn: sparse_block(cfg, w, il, xn, routes) if is_sparse(cfg, il) else None)


def greedy(cfg, w, prompt_ids, n):
    """(generated ids, logprob of each) of n greedy steps."""
    ids, out, lps = list(prompt_ids), [], []
    for _ in range(n):
        lg = logits(cfg, w, ids)[-1].astype(np.float64)
        t = int(np.argmax(lg))
        out.append(t)
        m = lg.max()
        lps.append(float(lg[t] - m - np.log(np.exp(lg - m).sum())))
        ids.append(t)
    return out, lps
