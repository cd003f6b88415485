"""fdrollout's Jinja engine against the real thing: every case (real chat templates from the
@lenml tokenizer packages + tests/jinja/templates/*.jinja × many conversations) is rendered by
fd_jinja_render, by python3-jinja2 with transformers' environment (ref_jinja2.py) and by
@huggingface/jinja (ref_hf_jinja.mjs), plus seeded random expressions and statements
(fuzz_cases.py). fdrollout must equal python3-jinja2 byte for byte (and
fail where it fails; raise_exception messages equal). Where the two references disagree the
case is listed, not failed: python3-jinja2 is what transformers and vLLM run.

    test_jinja_reference.py --render BIN --fixtures DIR --work DIR
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import fuzz_cases

HERE = os.path.dirname(os.path.abspath(__file__))
REAL = ["qwen3", "llama3", "llama3_1", "gemma3", "deepseek_v3"]
# Python prints these objects with their address: such outputs cannot be compared byte for byte.
UNMATCHABLE = ("generator object", "built-in method", " object at 0x", "<function ")  # lower case

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                            "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Web search (ünïcode ok)",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
UNICODE = "Grüße, 世界! 👋🏽 e\u0301 «quotes» \"dq\" 'sq' back\\slash\ttab\n  indented\n\n"


def conversations():
    """(name, chat) pairs; add_generation_prompt / kwargs variants are added by cases()."""
    sys_msg = {"role": "system", "content": "You are a terse assistant."}
    convs = {
        "user_only": [{"role": "user", "content": "Hello!"}],
        "system_user": [sys_msg, {"role": "user", "content": "What is 2+2?"}],
        "multi_turn": [sys_msg, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello. How can I help?"},
                       {"role": "user", "content": "Tell me a joke."}],
        "ends_assistant": [{"role": "user", "content": "Start a story"}, {"role": "assistant", "content": "Once upon a time"}],
        "ends_assistant_ws": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "  one, two  "}],
        "unicode": [{"role": "system", "content": UNICODE}, {"role": "user", "content": "日本語で答えて: " + UNICODE},
                    {"role": "assistant", "content": "はい。" + UNICODE}, {"role": "user", "content": "🙂 ok \u200b zero-width"}],
        "thinking": [{"role": "user", "content": "Solve x+1=3"},
                     {"role": "assistant", "content": "<think>\nx = 3 - 1\n</think>\n\nx = 2"},
                     {"role": "user", "content": "And x+2=3?"}],
        "thinking_last": [{"role": "user", "content": "Solve x+1=3"},
                          {"role": "assistant", "content": "<think>\nsubtract\n</think>\n\nx = 2"}],
        "reasoning_field": [{"role": "user", "content": "Q"},
                            {"role": "assistant", "content": "A", "reasoning_content": "because"},
                            {"role": "user", "content": "Q2"}],
        "long_20": [sys_msg] + [m for i in range(10) for m in (
            {"role": "user", "content": f"Question {i}: what is {i} squared? Explain in a sentence or two."},
            {"role": "assistant", "content": f"{i} squared is {i * i}, because {i} times {i} is {i * i}."})],
    }
    tool_conv = [sys_msg, {"role": "user", "content": "Weather in Paris and news?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
                 {"role": "assistant", "content": "It is 21°C.", "tool_calls": [
                     {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"news\"}"}}]},
                 {"role": "tool", "content": "headline one"}, {"role": "tool", "content": "headline two"},
                 {"role": "user", "content": "Thanks"}]
    deepseek_tools = [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                          {"type": "function", "function": {"name": "search", "arguments": "{\"q\": \"oslo\"}"}}]},
                      {"role": "tool", "content": "cold"}, {"role": "tool", "content": "snow"},
                      {"role": "assistant", "content": "Cold and snowy."}, {"role": "user", "content": "ok"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "sys part"}]},
             {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"}, {"type": "text", "text": " what?"}]}]
    llama_tool = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                  {"role": "tool", "content": {"temp": 30, "sky": "clear"}}, {"role": "ipython", "content": "plain output"}]
    out = [(n, {"messages": m}) for n, m in convs.items()]
    out += [("tools", {"messages": tool_conv, "tools": [WEATHER, SEARCH]}),
            ("tools_no_schema", {"messages": tool_conv}),
            ("tools_schema_only", {"messages": convs["system_user"], "tools": [WEATHER]}),
            ("tools_deepseek", {"messages": deepseek_tools}),
            ("content_parts", {"messages": parts}),
            ("llama_tool", {"messages": llama_tool, "tools": [WEATHER]}),
            ("bad_alternation", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
            ("bad_role", {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]})]
    return out


def cases(real_dirs, hand_dirs):
    result = []
    for tname in list(real_dirs) + [n for n in hand_dirs if not n.startswith("features_")]:
        for cname, chat in conversations():
            for agp in (False, True):
                c = dict(chat, add_generation_prompt=agp)
                result.append({"template": tname, "mode": "chat", "chat": c, "id": f"{tname}/{cname}/agp={agp}"})
            for think in (True, False):
                c = dict(chat, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": think})
                result.append({"template": tname, "mode": "chat", "chat": c, "id": f"{tname}/{cname}/thinking={think}"})
            if chat["messages"][-1]["role"] == "assistant":
                c = dict(chat, continue_final_message=True)
                result.append({"template": tname, "mode": "chat", "chat": c, "id": f"{tname}/{cname}/continue"})
    msgs = conversations()[2][1]["messages"]
    meta = {"b": 2, "a": "x", "c": [1, 2], "é": None}
    for tname in [n for n in hand_dirs if n.startswith("features_")]:
        for i, ctx in enumerate([{"messages": msgs, "meta": meta, "x": 5},
                                 {"messages": msgs[1:3], "meta": {"only": True}, "x": None},
                                 {"messages": [{"role": "user", "content": UNICODE}], "meta": {"k": UNICODE}, "x": "s"}]):
            result.append({"template": tname, "mode": "raw", "context": ctx, "id": f"{tname}/ctx{i}"})
    # Errors: undefined attribute access, raise_exception with a computed message, syntax error.
    result.append({"template": "errors", "mode": "raw", "context": {"messages": msgs}, "id": "errors/raise"})
    result.append({"template": "errors_undefined", "mode": "raw", "context": {}, "id": "errors/undefined_attr"})
    result.append({"template": "errors_syntax", "mode": "raw", "context": {}, "id": "errors/syntax"})
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--fuzz", type=int, default=3000, help="random expression/statement cases (fuzz_cases.py)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    templates = {}
    for m in REAL:
        d = os.path.join(args.fixtures, "models", m)
        if not os.path.exists(os.path.join(d, "tokenizer_config.json")):
            sys.exit(f"missing fixture {d}: run tests/fixtures/fetch_npm_fixtures.sh")
        templates[m] = d
    hand = {}
    extra = {"errors": "{% for m in messages %}{% if m.role == 'assistant' %}"
                       "{{ raise_exception('bad role at ' ~ loop.index0 ~ ': ' ~ m.role) }}{% endif %}{% endfor %}",
             "errors_undefined": "ok {{ nothing.attribute }}",
             "errors_syntax": "{% for x in y %}\n  {{ x }\n{% endfor %}"}
    tdir = os.path.join(HERE, "templates")
    sources = {f[:-len(".jinja")]: open(os.path.join(tdir, f), encoding="utf-8").read()
               for f in sorted(os.listdir(tdir)) if f.endswith(".jinja")}
    sources.update(extra)
    for name, src in sources.items():
        d = os.path.join(args.work, "models", name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(src)
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"}}, f)
        hand[name] = d
    all_cases = cases(templates, [n for n in hand if not n.startswith("errors")]) + fuzz_cases.cases(args.fuzz)
    spec = {"templates": {**templates, **hand}, "cases": all_cases}
    cases_path = os.path.join(args.work, "cases.json")
    with open(cases_path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    outs = {}
    for who, cmd in [("fd", [args.render]),
                     ("py", [sys.executable, os.path.join(HERE, "ref_jinja2.py")]),
                     ("node", ["node", os.path.join(HERE, "ref_hf_jinja.mjs"),
                               os.path.join(args.fixtures, "node_modules", "@huggingface", "jinja")])]:
        out_path = os.path.join(args.work, f"out_{who}.json")
        subprocess.run(cmd + [cases_path, out_path], check=True, timeout=300)
        with open(out_path, encoding="utf-8") as f:
            outs[who] = json.load(f)
    failures, disagreements, n_ok, n_err, n_unmatchable = [], [], 0, 0, 0
    for i, c in enumerate(all_cases):
        fd, py, node = outs["fd"][i], outs["py"][i], outs["node"][i]
        if c["id"].startswith("fuzz/") and py["ok"] and any(k in t.lower() for k in UNMATCHABLE for t in (py["text"], fd.get("text", ""))):
            n_unmatchable += 1  # Python printed an object address; only "it rendered" is comparable
            if not fd["ok"]:
                failures.append(f"{c['id']}: fdrollout failed ({fd['error']}), python3-jinja2 rendered {py['text'][:200]!r}")
            continue
        if py["ok"] != node["ok"] or (py["ok"] and py["text"] != node["text"]):
            disagreements.append(c["id"])
        if py["ok"]:
            n_ok += 1
            if not fd["ok"]:
                failures.append(f"{c['id']}: fdrollout failed ({fd['error']}), python3-jinja2 rendered {py['text'][:200]!r}")
            elif fd["text"] != py["text"]:
                a, b = fd["text"], py["text"]
                k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                failures.append(f"{c['id']}: differs at char {k}: fdrollout {a[max(0, k - 40):k + 40]!r} vs python3-jinja2 {b[max(0, k - 40):k + 40]!r}")
        else:
            n_err += 1
            if fd["ok"]:
                failures.append(f"{c['id']}: python3-jinja2 failed ({py['error']}) but fdrollout rendered {fd['text'][:200]!r}")
            elif py["raise"] and (not fd["raise"] or fd["error"] != py["error"]):
                failures.append(f"{c['id']}: raise_exception message {py['error']!r}, fdrollout {fd['error']!r}")
    print(f"{len(all_cases)} cases: {n_ok} rendered, {n_err} errors in python3-jinja2, {n_unmatchable} print an object address; "
          f"{len(disagreements)} where @huggingface/jinja differs from python3-jinja2")
    for d in disagreements:
        print(f"  references disagree (python3-jinja2 wins): {d}")
    for f in failures:
        print("FAIL", f)
    fd_syntax = outs["fd"][[c["id"] for c in all_cases].index("errors/syntax")]
    print("syntax error as reported:", fd_syntax.get("error"))
    if "2:" not in fd_syntax.get("error", ""):
        failures.append("syntax error message has no line number")
        print("FAIL syntax error message has no line number")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
