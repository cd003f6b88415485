// fd/tokenizer/jinja.h — a Jinja2 subset engine for chat templates.
//
// Renders what Hugging Face chat templates use, with the environment transformers builds
// (ImmutableSandboxedEnvironment, trim_blocks=True, lstrip_blocks=True, loopcontrols,
// tojson = json.dumps(ensure_ascii=False) keeping key order, raise_exception, strftime_now) and
// jinja2's default Undefined: {{ }}, {% %}, {# #}, `-`/`+` whitespace control, if/elif/else,
// for (loop.*, `if` filter, else, break/continue, unpacking, dict iteration), set (also block
// set and namespace attributes), macro, filter blocks, is-tests, filters, str/dict/list
// methods, slicing, Python operators. Not supported (a syntax error naming the tag): include,
// extends, import, call blocks, recursive loops, raw, with.
//
// Checked byte for byte against python3-jinja2 on real chat templates (tests/jinja/).
// A Template is immutable after parsing; render() is const and thread-safe.
#pragma once

#include "fd/status.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>

namespace fd::tokenizer::jinja {

struct Program;

/// The template called raise_exception(message): `what()` is the message, unchanged.
/// An fd::Error{invalid_argument}, so the API answers 400 with it.
class TemplateRaise : public fd::Error {
public:
    explicit TemplateRaise(std::string message) : fd::Error(Errc::invalid_argument, std::move(message)) {}
};

class Template {
public:
    /// Parse `source`; `name` (a file name) prefixes error positions.
    /// Errors  fd::Error{invalid_argument, "<name>:<line>:<column>: <what>"} for a syntax error
    ///         (1-based position of the offending token).
    Template(std::string_view source, std::string name);
    ~Template();
    Template(Template &&) noexcept;
    Template & operator=(Template &&) noexcept;

    /// Render with `context`, a JSON object whose members become top-level variables (key order
    /// kept: it is what tojson prints).
    /// Errors  TemplateRaise (raise_exception); fd::Error{invalid_argument,
    ///         "<name>:<line>: <what>"} for a render error (undefined attribute, type error...).
    std::string render(const nlohmann::ordered_json & context) const;

    const std::string & name() const { return name_; }

private:
    std::unique_ptr<Program> prog_;
    std::string              name_;
};

}  // namespace fd::tokenizer::jinja
