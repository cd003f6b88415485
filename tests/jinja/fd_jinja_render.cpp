// fd_jinja_render: renders a cases file with fdrollout's Jinja engine, for the reference
// comparison in tests/jinja/test_jinja_reference.py (python3-jinja2 and @huggingface/jinja
// render the same file).
//
//   fd_jinja_render CASES.json OUT.json
//   CASES: {"templates": {name: model_dir}, "cases": [{"template": name, "mode": "chat"|"raw",
//           "chat": {messages, tools, add_generation_prompt, continue_final_message,
//           chat_template_kwargs}, "context": {...}} | {"source": text, "context": {...}}]}
//   OUT:   [{"ok": true, "text": ...} | {"ok": false, "raise": bool, "error": ...}]
#include "fd/tokenizer/chat_template.h"

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

using ojson = nlohmann::ordered_json;

int main(int argc, char ** argv) {
    if (argc != 3) {
        std::cerr << "usage: fd_jinja_render CASES.json OUT.json\n";
        return 2;
    }
    std::ifstream in(argv[1]);
    std::stringstream ss;
    ss << in.rdbuf();
    ojson spec = ojson::parse(ss.str());
    std::map<std::string, std::optional<fd::tokenizer::ChatTemplate>> templates;
    std::map<std::string, std::string>                                 load_errors;
    for (const auto & [name, dir] : spec["templates"].items()) {
        try {
            templates.emplace(name, fd::tokenizer::ChatTemplate::load(dir.get<std::string>()));
        } catch (const fd::Error & e) {
            load_errors[name] = e.what();
        }
    }
    ojson out = ojson::array();
    for (const auto & c : spec["cases"]) {
        const std::string name = c.value("template", "");
        ojson             r;
        try {
            if (c.contains("source")) {  // an inline template rendered with `context` as is
                r = {{"ok", true}, {"text", fd::tokenizer::jinja::Template(c["source"].get<std::string>(), "inline").render(c["context"])}};
                out.push_back(std::move(r));
                continue;
            }
            if (load_errors.count(name)) { throw fd::Error(fd::Errc::invalid_checkpoint, load_errors[name]); }
            const auto & t = templates.at(name);
            if (!t) { throw fd::Error(fd::Errc::not_found, "no chat template"); }
            fd::tokenizer::ChatRequest req;
            if (c.value("mode", "chat") == "raw") {
                // A raw context: everything but messages goes through chat_template_kwargs.
                ojson ctx = c["context"];
                req.messages = ctx.contains("messages") ? ctx["messages"] : ojson::array();
                for (const auto & [k, v] : ctx.items()) {
                    if (k == "messages") { continue; }
                    if (k == "add_generation_prompt") { req.add_generation_prompt = v.get<bool>(); continue; }
                    if (k == "tools") { req.tools = v; continue; }
                    req.chat_template_kwargs[k] = v;
                }
            } else {
                const ojson & ch          = c["chat"];
                req.messages               = ch.at("messages");
                req.tools                  = ch.value("tools", ojson());
                req.add_generation_prompt  = ch.value("add_generation_prompt", false);
                req.continue_final_message = ch.value("continue_final_message", false);
                req.chat_template_kwargs   = ch.value("chat_template_kwargs", ojson::object());
            }
            r = {{"ok", true}, {"text", t->render(req)}};
        } catch (const fd::tokenizer::jinja::TemplateRaise & e) {
            r = {{"ok", false}, {"raise", true}, {"error", e.what()}};
        } catch (const std::exception & e) {
            r = {{"ok", false}, {"raise", false}, {"error", e.what()}};
        }
        out.push_back(std::move(r));
    }
    std::ofstream(argv[2]) << out.dump(1, ' ', false, ojson::error_handler_t::replace) << "\n";
    return 0;
}
