// Jinja engine and ChatTemplate (daemon/src/tokenizer/): error reporting, loading from a model
// dir, and transformers' apply_chat_template rules. Expected texts are python3-jinja2 3.1.2's
// output for the same template and context (transformers' environment); the byte-for-byte
// comparison over real templates is tests/jinja/test_jinja_reference.py.
#include "fd/tokenizer/chat_template.h"

#include "test_util.h"

#include <doctest/doctest.h>

#include <fstream>

using fd::tokenizer::ChatRequest;
using fd::tokenizer::ChatTemplate;
using fd::tokenizer::jinja::Template;
using fd::tokenizer::jinja::TemplateRaise;
using ojson = nlohmann::ordered_json;

namespace {

std::string render(const std::string & src, const ojson & ctx = ojson::object()) { return Template(src, "t.jinja").render(ctx); }

std::string error_of(const std::function<void()> & f) {
    try {
        f();
    } catch (const fd::Error & e) {
        return e.what();
    }
    return "<no error>";
}

void write(const std::filesystem::path & p, const std::string & s) { std::ofstream(p, std::ios::binary) << s; }

}  // namespace

TEST_SUITE("tokenizer::jinja") {
    TEST_CASE("whitespace control follows trim_blocks and lstrip_blocks") {
        // python3-jinja2: '  x\n  y\nz'
        CHECK(render("  {% if true %}\n  x\n  {% endif %}\n  {{ 'y' }}\n  {# c #}\nz\n") == "  x\n  y\nz");
        CHECK(render("a  {%- if true -%}  b  {%- endif -%}  c") == "abc");
        CHECK(render("{% if true +%}\nkept{% endif %}") == "\nkept");
    }

    TEST_CASE("loop scoping: assignments inside a for loop do not leak") {
        // python3-jinja2: '01|01|01|0'
        CHECK(render("{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{x}}|{% endfor %}{{x}}") == "01|01|01|0");
        CHECK(render("{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}") == "3");
    }

    TEST_CASE("python values print as python prints them") {
        CHECK(render("{{ 1.0 }} {{ 1e15 }} {{ 1e16 }} {{ 0.1+0.2 }} {{ 10/4 }} {{ 7//2 }} {{ -7 % 3 }}") ==
              "1.0 1000000000000000.0 1e+16 0.30000000000000004 2.5 3 2");
        CHECK(render("{{ [1,'a',none,true,{'k':'v\\n'}] }} {{ \"it's\" | list }}") == "[1, 'a', None, True, {'k': 'v\\n'}] ['i', 't', \"'\", 's']");
    }

    TEST_CASE("tojson keeps key order and does not escape non-ASCII (transformers' override)") {
        ojson ctx = ojson::parse(R"({"x": {"b": 1, "a": [1.5, "é\n\"", null, true]}})");
        CHECK(render("{{ x | tojson }}", ctx) == "{\"b\": 1, \"a\": [1.5, \"é\\n\\\"\", null, true]}");
        CHECK(render("{{ x | tojson(indent=2) }}", ojson::parse(R"({"x": {"b": 1, "a": [], "c": {}}})")) == "{\n  \"b\": 1,\n  \"a\": [],\n  \"c\": {}\n}");
    }

    TEST_CASE("undefined: empty when printed, falsy, an error on attribute access") {
        CHECK(render("[{{ nope }}]{{ nope is defined }}{{ 'y' if nope else 'n' }}{{ nope | length }}") == "[]Falsen0");
        CHECK(render("{{ d.x }}|{{ d['x'] }}|{{ d.x is defined }}", ojson::parse(R"({"d": {}})")) == "||False");
        CHECK(error_of([] { render("line one\n{{ nope.attr }}"); }) == "t.jinja:2: 'nope' is undefined");
        CHECK(error_of([] { render("{{ [1].append(2) }}"); }).find("unsafe") != std::string::npos);
    }

    TEST_CASE("syntax errors name the file, line and column") {
        CHECK(error_of([] { Template("{% for x in y %}\n  {{ x }\n{% endfor %}", "tpl.jinja"); }) == "tpl.jinja:2:8: unexpected '}'");
        CHECK(error_of([] { Template("{% if x %}never closed", "tpl.jinja"); }) == "tpl.jinja:1:23: unexpected end of template: missing '{% endif %}'");
        CHECK(error_of([] { Template("ok\n\n  {% include 'x' %}", "tpl.jinja"); }) == "tpl.jinja:3:6: unknown or unsupported tag 'include'");
        CHECK(error_of([] { Template("{{ 'unterminated }}", "tpl.jinja"); }) == "tpl.jinja:1:4: unterminated string literal");
    }

    TEST_CASE("a template that recurses without end, or nests too deep, is an error, not a stack overflow") {
        // jinja2 raises RecursionError for the first; the daemon crashed on both (a request's own
        // chat_template with --trust-request-chat-template).
        CHECK(error_of([] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); }) ==
              "t.jinja:1: the template nests or recurses deeper than 512 levels (a macro calling itself without end?)");
        const std::string parens = "{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}";
        CHECK(error_of([&] { Template(parens, "t.jinja"); }) == "t.jinja:1:345: the template nests deeper than 1024 statements/expressions");
        std::string ifs;
        for (int i = 0; i < 5000; ++i) { ifs += "{% if true %}"; }
        CHECK(error_of([&] { Template(ifs, "t.jinja"); }).find("nests deeper than 1024") != std::string::npos);
        // what real templates do stays fine: 100 nested macro calls, 100 nested parentheses
        CHECK(render("{% macro f(n) %}{% if n < 100 %}{{ f(n + 1) }}{% else %}{{ n }}{% endif %}{% endmacro %}{{ f(0) }}") == "100");
        CHECK(render("{{ " + std::string(100, '(') + "7" + std::string(100, ')') + " }}") == "7");
    }

    TEST_CASE("raise_exception reaches the caller with its message unchanged") {
        try {
            render("{{ raise_exception('Conversation roles must alternate ' ~ 1) }}");
            FAIL("no exception");
        } catch (const TemplateRaise & e) {
            CHECK(std::string(e.what()) == "Conversation roles must alternate 1");
            CHECK(e.code() == fd::Errc::invalid_argument);
        }
    }
}

TEST_SUITE("tokenizer::chat_template") {
    TEST_CASE("load: tokenizer_config.json string, list with default, AddedToken special tokens") {
        fd::test::TempDir dir;
        CHECK_FALSE(ChatTemplate::load(dir.path).has_value());
        write(dir.path / "tokenizer_config.json",
              R"({"bos_token": {"__type": "AddedToken", "content": "<B>"}, "eos_token": "<E>",
                  "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]})");
        auto t = ChatTemplate::load(dir.path);
        REQUIRE(t.has_value());
        ChatRequest req;
        req.messages = ojson::parse(R"([{"role": "user", "content": "hi"}])");
        CHECK(t->render(req) == "<B>hi<E>");
        CHECK(t->special_token("bos_token") == "<B>");
        write(dir.path / "chat_template.jinja", "file:{{ messages | length }}\n");
        CHECK(ChatTemplate::load(dir.path)->render(req) == "file:1");  // chat_template.jinja wins
    }

    TEST_CASE("a list of templates: tool_use when tools are given, others by name (transformers' get_chat_template)") {
        fd::test::TempDir dir;
        write(dir.path / "tokenizer_config.json",
              R"({"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"},
                                    {"name": "rag", "template": "R{{ documents | length }}"}]})");
        const auto t = ChatTemplate::load(dir.path);
        REQUIRE(t.has_value());
        ChatRequest req;
        req.messages = ojson::parse(R"([{"role": "user", "content": "hi"}])");
        CHECK(t->select(req.tools).render(req) == "D");
        req.documents = ojson::parse(R"([{"text": "d"}])");
        CHECK(t->select(req.tools).render(req) == "D");   // documents alone do not pick "rag"
        req.tools = ojson::parse(R"([{"type": "function", "function": {"name": "f"}}])");
        CHECK(t->select(req.tools).render(req) == "T1");
        req.tools = ojson::array();
        CHECK(t->select(req.tools).render(req) == "T0");  // an empty list is not None
        REQUIRE(t->named("rag") != nullptr);
        CHECK(t->named("rag")->render(req) == "R1");
        CHECK(t->named("default") == &*t);
        CHECK(t->named("nope") == nullptr);
        // A single template, or one without tool_use, always gives itself.
        write(dir.path / "tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]})");
        const auto u = ChatTemplate::load(dir.path);
        CHECK(&u->select(req.tools) == &*u);
        write(dir.path / "tokenizer_config.json", R"({"chat_template": "S"})");
        const auto v = ChatTemplate::load(dir.path);
        CHECK(&v->select(req.tools) == &*v);
        CHECK(v->named("default") == nullptr);
    }

    TEST_CASE("load: bad template or config is an invalid_checkpoint error naming the file") {
        fd::test::TempDir dir;
        write(dir.path / "tokenizer_config.json", R"({"chat_template": "{% for m in messages %}{{ m }"})");
        try {
            ChatTemplate::load(dir.path);
            FAIL("no exception");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::invalid_checkpoint);
            CHECK(std::string(e.what()) == (dir.path / "tokenizer_config.json").string() + " chat_template:1:29: unexpected '}'");
        }
        write(dir.path / "tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})");
        CHECK(error_of([&] { ChatTemplate::load(dir.path); }).find("without a template named \"default\"") != std::string::npos);
        write(dir.path / "tokenizer_config.json", R"({"chat_template": 3})");
        CHECK(error_of([&] { ChatTemplate::load(dir.path); }).find("must be a string or a list") != std::string::npos);
    }

    TEST_CASE("render: tools None when absent, kwargs merged, continue_final_message cut") {
        ChatTemplate t("{{ tools is none }}|{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}{{ extra }}",
                       "t", ojson::object());
        ChatRequest req;
        req.messages = ojson::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon  "}])");
        CHECK(t.render(req) == "True|<user>hi</user><assistant>Once upon</assistant>");
        req.chat_template_kwargs = {{"extra", "X"}};
        req.add_generation_prompt = true;
        CHECK(t.render(req) == "True|<user>hi</user><assistant>Once upon</assistant><assistant>X");
        req.add_generation_prompt  = false;
        req.continue_final_message = true;
        CHECK(t.render(req) == "True|<user>hi</user><assistant>Once upon");
        req.add_generation_prompt = true;
        CHECK(error_of([&] { t.render(req); }).find("not compatible") != std::string::npos);
        req.add_generation_prompt = false;
        req.messages[1]["content"] = "never rendered";
        ChatTemplate drops("{% for m in messages[:-1] %}{{ m.content }}{% endfor %}", "t", ojson::object());
        CHECK(error_of([&] { drops.render(req); }).find("does not appear in the chat") != std::string::npos);
        req.continue_final_message = false;
        req.chat_template_kwargs   = {{"messages", 1}};
        CHECK(error_of([&] { t.render(req); }).find("must not set 'messages'") != std::string::npos);
    }
}
