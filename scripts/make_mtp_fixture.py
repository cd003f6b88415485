#!/usr/bin/env python3
"""The trained MTP fixture of issue #24: stories260K in MiMo layout plus an MTP layer trained on
the model's own continuations, so that speculative decoding with "method": "mtp" has a real
acceptance rate (the random MiMo checkpoints of tests/e2e/test_mtp.py only prove exactness).

What it writes under --out:
  fresh/   MiMoForCausalLM checkpoint: stories260K's weights (Qwen2 layout: zero q/k/v biases,
           num_nextn_predict_layers 1) + model.mtp_layers.0.* trained to the end
  stale/   the same target with the MTP layer of an early training checkpoint (stale_step): a
           draft that lags the target, as after a weight update that left the draft behind; it
           is accepted well under the fresh layer's rate but above a third of it
  untrained/  the same target with the layer before training: a draft of another model
           altogether, accepted almost never (what the acceptance-collapse warning is for)
  meta.json  the script's hash, training figures (loss, per-depth top-1 agreement on held-out
           greedy text, the tokens per target forward it predicts at k = 1..3), timings, checks

The MTP math follows vLLM's mimo_mtp.py as daemon/src/model/mtp_forward.cpp implements it. MTP
row q (position q) reads the target's final-normed hidden state h_q and the embedding of token q+1
(zeroed at position 0):
    x = input_proj([hidden_layernorm(h_q) | token_layernorm(e)])     hidden columns first
    x = Qwen2 decoder block(x)   (its own causal attention over the MTP rows, RoPE at q)
    out = final_layernorm(x);  logits = lm_head(out)                  predicts token q+2
For k > 1 the layer runs again one position on, on (its own out, the previous token). Training
runs that chain too (depth 2..--depth, teacher-forced tokens): a chain row at position q+d-1
attends to the depth-1 rows' K/V at positions <= q and to its own chain's rows, exactly the K/V
the daemon's MTP cache holds when it drafts. Loss: cross-entropy against the frozen target's own
next-token distribution at the predicted position (self-distillation). Only the MTP layer is
trained; the target is frozen. One thread, fixed seed, fixed step count: same bytes every run.

Checks made here (the run fails if one does not hold):
  - the torch target reproduces llama2.c's greedy tokens and top-1 logits for stories260K
    (models/stories260K/reference_logits.json, from llama2.c run.c);
  - the trained layer's greedy drafts equal tests/e2e/np_llama.mtp_drafts (the numpy MTP
    reference the daemon's drafts are tested against) on held-out prompts.
The MiMo form's equality with the Llama form is checked through the daemon in
tests/e2e/test_mtp_trained.py (greedy tokens and logprobs bitwise).

Cached use (tests, benches): mtp_fixture(build_dir, quick) returns the fixture directory
build_dir/fixtures/mtp-stories260K-<hash of this file>[-quick], generating it on first use.
--quick trains a smaller layer faster (the CTest fixture); the default is the bench fixture.

Usage: /usr/bin/python3 scripts/make_mtp_fixture.py --out DIR [--quick]
       /usr/bin/python3 scripts/make_mtp_fixture.py --cache BUILD_DIR [--quick]   (prints the path)
Needs python3-torch (Debian /usr/bin/python3: torch 1.13) and numpy.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORIES = os.path.join(REPO, "models", "stories260K")
sys.path.insert(0, HERE)
from safetensors_np import load_file, save_file  # noqa: E402

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
MTP = "model.mtp_layers.0."
# Training sizes. full: the bench fixture (about 2.5 CPU-minutes: 12 wall minutes when the 2 cores
# are shared with builds); quick: the CTest one (about 25 CPU-seconds).
SIZES = {"full": dict(n_train=384, n_eval=32, seq=256, batch=8, steps=360, stale_step=50, depth=3, lr=3e-3),
         "quick": dict(n_train=96, n_eval=16, seq=128, batch=16, steps=150, stale_step=40, depth=2, lr=4e-3)}
BUDGET_CPU_S = 300  # hard bound on one run's CPU time (the issue: a few minutes on one CPU, <= 5 min)
EVAL_STEPS = {0, 5, 10, 15, 20, 25, 30, 40, 50, 60, 80}  # and every 100th: the curve the stale step is read from


def script_hash():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def mtp_fixture(build_dir, quick=False, log=sys.stderr):
    """The cached fixture directory for this script's version, generated on first use (written to
    a temporary sibling and renamed, so concurrent users never see half a fixture).
    FD_MTP_FIXTURE (FD_MTP_FIXTURE_QUICK for quick) = a directory made with --out: used instead."""
    given = os.environ.get("FD_MTP_FIXTURE_QUICK" if quick else "FD_MTP_FIXTURE")
    if given:
        return given
    root = os.path.join(os.path.abspath(build_dir), "fixtures")
    path = os.path.join(root, f"mtp-stories260K-{script_hash()[:12]}" + ("-quick" if quick else ""))
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=root)
    try:
        print(f"generating the MTP fixture {path} (once per version of {os.path.basename(__file__)})", file=log, flush=True)
        make(tmp, quick, log)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first
            if not os.path.exists(os.path.join(path, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- the torch forward (float32, HF Llama/Qwen2 conventions: rotate_half RoPE, GQA, SwiGLU) ----

def rms(x, g, eps):
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Model:
    """stories260K's config and frozen weights, as torch tensors."""

    def __init__(self, dir_):
        with open(os.path.join(dir_, "config.json")) as f:
            c = json.load(f)
        self.conf = c
        self.h, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or self.h // self.nh
        self.ff, self.layers, self.vocab = c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        self.eps, self.theta = c["rms_norm_eps"], c.get("rope_theta", 10000.0)
        self.np = {k: v.astype(np.float32) for k, v in load_file(os.path.join(dir_, "model.safetensors")).items()}
        self.w = {k: torch.from_numpy(v.copy()) for k, v in self.np.items()}
        self.lm = self.w["lm_head.weight"] if "lm_head.weight" in self.w else self.w["model.embed_tokens.weight"]
        self.inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd)

    def rope(self, x, pos):
        """x [B, heads, T, hd] at positions pos [T] (rotate_half)."""
        ang = pos.float()[:, None] * self.inv[None, :]
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def qkv(self, w, pre, xn, pos):
        """xn [B, T, h] -> q [B, nh, T, hd], k, v [B, nkv, T, hd] (RoPE'd q, k)."""
        B, T, _ = xn.shape
        q, k, v = (F.linear(xn, w[pre + f"self_attn.{n}_proj.weight"], w.get(pre + f"self_attn.{n}_proj.bias")) for n in "qkv")
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        return self.rope(q, pos), self.rope(k, pos), v

    def rep(self, t):
        return t.repeat_interleave(self.nh // self.nkv, dim=1)  # kv head i serves q heads i*rep..

    def mlp(self, w, pre, x):
        xn = rms(x, w[pre + "post_attention_layernorm.weight"], self.eps)
        g = F.linear(xn, w[pre + "mlp.gate_proj.weight"])
        u = F.linear(xn, w[pre + "mlp.up_proj.weight"])
        return x + F.linear(F.silu(g) * u, w[pre + "mlp.down_proj.weight"])

    def block(self, w, pre, x, pos, past=None):
        """A causal decoder block over x [B, T, h] at positions pos [T], after `past` (k, v) of
        earlier positions. Returns (x, (k, v) including past)."""
        q, k, v = self.qkv(w, pre, rms(x, w[pre + "input_layernorm.weight"], self.eps), pos)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        T, S = q.shape[2], k.shape[2]
        s = q @ self.rep(k).transpose(-1, -2) / math.sqrt(self.hd)
        mask = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
        s = s.masked_fill(mask, float("-inf"))
        att = (s.softmax(-1) @ self.rep(v)).transpose(1, 2).reshape(x.shape[0], T, self.nh * self.hd)
        x = x + F.linear(att, w[pre + "self_attn.o_proj.weight"])
        return self.mlp(w, pre, x), (k, v)

    def forward(self, ids, pos0=0, cache=None):
        """Final-normed hidden states [B, T, h] of ids [B, T] at positions pos0.., updating the
        per-layer KV cache list in place (None: no cache)."""
        x = self.w["model.embed_tokens.weight"][ids]
        pos = torch.arange(pos0, pos0 + ids.shape[1])
        for il in range(self.layers):
            past = cache[il] if cache is not None and cache[il] is not None else None
            x, kv = self.block(self.w, f"model.layers.{il}.", x, pos, past)
            if cache is not None:
                cache[il] = kv
        return rms(x, self.w["model.norm.weight"], self.eps)


def require(ok, *what):
    if not ok:
        raise RuntimeError(" ".join(str(w) for w in what))


def check_target_against_llama2c(m):
    """The torch target against llama2.c's greedy run of stories260K (reference_logits.json)."""
    with open(os.path.join(STORIES, "reference_logits.json")) as f:
        ref = json.load(f)
    ids = ref["prompt_token_ids"] + ref["generated_token_ids"]
    with torch.no_grad():
        lg = m.forward(torch.tensor([ids[:len(ref["steps"])]]))[0] @ m.lm.T
    worst = 0.0
    for st in ref["steps"]:
        row = lg[st["pos"]]
        if not st["forced"]:
            require(int(row.argmax()) == st["argmax"], "torch target's greedy token differs from llama2.c at", st["pos"])
        worst = max(worst, abs(float(row[st["argmax"]]) - st["top1_logit"]))
    require(worst < 1e-3, "torch target's top-1 logits differ from llama2.c by", worst)
    return {"steps": len(ref["steps"]), "max_abs_top1_logit_diff": worst}


# ---- the model's own continuations (the training data) -----------------------------------------

def continuations(m, n, seq, gen):
    """n sequences [n, seq] from BOS, with the target's final-normed hidden states [n, seq, h].
    Rows alternate: sampled at temperature 1.0 / 0.8 throughout, or sampled for their first 1..24
    tokens then greedy (the bench's greedy decodes); EOS is ignored (as ignore_eos)."""
    ids = torch.empty(n, seq, dtype=torch.int64)
    ids[:, 0] = 1
    hid = torch.empty(n, seq, m.h)
    kind = torch.arange(n) % 3                                  # 0: T=1.0, 1: T=0.8, 2: greedy after
    temp = torch.where(kind == 0, torch.tensor(1.0), torch.tensor(0.8))
    greedy_from = torch.where(kind == 2, 1 + torch.randint(0, 24, (n,), generator=gen), torch.tensor(seq))
    cache = [None] * m.layers
    with torch.no_grad():
        for t in range(seq):
            h = m.forward(ids[:, t:t + 1], t, cache)[:, 0]
            hid[:, t] = h
            if t + 1 == seq:
                break
            lg = h @ m.lm.T
            sampled = torch.multinomial((lg / temp[:, None]).softmax(-1), 1, generator=gen)[:, 0]
            ids[:, t + 1] = torch.where(t + 1 >= greedy_from, lg.argmax(-1), sampled)
    return ids, hid, kind == 2


# ---- the MTP layer --------------------------------------------------------------------------------

def init_mtp(m, gen):
    """The layer's starting point: the target's last block, input_proj = [I | R] with R a random
    rotation (both inputs summed, told apart: a layer trained from [I | I] stays nearly symmetric
    and would hide a swapped concat order), unit input norms, final_layernorm = the target's
    final norm, zero q/k/v biases."""
    last = f"model.layers.{m.layers - 1}."
    p = {MTP + k[len(last):]: v.clone() for k, v in m.w.items() if k.startswith(last)}
    for n, d in (("q", m.nh * m.hd), ("k", m.nkv * m.hd), ("v", m.nkv * m.hd)):
        p[MTP + f"self_attn.{n}_proj.bias"] = torch.zeros(d)
    p[MTP + "token_layernorm.weight"] = torch.ones(m.h)
    p[MTP + "hidden_layernorm.weight"] = torch.ones(m.h)
    rot, _ = torch.linalg.qr(torch.randn(m.h, m.h, generator=gen))
    p[MTP + "input_proj.weight"] = torch.cat([torch.eye(m.h), rot], dim=1)
    p[MTP + "final_layernorm.weight"] = m.w["model.norm.weight"].clone()
    return p


def mtp_in(m, p, hid, tok, zero_first):
    """input_proj([hidden_layernorm(hid) | token_layernorm(embed(tok))]); hid [B, n, h], tok [B, n]."""
    e = m.w["model.embed_tokens.weight"][tok]
    if zero_first:  # the row at position 0: vLLM zeroes its token embedding
        e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)
    x = torch.cat([rms(hid, p[MTP + "hidden_layernorm.weight"], m.eps), rms(e, p[MTP + "token_layernorm.weight"], m.eps)], -1)
    return F.linear(x, p[MTP + "input_proj.weight"])


def mtp_chain(m, p, hid, ids, depth):
    """Logits of every draft depth over whole sequences: a list, depth d (1-based) [B, T-d, vocab],
    row q predicting token q+d+1 at position q+d-1. hid [B, T, h] the target's states, ids [B, T]."""
    B, T, _ = hid.shape
    x = mtp_in(m, p, hid[:, :T - 1], ids[:, 1:T], True)
    x, (k1, v1) = m.block(p, MTP, x, torch.arange(T - 1))
    out = rms(x, p[MTP + "final_layernorm.weight"], m.eps)
    logits, chain_k, chain_v = [out @ m.lm.T], [], []
    for d in range(2, depth + 1):
        n = T - d
        pos = torch.arange(d - 1, d - 1 + n)
        x = mtp_in(m, p, out[:, :n], ids[:, d:d + n], False)
        q, k, v = m.qkv(p, MTP, rms(x, p[MTP + "input_layernorm.weight"], m.eps), pos)
        chain_k.append(k)
        chain_v.append(v)
        # keys: the depth-1 rows at positions <= q (the catch-up entries), then this chain's rows
        s_main = q @ m.rep(k1).transpose(-1, -2) / math.sqrt(m.hd)                        # [B, nh, n, T-1]
        s_main = s_main.masked_fill(torch.ones(n, T - 1, dtype=torch.bool).triu(1), float("-inf"))
        ck = torch.stack([m.rep(c[:, :, :n]) for c in chain_k], dim=3)                    # [B, nh, n, d-1, hd]
        cv = torch.stack([m.rep(c[:, :, :n]) for c in chain_v], dim=3)
        s_chain = (q.unsqueeze(3) * ck).sum(-1) / math.sqrt(m.hd)                         # [B, nh, n, d-1]
        a = torch.cat([s_main, s_chain], dim=-1).softmax(-1)
        att = a[..., :T - 1] @ m.rep(v1) + (a[..., T - 1:].unsqueeze(-1) * cv).sum(3)
        x = x + F.linear(att.transpose(1, 2).reshape(B, n, m.nh * m.hd), p[MTP + "self_attn.o_proj.weight"])
        x = m.mlp(p, MTP, x)
        out = rms(x, p[MTP + "final_layernorm.weight"], m.eps)
        logits.append(out @ m.lm.T)
    return logits



def evaluate(m, p, ids, hid, depth):
    """On greedy text: per-depth top-1 agreement with the target's greedy token, and the mean
    accepted length of a k-draft chain from every position (a draft counts only if all before
    it were right: then its teacher-forced input is what the daemon feeds)."""
    with torch.no_grad():
        lg = mtp_chain(m, p, hid, ids, depth)
        n = ids.shape[1] - depth
        right = torch.stack([lg[d - 1][:, :n].argmax(-1) == (hid[:, d:d + n] @ m.lm.T).argmax(-1) for d in range(1, depth + 1)])
    run = right.long().cumprod(0).float()  # [depth, B, n]: drafts 1..d all right
    return {"top1_agreement": [round(float(right[d].float().mean()), 4) for d in range(depth)],
            "tokens_per_forward_k": {str(k): round(1 + float(run[:k].sum(0).mean()), 4) for k in range(1, depth + 1)}}


def train(m, p, ids, hid, ev, cfg, gen, log):
    """AdamW on the MTP layer only, one fixed-size schedule. Returns (trained, stale, history)
    (the untrained layer is `p` as given, copied by the caller)."""
    params = [t.requires_grad_(True) for t in p.values()]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / cfg["steps"])))
    weights = [1.0, 0.6, 0.4][:cfg["depth"]]
    hist, stale, t0 = [], None, time.time()
    for step in range(cfg["steps"]):
        if step == cfg["stale_step"]:
            stale = {k: v.detach().clone() for k, v in p.items()}
        b = torch.randint(0, ids.shape[0], (cfg["batch"],), generator=gen)
        hb = hid[b]
        lg = mtp_chain(m, p, hb, ids[b], cfg["depth"])
        # depth d+1's row q predicts the token after position q+d+1: the target's distribution there
        loss = sum(w * -((hb[:, d + 1:] @ m.lm.T).softmax(-1) * lg[d].log_softmax(-1)).sum(-1).mean()
                   for d, w in enumerate(weights))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step in EVAL_STEPS or step % 100 == 0 or step + 1 == cfg["steps"]:
            e = evaluate(m, p, ev[0], ev[1], cfg["depth"])
            hist.append({"step": step, "loss": round(float(loss), 4), "elapsed_s": round(time.time() - t0, 1), **e})
            print(f"  step {step:5d} loss {float(loss):.4f} agreement {e['top1_agreement']} "
                  f"tokens/forward {e['tokens_per_forward_k']} ({time.time() - t0:.0f} s)", file=log, flush=True)
        if time.process_time() - CPU_START > BUDGET_CPU_S:
            raise RuntimeError(f"MTP fixture training passed its {BUDGET_CPU_S} CPU-second budget at step {step}")
    return {k: v.detach() for k, v in p.items()}, stale, hist


def check_against_numpy(fresh_dir, m, p, prompts, k=3):
    """The trained layer's greedy k-draft chains (torch, the training math) against
    tests/e2e/np_llama.mtp_drafts (the numpy reference the daemon's drafts are tested against)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
    import np_llama
    cfg, w = np_llama.load(fresh_dir)
    for ids in prompts:
        want = np_llama.mtp_drafts(cfg, w, ids, k)
        L, got = len(ids), []
        with torch.no_grad():
            hid = m.forward(torch.tensor([ids]))
            for d in range(1, k + 1):  # draft d: the depth-d row based at q = L-2, fed drafts 1..d-1
                t = torch.tensor([ids + got])
                h = torch.cat([hid, torch.zeros(1, len(got), m.h)], 1)  # rows past L-1 are never read by it
                got.append(int(mtp_chain(m, p, h, t, d)[d - 1][0, L - 2].argmax()))
        require(got == want, "torch MTP drafts differ from np_llama.mtp_drafts:", ids, got, want)
    return {"prompts": len(prompts), "drafts_each": k}


def save_checkpoint(dst, m, mtp):
    """stories260K in MiMo layout (zero q/k/v biases, num_nextn_predict_layers 1) + mtp."""
    os.makedirs(dst, exist_ok=True)
    t = dict(m.np)
    for il in range(m.layers):
        for n, d in (("q", m.nh * m.hd), ("k", m.nkv * m.hd), ("v", m.nkv * m.hd)):
            t[f"model.layers.{il}.self_attn.{n}_proj.bias"] = np.zeros(d, np.float32)
    t.update({k: v.numpy().astype(np.float32) for k, v in mtp.items()})
    save_file(t, os.path.join(dst, "model.safetensors"))
    c = {k: v for k, v in m.conf.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    c.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1,
             use_sliding_window=False, sliding_window=None, max_window_layers=m.layers)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(STORIES, name), os.path.join(dst, name))


def make(out, quick=False, log=sys.stderr):
    global CPU_START
    CPU_START, t_start = time.process_time(), time.time()
    cfg = SIZES["quick" if quick else "full"]
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(24)
    m = Model(STORIES)
    meta = {"script_sha256": script_hash(), "size": "quick" if quick else "full", **cfg,
            "llama2c_check": check_target_against_llama2c(m)}
    t = time.time()
    ids, hid, greedy = continuations(m, cfg["n_train"] + cfg["n_eval"], cfg["seq"], gen)
    meta["data_s"] = round(time.time() - t, 1)
    ev_rows = torch.nonzero(greedy[cfg["n_train"]:])[:, 0] + cfg["n_train"]  # held-out greedy rows
    ev = (ids[ev_rows], hid[ev_rows])
    print(f"  {cfg['n_train']} training continuations of {cfg['seq']} tokens in {meta['data_s']} s", file=log, flush=True)
    p = init_mtp(m, gen)
    untrained = {k: v.clone() for k, v in p.items()}
    t = time.time()
    fresh, stale, meta["history"] = train(m, p, ids[:cfg["n_train"]], hid[:cfg["n_train"]], ev, cfg, gen, log)
    meta["train_s"] = round(time.time() - t, 1)
    meta["fresh"] = evaluate(m, fresh, ev[0], ev[1], cfg["depth"])
    meta["stale"] = evaluate(m, stale, ev[0], ev[1], cfg["depth"])
    meta["untrained"] = evaluate(m, untrained, ev[0], ev[1], cfg["depth"])
    for name, layer in (("fresh", fresh), ("stale", stale), ("untrained", untrained)):
        save_checkpoint(os.path.join(out, name), m, layer)
    meta["numpy_check"] = check_against_numpy(os.path.join(out, "fresh"), m, fresh, [list(r[:n]) for r, n in zip(ev[0][:4].tolist(), (5, 17, 40, 2))])
    meta["total_s"], meta["total_cpu_s"] = round(time.time() - t_start, 1), round(time.process_time() - CPU_START, 1)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


CPU_START = 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="write the fixture here (fresh/, stale/, meta.json)")
    g.add_argument("--cache", metavar="BUILD_DIR", help="the cached fixture under BUILD_DIR/fixtures (made if missing); prints its path")
    ap.add_argument("--quick", action="store_true", help="the smaller, faster fixture of the CTest")
    a = ap.parse_args()
    if a.cache:
        print(mtp_fixture(a.cache, a.quick))
    else:
        meta = make(a.out, a.quick)
        print(json.dumps({k: meta[k] for k in ("fresh", "stale", "untrained", "train_s", "total_s", "total_cpu_s")}))


import torch  # noqa: E402  (after the docstring's usage: a clear ImportError names the module)
import torch.nn.functional as F  # noqa: E402

if __name__ == "__main__":
    main()
