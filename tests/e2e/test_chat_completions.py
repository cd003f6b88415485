"""/v1/chat/completions against the real daemon on a copy of stories260K given a chat template:
the prompt must be exactly what python3-jinja2 (transformers' environment, tests/jinja/ref_jinja2.py)
renders for the same messages, encoded as /v1/completions encodes it, and generation must then
equal /v1/completions on that text (greedy ids, text, logprobs); streaming, n + seed, stop,
max_completion_tokens, add_generation_prompt, continue_final_message, chat_template_kwargs and
tools; messages as vLLM post-processes them; a list of named templates (tool_use for tools); the
error answers (no template, raise_exception, malformed messages, malformed template)."""
import contextlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import unittest

from fdtest import REPO, STORIES, Daemon

sys.path.insert(0, os.path.join(REPO, "tests", "jinja"))
import ref_jinja2  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}{% if system_prefix is defined %}{{ system_prefix }} {% endif %}"
    "{%- if tools %}Tools:{% for t in tools %} {{ t.function.name }} {{ t | tojson }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('Unknown role: ' ~ m.role) }}{% endif %}"
    "{%- if m.role == 'assistant' %}{{ m.content | trim }}"
    "{%- for c in m.tool_calls or [] %} call {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "{%- else %}{{ m.content | trim }}{% endif %}"
    "{%- if not loop.last %} {% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %} Once upon a time{% endif %}")
NO_BOS_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if not loop.last %} {% endif %}{% endfor %}"

MESSAGES = [{"role": "system", "content": "Lily and Tom"}, {"role": "user", "content": "  were playing  "},
            {"role": "assistant", "content": "in the park."}, {"role": "user", "content": "They saw a big box."}]
TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look at a thing",
                                           "parameters": {"type": "object", "properties": {"what": {"type": "string"}}}}}]


def model_copy(dst, config_template=None, jinja_file=None):
    os.makedirs(dst)
    for f in os.listdir(STORIES):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(STORIES, f), os.path.join(dst, f))
    with open(os.path.join(STORIES, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    if config_template is not None:
        cfg["chat_template"] = config_template
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    if jinja_file is not None:
        with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
            f.write(jinja_file)
    return dst


def reference_text(model_dir, **chat):
    src, special = ref_jinja2.load_template(model_dir)
    return ref_jinja2.render_chat(ref_jinja2.make_env().from_string(src), special, chat)


class ChatCompletions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fd_chat_")
        cls.model = model_copy(os.path.join(cls.tmp, "chat"), config_template=TEMPLATE)
        cls.d = Daemon(model=cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.d.__exit__(None)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def chat(self, expect=200, **body):
        status, j = self.d.post("/v1/chat/completions", body)
        self.assertEqual(status, expect, j)
        return j

    def same_as_completion(self, chat_body, **chat):
        """The chat answer equals /v1/completions on python3-jinja2's rendering (BOS printed by the
        template → dropped from the text, the tokenizer adds it)."""
        text = reference_text(self.model, **chat)
        self.assertTrue(text.startswith("<s>"))
        j = self.chat(**chat_body)
        c = j["choices"][0]
        # no max_tokens: vLLM's chat default, the rest of the context (completions keep 16)
        max_len = self.d.get("/v1/models")[1]["data"][0]["max_model_len"]
        ref = self.d.complete(prompt=text[len("<s>"):], max_tokens=chat_body.get("max_tokens", max_len - len(c["prompt_token_ids"])),
                              temperature=0, logprobs=2)
        rc = ref["choices"][0]
        self.assertEqual(c["prompt_token_ids"], rc["prompt_token_ids"])
        self.assertEqual(c["prompt_token_ids"][0], 1)
        self.assertEqual(c["prompt_token_ids"].count(1), 1)  # BOS once
        self.assertEqual(c["token_ids"], rc["token_ids"])
        self.assertEqual(c["message"], {"role": "assistant", "content": rc["text"]})
        self.assertEqual(c["finish_reason"], rc["finish_reason"])
        return j, ref

    def test_greedy_equals_completion_on_the_reference_rendering(self):
        j, ref = self.same_as_completion({"messages": MESSAGES, "max_tokens": 24, "temperature": 0},
                                         messages=MESSAGES, add_generation_prompt=True)
        self.assertEqual(j["object"], "chat.completion")
        self.assertTrue(j["id"].startswith("chatcmpl-"))
        self.assertEqual(j["weight_version"], "0")
        self.assertEqual(j["usage"]["prompt_tokens"], len(j["choices"][0]["prompt_token_ids"]))
        self.assertEqual(j["usage"]["completion_tokens"], 24)
        self.assertEqual(j["prompt_token_ids"], j["choices"][0]["prompt_token_ids"])  # vLLM's place: the top level

    def test_template_options_reach_the_template(self):
        self.same_as_completion({"messages": MESSAGES, "add_generation_prompt": False, "temperature": 0},
                                messages=MESSAGES, add_generation_prompt=False)
        self.same_as_completion({"messages": MESSAGES[:3], "add_generation_prompt": False, "continue_final_message": True,
                                 "temperature": 0}, messages=MESSAGES[:3], continue_final_message=True)
        kw = {"system_prefix": "Once"}
        self.same_as_completion({"messages": MESSAGES, "chat_template_kwargs": kw, "temperature": 0},
                                messages=MESSAGES, add_generation_prompt=True, chat_template_kwargs=kw)
        calls = [{"role": "user", "content": "Tom"},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                  "function": {"name": "look", "arguments": "{\"what\": \"the box\", \"why\": 1}"}}]},
                 {"role": "tool", "content": "a ball"}]
        parsed = json.loads(json.dumps(calls))
        parsed[1]["tool_calls"][0]["function"]["arguments"] = {"what": "the box", "why": 1}  # vLLM parses JSON arguments
        self.same_as_completion({"messages": calls, "tools": TOOLS, "tool_choice": "auto", "temperature": 0},
                                messages=parsed, tools=TOOLS, add_generation_prompt=True)

    def test_streaming_equals_non_streaming(self):
        body = {"messages": MESSAGES, "max_completion_tokens": 20, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        j = self.chat(**body)
        conn = http.client.HTTPConnection("127.0.0.1", self.d.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        lines = [l[len("data: "):] for l in resp.read().decode().split("\n") if l.startswith("data: ")]
        conn.close()
        self.assertEqual(lines[-1], "[DONE]")
        chunks = [json.loads(l) for l in lines[:-1]]
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"], j["usage"])
        choices = [c["choices"][0] for c in chunks[:-1]]
        self.assertEqual(choices[0]["delta"]["role"], "assistant")
        self.assertEqual(choices[0]["prompt_token_ids"], j["choices"][0]["prompt_token_ids"])
        self.assertEqual("".join(c["delta"]["content"] for c in choices), j["choices"][0]["message"]["content"])
        self.assertEqual(sum((c["token_ids"] for c in choices), []), j["choices"][0]["token_ids"])
        self.assertEqual(sum((c["logprobs"]["content"] for c in choices), []), j["choices"][0]["logprobs"]["content"])
        self.assertEqual(choices[-1]["finish_reason"], "length")

    def test_logprobs_equal_the_completion_logprobs(self):
        text = reference_text(self.model, messages=MESSAGES, add_generation_prompt=True)
        ref = self.d.complete(prompt=text[len("<s>"):], max_tokens=8, temperature=0, logprobs=3)["choices"][0]["logprobs"]
        lp = self.chat(messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]
        self.assertEqual([e["token"] for e in lp["content"]], ref["tokens"])
        self.assertEqual([e["logprob"] for e in lp["content"]], ref["token_logprobs"])
        for e, top in zip(lp["content"], ref["top_logprobs"]):
            self.assertEqual({t["token"]: t["logprob"] for t in e["top_logprobs"]}, top)
            self.assertEqual(e["bytes"], list(e["token"].encode()))
        self.assertIsNone(self.chat(messages=MESSAGES, max_tokens=2)["choices"][0]["logprobs"])

    def test_n_seed_and_stop(self):
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
        a, b = self.chat(**body), self.chat(**body)
        self.assertEqual([c["index"] for c in a["choices"]], [0, 1, 2])
        self.assertEqual([c["token_ids"] for c in a["choices"]], [c["token_ids"] for c in b["choices"]])
        self.assertEqual(a["usage"]["completion_tokens"], 36)
        greedy = self.chat(messages=MESSAGES, max_tokens=30, temperature=0)["choices"][0]["message"]["content"]
        word = greedy.split()[3]
        s = self.chat(messages=MESSAGES, max_tokens=30, temperature=0, stop=[word])["choices"][0]
        self.assertEqual(s["finish_reason"], "stop")
        self.assertEqual(s["message"]["content"], greedy[:greedy.index(word)])

    def test_tokenize_chat_form_equals_the_chat_prompt(self):
        forms = [{"messages": MESSAGES},
                 {"messages": MESSAGES, "add_generation_prompt": False},
                 {"messages": MESSAGES[:3], "add_generation_prompt": False, "continue_final_message": True},
                 {"messages": MESSAGES, "chat_template_kwargs": {"system_prefix": "Once"}, "tools": TOOLS}]
        seen = set()
        for form in forms:
            status, t = self.d.post("/tokenize", {**form, "return_token_strs": True})
            self.assertEqual(status, 200, t)
            ids = self.chat(**form, max_tokens=1)["choices"][0]["prompt_token_ids"]
            self.assertEqual(t["tokens"], ids)
            self.assertEqual(t["count"], len(ids))
            self.assertEqual(len(t["token_strs"]), len(ids))
            seen.add(tuple(ids))
        self.assertEqual(len(seen), len(forms))  # each option changed the prompt
        # add_special_tokens (vLLM: default false for chat): the tokenizer's specials on top of the
        # template's text, i.e. the prompt form of python3-jinja2's rendering.
        text = reference_text(self.model, messages=MESSAGES, add_generation_prompt=True)
        _, t = self.d.post("/tokenize", {"messages": MESSAGES, "add_special_tokens": True})
        _, p = self.d.post("/tokenize", {"prompt": text, "add_special_tokens": True})
        self.assertEqual(t["tokens"], p["tokens"])
        for body, param in [({"messages": MESSAGES, "prompt": "x"}, "prompt"), ({"messages": "hi"}, "messages"),
                            ({"messages": MESSAGES, "max_tokens": 3}, "max_tokens"),
                            ({"messages": MESSAGES, "add_generation_prompt": 1}, "add_generation_prompt")]:
            status, j = self.d.post("/tokenize", body)
            self.assertEqual((status, j["error"]["param"]), (400, param), body)
        status, j = self.d.post("/tokenize", {"messages": [{"role": "robot", "content": "beep"}]})
        self.assertEqual((status, j["error"]["message"]), (400, "Unknown role: robot"))

    def test_vllm_fields_in_chat(self):
        greedy = self.chat(messages=MESSAGES, max_tokens=30, temperature=0)["choices"][0]
        self.assertIsNone(greedy["stop_reason"])
        word = greedy["message"]["content"].split()[3]
        s = self.chat(messages=MESSAGES, max_tokens=30, temperature=0, stop=[word], include_stop_str_in_output=True)
        c = s["choices"][0]
        self.assertEqual((c["finish_reason"], c["stop_reason"]), ("stop", word))
        self.assertTrue(c["message"]["content"].endswith(word))
        # prompt_logprobs: one top-level list, equal to /v1/completions' on the same prompt ids.
        j = self.chat(messages=MESSAGES, max_tokens=2, temperature=0, prompt_logprobs=2)
        ids = j["choices"][0]["prompt_token_ids"]
        ref = self.d.complete(prompt=ids, max_tokens=2, temperature=0, prompt_logprobs=2)["choices"][0]
        self.assertEqual(j["prompt_logprobs"], ref["prompt_logprobs"])
        self.assertIsNone(j["prompt_logprobs"][0])
        self.assertEqual(len(j["prompt_logprobs"]), len(ids))
        self.assertNotIn("prompt_logprobs", self.chat(messages=MESSAGES, max_tokens=1))
        j = self.chat(expect=400, messages=MESSAGES, prompt_logprobs=2, stream=True)
        self.assertEqual(j["error"]["param"], "prompt_logprobs")
        # return_tokens_as_token_ids
        c = self.chat(messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                      return_tokens_as_token_ids=True)["choices"][0]
        self.assertEqual([e["token"] for e in c["logprobs"]["content"]], [f"token_id:{i}" for i in c["token_ids"]])
        self.assertEqual(c["logprobs"]["content"][0]["bytes"], list(f"token_id:{c['token_ids'][0]}".encode()))
        self.assertTrue(all(t["token"].startswith("token_id:") for e in c["logprobs"]["content"] for t in e["top_logprobs"]))
        # penalties reach chat exactly as completions
        body = dict(max_tokens=30, temperature=0, repetition_penalty=1.5, logit_bias={"261": -5}, min_tokens=3)
        a = self.chat(messages=MESSAGES, **body)["choices"][0]
        b = self.d.complete(prompt=a["prompt_token_ids"], **body)["choices"][0]
        self.assertEqual(a["token_ids"], b["token_ids"])
        self.assertNotEqual(a["token_ids"], self.chat(messages=MESSAGES, max_tokens=30, temperature=0)["choices"][0]["token_ids"])

    def test_bad_requests_name_the_field(self):
        cases = [({"messages": "hi"}, "messages"),
                 ({"messages": []}, "messages"),
                 ({"messages": [{"content": "x"}]}, "messages[0].role"),
                 ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
                 ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                  "messages[0].content[0].type"),
                 ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
                     {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
                  "messages[0].tool_calls[0].function.arguments"),
                 ({"messages": MESSAGES, "tools": {"a": 1}}, "tools"),
                 ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
                 ({"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
                 ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
                 ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
                 ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format")]
        for body, param in cases:
            j = self.chat(expect=400, **body)
            self.assertEqual(j["error"]["param"], param, (body, j))
        j = self.chat(expect=400, messages=[{"role": "robot", "content": "beep"}])
        self.assertEqual(j["error"]["message"], "Unknown role: robot")
        # the messages name the field sent, and chat has no echo to score (the old daemon: "(0 only to
        # score an echoed prompt)", and "max_tokens is 600" for a max_completion_tokens)
        j = self.chat(expect=400, messages=MESSAGES, max_completion_tokens=-1)
        self.assertEqual((j["error"]["param"], j["error"]["message"]), ("max_completion_tokens", "'max_completion_tokens' must be >= 1, got -1"))
        j = self.chat(expect=400, messages=MESSAGES, max_completion_tokens=600)
        self.assertEqual(j["error"]["param"], "max_completion_tokens")
        self.assertIn("max_completion_tokens is 600", j["error"]["message"])
        self.assertNotIn("max_tokens", j["error"]["message"].replace("max_completion_tokens", ""))
        # vLLM refuses top_logprobs only > 0 without logprobs: 0 asks for nothing (the old daemon: 400)
        c = self.chat(messages=MESSAGES, max_tokens=2, top_logprobs=0)["choices"][0]
        self.assertIsNone(c["logprobs"])
        j = self.chat(expect=400, messages=MESSAGES, add_generation_prompt=True, continue_final_message=True)
        self.assertIn("not compatible", j["error"]["message"])
        # content parts with text only are joined for a template that does not loop over them
        a = self.chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Lily"}, {"type": "text", "text": "Tom"}]}],
                      max_tokens=2, temperature=0)["choices"][0]["prompt_token_ids"]
        b = self.chat(messages=[{"role": "user", "content": "Lily\nTom"}], max_tokens=2, temperature=0)["choices"][0]["prompt_token_ids"]
        self.assertEqual(a, b)


class ChatTemplateVariants(unittest.TestCase):
    @contextlib.contextmanager
    def template_daemon(self, text):
        """A stories260K daemon serving chat template `text` (--chat-template)."""
        tmp = tempfile.mkdtemp(prefix="fd_chat_tmpl_")
        try:
            path = os.path.join(tmp, "t.jinja")
            with open(path, "w") as f:
                f.write(text)
            with Daemon("--chat-template", path) as d:
                yield d
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_a_tool_call_turn_with_null_content_renders_as_vllm_renders_it(self):
        """OpenAI's tool-call turn is {"role": "assistant", "content": null, "tool_calls": [...]};
        vLLM gives the template "" for a null content (Qwen3's template tests `'<think>' in
        message.content`, which failed on null: a probe got a 400 for this standard turn)."""
        call = [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]
        turns = lambda content: [{"role": "user", "content": "Lily"}, {"role": "assistant", "content": content, "tool_calls": call},
                                 {"role": "tool", "tool_call_id": "c1", "content": "Tom"}]
        with self.template_daemon("{% for m in messages %}{% if '<think>' in m.content %}T{% endif %}{{ m.role }}: {{ m.content }}"
                                  "{% for c in m.tool_calls or [] %} call {{ c.function.name }}{% endfor %}\n{% endfor %}") as d:
            body = {"max_tokens": 2, "temperature": 0}
            status, j = d.post("/v1/chat/completions", {"messages": turns(None), **body})
            self.assertEqual(status, 200, j)
            self.assertEqual(j["choices"][0]["prompt_token_ids"],
                             d.post("/v1/chat/completions", {"messages": turns(""), **body})[1]["choices"][0]["prompt_token_ids"])
            status, j = d.post("/v1/chat/completions", {"messages": [turns(None)[0], {"role": "assistant", "tool_calls": call}], **body})
            self.assertEqual(status, 200, j)  # content left out: the same

    def test_messages_are_postprocessed_as_vllm_does(self):
        """vLLM's parse_chat_messages (_parse_chat_message_content, _postprocess_messages): tool-call
        arguments missing, null or "" are {} (a probe: "" was a 400, null reached the template), an
        empty tool_calls list is dropped, an assistant's reasoning is also its reasoning_content, and
        a null content is "" for any role (a probe: a tool message with null content was a 400)."""
        call = lambda name, **f: {"id": name, "type": "function", "function": {"name": name, **f}}
        with self.template_daemon("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                                  "{% if m.reasoning_content is defined %} R={{ m.reasoning_content }}{% endif %}"
                                  "{% if m.tool_calls is defined %} calls={{ m.tool_calls | length }}{% endif %}"
                                  "{% for c in m.tool_calls or [] %} {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
                                  ";{% endfor %}") as d:
            def rendered(messages):
                status, j = d.post("/tokenize", {"messages": messages, "add_generation_prompt": False})
                self.assertEqual(status, 200, j)
                return d.post("/detokenize", {"tokens": j["tokens"]})[1]["prompt"]
            user = {"role": "user", "content": "hi"}
            self.assertEqual(rendered([user, {"role": "assistant", "content": None, "tool_calls": [
                call("a", arguments=""), call("b", arguments=None), call("c"), call("d", arguments='{"x": 1}')]}]),
                "user:hi;assistant: calls=4 a{} b{} c{} d{\"x\": 1};")
            self.assertEqual(rendered([user, {"role": "assistant", "content": "ok", "tool_calls": []}]), "user:hi;assistant:ok;")
            self.assertEqual(rendered([user, {"role": "assistant", "content": "ok", "reasoning": "think"}]),
                             "user:hi;assistant:ok R=think;")
            self.assertEqual(rendered([user, {"role": "tool", "tool_call_id": "a", "content": None}, {"role": "user"}]),
                             "user:hi;tool:;user:;")
            # A non-empty string that is not JSON stays a 400 (vLLM's json.loads raises).
            for args in ("  ", "{not json"):
                status, j = d.post("/tokenize", {"messages": [user, {"role": "assistant", "tool_calls": [call("a", arguments=args)]}]})
                self.assertEqual((status, j["error"]["param"]), (400, "messages[1].tool_calls[0].function.arguments"), j)

    def test_a_list_of_templates_picks_tool_use_when_tools_are_given(self):
        """Hermes-2-Pro and Command-R keep [{name: default}, {name: tool_use}, {name: rag}]:
        transformers' get_chat_template (which vLLM reaches) takes tool_use when tools are given
        (an empty list too), default otherwise (documents alone too), and a request's chat_template
        may name one. A probe: default always. /tokenize takes chat_template as chat does."""
        tmp = tempfile.mkdtemp(prefix="fd_chat_list_")
        try:
            model = model_copy(os.path.join(tmp, "list"), config_template=[
                {"name": "default", "template": "{{ bos_token }}Once upon a time"},
                {"name": "tool_use", "template": "{{ bos_token }}Lily and Tom {{ tools | length }}"},
                {"name": "rag", "template": "{{ bos_token }}the park {{ documents | length }}"}])
            with Daemon("--trust-request-chat-template", model=model) as d:
                ids = lambda text: d.post("/tokenize", {"prompt": text})[1]["tokens"]
                user = [{"role": "user", "content": "hi"}]
                for extra, text in (({}, "Once upon a time"), ({"tools": TOOLS}, "Lily and Tom 1"), ({"tools": []}, "Lily and Tom 0"),
                                    ({"documents": [{"text": "x"}]}, "Once upon a time"),
                                    ({"chat_template": "rag", "documents": [{"text": "x"}], "tools": TOOLS}, "the park 1"),
                                    ({"chat_template": "default", "tools": TOOLS}, "Once upon a time"),
                                    ({"chat_template": "{{ bos_token }}Tom"}, "Tom")):
                    status, j = d.post("/tokenize", {"messages": user, **extra})
                    self.assertEqual((status, j.get("tokens")), (200, ids(text)), extra)
                    status, j = d.post("/v1/chat/completions", {"messages": user, "max_tokens": 1, **extra})
                    self.assertEqual((status, j["choices"][0]["prompt_token_ids"]), (200, ids(text)), extra)
            with Daemon(model=model) as d:  # without the flag: refused on both routes, naming it
                for route in ("/tokenize", "/v1/chat/completions"):
                    status, j = d.post(route, {"messages": [{"role": "user", "content": "hi"}], "chat_template": "rag"})
                    self.assertEqual((status, j["error"]["param"]), (400, "chat_template"), j)
                    self.assertIn("--trust-request-chat-template", j["error"]["message"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_integers_beyond_int64_are_refused_not_rendered_wrapped(self):
        """A probe: 18446744073709551615 in a tool schema rendered as -1, and 12345678901234567890
        in a tool call's arguments as -6101065172474983726, where Python's json (transformers,
        vLLM) keeps both exact. The template engine holds int64: such a number is a 400 naming
        it; int64's own bounds render exactly."""
        tool = lambda bound: [{"type": "function", "function": {"name": "f", "parameters": {"maximum": bound}}}]
        turns = lambda args: [{"role": "user", "content": "Lily"},
                              {"role": "assistant", "content": None,
                               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}]
        with self.template_daemon("{{ tools | tojson }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                                  "{% for c in m.tool_calls or [] %} {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}") as d:
            ok = {"messages": turns('{"n": -9223372036854775808}'), "tools": tool(9223372036854775807), "add_generation_prompt": False}
            status, j = d.post("/tokenize", ok)
            self.assertEqual(status, 200, j)
            text = d.post("/detokenize", {"tokens": j["tokens"]})[1]["prompt"]
            self.assertIn("9223372036854775807", text)
            self.assertIn("-9223372036854775808", text)
            status, j = d.post("/v1/chat/completions", {**ok, "max_tokens": 1, "seed": 9223372036854775807})
            self.assertEqual(status, 200, j)  # an int64 seed is no template value (beyond int64: 400, as vLLM)
            for body, param in (({**ok, "tools": tool(18446744073709551615)}, None),
                                ({**ok, "tools": tool(123456789012345678901234)}, None),
                                ({**ok, "messages": turns('{"n": 12345678901234567890}')}, "messages[1].tool_calls[0].function.arguments")):
                for route in ("/tokenize", "/v1/chat/completions"):
                    status, j = d.post(route, {**body, "max_tokens": 1} if route != "/tokenize" else body)
                    self.assertEqual(status, 400, (route, j))
                    self.assertIn("64-bit", j["error"]["message"])
                    if param:
                        self.assertEqual(j["error"]["param"], param)

    def test_no_template_no_bos_and_malformed_template(self):
        tmp = tempfile.mkdtemp(prefix="fd_chat_v_")
        try:
            # stories260K ships a small chat template (issue #26); a copy without one answers 400
            plain_dir = model_copy(os.path.join(tmp, "plain"))
            with open(os.path.join(plain_dir, "tokenizer_config.json")) as f:
                cfg = json.load(f)
            del cfg["chat_template"]
            with open(os.path.join(plain_dir, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f)
            with Daemon(model=plain_dir) as plain:
                status, j = plain.post("/v1/chat/completions", {"messages": MESSAGES})
                self.assertEqual(status, 400)
                self.assertIn("has no chat template", j["error"]["message"])
            # chat_template.jinja wins over tokenizer_config.json; a template without bos_token gets no BOS
            nobos = model_copy(os.path.join(tmp, "nobos"), config_template=TEMPLATE, jinja_file=NO_BOS_TEMPLATE)
            with Daemon(model=nobos) as d:
                status, j = d.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
                self.assertEqual(status, 200, j)
                text = reference_text(nobos, messages=MESSAGES, add_generation_prompt=True)
                self.assertEqual(text, "Lily and Tom   were playing   in the park. They saw a big box.")
                ref = d.complete(prompt=text, max_tokens=4, temperature=0)["choices"][0]
                self.assertEqual(j["choices"][0]["prompt_token_ids"], ref["prompt_token_ids"][1:])
            bad = model_copy(os.path.join(tmp, "bad"), config_template="{% for m in messages %}\n{{ m.content }")
            d = Daemon(model=bad, wait=False)
            try:
                d.proc.wait(60)
                self.assertNotEqual(d.proc.returncode, 0)
                self.assertIn("tokenizer_config.json chat_template:2:14: unexpected '}'", d.output())
            finally:
                d.__exit__(None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
