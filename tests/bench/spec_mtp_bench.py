"""The MTP half of tests/bench/spec_bench.py (--method mtp [--tp 2]; its docstring says what is measured).

Run through spec_bench.py, which passes itself as `sb` (one / batch / spec_counts / PROMPTS)."""
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from fdtest import BIN, REPO, Daemon, copy_checkpoint, rewrite_tensors  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_mtp_fixture  # noqa: E402
import safetensors_np  # noqa: E402

COLLAPSE_FACTOR, COLLAPSE_MIN_TOKENS = 3.0, 64  # docs/speculative.md "Acceptance collapse after an update"


def mtp_cfg(k, cutoff=0):
    c = {"method": "mtp", "num_speculative_tokens": k}
    if cutoff is not None:
        c["disable_by_batch_size"] = cutoff
    return json.dumps(c)


def per_version(d):
    """{weight_version: (proposed, accepted)} from /metrics."""
    out = {}
    for line in d.get("/metrics")[1].splitlines():
        for i, fam in enumerate(("fdrollout_spec_decode_num_draft_tokens_total", "fdrollout_spec_decode_num_accepted_tokens_total")):
            if line.startswith(fam + "{"):
                v = line.split('weight_version="', 1)[1].split('"', 1)[0]
                out.setdefault(v, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return out


def b1_pass(sb, d, bodies):
    """Greedy requests one at a time: (tokens/s, [token ids])."""
    total, toks = 0.0, []
    for b in bodies:
        dt, t = sb.one(d, b)
        total += dt
        toks.append(t)
    return sum(b["max_tokens"] for b in bodies) / total, toks


def run_mtp(a, sb):
    build = os.path.dirname(BIN)
    root = make_mtp_fixture.mtp_fixture(build)
    fresh = a.model or os.path.join(root, "fresh")
    with open(os.path.join(root, "meta.json")) as f:
        meta = json.load(f)
    common = ["--threads", str(a.threads), "--max-num-seqs", "64", "--max-model-len", "512"]
    flags = {"plain": [], "k1": ["--speculative-config", mtp_cfg(1)], "k2": ["--speculative-config", mtp_cfg(2)],
             "k3": ["--speculative-config", mtp_cfg(3)], "cutoff": ["--speculative-config", mtp_cfg(a.k, None)]}
    kname = f"k{a.k}"
    if kname not in flags:
        flags[kname] = ["--speculative-config", mtp_cfg(a.k)]
    res = {"method": "mtp", "k": a.k, "quick_fixture": bool(os.environ.get("FD_MTP_FIXTURE")) and "quick" in root, "gen": a.gen, "gen_batch": a.gen_batch, "rounds": a.rounds, "threads": a.threads,
           "fixture": os.path.basename(root), "fixture_heldout": {"fresh": meta["fresh"], "stale": meta["stale"], "untrained": meta["untrained"],
                                                                  "stale_step": meta["stale_step"], "steps": meta["steps"]},
           "outputs_identical": True}
    ds, tmp = {}, None
    try:
        for k, f in flags.items():
            ds[k] = Daemon(*common, *f, model=fresh, extra=False, timeout=600)
        # 1. B=1, k = 1, 2, 3
        bodies = [{"prompt": p, "max_tokens": a.gen, "temperature": 0, "ignore_eos": True} for p in sb.PROMPTS]
        spec = [k for k in ("k1", "k2", "k3") if k in ds]
        tps = {k: [] for k in ["plain"] + spec}
        c0 = {k: sb.spec_counts(ds[k]) for k in spec}
        for _ in range(a.rounds):
            toks = {}
            for k in tps:
                t, toks[k] = b1_pass(sb, ds[k], bodies)
                tps[k].append(t)
            res["outputs_identical"] &= all(toks[k] == toks["plain"] for k in spec)
        c1 = {k: sb.spec_counts(ds[k]) for k in spec}
        plain = statistics.median(tps["plain"])
        for k in spec:
            med = statistics.median(tps[k])
            res[f"b1_{k}"] = {"plain_tok_s": plain, "mtp_tok_s": med, "mtp_over_plain": med / plain,
                              "tokens_per_forward": (c1[k]["tokens"] - c0[k]["tokens"]) / (c1[k]["forwards"] - c0[k]["forwards"]),
                              "acceptance_rate": (c1[k]["accepted"] - c0[k]["accepted"]) / max(1.0, c1[k]["proposed"] - c0[k]["proposed"])}
        # 2. B=64 at k = --k, speculation at every batch size and with the default cut-off
        bodies64 = [{"prompt": p, "max_tokens": a.gen_batch, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True}
                    for p in sb.PROMPTS for i in range(8)]
        names = ["plain", kname, "cutoff"]
        tps = {k: [] for k in names}
        c0 = sb.spec_counts(ds[kname])
        for _ in range(a.rounds):
            outs = {}
            for k in names:
                dt, outs[k] = sb.batch(ds[k], bodies64)
                tps[k].append(len(bodies64) * a.gen_batch / dt)
            res["outputs_identical"] &= outs["plain"] == outs[kname] == outs["cutoff"]
        c1 = sb.spec_counts(ds[kname])
        med = {k: statistics.median(v) for k, v in tps.items()}
        res["b64"] = {"plain_tok_s": med["plain"], "mtp_tok_s": med[kname], "cutoff_tok_s": med["cutoff"],
                      "mtp_over_plain": med[kname] / med["plain"], "cutoff_over_plain": med["cutoff"] / med["plain"],
                      "tokens_per_forward": (c1["tokens"] - c0["tokens"]) / (c1["forwards"] - c0["forwards"]),
                      "acceptance_rate": (c1["accepted"] - c0["accepted"]) / max(1.0, c1["proposed"] - c0["proposed"])}
        for k in list(ds):
            if k != "plain":
                ds.pop(k).__exit__(None, None, None)
        # 3. stale vs refreshed draft after an update
        tmp = tempfile.mkdtemp(prefix="spec-mtp-", dir=os.path.join(build, "fixtures"))
        src = copy_checkpoint(fresh, os.path.join(tmp, "src"))
        layer = lambda d: {k: v for k, v in safetensors_np.load_file(os.path.join(d, "model.safetensors")).items()
                           if k.startswith("model.mtp_layers.")}
        layers = {"stale": layer(os.path.join(root, "stale")), "fresh1": layer(fresh), "untrained": layer(os.path.join(root, "untrained"))}
        ds["upd"] = Daemon(*common, "--dynamic-load-weight", "--weight-version", "fresh0", "--speculative-config", mtp_cfg(a.k),
                           model=src, extra=False, timeout=600)
        stale = {}
        order = ("fresh0", "stale", "fresh1", "untrained")
        for version in order:
            d = ds["upd"]
            if version != "fresh0":
                assert d.post("/v1/pause")[0] == 200
                rewrite_tensors(src, lambda t: t.update(layers[version]))
                code, j = d.post("/v1/update_weights", {"version": version, "verify_checksum": False})
                assert code == 200, j
                assert d.post("/v1/resume")[0] == 200
            tps = {"plain": [], "mtp": []}
            for _ in range(a.rounds):
                toks = {}
                for k, dd in (("plain", ds["plain"]), ("mtp", d)):
                    t, toks[k] = b1_pass(sb, dd, bodies[:4])
                    tps[k].append(t)
                res["outputs_identical"] &= toks["plain"] == toks["mtp"]
            pv = per_version(d)[version]
            h = d.get("/health")[1]["speculative"]
            stale[version] = {"acceptance_rate": pv[1] / pv[0], "draft_tokens": pv[0],
                              "mtp_tok_s": statistics.median(tps["mtp"]), "plain_tok_s": statistics.median(tps["plain"]),
                              "mtp_over_plain": statistics.median(tps["mtp"]) / statistics.median(tps["plain"]),
                              "collapse_reported": h["acceptance_collapse"]}
        log = ds["upd"].output()
        rate = {v: s["acceptance_rate"] for v, s in stale.items()}
        for prev, v in zip(order, order[1:]):
            stale[v]["collapse_expected"] = rate[v] < rate[prev] / COLLAPSE_FACTOR and min(
                stale[v]["draft_tokens"], stale[prev]["draft_tokens"]) >= COLLAPSE_MIN_TOKENS
            stale[v]["warning_logged"] = f"acceptance collapsed after the weight update from version '{prev}' to '{v}'" in log
        res["stale"] = stale
    finally:
        for d in ds.values():
            d.__exit__(None, None, None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return res


def run_mtp_tp(a, sb):
    """--tp T > 1: tp 1 and tp T side by side on the trained fixture, B=1 greedy (the 8 story
    prompts, --gen tokens each), k = 1, 2, 3: tokens per target forward and acceptance at both
    (the same drafts up to the last bits of the sharded sums: equal or nearly), and decode tokens/s
    with MTP ÷ without at tp T and at tp 1 (plain daemons of each, interleaved rounds, medians).
    tp T ranks get --threads 1 each, the tp 1 daemons --threads T: the same cores."""
    root = make_mtp_fixture.mtp_fixture(os.path.dirname(BIN))
    fresh = a.model or os.path.join(root, "fresh")
    common = ["--max-num-seqs", "64", "--max-model-len", "512"]
    tp1, tpn = ["--threads", str(a.tp)], ["--threads", "1", "--tensor-parallel-size", str(a.tp)]
    flags = {"plain_tp": tpn, "plain_tp1": tp1}
    for k in (1, 2, 3):
        flags[f"k{k}_tp1"] = [*tp1, "--speculative-config", mtp_cfg(k)]
        flags[f"k{k}_tp"] = [*tpn, "--speculative-config", mtp_cfg(k)]
    res = {"method": "mtp", "tp": a.tp, "gen": a.gen, "rounds": a.rounds, "fixture": os.path.basename(root), "outputs_identical": True}
    ds = {}
    try:
        for k, f in flags.items():
            ds[k] = Daemon(*common, *f, model=fresh, extra=False, timeout=600)
        bodies = [{"prompt": p, "max_tokens": a.gen, "temperature": 0, "ignore_eos": True} for p in sb.PROMPTS]
        tps = {k: [] for k in ds}
        c0 = {k: sb.spec_counts(ds[k]) for k in ds if not k.startswith("plain")}
        for _ in range(a.rounds):
            toks = {}
            for k in ds:
                t, toks[k] = b1_pass(sb, ds[k], bodies)
                tps[k].append(t)
            res["outputs_identical"] &= all(toks[k] == toks["plain_tp"] for k in ds)
        c1 = {k: sb.spec_counts(ds[k]) for k in c0}
        plain = statistics.median(tps["plain_tp"])
        for k in (1, 2, 3):
            row = {}
            for where in ("tp1", "tp"):
                n = f"k{k}_{where}"
                d0, d1 = c0[n], c1[n]
                row[where] = {"tokens_per_forward": (d1["tokens"] - d0["tokens"]) / (d1["forwards"] - d0["forwards"]),
                              "acceptance_rate": (d1["accepted"] - d0["accepted"]) / max(1.0, d1["proposed"] - d0["proposed"]),
                              "proposed": d1["proposed"] - d0["proposed"], "accepted": d1["accepted"] - d0["accepted"]}
            med = statistics.median(tps[f"k{k}_tp"])
            row["tp"].update({"plain_tok_s": plain, "mtp_tok_s": med, "mtp_over_plain": med / plain})
            med1, plain1 = statistics.median(tps[f"k{k}_tp1"]), statistics.median(tps["plain_tp1"])
            row["tp1"].update({"plain_tok_s": plain1, "mtp_tok_s": med1, "mtp_over_plain": med1 / plain1})
            row["tokens_per_forward_equal"] = row["tp"]["tokens_per_forward"] == row["tp1"]["tokens_per_forward"]
            res[f"b1_k{k}"] = row
    finally:
        for d in ds.values():
            d.__exit__(None, None, None)
    return res
