#!/usr/bin/python3
"""A real PyTorch trainer driving fdrollout: a few GRPO steps on the embedded stories260K Llama.

Each step:
  1. rollouts: G sampled completions per prompt from the daemon (`/v1/completions`, n=G,
     temperature 1, token ids and their logprobs), tagged with the weight_version that made them;
  2. the trainer's logprobs of the same tokens under its own weights (a torch Llama written from
     transformers' LlamaForCausalLM: RMSNorm, rotate_half RoPE, GQA, SwiGLU, tied lm_head), and
     the rollout-vs-trainer logprob mismatch (|Δ| max and mean over the sampled tokens);
  3. GRPO: group-normalised advantages of a verifiable reward, the clipped surrogate with the
     rollout's logprobs as the old policy, one optimizer step;
  4. the new weights streamed into the daemon without files (`Client.weight_stream`): in full, or
     as a delta against the version the daemon serves (`send_delta` of the changed elements) when
     few enough elements changed, landed on the ranks where they can take it (`--land`: each
     rank's share on its own connection, no daemon hop); the update time and the bytes sent are
     printed.

  /usr/bin/python3 examples/grpo_trainer.py                      # starts build/fdrollout itself
  /usr/bin/python3 examples/grpo_trainer.py --url 127.0.0.1:8000  # a daemon started with --dynamic-load-weight
  /usr/bin/python3 examples/grpo_trainer.py --check --steps 3     # the CTest run: asserts the invariants

--check asserts: every rollout after an update reports the streamed version; the mismatch is at
most --max-mismatch (both sides compute in float32 from the same bytes); a delta update was used
at least once (only the --trainable parameters change: by default the last block's MLP, 13 % of
the elements, as a cheap fine-tune; a step changes somewhat fewer, the runs print about 11 % "of
elements changed"; `--trainable all` trains everything and streams in full); with `--land on`
every update was landed.
Needs python3-torch (Debian 1.13) and numpy.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

import numpy as np  # noqa: E402

try:
    import torch
    from torch import nn
except ImportError:  # the CTest run skips (77) where python3-torch is not installed
    print("grpo_trainer: needs PyTorch (Debian: apt-get install python3-torch)", file=sys.stderr)
    sys.exit(77)

from fdrollout import Client, changed_elements, safetensors_np  # noqa: E402

# "Once upon a time", "Lily and Tom" in the stories260K tokenizer (BOS first).
PROMPTS = [[1, 403, 407, 261, 378], [1, 317, 269, 274, 287]]


# ---- the model: transformers' LlamaForCausalLM, float32, names as the HF checkpoint's ----------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):  # x [T, dim]
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin):  # x [T, hidden]; cos, sin [T, head_dim]
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd).transpose(0, 1)   # [heads, T, head_dim]
        k = self.k_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        v = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)

        def rotate_half(t):
            return torch.cat([-t[..., self.hd // 2:], t[..., : self.hd // 2]], dim=-1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd)                 # [heads, T, T]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v                                  # [heads, T, head_dim]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class Llama(nn.Module):
    """state_dict() names are the checkpoint's (model.layers.0.self_attn.q_proj.weight, ...)."""

    def __init__(self, cfg):
        super().__init__()
        assert cfg.get("tie_word_embeddings"), "stories260K ties lm_head to the embedding"
        self.cfg, self.model = cfg, Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as transformers ties them (both names in state_dict)
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.inv_freq = 1.0 / cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)

    def forward(self, ids):  # ids [T] -> logits [T, vocab]
        ang = torch.arange(len(ids), dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @classmethod
    def from_checkpoint(cls, dir_):
        with open(os.path.join(dir_, "config.json")) as f:
            cfg = json.load(f)
        m = cls(cfg)
        w = safetensors_np.load_file(os.path.join(dir_, "model.safetensors"))
        m.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in w.items()}, strict=True)
        return m


def token_logprobs(model, prompt, completion):
    """[len(completion)] logprobs of `completion`'s tokens after `prompt` (with grad)."""
    ids = torch.tensor(prompt + completion)
    lp = torch.log_softmax(model(ids[:-1]), dim=-1)
    n = len(prompt)
    return lp[n - 1:].gather(1, ids[n:, None])[:, 0]


# ---- the loop ----------------------------------------------------------------------------------

def reward(prompt, completion):
    """Verifiable and cheap: the share of the completion's tokens that occur in the prompt."""
    return sum(t in set(prompt) for t in completion) / max(1, len(completion))


def rollouts(client, group, max_tokens, seed):
    out = []
    for pi, prompt in enumerate(PROMPTS):
        j = client.completions(prompt, n=group, temperature=1.0, max_tokens=max_tokens, logprobs=1, seed=seed + pi)
        for c in j["choices"]:
            out.append({"prompt": prompt, "ids": c["token_ids"], "lp": c["logprobs"]["token_logprobs"],
                        "version": j.get("weight_version"), "group": pi})
    return out


def grpo_loss(model, samples, clip=0.2):
    by_group = {}
    for s in samples:
        s["reward"] = reward(s["prompt"], s["ids"])
        by_group.setdefault(s["group"], []).append(s["reward"])
    total, n_tok, mism = 0.0, 0, []
    for s in samples:
        rs = by_group[s["group"]]
        adv = (s["reward"] - np.mean(rs)) / (np.std(rs) + 1e-4)
        lp = token_logprobs(model, s["prompt"], s["ids"])
        old = torch.tensor(s["lp"], dtype=torch.float32)
        mism.extend((lp.detach() - old).abs().tolist())
        ratio = torch.exp(lp - old)
        surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        total = total - surr.sum()
        n_tok += len(s["ids"])
    return total / max(1, n_tok), mism


def stream_weights(client, model, sent, version, mode, threshold, land="auto"):
    """Stream the model's weights as `version`: a delta against the served version when mode is
    "delta", or "auto" and the changed share is below `threshold`; else in full. `land`: each rank
    takes its share on its own connection (True), through the daemon (False), or where the ranks can
    ("auto"; docs/weight_streams.md "Landing"). Returns (kind, seconds, bytes on the wire, changed
    share); kind says "landed" when it was."""
    now = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    changes = {k: changed_elements(sent["tensors"][k], now[k]) for k in now} if sent["tensors"] else None
    n_all = sum(a.size for a in now.values())
    share = sum(c[0].size for c in changes.values()) / n_all if changes else 1.0
    use_delta = changes is not None and (mode == "delta" or (mode == "auto" and share < threshold))
    t0 = time.perf_counter()
    if use_delta:
        with client.weight_stream(version, base_version=sent["version"], land=land) as ws:
            for k, (idx, vals) in changes.items():
                if idx.size:
                    ws.send_delta(k, idx, vals)
    else:
        with client.weight_stream(version, land=land) as ws:
            for k, a in now.items():
                ws.send(k, a)
    dt = time.perf_counter() - t0
    assert ws.result["weight_version"] == version, ws.result
    sent.update(tensors=now, version=version)
    return ("delta" if use_delta else "full") + (" landed" if ws.land else ""), dt, ws.bytes_sent, share


def start_daemon(binary, model_dir, tp):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    log = tempfile.TemporaryFile()
    args = [binary, "--model", model_dir, "--port", str(port), "--dynamic-load-weight", "--control-timeout-s", "60"]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--threads", "1"]
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        if p.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"fdrollout exited with {p.returncode}:\n{log.read().decode(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return p, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    p.kill()
    raise TimeoutError("fdrollout did not become ready within 60 s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running daemon (started with --dynamic-load-weight); default: start one")
    ap.add_argument("--fdrollout", default=os.environ.get("FDROLLOUT_BIN", os.path.join(REPO, "build", "fdrollout")))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "stories260K"))
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the daemon this script starts")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--trainable", default=r"model\.layers\.4\.mlp\.", help="regex of the trained parameters' names, or 'all'")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--update", choices=["auto", "full", "delta"], default="auto", help="how to stream after each step")
    ap.add_argument("--delta-threshold", type=float, default=0.5, help="auto: delta when fewer than this share of elements changed")
    ap.add_argument("--land", choices=["auto", "on", "off"], default="auto",
                    help="updates landed on the ranks (each rank's share on its own connection), through the daemon, or where the ranks can")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="assert the invariants (the CTest run)")
    ap.add_argument("--max-mismatch", type=float, default=1e-3)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    proc = None
    if a.url is None:
        proc, a.url = start_daemon(a.fdrollout, a.model, a.tp)
    try:
        client = Client(a.url, timeout=60)
        model = Llama.from_checkpoint(a.model)
        import re
        params = [p for n, p in model.named_parameters() if a.trainable == "all" or re.search(a.trainable, n)]
        for n, p in model.named_parameters():
            p.requires_grad_(any(p is q for q in params))
        assert params, f"--trainable {a.trainable!r} matches no parameter"
        opt = torch.optim.SGD(params, lr=a.lr) if a.optimizer == "sgd" else torch.optim.Adam(params, lr=a.lr)
        sent = {"tensors": None, "version": None}
        # The daemon serves the trainer's step-0 weights: stream them (in full) first, so that the
        # rollouts and the trainer start from the same bytes whatever the daemon held.
        land = {"auto": "auto", "on": True, "off": False}[a.land]
        kind, dt, nbytes, _ = stream_weights(client, model, sent, "grpo-0", "full", 0, land)
        print(f"step 0: streamed {kind} {nbytes} B in {dt * 1e3:.1f} ms -> grpo-0", flush=True)
        kinds, worst = [], 0.0
        for step in range(1, a.steps + 1):
            samples = rollouts(client, a.group, a.max_tokens, a.seed + 100 * step)
            versions = {s["version"] for s in samples}
            loss, mism = grpo_loss(model, samples)
            mean_r = float(np.mean([s["reward"] for s in samples]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            kind, dt, nbytes, share = stream_weights(client, model, sent, f"grpo-{step}", a.update, a.delta_threshold, land)
            kinds.append(kind)
            worst = max(worst, max(mism))
            print(f"step {step}: rollout version {sorted(versions)} reward {mean_r:.3f} loss {loss.item():+.3e} | "
                  f"logprob mismatch max {max(mism):.2e} mean {np.mean(mism):.2e} over {len(mism)} tokens | "
                  f"update {kind} ({share:.1%} of elements changed) {nbytes} B in {dt * 1e3:.1f} ms -> grpo-{step}", flush=True)
            if a.check:
                assert versions == {f"grpo-{step - 1}"}, f"step {step}: rollouts came from {versions}, not grpo-{step - 1}"
                assert max(mism) <= a.max_mismatch, f"step {step}: rollout-vs-trainer logprob mismatch {max(mism):.3g} > {a.max_mismatch}"
        final = client.completions(PROMPTS[0], max_tokens=1, temperature=0)["weight_version"]
        print(f"done: the daemon serves {final}; updates {kinds}; worst logprob mismatch {worst:.2e}", flush=True)
        if a.check:
            assert final == f"grpo-{a.steps}", final
            if a.update == "auto" and a.trainable != "all":
                assert any(k.startswith("delta") for k in kinds), f"only {a.trainable} changes: a delta update was expected ({kinds})"
            if a.land == "on":
                assert all(k.endswith("landed") for k in kinds), kinds
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
