#!/usr/bin/env python3
"""Issue 28 peer comparison, driven by tests/bench/llamacpp_peer.sh (which fetches and builds
llama.cpp v0.4.0 from the npm node-llama-cpp bundle and writes the GGUF files).

  llamacpp_peer.py check  --llama-bin DIR --gguf M.gguf --checkpoint CK --fd-build B
  llamacpp_peer.py bench  ... --out J.json [--threads 1,2] [--reps 2]
  llamacpp_peer.py server ... --out J.json [--clients 64]
  llamacpp_peer.py table  ... --out J.json      (markdown table of a bench JSON)

check: greedy continuation of one prompt of 32 token ids (16 steps, temperature 0, ignore_eos) by
  fdrollout's daemon (/v1/completions, --compute-dtype float32 and bfloat16, 1 thread) and by
  llama.cpp (tests/bench/llamacpp_greedy.cpp on libllama, 1 thread, F16 KV) on the BF16 GGUF
  and on an F32 GGUF of the same weights (widened exactly): token ids and the chosen token's
  log-probability, step by step, against fdrollout's float32 mode.
bench: per thread count, per repetition, interleaved in this order: fd_bench --compute-dtype
  float32 (prefill 128/512/2048; decode B=1/8/32/64 after a 64-token prompt, 32 steps), fd_bench
  --compute-dtype bfloat16 (the same shapes, or --bf16-batches / --bf16-prefill: on a CPU
  without AVX512_BF16 the bfloat16 mode runs a scalar path that takes many minutes per shape),
  llama-bench -p 128,512,2048 -n 64 (pp/tg, its default F16 KV), llama-batched-bench -npp 64
  -ntg 32 -npl 1,8,32,64 -pps (S_TG). Medians over repetitions; ratio = fdrollout tok/s ÷
  llama.cpp tok/s for the same shape (prefill N ÷ ppN; decode B ÷ batched-bench S_TG at B; B=1
  also ÷ llama-bench tg64, which decodes from an empty context).
server: --clients concurrent non-streaming /v1/completions (each its own 64 random token ids,
  32 tokens, temperature 0, ignore_eos) against fdrollout (--compute-dtype bfloat16, then
  float32, each with its default f32 KV; then bfloat16 with --kv-cache-dtype bfloat16, 16-bit
  K/V as llama.cpp's default F16 KV) and llama-server (-np clients), alternating, --reps
  bursts; aggregate generated tok/s = all tokens ÷ burst wall time; medians. Both servers get the same logit_bias of -100 on
  the tokenizer's 256 <0xNN> byte pieces: llama-server v0.4.0 runs its chat-output parser on every
  completion, /completion included, and answers 500 ("does not match the expected Content-only
  format") when the text is not valid UTF-8, which a lone byte piece from this random model makes.
"""
import argparse
import concurrent.futures as cf
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SIMD = ("sse4_2", "fma", "f16c", "avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
        "avx512_vnni", "amx_bf16", "amx_tile", "avx_vnni")


def machine():
    cpu, flags = "?", []
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and cpu == "?":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in SIMD if f in have]
    return {"cpu": cpu, "cpu_simd_flags": " ".join(flags), "n_cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": open("/proc/loadavg").read().strip()}


def run(cmd, timeout=1800):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"llamacpp_peer: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST {path} -> {r.status}: {data[:500]!r}")
        return json.loads(data)
    finally:
        c.close()


class Server:
    """fdrollout or llama-server on a free port; a context manager that always kills it."""

    def __init__(self, cmd, health="/health", timeout=120):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="llamacpp_peer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([c.replace("{PORT}", str(self.port)) for c in cmd],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", health)
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        sys.exit(f"llamacpp_peer: {cmd[0]} did not come up:\n{open(self.log.name).read()[-3000:]}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fd_server(a, threads, compute, max_seqs=64, kv_dtype="auto"):
    return Server([os.path.join(a.fd_build, "fdrollout"), "--model", a.checkpoint, "--port", "{PORT}",
                   "--log-level", "warn", "--threads", str(threads), "--compute-dtype", compute,
                   "--max-num-seqs", str(max_seqs), "--kv-cache-dtype", kv_dtype])


def llama_server(a, gguf, threads, slots, ctx):
    return Server([os.path.join(a.llama_bin, "llama-server"), "-m", gguf, "--port", "{PORT}", "-t", str(threads),
                   "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "--no-webui", "--log-disable"])


def prompt_ids(seed, n, lo=3, hi=512):
    """n pseudo-random token ids in [lo, hi) (the checkpoint's tokenizer pieces), reproducible."""
    x, out = seed * 2654435761 % 2**32 or 1, []
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(lo + x % (hi - lo))
    return out


# ---- check -------------------------------------------------------------------------------------

def fd_greedy(a, compute, ids, steps):
    with fd_server(a, 1, compute, 4) as s:
        j = post(s.port, "/v1/completions", {"model": a.checkpoint, "prompt": ids, "max_tokens": steps, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 1})
    c = j["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def llama_greedy(a, gguf, ids, steps):
    j = json.loads(run([os.path.join(a.llama_bin, "llamacpp_greedy"), gguf, str(steps), *map(str, ids)]))
    return j["tokens"], j["logprobs"]


def compare(ref, other):
    (t0, l0), (t1, l1) = ref, other
    agree = 0
    while agree < min(len(t0), len(t1)) and t0[agree] == t1[agree]:
        agree += 1
    gaps = [abs(x - y) for x, y in zip(l0[:agree], l1[:agree])]
    return {"tokens_agree": agree, "of": len(t0), "max_abs_logprob_gap": max(gaps) if gaps else None,
            "tokens": t1}


def cmd_check(a):
    ids = prompt_ids(28, 32)
    steps = 16
    out = {"machine": machine(), "prompt_ids": ids, "steps": steps}
    ref = fd_greedy(a, "float32", ids, steps)
    out["fdrollout_float32"] = {"tokens": ref[0], "token_logprobs": ref[1]}
    out["fdrollout_bfloat16_vs_fd_float32"] = compare(ref, fd_greedy(a, "bfloat16", ids, steps))
    gguf_f32 = a.gguf.replace("-bf16.gguf", "-f32.gguf")
    for name, g in (("llamacpp_f32_gguf_vs_fd_float32", gguf_f32), ("llamacpp_bf16_gguf_vs_fd_float32", a.gguf)):
        if os.path.exists(g):
            out[name] = compare(ref, llama_greedy(a, g, ids, steps))
    print(json.dumps(out, indent=1))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


# ---- bench -------------------------------------------------------------------------------------

def fd_bench(a, t, mode, batches, prefill_lens):
    txt = run([os.path.join(a.fd_build, "fd_bench"), "--model", a.checkpoint, "--compute-dtype", mode,
               "--threads", str(t), "--batches", batches, "--prompt-len", "64", "--decode-steps", "32",
               "--seconds-min", str(a.seconds_min), "--prefill-lens", prefill_lens, "--no-breakdown",
               "--decode-ctx", "", "--linear-m", "64", "--bw-mib", "256"])
    j = json.loads(txt)
    rows = {}
    for m in j["models"]:
        mode = m["compute_dtype"]
        for p in m["prefill"]:
            rows[(mode, f"prefill {p['tokens']}")] = p["tok_s"]
        for d in m["decode"]:
            rows[(mode, f"decode B={d['batch']}")] = d["tok_s"]
    return rows, j.get("memory_read_bw_gbs", {}).get("single_thread")


def llama_bench(a, t):
    txt = run([os.path.join(a.llama_bin, "llama-bench"), "-m", a.gguf, "-t", str(t), "-p", "128,512,2048",
               "-n", "64", "-r", str(a.llama_reps), "-o", "json"])
    rows, info = {}, {}
    for r in json.loads(txt):
        key = f"prefill {r['n_prompt']}" if r["n_gen"] == 0 else "decode B=1 (tg64)"
        rows[key] = r["avg_ts"]
        info = {k: r.get(k) for k in ("build_commit", "build_number", "cpu_info", "type_k", "type_v", "flash_attn",
                                      "n_batch", "n_ubatch", "model_type")}
    return rows, info


def batched_bench(a, t):
    txt = run([os.path.join(a.llama_bin, "llama-batched-bench"), "-m", a.gguf, "-t", str(t), "-tb", str(t),
               "-c", "8192", "-npp", "64", "-ntg", "32", "-npl", "1,8,32,64", "-pps", "--output-format", "jsonl"])
    rows = {}
    for line in txt.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[f"decode B={r['pl']}"] = r["speed_tg"]
    return rows


ROWS = ["decode B=1", "prefill 128", "prefill 512", "prefill 2048", "decode B=8", "decode B=32", "decode B=64"]


def cmd_bench(a):
    out = {"machine_start": machine(), "command": " ".join(sys.argv), "threads": {}}
    for t in [int(x) for x in a.threads.split(",")]:
        samples = {"fd": [], "llama_bench": [], "batched": [], "bw": []}
        info = {}
        for rep in range(a.reps):
            fd, bw = fd_bench(a, t, "float32", "1,8,32,64", "128,512,2048")
            if a.bf16_batches:  # the bfloat16 mode on the shapes asked for (all by default)
                fd.update(fd_bench(a, t, "bfloat16", a.bf16_batches, a.bf16_prefill)[0])
            lb, info = llama_bench(a, t)
            bb = batched_bench(a, t)
            samples["fd"].append(fd)
            samples["llama_bench"].append(lb)
            samples["batched"].append(bb)
            samples["bw"].append(bw)
            print(f"llamacpp_peer: threads {t} rep {rep} done ({open('/proc/loadavg').read().strip()})", file=sys.stderr)
        med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
        llama = {}
        for r in ROWS:
            src = samples["batched"] if r.startswith("decode") else samples["llama_bench"]
            vals = [s[r] for s in src if r in s]
            if vals:
                llama[r] = med(vals)
        llama["decode B=1 (tg64)"] = med([s["decode B=1 (tg64)"] for s in samples["llama_bench"]])
        table = []
        for r in ROWS:
            row = {"row": r, "llamacpp_tok_s": llama.get(r)}
            for mode in ("float32", "bfloat16"):
                vals = [s[(mode, r)] for s in samples["fd"] if (mode, r) in s]
                v = med(vals) if vals else None  # None: not measured (see --bf16-batches)
                row[f"fd_{mode}_tok_s"] = v
                row[f"ratio_{mode}"] = round(v / llama[r], 3) if v and llama.get(r) else None
                if r == "decode B=1":
                    row[f"ratio_{mode}_vs_tg64"] = round(v / llama["decode B=1 (tg64)"], 3) if v else None
            row["bfloat16_meets_1.2"] = row["ratio_bfloat16"] is not None and row["ratio_bfloat16"] >= 1.2
            table.append(row)
        out["threads"][str(t)] = {"rows": table, "llamacpp_tg64_tok_s": llama["decode B=1 (tg64)"],
                                  "llama_bench_info": info, "read_bw_gbs_1thread": samples["bw"], "samples": {
                                      "fd": [{f"{m} {r}": v for (m, r), v in s.items()} for s in samples["fd"]],
                                      "llama_bench": samples["llama_bench"], "batched_bench": samples["batched"]}}
        if a.out:  # what is done so far survives an interrupted run
            open(a.out + ".partial", "w").write(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    out["machine_end"] = machine()
    out["what"] = "fdrollout tok/s ÷ llama.cpp tok/s, same shapes, same run; medians over reps"
    txt = json.dumps(out, indent=1, ensure_ascii=False)
    print(txt)
    if a.out:
        open(a.out, "w").write(txt + "\n")
        if os.path.exists(a.out + ".partial"):
            os.unlink(a.out + ".partial")


def cmd_table(a):
    """Markdown table of a bench JSON (--out): per row and thread count, the tok/s and ratios."""
    j = json.load(open(a.out))
    print("| row | threads | llama.cpp tok/s | fd float32 tok/s | fd bfloat16 tok/s | float32 ÷ llama.cpp | "
          "**bfloat16 ÷ llama.cpp** (target ≥ 1.2) |")
    print("|---|---|---|---|---|---|---|")
    for t, d in j["threads"].items():
        for r in d["rows"]:
            extra = ""
            if r["row"] == "decode B=1":
                extra = f" (÷ tg64 {d['llamacpp_tg64_tok_s']}: {r['ratio_float32_vs_tg64']} / {r['ratio_bfloat16_vs_tg64']})"
            mark = "" if r["bfloat16_meets_1.2"] else " ✗"
            print(f"| {r['row']} | {t} | {r['llamacpp_tok_s']} | {r['fd_float32_tok_s']} | {r['fd_bfloat16_tok_s']} | "
                  f"{r['ratio_float32']} | **{r['ratio_bfloat16']}**{mark}{extra} |")


# ---- server ------------------------------------------------------------------------------------

def burst(port, path, clients, body_of):
    def one(i):
        j = post(port, path, body_of(i))
        return len(j["choices"][0].get("token_ids") or []) if "choices" in j else j.get("tokens_predicted", 0)

    t0 = time.time()
    with cf.ThreadPoolExecutor(clients) as ex:
        n = list(ex.map(one, range(clients)))
    return sum(n), time.time() - t0


def byte_token_ids(checkpoint):
    """Ids of the <0xNN> byte pieces of the checkpoint's tokenizer.json (BYTE tokens in the GGUF)."""
    v = json.load(open(os.path.join(checkpoint, "tokenizer.json")))["model"]["vocab"]
    items = v.items() if isinstance(v, dict) else ((p, i) for i, (p, _) in enumerate(v))
    return sorted(i for p, i in items if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", p))


def cmd_server(a):
    ban = {str(i): -100 for i in byte_token_ids(a.checkpoint)}  # see the module docstring: server
    out = {"machine_start": machine(), "command": " ".join(sys.argv), "clients": a.clients, "prompt_len": 64,
           "max_tokens": 32, "logit_bias_minus_100_on_byte_tokens": len(ban), "threads": {}}
    C = a.clients

    def fd_body(i):
        return {"model": a.checkpoint, "prompt": prompt_ids(1000 + i, 64), "max_tokens": 32, "temperature": 0,
                "ignore_eos": True, "logit_bias": ban}

    def ll_body(i):
        return {"prompt": prompt_ids(1000 + i, 64), "n_predict": 32, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "logit_bias": ban}

    for t in [int(x) for x in a.threads.split(",")]:
        res = {"fd_bfloat16": [], "fd_float32": [], "llamacpp": [], "fd_bfloat16_bf16kv": []}
        for rep in range(a.reps):
            for name in ("fd_bfloat16", "llamacpp", "fd_float32", "fd_bfloat16_bf16kv"):
                if name == "llamacpp":
                    srv = llama_server(a, a.gguf, t, C, C * 128)
                    path, body = "/completion", ll_body
                else:  # fd_<compute>[_bf16kv]: the last also stores K/V in 16 bits, as llama.cpp's F16 KV
                    srv = fd_server(a, t, name.split("_")[1], C, "bfloat16" if name.endswith("_bf16kv") else "auto")
                    path, body = "/v1/completions", fd_body
                with srv:
                    burst(srv.port, path, min(C, 8), body)  # warm-up
                    n, dt = burst(srv.port, path, C, body)
                if n != C * 32:
                    sys.exit(f"llamacpp_peer: {name} generated {n} tokens, expected {C * 32}")
                res[name].append(round(n / dt, 1))
            print(f"llamacpp_peer: server threads {t} rep {rep}: {res}", file=sys.stderr)
        m = {k: statistics.median(v) for k, v in res.items()}
        out["threads"][str(t)] = {"tok_s": res, "median_tok_s": m,
                                  "ratio_bfloat16": round(m["fd_bfloat16"] / m["llamacpp"], 3),
                                  "ratio_float32": round(m["fd_float32"] / m["llamacpp"], 3),
                                  "ratio_bfloat16_bf16kv": round(m["fd_bfloat16_bf16kv"] / m["llamacpp"], 3)}
    out["machine_end"] = machine()
    txt = json.dumps(out, indent=1)
    print(txt)
    if a.out:
        open(a.out, "w").write(txt + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["check", "bench", "server", "table"])
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--fd-build", required=True)
    ap.add_argument("--out")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=int(os.environ.get("PEER_REPS", "2")))
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--seconds-min", type=float, default=0.3, help="fd_bench --seconds-min")
    ap.add_argument("--bf16-batches", default="1,8,32,64",
                    help="decode batches of the bfloat16-mode fd_bench run (empty: no bfloat16 run)")
    ap.add_argument("--bf16-prefill", default="128,512,2048", help="prefill lengths of the bfloat16-mode run")
    ap.add_argument("--clients", type=int, default=64)
    a = ap.parse_args()
    {"check": cmd_check, "bench": cmd_bench, "server": cmd_server, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
