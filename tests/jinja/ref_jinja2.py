"""Reference renderer: python3-jinja2 with the environment transformers builds
(transformers/utils/chat_template_utils.py: _compile_jinja_template, render_jinja_template).

    ref_jinja2.py CASES.json OUT.json      (formats: see fd_jinja_render.cpp)
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Raised(Exception):
    pass


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def make_env():
    # transformers also registers its AssistantTracker extension for {% generation %}; this
    # stand-in renders the block's body, which is what it does without return_assistant_tokens_mask.
    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def load_template(model_dir):
    """(source, special_tokens) as fdrollout's ChatTemplate::load and transformers read them."""
    cfg = {}
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None:
            special[k] = v
    j = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(j):
        with open(j, encoding="utf-8") as f:
            return f.read(), special
    ct = cfg.get("chat_template")
    if isinstance(ct, list):
        ct = {t["name"]: t["template"] for t in ct}["default"]
    return ct, special


def render_chat(tmpl, special, chat):
    """transformers render_jinja_template for one conversation."""
    messages = chat["messages"]
    add_gen = chat.get("add_generation_prompt", False)
    cont = chat.get("continue_final_message", False)
    if add_gen and cont:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    kwargs = {**special, **chat.get("chat_template_kwargs", {})}
    rendered = tmpl.render(messages=messages, tools=chat.get("tools"), documents=None, add_generation_prompt=add_gen, **kwargs)
    if cont:
        final_message = messages[-1]["content"]
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    break
            else:
                raise ValueError("no text to continue")
        if final_message.strip() not in rendered:
            raise ValueError("final message not in the output")
        loc = rendered.rindex(final_message.strip())
        if rendered[loc: loc + len(final_message.lstrip())] == final_message:
            rendered = rendered[: loc + len(final_message.lstrip())]
        else:
            rendered = rendered[: loc + len(final_message.strip())]
    return rendered


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    env = make_env()
    templates = {}
    for name, d in spec["templates"].items():
        src, special = load_template(d)
        try:
            templates[name] = (env.from_string(src), special, None)
        except Exception as e:  # noqa: BLE001
            templates[name] = (None, special, f"{type(e).__name__}: {e}")
    out = []
    for case in spec["cases"]:
        tmpl, special, err = templates.get(case.get("template"), (None, {}, None))
        try:
            if "source" in case:
                tmpl, special = env.from_string(case["source"]), {}
            if err:
                raise ValueError(err)
            if case.get("mode", "chat") == "raw":
                text = tmpl.render(**{**special, **case["context"]})
            else:
                text = render_chat(tmpl, special, case["chat"])
            out.append({"ok": True, "text": text})
        except jinja2.exceptions.TemplateError as e:
            is_raise = type(e) is jinja2.exceptions.TemplateError
            out.append({"ok": False, "raise": is_raise, "error": str(e) if is_raise else f"{type(e).__name__}: {e}"})
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "raise": False, "error": f"{type(e).__name__}: {e}"})
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
