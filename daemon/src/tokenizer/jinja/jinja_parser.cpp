// Jinja parser: tokens → statements and expressions, with jinja2's operator precedence
// (jinja2/parser.py: condexpr < or < and < not < compare < +,- < ~ < *,/,//,% < ** < unary
// < postfix/filters/tests).
#include "jinja_ast.h"

#include <fmt/format.h>

#include <initializer_list>

namespace fd::tokenizer::jinja {
namespace {

using T = Token::Type;

class Parser {
public:
    explicit Parser(const std::vector<Token> & toks) : t_(toks) {}

    Body parse_all() {
        Body body = parse_body({});
        if (cur().type != T::eof) { error(cur(), "unexpected tag '" + peek(1).s + "'"); }
        return body;
    }

private:
    const Token & cur() const { return t_[i_]; }
    const Token & peek(size_t k) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
    const Token & next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
    bool is_op(const char * op) const { return cur().type == T::op && cur().s == op; }
    bool is_name(const char * n) const { return cur().type == T::name && cur().s == n; }
    bool skip_op(const char * op) {
        if (!is_op(op)) { return false; }
        ++i_;
        return true;
    }
    bool skip_name(const char * n) {
        if (!is_name(n)) { return false; }
        ++i_;
        return true;
    }
    void expect_op(const char * op) {
        if (!skip_op(op)) { error(cur(), fmt::format("expected '{}', got {}", op, describe(cur()))); }
    }
    std::string expect_name() {
        if (cur().type != T::name) { error(cur(), "expected a name, got " + describe(cur())); }
        return next().s;
    }
    void expect_block_end() {
        if (cur().type != T::block_end) { error(cur(), "expected end of statement block, got " + describe(cur())); }
        ++i_;
    }
    static std::string describe(const Token & t) {
        switch (t.type) {
        case T::eof: return "end of template";
        case T::block_end: return "'%}'";
        case T::var_end: return "'}}'";
        case T::string: return "string literal";
        case T::integer:
        case T::floating: return "number";
        default: return "'" + t.s + "'";
        }
    }
    [[noreturn]] static void error(const Token & t, const std::string & msg) { throw SyntaxError(msg, t.line, t.col); }

    /// Nesting of statements and expressions being parsed: the parser recurses on each, so
    /// "((((...))))" 100,000 deep would overflow the stack; deeper than kMaxNest is a SyntaxError.
    static constexpr int kMaxNest = 1024;  ///< counts 3 per parenthesis (parse_expr, parse_not, parse_unary): ~340 of them
    struct Nest {
        explicit Nest(Parser & p) : p(p) {
            if (++p.nest_ > kMaxNest) {
                --p.nest_;
                error(p.cur(), fmt::format("the template nests deeper than {} statements/expressions", kMaxNest));
            }
        }
        ~Nest() { --p.nest_; }
        Parser & p;
    };

    template <typename N>
    static std::unique_ptr<N> make(typename N::Kind k, const Token & at) {
        auto n  = std::make_unique<N>();
        n->kind = k;
        n->line = at.line;
        n->col  = at.col;
        return n;
    }

    // ---- statements ----------------------------------------------------------------------

    /// Statements until a block tag whose name is in `stops` (left unconsumed: cur() is that
    /// block_begin) or the end of the template; the last of `stops` is the closing tag.
    Body parse_body(std::initializer_list<const char *> stops) {
        Body body;
        for (;;) {
            const Token & t = cur();
            if (t.type == T::eof) {
                if (stops.size() != 0) { error(t, fmt::format("unexpected end of template: missing '{{% {} %}}'", *(stops.end() - 1))); }
                return body;
            }
            if (t.type == T::text) {
                auto s  = make<Stmt>(Stmt::Kind::text, t);
                s->name = t.s;
                body.push_back(std::move(s));
                ++i_;
            } else if (t.type == T::var_begin) {
                ++i_;
                auto s  = make<Stmt>(Stmt::Kind::output, t);
                s->expr = parse_tuple_expr();
                if (cur().type != T::var_end) { error(cur(), "expected '}}', got " + describe(cur())); }
                ++i_;
                body.push_back(std::move(s));
            } else if (t.type == T::block_begin) {
                const Token & kw = peek(1);
                if (kw.type != T::name) { error(kw, "expected a statement name, got " + describe(kw)); }
                for (const char * s : stops) {
                    if (kw.s == s) { return body; }
                }
                ++i_;
                body.push_back(parse_statement());
            } else {
                error(t, "unexpected " + describe(t));
            }
        }
    }

    /// Consumes `{% name` of the closing tag (`endfor`...) and its `%}`.
    void end_tag(const char * name) {
        ++i_;  // block_begin
        if (!skip_name(name)) { error(cur(), fmt::format("expected '{}', got {}", name, describe(cur()))); }
        expect_block_end();
    }

    StmtPtr parse_statement() {
        const Nest nest(*this);
        const Token & kw = next();
        if (kw.s == "if") { return parse_if(kw); }
        if (kw.s == "for") { return parse_for(kw); }
        if (kw.s == "set") { return parse_set(kw); }
        if (kw.s == "macro") { return parse_macro(kw); }
        if (kw.s == "filter") {
            auto s     = make<Stmt>(Stmt::Kind::filter_block, kw);
            s->filters = parse_filter_chain(nullptr, false);
            expect_block_end();
            s->body = parse_body({"endfilter"});
            end_tag("endfilter");
            return s;
        }
        if (kw.s == "generation") {
            auto s = make<Stmt>(Stmt::Kind::generation, kw);
            expect_block_end();
            s->body = parse_body({"endgeneration"});
            end_tag("endgeneration");
            return s;
        }
        if (kw.s == "break" || kw.s == "continue") {
            if (loop_depth_ == 0) { error(kw, fmt::format("'{}' outside of a loop", kw.s)); }
            auto s = make<Stmt>(kw.s == "break" ? Stmt::Kind::break_ : Stmt::Kind::continue_, kw);
            expect_block_end();
            return s;
        }
        error(kw, fmt::format("unknown or unsupported tag '{}'", kw.s));
    }

    StmtPtr parse_if(const Token & kw) {
        auto s = make<Stmt>(Stmt::Kind::if_, kw);
        s->conds.push_back(parse_tuple_expr());
        expect_block_end();
        for (;;) {
            s->bodies.push_back(parse_body({"elif", "else", "endif"}));
            const std::string which = peek(1).s;
            i_ += 2;
            if (which == "elif") {
                s->conds.push_back(parse_tuple_expr());
                expect_block_end();
            } else if (which == "else") {
                expect_block_end();
                s->else_body = parse_body({"endif"});
                end_tag("endif");
                return s;
            } else {
                expect_block_end();
                return s;
            }
        }
    }

    std::vector<std::string> parse_targets() {
        std::vector<std::string> names;
        bool paren = skip_op("(");
        do {
            names.push_back(expect_name());
        } while (skip_op(",") && cur().type == T::name);
        if (paren) { expect_op(")"); }
        return names;
    }

    StmtPtr parse_for(const Token & kw) {
        auto s     = make<Stmt>(Stmt::Kind::for_, kw);
        s->targets = parse_targets();
        if (!skip_name("in")) { error(cur(), "expected 'in', got " + describe(cur())); }
        s->expr = parse_tuple_expr(/*no_condexpr=*/true);
        if (skip_name("if")) { s->cond = parse_expr(); }
        if (skip_name("recursive")) { error(kw, "recursive for loops are not supported"); }
        expect_block_end();
        ++loop_depth_;
        s->body = parse_body({"else", "endfor"});
        --loop_depth_;
        if (peek(1).s == "else") {
            i_ += 2;
            expect_block_end();
            s->else_body = parse_body({"endfor"});
        }
        end_tag("endfor");
        return s;
    }

    StmtPtr parse_set(const Token & kw) {
        if (cur().type == T::name && peek(1).type == T::op && peek(1).s == ".") {
            auto s  = make<Stmt>(Stmt::Kind::set, kw);
            s->name = next().s;
            ++i_;
            s->attr = expect_name();
            expect_op("=");
            s->expr = parse_tuple_expr();
            expect_block_end();
            return s;
        }
        std::vector<std::string> targets = parse_targets();
        if (skip_op("=")) {
            auto s     = make<Stmt>(Stmt::Kind::set, kw);
            s->targets = std::move(targets);
            s->expr    = parse_tuple_expr();
            expect_block_end();
            return s;
        }
        if (targets.size() != 1) { error(cur(), "expected '='"); }
        auto s     = make<Stmt>(Stmt::Kind::set_block, kw);
        s->targets = std::move(targets);
        if (is_op("|")) { s->filters = parse_filter_chain(nullptr); }
        expect_block_end();
        s->body = parse_body({"endset"});
        end_tag("endset");
        return s;
    }

    StmtPtr parse_macro(const Token & kw) {
        auto s  = make<Stmt>(Stmt::Kind::macro, kw);
        s->name = expect_name();
        expect_op("(");
        while (!skip_op(")")) {
            if (!s->targets.empty()) { expect_op(","); }
            if (skip_op(")")) { break; }
            s->targets.push_back(expect_name());
            s->defaults.push_back(skip_op("=") ? parse_expr() : nullptr);
        }
        expect_block_end();
        int saved   = loop_depth_;
        loop_depth_ = 0;
        s->body     = parse_body({"endmacro"});
        loop_depth_ = saved;
        end_tag("endmacro");
        return s;
    }

    // ---- expressions ---------------------------------------------------------------------

    /// An expression, or a bare tuple `a, b` (as in `{% set x = a, b %}`).
    ExprPtr parse_tuple_expr(bool no_condexpr = false) {
        const Token & at    = cur();
        ExprPtr       first = no_condexpr ? parse_or() : parse_expr();
        if (!is_op(",")) { return first; }
        auto t   = make<Expr>(Expr::Kind::list, at);
        t->tuple = true;
        t->items.push_back(std::move(first));
        while (skip_op(",")) {
            if (cur().type == T::block_end || cur().type == T::var_end || is_name("if") || is_op(")") || is_name("in") || is_op("=")) { break; }
            t->items.push_back(no_condexpr ? parse_or() : parse_expr());
        }
        return t;
    }

    ExprPtr parse_expr() {
        const Nest nest(*this);
        const Token & at   = cur();
        ExprPtr       expr = parse_or();
        while (is_name("if")) {
            ++i_;
            auto c = make<Expr>(Expr::Kind::condexpr, at);
            c->a   = parse_or();
            c->b   = std::move(expr);
            if (skip_name("else")) { c->c = parse_expr(); }
            expr = std::move(c);
        }
        return expr;
    }

    ExprPtr binary(const Token & at, std::string op, ExprPtr a, ExprPtr b) {
        auto e  = make<Expr>(Expr::Kind::binary, at);
        e->name = std::move(op);
        e->a    = std::move(a);
        e->b    = std::move(b);
        return e;
    }

    ExprPtr parse_or() {
        ExprPtr a = parse_and();
        while (is_name("or")) {
            const Token & at = next();
            a                = binary(at, "or", std::move(a), parse_and());
        }
        return a;
    }
    ExprPtr parse_and() {
        ExprPtr a = parse_not();
        while (is_name("and")) {
            const Token & at = next();
            a                = binary(at, "and", std::move(a), parse_not());
        }
        return a;
    }
    ExprPtr parse_not() {
        const Nest nest(*this);
        if (is_name("not")) {
            const Token & at = next();
            auto          e  = make<Expr>(Expr::Kind::unary, at);
            e->name          = "not";
            e->a             = parse_not();
            return e;
        }
        return parse_compare();
    }
    ExprPtr parse_compare() {
        ExprPtr a = parse_math1();
        for (;;) {
            const Token & at = cur();
            std::string   op;
            if (at.type == T::op && (at.s == "==" || at.s == "!=" || at.s == "<" || at.s == ">" || at.s == "<=" || at.s == ">=")) {
                op = at.s;
                ++i_;
            } else if (is_name("in")) {
                op = "in";
                ++i_;
            } else if (is_name("not") && peek(1).type == T::name && peek(1).s == "in") {
                op = "not in";
                i_ += 2;
            } else {
                return a;
            }
            // Chained comparisons (a < b < c) become (a < b) and (b < c) in jinja2; templates
            // don't chain, so the left-associative form is kept.
            a = binary(at, op, std::move(a), parse_math1());
        }
    }
    ExprPtr parse_math1() {
        ExprPtr a = parse_concat();
        while (is_op("+") || is_op("-")) {
            const Token & at = next();
            a                = binary(at, at.s, std::move(a), parse_concat());
        }
        return a;
    }
    ExprPtr parse_concat() {
        ExprPtr a = parse_math2();
        while (is_op("~")) {
            const Token & at = next();
            a                = binary(at, "~", std::move(a), parse_math2());
        }
        return a;
    }
    ExprPtr parse_math2() {
        ExprPtr a = parse_pow();
        while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
            const Token & at = next();
            a                = binary(at, at.s, std::move(a), parse_pow());
        }
        return a;
    }
    ExprPtr parse_pow() {
        ExprPtr a = parse_unary(true);
        while (is_op("**")) {
            const Token & at = next();
            a                = binary(at, "**", std::move(a), parse_unary(true));
        }
        return a;
    }
    ExprPtr parse_unary(bool with_filter) {
        const Nest nest(*this);
        ExprPtr node;
        if (is_op("-") || is_op("+")) {
            const Token & at = next();
            node             = make<Expr>(Expr::Kind::unary, at);
            node->name       = at.s;
            node->a          = parse_unary(false);
        } else {
            node = parse_primary();
        }
        node = parse_postfix(std::move(node));
        if (with_filter) { node = parse_filter_expr(std::move(node)); }
        return node;
    }

    ExprPtr parse_primary() {
        const Token & t = cur();
        switch (t.type) {
        case T::name: {
            ++i_;
            auto lit = make<Expr>(Expr::Kind::literal, t);
            if (t.s == "true" || t.s == "True") {
                lit->value = Value(true);
            } else if (t.s == "false" || t.s == "False") {
                lit->value = Value(false);
            } else if (t.s == "none" || t.s == "None") {
                lit->value = Value(NoneT{});
            } else {
                auto n  = make<Expr>(Expr::Kind::name, t);
                n->name = t.s;
                return n;
            }
            return lit;
        }
        case T::string: {
            std::string s;
            while (cur().type == T::string) { s += next().s; }  // adjacent literals concatenate
            auto lit   = make<Expr>(Expr::Kind::literal, t);
            lit->value = Value(std::move(s));
            return lit;
        }
        case T::integer:
        case T::floating: {
            ++i_;
            auto lit   = make<Expr>(Expr::Kind::literal, t);
            lit->value = t.type == T::integer ? Value(t.i) : Value(t.f);
            return lit;
        }
        case T::op:
            if (t.s == "(") {
                ++i_;
                if (skip_op(")")) {
                    auto e   = make<Expr>(Expr::Kind::list, t);
                    e->tuple = true;
                    return e;
                }
                ExprPtr e = parse_tuple_expr();
                expect_op(")");
                return e;
            }
            if (t.s == "[") {
                ++i_;
                auto e = make<Expr>(Expr::Kind::list, t);
                while (!skip_op("]")) {
                    if (!e->items.empty()) { expect_op(","); }
                    if (skip_op("]")) { break; }
                    e->items.push_back(parse_expr());
                }
                return e;
            }
            if (t.s == "{") {
                ++i_;
                auto e = make<Expr>(Expr::Kind::dict, t);
                while (!skip_op("}")) {
                    if (!e->items.empty()) { expect_op(","); }
                    if (skip_op("}")) { break; }
                    e->keys.push_back(parse_expr());
                    expect_op(":");
                    e->items.push_back(parse_expr());
                }
                return e;
            }
            break;
        default: break;
        }
        error(t, "unexpected " + describe(t));
    }

    ExprPtr parse_postfix(ExprPtr node) {
        for (;;) {
            const Token & at = cur();
            if (is_op(".")) {
                ++i_;
                auto e = make<Expr>(Expr::Kind::attr, at);
                if (cur().type == T::integer) {  // x.0 is x[0]
                    e->kind        = Expr::Kind::item;
                    e->b           = make<Expr>(Expr::Kind::literal, cur());
                    e->b->value    = Value(next().i);
                } else {
                    e->name = expect_name();
                }
                e->a = std::move(node);
                node = std::move(e);
            } else if (is_op("[")) {
                ++i_;
                node = parse_subscript(at, std::move(node));
            } else if (is_op("(")) {
                node = parse_call(std::move(node));
            } else {
                return node;
            }
        }
    }

    ExprPtr parse_subscript(const Token & at, ExprPtr obj) {
        ExprPtr parts[3];
        int     n_colons = 0;
        for (;;) {
            if (is_op("]")) { break; }
            if (is_op(":")) {
                ++i_;
                if (++n_colons > 2) { error(cur(), "too many ':' in slice"); }
                continue;
            }
            if (parts[n_colons]) { error(cur(), "expected ']'"); }
            parts[n_colons] = parse_expr();
        }
        expect_op("]");
        if (n_colons == 0) {
            if (!parts[0]) { error(at, "empty subscript"); }
            auto e = make<Expr>(Expr::Kind::item, at);
            e->a   = std::move(obj);
            e->b   = std::move(parts[0]);
            return e;
        }
        auto e = make<Expr>(Expr::Kind::slice, at);
        e->a   = std::move(obj);
        for (auto & p : parts) { e->items.push_back(std::move(p)); }
        return e;
    }

    /// `(args, kw=args)` into `e` (items, kw).
    void parse_args(Expr & e) {
        expect_op("(");
        bool first = true;
        while (!skip_op(")")) {
            if (!first) { expect_op(","); }
            first = false;
            if (skip_op(")")) { break; }
            if (cur().type == T::name && peek(1).type == T::op && peek(1).s == "=") {
                std::string k = next().s;
                ++i_;
                e.kw.emplace_back(std::move(k), parse_expr());
            } else {
                if (!e.kw.empty()) { error(cur(), "positional argument after keyword argument"); }
                e.items.push_back(parse_expr());
            }
        }
    }

    ExprPtr parse_call(ExprPtr callee) {
        auto e = make<Expr>(Expr::Kind::call, cur());
        e->a   = std::move(callee);
        parse_args(*e);
        return e;
    }

    ExprPtr parse_filter_expr(ExprPtr node) {
        for (;;) {
            if (is_op("|")) {
                node = parse_filter_chain(std::move(node));
            } else if (is_name("is")) {
                const Token & at = next();
                auto          e  = make<Expr>(Expr::Kind::test, at);
                e->negated       = skip_name("not");
                e->name          = expect_name();
                e->a             = std::move(node);
                if (is_op("(")) {
                    parse_args(*e);
                } else if (starts_test_arg()) {
                    e->items.push_back(parse_primary_postfix());
                }
                node = std::move(e);
            } else if (is_op("(")) {
                node = parse_call(std::move(node));
            } else {
                return node;
            }
        }
    }

    /// jinja2 parse_test: a bare argument follows when the next token can start a primary
    /// and is not one of else/or/and.
    bool starts_test_arg() const {
        const Token & t = cur();
        if (t.type == T::name) { return t.s != "else" && t.s != "or" && t.s != "and" && t.s != "if" && t.s != "in" && t.s != "is" && t.s != "not"; }
        if (t.type == T::string || t.type == T::integer || t.type == T::floating) { return true; }
        return t.type == T::op && (t.s == "(" || t.s == "[" || t.s == "{" || t.s == "-" || t.s == "+");
    }
    ExprPtr parse_primary_postfix() { return parse_postfix(parse_unary(false)); }

    /// `| name(args) | name2 ...` applied to `node` (null inside {% filter %}/{% set %} blocks,
    /// where the first `|` is absent for `{% filter name %}`: need_pipe false).
    ExprPtr parse_filter_chain(ExprPtr node, bool need_pipe = true) {
        for (bool first = true;; first = false) {
            if (first && !need_pipe) {
                skip_op("|");
            } else if (!skip_op("|")) {
                return node;
            }
            const Token & at = cur();
            auto          e  = make<Expr>(Expr::Kind::filter, at);
            e->name          = expect_name();
            while (skip_op(".")) { e->name += "." + expect_name(); }
            if (is_op("(")) { parse_args(*e); }
            e->a = std::move(node);
            node = std::move(e);
        }
    }

    const std::vector<Token> & t_;
    size_t                     i_          = 0;
    int                        loop_depth_ = 0;
    int                        nest_ = 0;
};

}  // namespace

Body parse(const std::vector<Token> & tokens) { return Parser(tokens).parse_all(); }

}  // namespace fd::tokenizer::jinja
