// jinja_ast.h — tokens and syntax tree of the Jinja engine (internal to src/tokenizer/jinja_*.cpp).
//
// lex() turns a template into tokens with jinja2's whitespace rules applied to the text
// (trim_blocks and lstrip_blocks on, as transformers sets them; `-` and `+` markers; one trailing
// newline dropped; newlines normalized to \n). parse() builds the statement list.
#pragma once

#include "jinja_value.h"

#include <memory>
#include <string>
#include <vector>

namespace fd::tokenizer::jinja {

struct Token {
    enum class Type : uint8_t { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, eof };
    Type        type = Type::eof;
    std::string s;        ///< text, name, string literal (unescaped), operator spelling
    int64_t     i  = 0;   ///< integer literal
    double      f  = 0;   ///< float literal
    int         line = 1; ///< 1-based position of the token's first character
    int         col  = 1;
};

/// A template syntax error at a position (1-based).
struct SyntaxError : std::runtime_error {
    SyntaxError(const std::string & msg, int line_, int col_) : std::runtime_error(msg), line(line_), col(col_) {}
    int line;
    int col;
};

/// Errors  SyntaxError (unterminated tag, comment or string; unexpected character).
std::vector<Token> lex(std::string_view source);

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body    = std::vector<StmtPtr>;

struct Expr {
    enum class Kind : uint8_t {
        literal,     ///< value
        name,        ///< name
        list,        ///< items (tuple when `tuple`)
        dict,        ///< keys[i] : items[i]
        attr,        ///< a.name
        item,        ///< a[b]
        slice,       ///< a[items[0]:items[1]:items[2]] (null = omitted)
        call,        ///< a(items..., kw...)
        filter,      ///< a | name(items..., kw...); a is null inside `{% filter %}`
        test,        ///< a is [not] name(items...)
        unary,       ///< op a   ("-", "+", "not")
        binary,      ///< a op b ("+", "-", "*", "/", "//", "%", "**", "~", "and", "or", "in", "not in", ==...)
        condexpr,    ///< b if a else c (c may be null)
    };
    Kind                                      kind;
    int                                       line = 1, col = 1;
    Value                                     value;
    std::string                               name;  ///< name, attribute, filter, test or operator
    bool                                      negated = false;
    bool                                      tuple   = false;
    ExprPtr                                   a, b, c;
    std::vector<ExprPtr>                      items;
    std::vector<ExprPtr>                      keys;
    std::vector<std::pair<std::string, ExprPtr>> kw;
};

struct Stmt {
    enum class Kind : uint8_t {
        text,       ///< name = text
        output,     ///< {{ expr }}
        if_,        ///< conds[i] → bodies[i]; else_body
        for_,       ///< targets in expr [if cond]: body; else_body
        set,        ///< targets = expr, or ns.attr = expr (attr non-empty)
        set_block,  ///< {% set targets[0] | filters %}body{% endset %}
        macro,      ///< name(params = defaults): body
        filter_block,
        break_,
        continue_,
        generation, ///< transformers' {% generation %}: renders its body
    };
    Kind                     kind;
    int                      line = 1, col = 1;
    std::string              name;
    std::string              attr;
    std::vector<std::string> targets;
    ExprPtr                  expr;
    ExprPtr                  cond;
    std::vector<ExprPtr>     conds;
    std::vector<Body>        bodies;
    Body                     body;
    Body                     else_body;
    std::vector<ExprPtr>     defaults;  ///< macro: one per param, null = none
    ExprPtr                  filters;   ///< set_block / filter_block: a filter chain applied to the body
};

/// Errors  SyntaxError at the offending token.
Body parse(const std::vector<Token> & tokens);

}  // namespace fd::tokenizer::jinja
