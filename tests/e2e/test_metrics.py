"""GET /metrics against Prometheus' own rules and against requests counted by the client.

The exposition is parsed with Debian's python3-prometheus-client (the reference parser of the
text format); names, types and units are checked against https://prometheus.io/docs/practices/naming/
and https://prometheus.io/docs/instrumenting/writing_exporters/ (counters end in _total, base
units, _info gauges are 1, histogram buckets cumulative with +Inf == _count). The request
histograms must count exactly the choices the client sent, and their sums must respect the
order of events (queue <= TTFT, TTFT + inter-token <= e2e) and the client's own clock."""
import os
import re
import subprocess
import threading
import time
import unittest

from prometheus_client.parser import text_string_to_metric_families

from fdtest import REPO, Daemon, rss_bytes, wait_until

NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Non-base units (Prometheus: seconds, bytes, ratios; never ms, KiB, percent ...).
BAD_UNITS = ["_milliseconds", "_microseconds", "_nanoseconds", "_minutes", "_hours", "_ms", "_us", "_kb", "_kib", "_mb",
             "_mib", "_gb", "_gib", "_percent", "_perc"]


def raw_families(text):
    """{name: type} from the # TYPE lines, and the set of names that have a # HELP line."""
    types, helps = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            assert name not in types, f"{name}: two # TYPE lines"
            types[name] = typ
        elif line.startswith("# HELP "):
            helps.add(line.split(" ", 3)[2])
    return types, helps


def naming_problems(text):
    """Every violation of the naming rules in an exposition, as strings (empty = clean)."""
    problems = []
    types, helps = raw_families(text)
    for name, typ in types.items():
        if not NAME_RE.match(name):
            problems.append(f"{name}: not a valid metric name")
        if name not in helps:
            problems.append(f"{name}: no # HELP")
        if typ == "counter" and not name.endswith("_total"):
            problems.append(f"{name}: a counter must end in _total")
        if typ != "counter" and name.endswith("_total"):
            problems.append(f"{name}: a {typ} must not end in _total")
        if typ != "histogram" and re.search(r"_(sum|count|bucket)$", name):
            problems.append(f"{name}: a {typ} must not end in _sum/_count/_bucket")
        for bad in BAD_UNITS:
            if bad + "_" in name + "_" and not name.startswith("vllm:"):  # vLLM's own names are kept as vLLM spells them
                problems.append(f"{name}: use base units, not {bad[1:]}")
        stem = name[:-len("_total")] if name.endswith("_total") else name
        if re.search(r"(latency|duration|time)", stem) and not re.search(r"_seconds$|_info$", stem):
            problems.append(f"{name}: a time must be in seconds and say so (_seconds)")
        if "bytes" in stem and not stem.endswith("_bytes"):
            problems.append(f"{name}: the unit _bytes goes last")
        if typ not in ("counter", "gauge", "histogram", "summary", "untyped"):
            problems.append(f"{name}: unknown type {typ}")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for label in s.labels:
                if not LABEL_RE.match(label) or label.startswith("__"):
                    problems.append(f"{s.name}: bad label name {label}")
        if fam.type == "info" or fam.name.endswith("_info"):
            problems += [f"{s.name}: an _info gauge must be 1" for s in fam.samples if s.value != 1]
        if fam.type == "histogram":
            series = {}
            for s in fam.samples:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                series.setdefault(key, {"buckets": [], "sum": None, "count": None})
                if s.name.endswith("_bucket"):
                    series[key]["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    series[key]["sum"] = s.value
                elif s.name.endswith("_count"):
                    series[key]["count"] = s.value
            for key, h in series.items():
                b = h["buckets"]
                if not b or b[-1][0] != float("inf"):
                    problems.append(f"{fam.name}{key}: no +Inf bucket last")
                    continue
                if any(b[i][0] >= b[i + 1][0] for i in range(len(b) - 1)):
                    problems.append(f"{fam.name}{key}: le not ascending")
                if any(b[i][1] > b[i + 1][1] for i in range(len(b) - 1)):
                    problems.append(f"{fam.name}{key}: buckets not cumulative")
                if h["count"] is None or h["sum"] is None or b[-1][1] != h["count"]:
                    problems.append(f"{fam.name}{key}: +Inf bucket != _count, or _sum missing")
    return problems


def scrape(d):
    status, text = d.get("/metrics")
    assert status == 200, (status, text)
    return text


def values(text):
    """{(sample name, frozenset(labels)): value}"""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out



def proc_cpu_seconds(pid):
    """utime + stime of `pid` from /proc (clock ticks → seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

class Metrics(unittest.TestCase):
    def test_the_checker_catches_what_it_should(self):
        # The counter this daemon used to expose, and other classic mistakes: each must be caught.
        for bad, why in [("# HELP x_seconds_sum s\n# TYPE x_seconds_sum counter\nx_seconds_sum 1\n", "_total"),
                         ("# HELP x_requests r\n# TYPE x_requests counter\nx_requests_total 1\n", "_total"),
                         ("# HELP x_latency_ms l\n# TYPE x_latency_ms gauge\nx_latency_ms 1\n", "base units"),
                         ("# HELP x_up_total u\n# TYPE x_up_total gauge\nx_up_total 1\n", "must not end in _total"),
                         ("# HELP x_build_info b\n# TYPE x_build_info gauge\nx_build_info{v=\"1\"} 2\n", "_info gauge must be 1"),
                         ("# HELP x_h_seconds h\n# TYPE x_h_seconds histogram\nx_h_seconds_bucket{le=\"1\"} 3\n"
                          "x_h_seconds_bucket{le=\"+Inf\"} 2\nx_h_seconds_sum 1\nx_h_seconds_count 2\n", "cumulative")]:
            problems = naming_problems(bad)
            self.assertTrue(any(why in p for p in problems), (bad, problems))

    def test_names_types_and_histograms_follow_prometheus_rules(self):
        with Daemon() as d:
            d.complete(prompt="Lily", max_tokens=3, temperature=0)
            text = scrape(d)
            self.assertEqual(naming_problems(text), [])
            types, _ = raw_families(text)
            for name, typ in {"fdrollout_time_to_first_token_seconds": "histogram",
                              "fdrollout_inter_token_latency_seconds": "histogram",
                              "fdrollout_e2e_request_latency_seconds": "histogram",
                              "fdrollout_request_queue_time_seconds": "histogram",
                              "fdrollout_prompt_tokens_total": "counter", "fdrollout_generation_tokens_total": "counter",
                              "fdrollout_control_seconds_total": "counter", "fdrollout_build_info": "gauge",
                              "process_cpu_seconds_total": "counter", "process_resident_memory_bytes": "gauge",
                              "process_start_time_seconds": "gauge", "process_open_fds": "gauge"}.items():
                self.assertEqual(types.get(name), typ, name)
            self.assertNotIn("fdrollout_control_seconds_sum", types)
            # vLLM's TTFT buckets, in order
            v = values(text)
            les = sorted(float(dict(k[1])["le"]) for k in v if k[0] == "fdrollout_time_to_first_token_seconds_bucket")
            for b in [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                      80.0, 160.0, 640.0, 2560.0]:
                self.assertIn(b, les)

    def test_build_info_and_process_metrics_are_true(self):
        with Daemon() as d:
            d.complete(prompt="Once upon a time", max_tokens=200, temperature=0, ignore_eos=True)
            cpu_before = proc_cpu_seconds(d.proc.pid)  # the scrape's value lies between this and a read after it
            v = values(scrape(d))
            info = [dict(k[1]) for k in v if k[0] == "fdrollout_build_info"]
            self.assertEqual(len(info), 1)
            with open(os.path.join(REPO, "CMakeLists.txt")) as f:
                version = re.search(r"project\(fdrollout VERSION (\S+)", f.read()).group(1)
            self.assertEqual(info[0]["version"], version)
            # a commit of this repository (the one built, which may be older than HEAD), or "unknown" without git
            commit = info[0]["git_commit"]
            if subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode == 0:
                self.assertRegex(commit, r"^[0-9a-f]{12}(-dirty)?$")
                p = subprocess.run(["git", "-C", REPO, "cat-file", "-t", commit.split("-")[0]], capture_output=True, text=True)
                self.assertEqual(p.stdout.strip(), "commit", commit)
            else:
                self.assertEqual(commit, "unknown")
            rss = v[("process_resident_memory_bytes", frozenset())]
            self.assertLess(abs(rss - rss_bytes(d.proc.pid)), 0.2 * rss)
            with open(f"/proc/{d.proc.pid}/stat") as f:  # start time: the kernel's, via boot time
                start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                btime = int([l for l in f if l.startswith("btime")][0].split()[1])
            self.assertAlmostEqual(v[("process_start_time_seconds", frozenset())], btime + start_ticks / os.sysconf("SC_CLK_TCK"), delta=0.02)
            self.assertLess(abs(v[("process_start_time_seconds", frozenset())] - time.time()), 120)
            # the scrape's own connection (and a keep-alive one) are open while it is answered
            self.assertLessEqual(abs(v[("process_open_fds", frozenset())] - len(os.listdir(f"/proc/{d.proc.pid}/fd"))), 3)
            cpu_after = proc_cpu_seconds(d.proc.pid)
            self.assertLessEqual(v[("process_cpu_seconds_total", frozenset())], cpu_after + 1e-9)  # float formatting only
            self.assertGreaterEqual(v[("process_cpu_seconds_total", frozenset())], cpu_before - 0.02)  # tick rounding
            status, j = d.get("/version")
            self.assertEqual((status, j["version"], j["git_commit"]), (200, info[0]["version"], info[0]["git_commit"]))

    def test_control_in_flight_names_every_running_op(self):
        # A probe: only pause/resume/sleep/wakeup/update_weights had a series, so a running
        # flush_cache (or commit_weights, drop_staged_weights, abort_request) showed as nothing.
        with Daemon("--dynamic-load-weight", env={"FD_DEBUG_CONTROL_DELAY_MS": "1500"}) as d:
            t = threading.Thread(target=d.post, args=("/v1/flush_cache",))
            t.start()
            wait_until(lambda: d.get("/health")[1]["control_in_flight"] == "flush_cache", 30, "flush_cache in the engine")
            _, text = d.get("/metrics")
            t.join()
            flight = {m.group(1): float(m.group(2)) for m in re.finditer(r'^fdrollout_control_in_flight\{op="([^"]+)"\} (\S+)', text, re.M)}
            self.assertEqual(flight.get("flush_cache"), 1.0, flight)
            self.assertEqual(sum(flight.values()), 1.0, flight)
            self.assertIn("commit_weights", flight)

    def test_a_request_timeout_counts_as_error_not_abort(self):
        # A probe: the client got 504 timeout, /metrics counted the choice as an abort.
        def finished(d, reason):
            _, text = d.get("/metrics")
            m = re.search(r'^fdrollout_requests_finished_total\{[^}]*finished_reason="%s"\} (\S+)' % reason, text, re.M)
            return float(m.group(1)) if m else 0.0

        with Daemon("--request-timeout-s", "0.5", env={"FD_DEBUG_STEP_DELAY_MS": "50"}) as d:
            before = {r: finished(d, r) for r in ("abort", "error")}
            status, j = d.post("/v1/completions", {"prompt": "Once", "max_tokens": 100, "ignore_eos": True})
            self.assertEqual((status, j["error"]["type"]), (504, "timeout"), j)
            wait_until(lambda: finished(d, "error") > before["error"], 10, "the timed-out choice counted")
            self.assertEqual(finished(d, "abort"), before["abort"])

    def test_request_histograms_count_real_requests(self):
        with Daemon("--max-num-seqs", "4") as d:
            before = values(scrape(d))
            n_req, max_tokens, prompt_tokens, client_s = 0, 12, 0, 0.0
            prompts = ["Once upon a time", "Lily and Tom", "The cat", "A big red ball"]
            for i, p in enumerate(prompts):
                t0 = time.time()
                if i % 2:
                    chunks, done = d.stream(prompt=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    self.assertTrue(done)
                    prompt_tokens += len(next(c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"]))
                else:
                    j = d.complete(prompt=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    self.assertEqual(j["usage"]["completion_tokens"], max_tokens)
                    prompt_tokens += j["usage"]["prompt_tokens"]
                client_s += time.time() - t0
                n_req += 1
            mid = values(scrape(d))
            j = d.complete(prompt=["Lily", "Tom"], n=2, max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
            n_choices = n_req + 4
            prompt_tokens += 2 * j["usage"]["prompt_tokens"]  # counted per choice: each of the n = 2 is prefilled
            after = values(scrape(d))

            def delta(name, labels=(("model_name", "stories260K"),)):
                k = (name, frozenset(labels))
                return after[k] - before.get(k, 0)

            self.assertEqual(delta("fdrollout_requests_total"), n_req + 1)
            self.assertEqual(delta("fdrollout_generation_tokens_total"), n_choices * max_tokens)
            self.assertEqual(delta("fdrollout_prompt_tokens_total"), prompt_tokens)
            self.assertEqual(delta("fdrollout_requests_finished_total", (("model_name", "stories260K"), ("finished_reason", "length"))),
                             n_choices)
            counts = {n: delta(n + "_count") for n in ["fdrollout_time_to_first_token_seconds", "fdrollout_e2e_request_latency_seconds",
                                                      "fdrollout_request_queue_time_seconds", "fdrollout_inter_token_latency_seconds"]}
            self.assertEqual(counts, {"fdrollout_time_to_first_token_seconds": n_choices, "fdrollout_e2e_request_latency_seconds": n_choices,
                                      "fdrollout_request_queue_time_seconds": n_choices,
                                      "fdrollout_inter_token_latency_seconds": n_choices * (max_tokens - 1)})
            ttft, e2e = delta("fdrollout_time_to_first_token_seconds_sum"), delta("fdrollout_e2e_request_latency_seconds_sum")
            queue, itl = delta("fdrollout_request_queue_time_seconds_sum"), delta("fdrollout_inter_token_latency_seconds_sum")
            self.assertGreater(ttft, 0)
            self.assertGreater(itl, 0)
            self.assertLessEqual(queue, ttft + 1e-9)
            self.assertLessEqual(ttft + itl, e2e + 1e-6)  # per choice: last token <= finish
            # The first n_req requests ran one at a time: the server's e2e of each lies inside the
            # client's round trip, so their sum does too.
            lab = frozenset({("model_name", "stories260K")})
            e2e_seq = mid[("fdrollout_e2e_request_latency_seconds_sum", lab)] - before[("fdrollout_e2e_request_latency_seconds_sum", lab)]
            self.assertGreater(e2e_seq, 0)
            self.assertLessEqual(e2e_seq, client_s)

    def test_vllm_named_series_equal_ours_after_known_requests(self):
        """Issue #26: vLLM's metric names (vllm/v1/metrics/loggers.py; counters with the `_total`
        prometheus_client adds) beside ours, with values checked against the requests sent."""
        with Daemon("--max-num-seqs", "4", "--enable-prefix-caching", "--block-size", "16") as d:
            lab = frozenset({("model_name", "stories260K")})
            before = values(scrape(d))
            max_tokens = 12
            long_prompt = " ".join(["Once upon a time there was a little girl named Lily."] * 6)
            first = d.complete(prompt=long_prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            second = d.complete(prompt=long_prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            pair = d.complete(prompt=["Lily", "Tom"], n=2, max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
            text = scrape(d)
            self.assertEqual(naming_problems(text), [])
            after = values(text)

            def delta(name, labels=lab):
                return after[(name, labels)] - before.get((name, labels), 0)

            p_long = first["usage"]["prompt_tokens"]
            cached = first["usage"]["prompt_tokens_details"]["cached_tokens"] + second["usage"]["prompt_tokens_details"]["cached_tokens"]
            self.assertGreaterEqual(second["usage"]["prompt_tokens_details"]["cached_tokens"], 16)  # full blocks from the prefix cache
            prompt_total = 2 * p_long + 2 * pair["usage"]["prompt_tokens"]  # per choice: each of the n = 2 is prefilled
            self.assertEqual(delta("vllm:prompt_tokens_total"), prompt_total)
            self.assertEqual(delta("vllm:prefix_cache_queries_total"), prompt_total)
            self.assertEqual(delta("vllm:prefix_cache_hits_total"), cached)  # "Lily", "Tom": shorter than a block
            self.assertEqual(delta("vllm:generation_tokens_total"), 2 * max_tokens + 4 * 3)
            self.assertEqual(delta("vllm:num_preemptions_total"), delta("fdrollout_preemptions_total", frozenset()))
            # histograms: one observation per finished choice, in the buckets their sizes fall in

            def buckets(name):
                return {float(dict(k[1])["le"]): v - before.get(k, 0) for k, v in after.items() if k[0] == name + "_bucket"}

            gen = buckets("vllm:request_generation_tokens")
            self.assertEqual((gen[2], gen[5], gen[10], gen[20], gen[float("inf")]), (0, 4, 4, 6, 6))
            self.assertEqual(delta("vllm:request_generation_tokens_count"), 6)
            self.assertEqual(delta("vllm:request_generation_tokens_sum"), 2 * max_tokens + 4 * 3)
            prm = buckets("vllm:request_prompt_tokens")
            self.assertEqual((prm[1], prm[float("inf")]), (0, 6))
            self.assertLessEqual(pair["usage"]["prompt_tokens"], 10)  # "Lily", "Tom": BOS + a few tokens each
            le_long = min(b for b in prm if p_long <= b)  # the bucket the two long prompts fall in
            below = max(b for b in prm if b < le_long)
            self.assertEqual((prm[5], prm[below], prm[le_long]), (4, 4, 6))
            self.assertEqual(delta("vllm:request_prompt_tokens_count"), 6)
            self.assertEqual(delta("vllm:request_prompt_tokens_sum"), prompt_total)
            for ours in ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]:
                self.assertEqual(after[(f"vllm:{ours}_count", lab)], after[(f"fdrollout_{ours}_count", lab)], ours)
                self.assertEqual(after[(f"vllm:{ours}_sum", lab)], after[(f"fdrollout_{ours}_sum", lab)], ours)
            # gauges, idle: nothing runs or waits; usage is the used share of the pool
            self.assertEqual((after[("vllm:num_requests_running", lab)], after[("vllm:num_requests_waiting", lab)]), (0, 0))
            used, cap = after[("fdrollout_kv_blocks_used", frozenset())], after[("fdrollout_kv_blocks_capacity", frozenset())]
            self.assertGreater(cap, 0)
            self.assertAlmostEqual(after[("vllm:kv_cache_usage_perc", lab)], used / cap)
            # busy: 24 choices on 4 slots, so 4 run and 20 wait; usage is the used share of the pool
            results = {}
            t = threading.Thread(target=lambda: results.setdefault(
                "r", d.complete(prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True, n=24)))
            t.start()
            wait_until(lambda: values(scrape(d))[("vllm:num_requests_waiting", lab)] == 20, 60, "20 choices waiting")
            mid = values(scrape(d))
            self.assertEqual(mid[("vllm:num_requests_running", lab)], 4)
            used, cap = mid[("fdrollout_kv_blocks_used", frozenset())], mid[("fdrollout_kv_blocks_capacity", frozenset())]
            self.assertGreaterEqual(used, 4)  # 4 sequences hold at least a block each
            self.assertAlmostEqual(mid[("vllm:kv_cache_usage_perc", lab)], used / cap)
            t.join(300)
            self.assertEqual(len(results["r"]["choices"]), 24)


if __name__ == "__main__":
    unittest.main()
