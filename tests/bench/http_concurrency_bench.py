#!/usr/bin/env python3
"""HTTP-layer concurrency bench (issue #12, defect 4): N concurrent streaming completions on
stories260K, each on its own connection, while a separate process makes control calls; then one
completion with M idle connections open. Run against each binary given (the current Beast layer
and, for comparison, a binary built from the last cpp-httplib commit), in the same run, with the
same flags. Prints one JSON object.

  /usr/bin/python3 tests/bench/http_concurrency_bench.py --bin build/fdrollout \\
      --old-bin build-httplib/fdrollout [--clients 2000] [--max-tokens 32] [--idle 1000]

Per layer, the median over --trials bursts (layers alternate, so drifting background load hits
both alike): all_complete (every stream ended with [DONE] and max_tokens tokens), time to first
token p50/p99 (from the request's send to its first token event, client side), aggregate
generated tokens/s (all tokens / wall time of the burst), control-call latency p50/p99/max
(GET /v1/is_paused and GET /health alternately, a fresh connection each, from another process,
every 20 ms during the burst) and, after the first burst, the idle test: seconds for one
completion while M idle connections are open. The old binary: `git worktree add /tmp/old 406cd72
&& (cd /tmp/old && bash scripts/build.sh)` (the last commit with cpp-httplib's server).
"""
import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROMPT = "Once upon a time"


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(binary, model, flags, log_level="warn"):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="fdbench-", suffix=".log", delete=False)
    proc = subprocess.Popen([binary, "--model", model, "--port", str(port), "--log-level", log_level, *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                c.close()
                return proc, port, log.name
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{binary} did not start: {open(log.name).read()}")


def stop_daemon(proc, log):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    os.unlink(log)


def control_prober(port, stop, out, interval_s):
    """Another process: control calls on fresh connections until `stop` is set."""
    lat, failures, i = [], 0, 0
    while not stop.is_set():
        path = "/v1/is_paused" if i % 2 == 0 else "/health"
        i += 1
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            if r.status != 200:
                failures += 1
            lat.append(time.perf_counter() - t0)
        except OSError:
            failures += 1
        time.sleep(interval_s)
    out.put({"latencies_s": lat, "failures": failures})


TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')


async def one_stream(port, body, res, timeout_s):
    """POST a streaming completion on its own connection; record first-token time and tokens.
    Cheap on purpose (no JSON decode, no chunk parsing: chunk-size lines fall between events),
    so that the client keeps up with the server on the same two cores."""
    rec = {"ttft_s": None, "tokens": 0, "done": False, "error": None}
    res.append(rec)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, limit=1 << 20), timeout_s)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        t0 = time.perf_counter()  # TTFT from the request's send (a server's accept queue counts, our connect does not)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
            rec["error"] = head.split(b"\r\n")[0].decode()
            writer.close()
            return
        pending = b""
        while not rec["done"]:
            data = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not data:
                break
            pending += data
            cut = pending.rfind(b"\n\n")  # events end with a blank line; keep a partial one
            if cut < 0:
                continue
            events, pending = pending[:cut], pending[cut + 2:]
            n = sum(len(m.split(b",")) for m in TOKEN_IDS.findall(events) if m)
            if n and rec["ttft_s"] is None:
                rec["ttft_s"] = time.perf_counter() - t0
            rec["tokens"] += n
            rec["done"] = b"data: [DONE]" in events
        writer.close()
    except Exception as e:  # counted as incomplete
        rec["error"] = repr(e)


async def burst(port, n_clients, max_tokens, timeout_s):
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    res = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one_stream(port, body, res, timeout_s) for _ in range(n_clients)))
    return res, time.perf_counter() - t0


def idle_test(port, n_idle, timeout_s):
    """Seconds for one completion while n_idle connections sit open and silent."""
    idle = []
    try:
        for _ in range(n_idle):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.2)
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
                  headers={"Content-Type": "application/json"})
        ok = c.getresponse().status == 200
        c.close()
        return round(time.perf_counter() - t0, 3) if ok else None
    except OSError:
        return None
    finally:
        for s in idle:
            s.close()


def run_layer(binary, args, with_idle):
    proc, port, log = start_daemon(binary, args.model, args.flags)
    try:
        stop, out = mp.Event(), mp.Queue()
        prober = mp.Process(target=control_prober, args=(port, stop, out, args.control_interval_s))
        prober.start()
        time.sleep(0.3)
        res, wall = asyncio.run(burst(port, args.clients, args.max_tokens, args.timeout_s))
        stop.set()
        probe = out.get(timeout=300)
        prober.join(60)
        ttft = [r["ttft_s"] for r in res if r["ttft_s"] is not None]
        complete = [r for r in res if r["done"] and r["tokens"] == args.max_tokens]
        lat = probe["latencies_s"]
        errors = sorted({r["error"] for r in res if r["error"]})
        out = {
            "all_complete": len(complete) == args.clients,
            "n_complete": len(complete),
            "errors": errors[:5],
            "wall_s": round(wall, 3),
            "ttft_p50_s": round(pct(ttft, 50), 4) if ttft else None,
            "ttft_p99_s": round(pct(ttft, 99), 4) if ttft else None,
            "tokens_per_s": round(sum(r["tokens"] for r in res) / wall, 1),
            "control_calls": len(lat),
            "control_failures": probe["failures"],
            "control_p50_ms": round(pct(lat, 50) * 1000, 2) if lat else None,
            "control_p99_ms": round(pct(lat, 99) * 1000, 2) if lat else None,
            "control_max_ms": round(max(lat) * 1000, 2) if lat else None,
        }
        if with_idle and args.idle:
            time.sleep(args.idle_pause_s)  # let the burst's keep-alive connections expire first
            out[f"idle_{args.idle}_completion_s"] = idle_test(port, args.idle, args.timeout_s)
        return out
    finally:
        stop_daemon(proc, log)


def median_of(trials):
    """Per metric, the median over trials (numbers), all true (booleans), the union (lists)."""
    out = {}
    for k in trials[0]:
        vals = [t[k] for t in trials if k in t]
        if isinstance(vals[0], bool):
            out[k] = all(vals)
        elif isinstance(vals[0], list):
            out[k] = sorted({e for v in vals for e in v})[:5]
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = sorted(vals)[len(vals) // 2]
        else:
            out[k] = vals[0]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "fdrollout"), help="the fdrollout under test (Beast layer)")
    ap.add_argument("--old-bin", default=None, help="a fdrollout built from the last cpp-httplib commit (406cd72), for comparison")
    ap.add_argument("--model", default=os.path.join(REPO, "models", "stories260K"))
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--idle", type=int, default=1000, help="idle connections held for the idle test (0 = skip)")
    ap.add_argument("--idle-pause-s", type=float, default=6.0)
    ap.add_argument("--control-interval-s", type=float, default=0.02)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--trials", type=int, default=3, help="bursts per layer, alternating layers; medians are reported")
    ap.add_argument("--flags", nargs="*", default=[], help="daemon flags for every binary (default: none, as shipped)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    bins = {"beast": args.bin, **({"httplib": args.old_bin} if args.old_bin else {})}
    trials = {name: [] for name in bins}
    for t in range(args.trials):  # alternate the order so drifting background load hits both alike
        for name in (list(bins) if t % 2 == 0 else list(reversed(bins))):
            trials[name].append(run_layer(bins[name], args, with_idle=(t == 0)))
            print(f"trial {t} {name}: {json.dumps(trials[name][-1])}", file=sys.stderr, flush=True)
    layers = {name: {"binary": bins[name], **median_of(trials[name])} for name in bins}
    out = {"bench": "http_concurrency", "model": os.path.basename(args.model), "clients": args.clients,
           "max_tokens": args.max_tokens, "daemon_flags": args.flags, "cpus": os.cpu_count(), "trials": args.trials,
           "layers": layers, "per_trial": trials}
    if "httplib" in layers:
        new, old = layers["beast"], layers["httplib"]
        ratio = lambda a, b: round(a / b, 2) if a and b else None
        out["old_over_new"] = {"ttft_p99": ratio(old["ttft_p99_s"], new["ttft_p99_s"]),
                               "control_p99": ratio(old["control_p99_ms"], new["control_p99_ms"]),
                               "wall": ratio(old["wall_s"], new["wall_s"])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
