// Jinja renderer: statements and expressions over Values, with jinja2's scoping and
// Python's operator semantics.
#include "jinja_interp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace fd::tokenizer::jinja {
namespace {

/// The `loop` variable of a for loop.
struct LoopObject : Object {
    int64_t            index0 = 0;
    const std::vector<Value> * items = nullptr;

    Value attr(const std::string & n) const override {
        const auto len = static_cast<int64_t>(items->size());
        if (n == "index") { return Value(index0 + 1); }
        if (n == "index0") { return Value(index0); }
        if (n == "revindex") { return Value(len - index0); }
        if (n == "revindex0") { return Value(len - index0 - 1); }
        if (n == "first") { return Value(index0 == 0); }
        if (n == "last") { return Value(index0 == len - 1); }
        if (n == "length") { return Value(len); }
        if (n == "depth") { return Value(1); }
        if (n == "depth0") { return Value(0); }
        if (n == "previtem") { return index0 > 0 ? (*items)[static_cast<size_t>(index0 - 1)] : Value::undefined("there is no previous item"); }
        if (n == "nextitem") { return index0 + 1 < len ? (*items)[static_cast<size_t>(index0 + 1)] : Value::undefined("there is no next item"); }
        if (n == "cycle") {
            int64_t i = index0;
            auto    c = std::make_shared<Callable>();
            c->name   = "cycle";
            c->fn     = [i](const Args & a) -> Value {
                if (a.pos.empty()) { fail("no items for cycling given"); }
                return a.pos[static_cast<size_t>(i) % a.pos.size()];
            };
            return Value(std::shared_ptr<const Callable>(std::move(c)));
        }
        return Value::undefined(fmt::format("'LoopContext object' has no attribute '{}'", n));
    }
    std::string repr() const override { return fmt::format("<LoopContext {}/{}>", index0 + 1, items->size()); }
};

int64_t as_int(const Value & v) { return v.is_bool() ? int64_t{v.get_bool()} : v.get_int(); }
bool    is_intlike(const Value & v) { return v.is_int() || v.is_bool(); }

[[noreturn]] void bad_operands(const char * op, const Value & a, const Value & b) {
    if (a.is_undefined()) { fail(a.undefined_hint()); }
    if (b.is_undefined()) { fail(b.undefined_hint()); }
    fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name()));
}

Value repeat(const Value & seq, int64_t n) {
    if (seq.is_list() && !seq.list_data().plain()) { fail(fmt::format("unsupported operand type(s) for *: '{}' and 'int'", seq.type_name())); }
    if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) { out += seq.str(); }
        return Value(std::move(out));
    }
    std::vector<Value> out;
    for (int64_t i = 0; i < n; ++i) {
        for (const auto & v : seq.list_data().items) { out.push_back(v); }
    }
    return Value::list(std::move(out), seq.list_data().seq);
}

Value arith(const std::string & op, const Value & a, const Value & b) {
    const char * o = op.c_str();
    if (op == "+") {
        if (a.is_number() && b.is_number()) {
            if (is_intlike(a) && is_intlike(b)) { return Value(as_int(a) + as_int(b)); }
            return Value(a.number() + b.number());
        }
        if (a.is_string() && b.is_string()) { return Value(a.str() + b.str()); }
        if (a.is_list() && b.is_list() && a.list_data().plain() && a.list_data().seq == b.list_data().seq) {
            std::vector<Value> out = a.list_data().items;
            for (const auto & v : b.list_data().items) { out.push_back(v); }
            return Value::list(std::move(out), a.list_data().seq);
        }
        if (a.is_string() && !b.is_undefined()) { fail(fmt::format("can only concatenate str (not \"{}\") to str", b.type_name())); }
        bad_operands(o, a, b);
    }
    if (op == "*") {
        if (a.is_number() && b.is_number()) {
            if (is_intlike(a) && is_intlike(b)) { return Value(as_int(a) * as_int(b)); }
            return Value(a.number() * b.number());
        }
        if ((a.is_string() || a.is_list()) && is_intlike(b)) { return repeat(a, as_int(b)); }
        if ((b.is_string() || b.is_list()) && is_intlike(a)) { return repeat(b, as_int(a)); }
        bad_operands(o, a, b);
    }
    if (!a.is_number() || !b.is_number()) {
        if (op == "%" && a.is_string()) { return Value(py_percent_format(a.str(), b)); }
        bad_operands(o, a, b);
    }
    const bool ints = is_intlike(a) && is_intlike(b);
    if (op == "-") { return ints ? Value(as_int(a) - as_int(b)) : Value(a.number() - b.number()); }
    if (op == "/") {
        if (b.number() == 0) { fail("division by zero"); }
        return Value(a.number() / b.number());
    }
    if (op == "//" || op == "%") {
        if (b.number() == 0) { fail(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero"); }
        if (ints) {
            int64_t x = as_int(a), y = as_int(b);
            int64_t q = x / y, r = x % y;
            if (r != 0 && ((r < 0) != (y < 0))) {
                q -= 1;
                r += y;
            }
            return op == "//" ? Value(q) : Value(r);
        }
        // CPython float_divmod
        double x = a.number(), y = b.number();
        double mod = std::fmod(x, y);
        double div = (x - mod) / y;
        if (mod != 0) {
            if ((y < 0) != (mod < 0)) {
                mod += y;
                div -= 1.0;
            }
        } else {
            mod = std::copysign(0.0, y);
        }
        double floordiv;
        if (div != 0) {
            floordiv = std::floor(div);
            if (div - floordiv > 0.5) { floordiv += 1.0; }
        } else {
            floordiv = std::copysign(0.0, x / y);
        }
        return op == "//" ? Value(floordiv) : Value(mod);
    }
    if (op == "**") {
        if (ints && as_int(b) >= 0) {
            int64_t r = 1, base = as_int(a);
            for (int64_t e = as_int(b); e > 0; --e) { r *= base; }
            return Value(r);
        }
        if (a.number() == 0 && b.number() < 0) { fail("0.0 cannot be raised to a negative power"); }
        return Value(std::pow(a.number(), b.number()));
    }
    fail("unknown operator " + op);
}

}  // namespace

Interp::Interp(Value context) : context_(std::move(context)) { frames_.push_back(Frame{}); }

void Interp::render(const Body & body, std::string & out) { exec(body, out); }

Interp::DepthGuard::DepthGuard(Interp & in) : in(in) {
    if (++in.depth_ > kMaxDepth) {
        --in.depth_;
        fail(fmt::format("the template nests or recurses deeper than {} levels (a macro calling itself without end?)", kMaxDepth));
    }
}

Value Interp::lookup(const std::string & name) const {
    for (int f = static_cast<int>(frames_.size()) - 1; f >= 0; f = frames_[static_cast<size_t>(f)].parent) {
        const auto & vars = frames_[static_cast<size_t>(f)].vars;
        for (auto it = vars.rbegin(); it != vars.rend(); ++it) {
            if (it->first == name) { return it->second; }
        }
    }
    if (const Value * v = context_.dict_data().find(name)) { return *v; }
    Value g = global_function(name);
    if (!g.is_undefined()) { return g; }
    return Value::undefined(fmt::format("'{}' is undefined", name));
}

void Interp::assign(const std::string & name, Value v) {
    auto & vars = frames_.back().vars;
    for (auto & kv : vars) {
        if (kv.first == name) {
            kv.second = std::move(v);
            return;
        }
    }
    vars.emplace_back(name, std::move(v));
}

void Interp::assign_targets(const std::vector<std::string> & targets, const Value & v) {
    if (targets.size() == 1) {
        assign(targets[0], v);
        return;
    }
    std::vector<Value> items = v.iterate();
    if (items.size() != targets.size()) {
        fail(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    }
    for (size_t i = 0; i < targets.size(); ++i) { assign(targets[i], items[i]); }
}

Interp::Flow Interp::exec(const Body & body, std::string & out) {
    const DepthGuard guard(*this);
    for (const auto & sp : body) {
        const Stmt & s = *sp;
        line_          = s.line;
        switch (s.kind) {
        case Stmt::Kind::text: out += s.name; break;
        case Stmt::Kind::output: {
            Value v = eval(*s.expr);
            if (v.is_string()) {
                out += v.str();
            } else {
                out += v.to_str();
            }
            break;
        }
        case Stmt::Kind::if_: {
            const Body * chosen = &s.else_body;
            for (size_t i = 0; i < s.conds.size(); ++i) {
                if (eval(*s.conds[i]).truthy()) {
                    chosen = &s.bodies[i];
                    break;
                }
            }
            Flow f = exec(*chosen, out);
            if (f != Flow::normal) { return f; }
            break;
        }
        case Stmt::Kind::for_: exec_for(s, out); break;
        case Stmt::Kind::set: exec_set(s); break;
        case Stmt::Kind::set_block: {
            std::string captured;
            exec(s.body, captured);
            Value v(std::move(captured));
            if (s.filters) { v = eval_filter_chain(*s.filters, v); }
            assign(s.targets[0], std::move(v));
            break;
        }
        case Stmt::Kind::filter_block: {
            std::string captured;
            exec(s.body, captured);
            out += eval_filter_chain(*s.filters, Value(std::move(captured))).to_str();
            break;
        }
        case Stmt::Kind::macro: define_macro(s); break;
        case Stmt::Kind::generation: {
            Flow f = exec(s.body, out);
            if (f != Flow::normal) { return f; }
            break;
        }
        case Stmt::Kind::break_: return Flow::break_;
        case Stmt::Kind::continue_: return Flow::continue_;
        }
    }
    return Flow::normal;
}

Interp::Flow Interp::exec_for(const Stmt & s, std::string & out) {
    std::vector<Value> items = eval(*s.expr).iterate();
    const int          outer = static_cast<int>(frames_.size()) - 1;
    if (s.cond) {  // `for x in xs if cond`: filtered before loop.length is known
        std::vector<Value> kept;
        for (auto & v : items) {
            frames_.push_back(Frame{{}, outer});
            assign_targets(s.targets, v);
            bool keep = eval(*s.cond).truthy();
            frames_.pop_back();
            if (keep) { kept.push_back(std::move(v)); }
        }
        items = std::move(kept);
    }
    if (items.empty()) { return exec(s.else_body, out); }
    auto loop   = std::make_shared<LoopObject>();
    loop->items = &items;
    Value loop_value{std::shared_ptr<Object>(loop)};
    for (size_t i = 0; i < items.size(); ++i) {
        loop->index0 = static_cast<int64_t>(i);
        frames_.push_back(Frame{{}, outer});
        frames_.back().vars.reserve(4);
        frames_.back().vars.emplace_back("loop", loop_value);
        assign_targets(s.targets, items[i]);
        Flow f = exec(s.body, out);
        frames_.pop_back();
        if (f == Flow::break_) { break; }
    }
    return Flow::normal;
}

void Interp::exec_set(const Stmt & s) {
    Value v = eval(*s.expr);
    if (s.attr.empty()) {
        assign_targets(s.targets, v);
        return;
    }
    Value obj = lookup(s.name);
    if (!obj.is_object()) { fail(fmt::format("can only set attributes of a namespace, '{}' is a {}", s.name, obj.type_name())); }
    obj.object().set_attr(s.attr, std::move(v));
}

void Interp::define_macro(const Stmt & s) {
    auto c  = std::make_shared<Callable>();
    c->name = s.name;
    c->fn   = [this, &s](const Args & args) -> Value {
        if (args.pos.size() > s.targets.size()) { fail(fmt::format("macro '{}' takes not more than {} argument(s)", s.name, s.targets.size())); }
        frames_.push_back(Frame{{}, 0});
        for (const auto & p : s.targets) { assign(p, Value::undefined(fmt::format("'{}' is undefined", p))); }
        for (size_t i = 0; i < s.targets.size(); ++i) {
            const Value * given = i < args.pos.size() ? &args.pos[i] : nullptr;
            for (const auto & kv : args.kw) {
                if (kv.first == s.targets[i]) { given = &kv.second; }
            }
            Value v = given ? *given : s.defaults[i] ? eval(*s.defaults[i]) : Value::undefined(fmt::format("'{}' is undefined", s.targets[i]));
            assign(s.targets[i], std::move(v));
        }
        std::string out;
        const int   saved = line_;
        exec(s.body, out);
        line_ = saved;
        frames_.pop_back();
        return Value(std::move(out));
    };
    assign(s.name, Value(std::shared_ptr<const Callable>(std::move(c))));
}

Args Interp::eval_args(const Expr & e) {
    Args a;
    a.pos.reserve(e.items.size());
    for (const auto & x : e.items) { a.pos.push_back(eval(*x)); }
    for (const auto & [k, x] : e.kw) { a.kw.emplace_back(k, eval(*x)); }
    return a;
}

Value Interp::call(const Value & callee, const Args & args, const std::string & what) {
    if (callee.is_callable()) { return callee.callable().fn(args); }
    if (callee.is_undefined()) { fail(callee.undefined_hint()); }
    fail(fmt::format("'{}' object is not callable ({})", callee.type_name(), what));
}

Value Interp::eval_call(const Expr & e) {
    if (e.a->kind == Expr::Kind::attr) {  // obj.method(...) without a bound-method object
        Value obj = eval(*e.a->a);
        if ((obj.is_string() || obj.is_dict() || obj.is_list()) && has_method(obj, e.a->name)) {
            return call_method(obj, e.a->name, eval_args(e));  // getattr wins over a dict key
        }
        return call(get_attr(obj, e.a->name), eval_args(e), e.a->name);
    }
    Value callee = eval(*e.a);
    return call(callee, eval_args(e), e.a->kind == Expr::Kind::name ? e.a->name : "expression");
}

Value Interp::eval_slice(const Expr & e) {
    Value obj = eval(*e.a);
    if (obj.is_undefined()) { fail(obj.undefined_hint()); }
    auto bound = [&](size_t i) -> std::optional<int64_t> {
        if (!e.items[i]) { return std::nullopt; }
        Value v = eval(*e.items[i]);
        if (v.is_none()) { return std::nullopt; }
        if (!is_intlike(v)) { fail("slice indices must be integers or None"); }
        return as_int(v);
    };
    std::optional<int64_t> start = bound(0), stop = bound(1), step_o = bound(2);
    int64_t                step = step_o.value_or(1);
    if (step == 0) { fail("slice step cannot be zero"); }
    auto pick = [&](int64_t n, auto && emit) {  // Python slice.indices
        auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
            if (!v) { return dflt; }
            int64_t x = *v < 0 ? *v + n : *v;
            if (step > 0) { return std::clamp<int64_t>(x, 0, n); }
            return std::clamp<int64_t>(x, -1, n - 1);
        };
        int64_t b = clamp(start, step > 0 ? 0 : n - 1);
        int64_t s = clamp(stop, step > 0 ? n : -1);
        for (int64_t i = b; step > 0 ? i < s : i > s; i += step) { emit(static_cast<size_t>(i)); }
    };
    if (obj.is_string()) {
        std::u32string cps = utf8_decode(obj.str()), out;
        pick(static_cast<int64_t>(cps.size()), [&](size_t i) { out += cps[i]; });
        return Value(utf8_encode(out));
    }
    if (obj.is_list() && obj.list_data().plain()) {
        const auto &       items = obj.list_data().items;
        std::vector<Value> out;
        pick(static_cast<int64_t>(items.size()), [&](size_t i) { out.push_back(items[i]); });
        return Value::list(std::move(out), obj.list_data().seq);
    }
    fail(fmt::format("'{}' object is not subscriptable", obj.type_name()));
}

Value Interp::eval_filter_chain(const Expr & e, const Value & input) {
    Value v = e.a ? eval_filter_chain(*e.a, input) : input;
    return apply_filter(*this, e.name, v, eval_args(e));
}

Value Interp::eval_binary(const Expr & e) {
    const std::string & op = e.name;
    if (op == "and") {
        Value a = eval(*e.a);
        return a.truthy() ? eval(*e.b) : a;
    }
    if (op == "or") {
        Value a = eval(*e.a);
        return a.truthy() ? a : eval(*e.b);
    }
    Value a = eval(*e.a);
    Value b = eval(*e.b);
    if (op == "~") { return Value(a.to_str() + b.to_str()); }
    if (op == "==") { return Value(a.equals(b)); }
    if (op == "!=") { return Value(!a.equals(b)); }
    if (op == "<") { return Value(a.less(b)); }
    if (op == ">") { return Value(b.less(a)); }
    if (op == "<=") { return Value(!b.less(a)); }
    if (op == ">=") { return Value(!a.less(b)); }
    if (op == "in") { return Value(contains(b, a)); }
    if (op == "not in") { return Value(!contains(b, a)); }
    return arith(op, a, b);
}

Value Interp::eval(const Expr & e) {
    const DepthGuard guard(*this);
    switch (e.kind) {
    case Expr::Kind::literal: return e.value;
    case Expr::Kind::name: return lookup(e.name);
    case Expr::Kind::list: {
        std::vector<Value> items;
        items.reserve(e.items.size());
        for (const auto & x : e.items) { items.push_back(eval(*x)); }
        return Value::list(std::move(items), e.tuple ? Seq::tuple : Seq::list);
    }
    case Expr::Kind::dict: {
        std::vector<std::pair<std::string, Value>> items;
        for (size_t i = 0; i < e.items.size(); ++i) {
            Value k = eval(*e.keys[i]);
            if (!k.is_string()) { fail("only string keys are supported in dict literals"); }
            Value v = eval(*e.items[i]);
            bool  replaced = false;
            for (auto & kv : items) {
                if (kv.first == k.str()) {
                    kv.second = v;
                    replaced  = true;
                }
            }
            if (!replaced) { items.emplace_back(k.str(), std::move(v)); }
        }
        return Value::dict(std::move(items));
    }
    case Expr::Kind::attr: return get_attr(eval(*e.a), e.name);
    case Expr::Kind::item: return get_item(eval(*e.a), eval(*e.b));
    case Expr::Kind::slice: return eval_slice(e);
    case Expr::Kind::call: return eval_call(e);
    case Expr::Kind::filter: return apply_filter(*this, e.name, eval(*e.a), eval_args(e));
    case Expr::Kind::test: {
        bool r = apply_test(*this, e.name, eval(*e.a), eval_args(e));
        return Value(e.negated ? !r : r);
    }
    case Expr::Kind::unary: {
        Value a = eval(*e.a);
        if (e.name == "not") { return Value(!a.truthy()); }
        if (a.is_undefined()) { fail(a.undefined_hint()); }
        if (!a.is_number()) { fail(fmt::format("bad operand type for unary {}: '{}'", e.name, a.type_name())); }
        if (e.name == "+") { return a.is_bool() ? Value(as_int(a)) : a; }
        return a.is_float() ? Value(-a.get_float()) : Value(-as_int(a));
    }
    case Expr::Kind::binary: return eval_binary(e);
    case Expr::Kind::condexpr:
        if (eval(*e.a).truthy()) { return eval(*e.b); }
        return e.c ? eval(*e.c) : Value::undefined("the inline if-expression evaluated to false and no else section was defined");
    }
    return Value();
}

}  // namespace fd::tokenizer::jinja
