"""Chat-template render time p50 for a 20-turn conversation: fdrollout's engine
(fd_jinja_bench) against python3-jinja2 with transformers' environment and @huggingface/jinja,
measured in the same run on the same templates and messages. Prints one JSON object.

    jinja_bench.py --bench build/fd_jinja_bench --fixtures build/npm_fixtures [--iters 2000]
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "jinja"))
import ref_jinja2  # noqa: E402

NODE_TIMER = r"""
import fs from "fs"; import path from "path"; import { pathToFileURL } from "url";
const [mod, src, ctxPath, iters] = process.argv.slice(1);
const { Template } = await import(pathToFileURL(path.join(mod, "dist/index.js")).href);
const t = new Template(fs.readFileSync(src, "utf8")); const ctx = JSON.parse(fs.readFileSync(ctxPath, "utf8"));
t.render(ctx); const us = [];
for (let i = 0; i < +iters; i++) { const b = process.hrtime.bigint(); t.render(ctx); us.push(Number(process.hrtime.bigint() - b) / 1000); }
us.sort((a, b) => a - b); console.log(JSON.stringify({ p50_us: us[us.length >> 1] }));
"""


def conversation(turns=20):
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."}]
    for i in range(turns // 2):
        msgs.append({"role": "user", "content": f"Question {i}: explain why {i} squared is {i * i}, in one or two sentences please."})
        msgs.append({"role": "assistant", "content": f"{i} squared is {i * i} because multiplying {i} by itself gives {i * i}; "
                                                     "squaring a number means multiplying it by itself."})
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--models", default="qwen3,llama3_1")
    args = ap.parse_args()
    models = {m: os.path.join(args.fixtures, "models", m) for m in args.models.split(",")}
    msgs = conversation(20)
    tmp = tempfile.mkdtemp(prefix="fd_jinja_bench_")
    atexit.register(shutil.rmtree, tmp, True)  # the scratch files go however the run ends
    chat_path = os.path.join(tmp, "chat.json")
    with open(chat_path, "w", encoding="utf-8") as f:
        json.dump({"messages": msgs}, f)
    fd = json.loads(subprocess.run([args.bench, "--chat", chat_path, "--iters", str(args.iters)] +
                                   [f"{m}={d}" for m, d in models.items()], check=True, capture_output=True, text=True).stdout)
    env = ref_jinja2.make_env()
    result = {"turns": len(msgs) - 1, "iters": args.iters, "templates": {}}
    for m, d in models.items():
        src, special = ref_jinja2.load_template(d)
        tmpl = env.from_string(src)
        ctx = {**special, "messages": msgs, "tools": None, "documents": None, "add_generation_prompt": True}
        tmpl.render(**ctx)
        us = []
        for _ in range(args.iters):
            b = time.perf_counter()
            tmpl.render(**ctx)
            us.append((time.perf_counter() - b) * 1e6)
        us.sort()
        py_p50 = us[len(us) // 2]
        src_path, ctx_path = os.path.join(tmp, f"{m}.jinja"), os.path.join(tmp, f"{m}.json")
        with open(src_path, "w", encoding="utf-8") as f:
            f.write(src)
        with open(ctx_path, "w", encoding="utf-8") as f:
            json.dump(ctx, f)
        node = json.loads(subprocess.run(["node", "--input-type=module", "-e", NODE_TIMER,
                                          os.path.join(args.fixtures, "node_modules", "@huggingface", "jinja"),
                                          src_path, ctx_path, str(args.iters)], check=True, capture_output=True, text=True).stdout)
        r = fd[m]
        result["templates"][m] = {"fd_p50_us": round(r["p50_us"], 1), "fd_p90_us": round(r["p90_us"], 1),
                                  "python3_jinja2_p50_us": round(py_p50, 1), "hf_jinja_p50_us": round(node["p50_us"], 1),
                                  "speedup_vs_python3_jinja2": round(py_p50 / r["p50_us"], 2),
                                  "speedup_vs_hf_jinja": round(node["p50_us"] / r["p50_us"], 2),
                                  "prompt_bytes": r["prompt_bytes"]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
