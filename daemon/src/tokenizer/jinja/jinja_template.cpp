// Template: parse once, render many times; converts engine errors into fd::Error.
#include "fd/tokenizer/jinja/jinja.h"

#include "jinja_interp.h"

#include <fmt/format.h>

#include <variant>

namespace fd::tokenizer::jinja {

struct Program {
    Body body;
};

Template::Template(std::string_view source, std::string name) : prog_(std::make_unique<Program>()), name_(std::move(name)) {
    try {
        prog_->body = parse(lex(source));
    } catch (const SyntaxError & e) {
        throw fd::Error(Errc::invalid_argument, fmt::format("{}:{}:{}: {}", name_, e.line, e.col, e.what()));
    }
}

Template::~Template()                               = default;
Template::Template(Template &&) noexcept            = default;
Template & Template::operator=(Template &&) noexcept = default;

std::string Template::render(const nlohmann::ordered_json & context) const {
    if (!context.is_object()) { throw fd::Error(Errc::invalid_argument, "template context must be a JSON object"); }
    Interp      in(Value::from_json(context));
    std::string out;
    try {
        in.render(prog_->body, out);
    } catch (const RaisedError & e) {
        throw TemplateRaise(e.what());
    } catch (const RenderError & e) {
        throw fd::Error(Errc::invalid_argument, fmt::format("{}:{}: {}", name_, in.line(), e.what()));
    } catch (const std::bad_variant_access &) {  // a value of the wrong type reached a built-in
        throw fd::Error(Errc::invalid_argument, fmt::format("{}:{}: argument of the wrong type", name_, in.line()));
    }
    return out;
}

}  // namespace fd::tokenizer::jinja
