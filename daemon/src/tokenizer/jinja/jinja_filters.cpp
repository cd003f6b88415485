// jinja2's builtin filters and tests (jinja2/filters.py, jinja2/tests.py) that chat templates
// use, plus transformers' tojson override (json.dumps, ensure_ascii=False, keys in order).
#include "jinja_interp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fd::tokenizer::jinja {
namespace {

const Value kNone{NoneT{}};
const Value kUndef{};

Value lower_if_str(const Value & v, bool case_sensitive) {
    if (case_sensitive || !v.is_string()) { return v; }
    std::string s = v.str();
    for (char & c : s) {
        if (c >= 'A' && c <= 'Z') { c = static_cast<char>(c + 32); }
    }
    return Value(std::move(s));
}

/// jinja2 make_attrgetter: "a.b.0" looked up item-wise.
Value attr_path(const Value & v, const Value & attribute) {
    if (attribute.is_int()) { return get_item(v, attribute); }
    const std::string & path = attribute.str();
    Value               cur  = v;
    size_t              b    = 0;
    for (;;) {
        size_t      e    = path.find('.', b);
        std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
        Value       key  = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit) ? Value(static_cast<int64_t>(std::stoll(part))) : Value(part);
        cur              = get_item(cur, key);
        if (e == std::string::npos) { return cur; }
        b = e + 1;
    }
}

/// select/reject/selectattr/rejectattr.
Value select(Interp & in, const Value & seq, const Args & a, bool by_attr, bool keep) {
    size_t first_test_arg = by_attr ? 1 : 0;
    Value  attribute      = by_attr ? a.get(0, "", kUndef) : kUndef;
    if (by_attr && !attribute.is_string()) { fail("selectattr/rejectattr need an attribute name"); }
    std::string test = a.pos.size() > first_test_arg ? a.pos[first_test_arg].to_str() : std::string();
    Args        targs;
    for (size_t i = first_test_arg + 1; i < a.pos.size(); ++i) { targs.pos.push_back(a.pos[i]); }
    std::vector<Value> out;
    if (!seq.truthy()) { return Value::list({}, Seq::generator); }  // jinja2: `if seq:` before iterating
    for (const auto & item : seq.iterate()) {
        Value x  = by_attr ? attr_path(item, attribute) : item;
        bool  ok = test.empty() ? x.truthy() : apply_test(in, test, x, targs);
        if (ok == keep) { out.push_back(item); }
    }
    return Value::list(std::move(out), Seq::generator);
}

std::vector<Value> sorted(std::vector<Value> items, bool reverse, bool case_sensitive, const Value & attribute) {
    auto key = [&](const Value & v) { return lower_if_str(attribute.is_undefined() || attribute.is_none() ? v : attr_path(v, attribute), case_sensitive); };
    std::stable_sort(items.begin(), items.end(), [&](const Value & x, const Value & y) {
        return reverse ? key(y).less(key(x)) : key(x).less(key(y));
    });
    return items;
}

int64_t to_int(const Value & v, const Value & dflt, int64_t base) {
    if (v.is_int()) { return v.get_int(); }
    if (v.is_bool()) { return v.get_bool(); }
    if (v.is_float()) { return static_cast<int64_t>(v.get_float()); }
    if (v.is_string()) {
        std::string s;
        for (char c : py_strip(v.str(), kNone, true, true)) {
            if (c != '_') { s += c; }
        }
        try {
            size_t  n = 0;
            int64_t r = std::stoll(s, &n, static_cast<int>(base));
            if (n == s.size()) { return r; }
        } catch (const std::exception &) {
        }
        try {
            size_t n = 0;
            double d = std::stod(s, &n);
            if (n == s.size()) { return static_cast<int64_t>(d); }
        } catch (const std::exception &) {
        }
    }
    return dflt.is_int() ? dflt.get_int() : 0;
}

std::string html_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
        }
    }
    return out;
}

/// Python's `x % 2` etc. for the number tests; other types fail as Python does.
double py_mod(const Value & v, double m) {
    if (!v.is_number()) {
        if (v.is_undefined()) { fail(v.undefined_hint()); }
        fail(fmt::format("unsupported operand type(s) for %: '{}' and 'int'", v.type_name()));
    }
    if (m == 0) { fail("integer division or modulo by zero"); }
    double x = v.number();
    return x - std::floor(x / m) * m;
}

Value lazy_filter(Interp & in, const std::string & f, const Value & v, const Args & a);
/// The eager filters other than abs/round.
Value apply_filter_rest(Interp & in, const std::string & f, const Value & v, const Args & a);

}  // namespace

Value apply_filter(Interp & in, const std::string & f, const Value & v, const Args & a) {
    // jinja2's lazy filters return generators: always truthy, no len(), and errors from a bad
    // input surface only when the result is consumed.
    if (f == "map" || f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr" || f == "items" || f == "unique" ||
        f == "batch") {
        try {
            return lazy_filter(in, f, v, a);
        } catch (const RenderError & e) {
            return Value::broken_generator(e.what());
        }
    }
    if ((f == "int" || f == "float" || f == "abs" || f == "round" || f == "indent") && v.is_undefined()) { fail(v.undefined_hint()); }
    if (f == "trim") { return Value(py_strip(v.to_str(), a.get(0, "chars", kNone), true, true)); }
    if (f == "tojson") {
        a.check(f, 1, {"indent", "ensure_ascii", "separators", "sort_keys"});
        const Value & ind = a.get(0, "indent", kNone);
        if (!a.get(99, "sort_keys", Value(false)).is_bool() || a.get(99, "sort_keys", Value(false)).truthy()) { fail("tojson(sort_keys=True) is not supported"); }
        if (!a.get(99, "separators", kNone).is_none()) { fail("tojson(separators=...) is not supported"); }
        if (a.get(99, "ensure_ascii", Value(false)).truthy()) { fail("tojson(ensure_ascii=True) is not supported"); }
        if (!ind.is_none() && !ind.is_int()) { fail("tojson indent must be an integer"); }
        return Value(v.to_json_text(ind.is_int() ? static_cast<int>(ind.get_int()) : -1));
    }
    if (f == "length" || f == "count") { return Value(v.length()); }
    if (f == "lower" || f == "upper" || f == "capitalize") { return call_method(Value(v.to_str()), f, Args{}); }
    if (f == "title") {  // jinja2 do_title: words begin after [-\s({\[<]
        std::u32string cps   = utf8_decode(v.to_str());
        bool           start = true;
        for (char32_t & c : cps) {
            bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
            if (!sep) { c = start ? (c >= 'a' && c <= 'z' ? c - 32 : c) : (c >= 'A' && c <= 'Z' ? c + 32 : c); }
            start = sep;
        }
        return Value(utf8_encode(cps));
    }
    if (f == "default" || f == "d") {
        const bool boolean = a.get(1, "boolean", Value(false)).truthy();
        if (v.is_undefined() || (boolean && !v.truthy())) { return a.get(0, "default_value", Value("")); }
        return v;
    }
    if (f == "join") {
        std::string   sep  = a.get(0, "d", Value("")).to_str();
        const Value & attr = a.get(1, "attribute", kNone);
        std::string   out;
        bool          first = true;
        for (const auto & x : v.iterate()) {
            if (!first) { out += sep; }
            first = false;
            out += (attr.is_none() ? x : attr_path(x, attr)).to_str();
        }
        return Value(std::move(out));
    }
    if (f == "first" || f == "last") {
        if (f == "last" && v.is_list() && v.list_data().seq == Seq::generator) { fail("'generator' object is not reversible"); }
        std::vector<Value> items = v.iterate();
        if (items.empty()) { return Value::undefined(fmt::format("No {} item, sequence was empty.", f)); }
        return f == "first" ? items.front() : items.back();
    }
    if (f == "list") { return Value::list(v.iterate()); }
    if (f == "abs") {
        if (v.is_int() || v.is_bool()) {
            int64_t x = v.is_bool() ? v.get_bool() : v.get_int();
            return Value(x < 0 ? -x : x);
        }
        if (!v.is_float()) { fail(fmt::format("bad operand type for abs(): '{}'", v.type_name())); }
        return Value(std::fabs(v.get_float()));
    }
    if (f == "round") {
        int64_t     prec   = a.get(0, "precision", Value(0)).get_int();
        std::string method = a.get(1, "method", Value("common")).to_str();
        if (!v.is_number()) { fail(fmt::format("type {} doesn't define __round__ method", v.type_name())); }
        if (method == "common" && !v.is_float()) { return Value(v.is_bool() ? int64_t{v.get_bool()} : v.get_int()); }
        double m = std::pow(10.0, static_cast<double>(prec));
        double x = v.number() * m;
        if (method == "common") {  // Python round(): half to even
            double r = std::nearbyint(x);
            x        = r;
        } else {
            x = method == "ceil" ? std::ceil(x) : std::floor(x);
        }
        return Value(x / m);
    }
    return apply_filter_rest(in, f, v, a);
}

namespace {

Value lazy_filter(Interp & in, const std::string & f, const Value & v, const Args & a) {
    if (f == "items") {
        if (v.is_undefined()) { return Value::list({}, Seq::generator); }
        if (!v.is_dict()) { fail("Can only get item pairs from a mapping."); }
        return Value::list(call_method(v, "items", Args{}).list_data().items, Seq::generator);
    }
    if (f == "batch") {
        int64_t n = a.get(0, "linecount", Value(1)).get_int();
        if (n <= 0) { fail("batch size must be positive"); }
        const Value        fill = a.get(1, "fill_with", kNone);
        std::vector<Value> out, cur;
        for (const auto & x : v.iterate()) {
            cur.push_back(x);
            if (static_cast<int64_t>(cur.size()) == n) {
                out.push_back(Value::list(std::move(cur)));
                cur.clear();
            }
        }
        if (!cur.empty()) {
            if (!fill.is_none()) {
                while (static_cast<int64_t>(cur.size()) < n) { cur.push_back(fill); }
            }
            out.push_back(Value::list(std::move(cur)));
        }
        return Value::list(std::move(out), Seq::generator);
    }
    if (f == "map") {
        std::vector<Value> out;
        if (!v.truthy()) { return Value::list({}, Seq::generator); }  // jinja2: `if value:` before iterating
        const Value &      attribute = a.get(99, "attribute", kUndef);
        if (!attribute.is_undefined()) {
            const Value & dflt = a.get(99, "default", kUndef);
            for (const auto & x : v.iterate()) {
                Value r = attr_path(x, attribute);
                out.push_back(r.is_undefined() && !dflt.is_undefined() ? dflt : r);
            }
        } else {
            if (a.pos.empty()) { fail("map requires a filter argument"); }
            std::string name = a.pos[0].to_str();
            Args        fargs;
            fargs.pos.assign(a.pos.begin() + 1, a.pos.end());
            fargs.kw = a.kw;
            for (const auto & x : v.iterate()) { out.push_back(apply_filter(in, name, x, fargs)); }
        }
        return Value::list(std::move(out), Seq::generator);
    }
    if (f == "selectattr" || f == "rejectattr") { return select(in, v, a, true, f == "selectattr"); }
    if (f == "select" || f == "reject") { return select(in, v, a, false, f == "select"); }
    if (f == "unique") {
        const bool         cs   = a.get(0, "case_sensitive", Value(false)).truthy();
        const Value &      attr = a.get(1, "attribute", kNone);
        std::vector<Value> out, seen;
        for (const auto & x : v.iterate()) {
            Value k = lower_if_str(attr.is_none() ? x : attr_path(x, attr), cs);
            if (std::none_of(seen.begin(), seen.end(), [&](const Value & s) { return s.equals(k); })) {
                seen.push_back(k);
                out.push_back(x);
            }
        }
        return Value::list(std::move(out), Seq::generator);
    }
    fail(fmt::format("no filter named '{}'", f));
}

Value apply_filter_rest(Interp & in, const std::string & f, const Value & v, const Args & a) {
    if (f == "string") { return Value(v.to_str()); }
    if (f == "int") { return Value(to_int(v, a.get(0, "default", Value(0)), a.get(1, "base", Value(10)).get_int())); }
    if (f == "float") {
        if (v.is_number()) { return Value(v.number()); }
        try {
            size_t      n = 0;
            std::string s = py_strip(v.to_str(), kNone, true, true);
            double      d = std::stod(s, &n);
            if (n == s.size()) { return Value(d); }
        } catch (const std::exception &) {
        }
        return a.get(0, "default", Value(0.0));
    }
    if (f == "replace") {
        Args ra;
        ra.pos = {a.get(0, "old", kUndef), a.get(1, "new", kUndef), a.get(2, "count", Value(-1))};
        if (ra.pos[2].is_none()) { ra.pos[2] = Value(-1); }
        return call_method(Value(v.to_str()), "replace", ra);
    }
    if (f == "safe") { return Value(v.to_str()); }  // Markup(str(value))
    if (f == "escape" || f == "e" || f == "forceescape") { return Value(html_escape(v.to_str())); }
    if (f == "reverse" && !v.is_string()) {  // reversed(): eager, fails at once on a non-sequence
        if (!(v.is_list() || v.is_dict() || v.is_undefined())) { fail("argument must be iterable"); }
        std::vector<Value> items = v.iterate();
        std::reverse(items.begin(), items.end());
        return Value::list(std::move(items), Seq::generator);
    }
    if (f == "reverse") {
        std::u32string cps = utf8_decode(v.str());
        std::reverse(cps.begin(), cps.end());
        return Value(utf8_encode(cps));
    }
    if (f == "sort") {
        return Value::list(sorted(v.iterate(), a.get(0, "reverse", Value(false)).truthy(), a.get(1, "case_sensitive", Value(false)).truthy(),
                                  a.get(2, "attribute", kNone)));
    }
    if (f == "dictsort") {
        if (!v.is_dict()) { fail("dictsort requires a mapping"); }
        const bool cs      = a.get(0, "case_sensitive", Value(false)).truthy();
        const bool by_val  = a.get(1, "by", Value("key")).to_str() == "value";
        const bool reverse = a.get(2, "reverse", Value(false)).truthy();
        Value      pairs   = call_method(v, "items", Args{});
        return Value::list(sorted(pairs.list_data().items, reverse, cs, Value(static_cast<int64_t>(by_val ? 1 : 0))));
    }
    if (f == "min" || f == "max") {
        std::vector<Value> items = sorted(v.iterate(), false, a.get(0, "case_sensitive", Value(false)).truthy(), a.get(1, "attribute", kNone));
        if (items.empty()) { return Value::undefined(fmt::format("No aggregated item, sequence was empty.")); }
        return f == "min" ? items.front() : items.back();
    }
    if (f == "sum") {
        const Value & attr = a.get(0, "attribute", kNone);
        Value         acc  = a.get(1, "start", Value(0));
        for (const auto & x : v.iterate()) {
            Value y = attr.is_none() ? x : attr_path(x, attr);
            if (!acc.is_number() || !y.is_number()) { fail("sum of non-numbers"); }
            acc = acc.is_int() && y.is_int() ? Value(acc.get_int() + y.get_int()) : Value(acc.number() + y.number());
        }
        return acc;
    }
    if (f == "indent") {
        if (!v.is_string()) { fail(fmt::format("unsupported operand type(s) for +=: '{}' and 'str'", v.type_name())); }
        const Value & w     = a.get(0, "width", Value(4));
        std::string   pad   = w.is_string() ? w.str() : std::string(static_cast<size_t>(w.get_int()), ' ');
        const bool    first = a.get(1, "first", Value(false)).truthy();
        const bool    blank = a.get(2, "blank", Value(false)).truthy();
        std::string   s     = v.to_str(), out;
        size_t        b     = 0;
        bool          is_first = true;
        for (;;) {
            size_t      e    = s.find('\n', b);
            std::string line = s.substr(b, e == std::string::npos ? std::string::npos : e - b);
            if ((is_first && first) || (!is_first && (blank || !line.empty()))) { out += pad; }
            out += line;
            if (e == std::string::npos) { break; }
            out += '\n';
            b        = e + 1;
            is_first = false;
        }
        return Value(std::move(out));
    }
    if (f == "wordcount") {  // len(re.findall(r"\w+", str(v)))
        int64_t n       = 0;
        bool    in_word = false;
        for (char32_t c : utf8_decode(v.to_str())) {
            bool w = c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0xAA;
            n += w && !in_word;
            in_word = w;
        }
        return Value(n);
    }
    if (f == "attr") { return get_attr(v, a.get(0, "name", kUndef).to_str()); }
    fail(fmt::format("no filter named '{}'", f));
}

}  // namespace

bool apply_test(Interp & in, const std::string & t, const Value & v, const Args & a) {
    (void) in;
    const Value & x = a.get(0, "", kUndef);
    if (t == "defined") { return !v.is_undefined(); }
    if (t == "undefined") { return v.is_undefined(); }
    if (t == "none") { return v.is_none(); }
    if (t == "boolean") { return v.is_bool(); }
    if (t == "true") { return v.is_bool() && v.get_bool(); }
    if (t == "false") { return v.is_bool() && !v.get_bool(); }
    if (t == "integer") { return v.is_int(); }
    if (t == "float") { return v.is_float(); }
    if (t == "number") { return v.is_number(); }
    if (t == "string") { return v.is_string(); }
    if (t == "mapping") { return v.is_dict(); }
    if (t == "iterable") { return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict(); }
    if (t == "sequence") { return v.is_undefined() || v.is_string() || (v.is_list() && v.list_data().plain()) || v.is_dict(); }
    if (t == "callable") { return v.is_callable() || v.is_undefined(); }  // jinja2's Undefined defines __call__
    if (t == "eq" || t == "equalto" || t == "==") { return v.equals(x); }
    if (t == "ne" || t == "!=") { return !v.equals(x); }
    if (t == "lt" || t == "lessthan" || t == "<") { return v.less(x); }
    if (t == "le" || t == "<=") { return !x.less(v); }
    if (t == "gt" || t == "greaterthan" || t == ">") { return x.less(v); }
    if (t == "ge" || t == ">=") { return !v.less(x); }
    if (t == "in") { return contains(x, v); }
    if (t == "sameas") { return v.kind() == x.kind() && v.equals(x) && (v.is_none() || v.is_bool() || v.is_undefined() || v.is_object()); }
    if (t == "odd") { return py_mod(v, 2) == 1; }
    if (t == "even") { return py_mod(v, 2) == 0; }
    if (t == "divisibleby") {
        if (!x.is_number()) { fail("divisibleby needs a number"); }
        return py_mod(v, x.number()) == 0;
    }
    if (t == "lower" || t == "upper") {
        std::string s = v.to_str();
        return call_method(Value(s), t == "lower" ? "islower" : "isupper", Args{}).get_bool();
    }
    if (t == "escaped") { return false; }
    fail(fmt::format("no test named '{}'", t));
}

}  // namespace fd::tokenizer::jinja
