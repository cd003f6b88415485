// Jinja built-ins that are Python, not jinja2: attribute and item access as the sandboxed
// environment does them, the str/dict/list methods templates call, `in`, and the globals
// (range, namespace, dict, raise_exception, strftime_now — the last two are transformers').
#include "jinja_interp.h"

#include <fmt/format.h>
#include <fmt/printf.h>

#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>

namespace fd::tokenizer::jinja {
namespace {

struct NamespaceObject : Object {
    std::vector<std::pair<std::string, Value>> attrs;

    Value attr(const std::string & n) const override {
        for (const auto & kv : attrs) {
            if (kv.first == n) { return kv.second; }
        }
        return Value::undefined(fmt::format("'Namespace object' has no attribute '{}'", n));
    }
    void set_attr(const std::string & n, Value v) override {
        for (auto & kv : attrs) {
            if (kv.first == n) {
                kv.second = std::move(v);
                return;
            }
        }
        attrs.emplace_back(n, std::move(v));
    }
    std::string repr() const override { return "<Namespace " + Value::dict(attrs).repr() + ">"; }
};

Value make_fn(std::string name, std::function<Value(const Args &)> fn) {
    auto c  = std::make_shared<Callable>();
    c->name = std::move(name);
    c->fn   = std::move(fn);
    return Value(std::shared_ptr<const Callable>(std::move(c)));
}

const Value kNone{NoneT{}};
const Value kUndef{};

const std::string & need_str(const Value & v, const char * what) {
    if (!v.is_string()) { fail(fmt::format("{} must be str, not {}", what, v.type_name())); }
    return v.str();
}

// Unicode simple case mapping and categories (utf8proc); Python's str methods use the same
// tables except for the few full mappings (ß → SS), which stay unchanged here.
char32_t ascii_upper(char32_t c) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); }
char32_t ascii_lower(char32_t c) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); }
bool     is_alpha(char32_t c) {
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
    return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}
bool is_cased_upper(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LU; }
bool is_cased_lower(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LL; }

std::vector<Value> py_split(const std::string & s, const Value & sep, int64_t maxsplit) {
    std::vector<Value> out;
    if (sep.is_none() || sep.is_undefined()) {
        std::u32string cps = utf8_decode(s);
        size_t         i   = 0;
        while (i < cps.size()) {
            while (i < cps.size() && is_py_space(cps[i])) { ++i; }
            if (i >= cps.size()) { break; }
            if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {  // the rest as is
                out.emplace_back(utf8_encode(cps.substr(i)));
                return out;
            }
            size_t b = i;
            while (i < cps.size() && !is_py_space(cps[i])) { ++i; }
            out.emplace_back(utf8_encode(cps.substr(b, i - b)));
        }
        return out;
    }
    const std::string & d = need_str(sep, "separator");
    if (d.empty()) { fail("empty separator"); }
    size_t b = 0;
    for (size_t p = s.find(d); p != std::string::npos; p = s.find(d, b)) {
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) { break; }
        out.emplace_back(s.substr(b, p - b));
        b = p + d.size();
    }
    out.emplace_back(s.substr(b));
    return out;
}

std::string py_replace(const std::string & s, const std::string & old, const std::string & rep, int64_t count) {
    if (old.empty()) {
        std::u32string cps = utf8_decode(s);
        std::string    out;
        int64_t        n = 0;
        for (size_t i = 0; i <= cps.size(); ++i) {
            if (count < 0 || n < count) {
                out += rep;
                ++n;
            }
            if (i < cps.size()) { out += utf8_encode(cps.substr(i, 1)); }
        }
        return out;
    }
    std::string out;
    size_t      b = 0;
    int64_t     n = 0;
    for (size_t p = s.find(old); p != std::string::npos && (count < 0 || n < count); p = s.find(old, b), ++n) {
        out.append(s, b, p - b);
        out += rep;
        b = p + old.size();
    }
    out.append(s, b);
    return out;
}

/// str.format with {} / {0} / {name} fields (no format specs).
std::string py_format(const std::string & f, const Args & a) {
    std::string out;
    size_t      auto_i = 0;
    for (size_t i = 0; i < f.size(); ++i) {
        char c = f[i];
        if (c == '{' && i + 1 < f.size() && f[i + 1] == '{') {
            out += '{';
            ++i;
        } else if (c == '}' && i + 1 < f.size() && f[i + 1] == '}') {
            out += '}';
            ++i;
        } else if (c == '{') {
            size_t e = f.find('}', i);
            if (e == std::string::npos) { fail("Single '{' encountered in format string"); }
            std::string field = f.substr(i + 1, e - i - 1);
            if (field.find(':') != std::string::npos || field.find('!') != std::string::npos) { fail("format specs are not supported in str.format"); }
            const Value * v = nullptr;
            if (field.empty()) {
                if (auto_i < a.pos.size()) { v = &a.pos[auto_i++]; }
            } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
                size_t k = std::stoul(field);
                if (k < a.pos.size()) { v = &a.pos[k]; }
            } else {
                for (const auto & kv : a.kw) {
                    if (kv.first == field) { v = &kv.second; }
                }
            }
            if (!v) { fail(fmt::format("Replacement index {} out of range for positional args tuple", field)); }
            out += v->to_str();
            i = e;
        } else {
            out += c;
        }
    }
    return out;
}

Value str_method(const std::string & s, const std::string & m, const Args & a) {
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
        a.check(m, 1, {});
        return Value(py_strip(s, a.get(0, "", kNone), m != "rstrip", m != "lstrip"));
    }
    if (m == "split" || m == "rsplit") {
        a.check(m, 2, {"sep", "maxsplit"});
        const Value & mx = a.get(1, "maxsplit", Value(-1));
        if (!mx.is_int()) { fail("maxsplit must be an integer"); }
        if (m == "rsplit" && mx.get_int() >= 0) {  // split the reversed string, reverse back
            auto rev = [](const std::string & x) {
                std::u32string c = utf8_decode(x);
                std::reverse(c.begin(), c.end());
                return utf8_encode(c);
            };
            Value sep = a.get(0, "sep", kNone);
            if (sep.is_string()) { sep = Value(rev(sep.str())); }
            std::vector<Value> parts = py_split(rev(s), sep, mx.get_int());
            std::reverse(parts.begin(), parts.end());
            for (auto & p : parts) { p = Value(rev(p.str())); }
            return Value::list(std::move(parts));
        }
        return Value::list(py_split(s, a.get(0, "sep", kNone), mx.get_int()));
    }
    if (m == "startswith" || m == "endswith") {
        a.check(m, 1, {});
        const Value &      p = a.get(0, "", kUndef);
        std::vector<Value> options = p.is_list() ? p.list_data().items : std::vector<Value>{p};
        for (const auto & o : options) {
            const std::string & x = need_str(o, m.c_str());
            bool hit = m == "startswith" ? s.compare(0, x.size(), x) == 0 && s.size() >= x.size()
                                         : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
            if (hit) { return Value(true); }
        }
        return Value(false);
    }
    if (m == "upper" || m == "lower" || m == "title" || m == "capitalize" || m == "swapcase") {
        std::u32string cps = utf8_decode(s);
        bool           prev_cased = false;
        for (size_t i = 0; i < cps.size(); ++i) {
            char32_t & c = cps[i];
            if (m == "upper") {
                c = ascii_upper(c);
            } else if (m == "lower") {
                c = ascii_lower(c);
            } else if (m == "capitalize") {
                c = i == 0 ? ascii_upper(c) : ascii_lower(c);
            } else if (m == "swapcase") {
                c = is_cased_lower(c) ? ascii_upper(c) : ascii_lower(c);
            } else {
                bool alpha = is_alpha(c);
                c          = alpha ? (prev_cased ? ascii_lower(c) : ascii_upper(c)) : c;
                prev_cased = alpha;
            }
        }
        return Value(utf8_encode(cps));
    }
    if (m == "replace") {
        a.check(m, 3, {});
        const Value & n = a.get(2, "", Value(-1));
        return Value(py_replace(s, need_str(a.get(0, "", kUndef), "replace() argument 1"), need_str(a.get(1, "", kUndef), "replace() argument 2"), n.get_int()));
    }
    if (m == "format") { return Value(py_format(s, a)); }
    if (m == "join") {
        std::string out;
        bool        first = true;
        for (const auto & v : a.get(0, "", kUndef).iterate()) {
            if (!first) { out += s; }
            first = false;
            out += need_str(v, "sequence item");
        }
        return Value(std::move(out));
    }
    if (m == "find" || m == "rfind" || m == "index" || m == "count") {
        const std::string & x = need_str(a.get(0, "", kUndef), m.c_str());
        if (m == "count") {
            if (x.empty()) { return Value(static_cast<int64_t>(utf8_decode(s).size() + 1)); }
            int64_t n = 0;
            for (size_t p = s.find(x); p != std::string::npos; p = s.find(x, p + x.size())) { ++n; }
            return Value(n);
        }
        size_t p = m == "rfind" ? s.rfind(x) : s.find(x);
        if (p == std::string::npos) {
            if (m == "index") { fail("substring not found"); }
            return Value(-1);
        }
        return Value(static_cast<int64_t>(utf8_decode(s.substr(0, p)).size()));
    }
    if (m == "splitlines") {
        std::vector<Value> out;
        size_t             b = 0;
        for (size_t i = 0; i < s.size(); ++i) {
            if (s[i] == '\n' || s[i] == '\r') {
                out.emplace_back(s.substr(b, i - b));
                if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') { ++i; }
                b = i + 1;
            }
        }
        if (b < s.size()) { out.emplace_back(s.substr(b)); }
        return Value::list(std::move(out));
    }
    std::u32string cps = utf8_decode(s);
    auto all = [&](auto pred) { return Value(!cps.empty() && std::all_of(cps.begin(), cps.end(), pred)); };
    if (m == "isdigit") { return all([](char32_t c) { return c >= '0' && c <= '9'; }); }
    if (m == "isalpha") { return all(is_alpha); }
    if (m == "isalnum") { return all([](char32_t c) { return is_alpha(c) || (c >= '0' && c <= '9'); }); }
    if (m == "isspace") { return all(is_py_space); }
    if (m == "isupper") { return Value(std::any_of(cps.begin(), cps.end(), is_cased_upper) && std::none_of(cps.begin(), cps.end(), is_cased_lower)); }
    if (m == "islower") { return Value(std::any_of(cps.begin(), cps.end(), is_cased_lower) && std::none_of(cps.begin(), cps.end(), is_cased_upper)); }
    fail(fmt::format("'str' object has no attribute '{}'", m));
}

const char * const kStrMethods[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "upper", "lower",
                                    "title", "capitalize", "swapcase", "replace", "format", "join", "find", "rfind", "index",
                                    "count", "splitlines", "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower"};
const char * const kDictMethods[]   = {"items", "keys", "values", "get", "copy"};
const char * const kListMethods[]   = {"index", "count", "copy"};
const char * const kUnsafeMethods[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear",
                                       "update", "setdefault", "popitem"};

template <size_t N>
bool in_list(const char * const (&names)[N], const std::string & n) {
    return std::any_of(std::begin(names), std::end(names), [&](const char * x) { return n == x; });
}

}  // namespace

std::string py_percent_format(const std::string & f, const Value & args) {
    std::vector<Value> pos;
    if (args.is_list() && args.list_data().tuple()) {
        pos = args.list_data().items;
    } else {
        pos.push_back(args);
    }
    // Python takes any non-tuple, non-str argument with __getitem__ as a mapping.
    const bool  mapping = args.is_dict() || args.is_undefined() || (args.is_list() && args.list_data().plain() && !args.list_data().tuple());
    size_t      next    = 0;
    std::string out;
    for (size_t i = 0; i < f.size(); ++i) {
        if (f[i] != '%') {
            out += f[i];
            continue;
        }
        size_t j = i + 1;
        std::string spec = "%";
        while (j < f.size() && std::strchr("-+ #0", f[j])) { spec += f[j++]; }
        while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) { spec += f[j++]; }
        if (j < f.size() && f[j] == '.') {
            spec += f[j++];
            while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) { spec += f[j++]; }
        }
        if (j >= f.size()) { fail("incomplete format"); }
        const char conv = f[j];
        i               = j;
        if (conv == '%') {
            out += '%';
            continue;
        }
        if (mapping && args.is_dict()) { fail("format requires a mapping key"); }
        if (next >= pos.size()) { fail("not enough arguments for format string"); }
        const Value & v = pos[next++];
        if (v.is_undefined()) { fail(v.undefined_hint()); }
        if (conv == 's' || conv == 'r') {
            std::string s = conv == 's' ? v.to_str() : v.repr();
            out += fmt::sprintf(spec + "s", s);
        } else if (conv == 'd' || conv == 'i') {
            if (!v.is_number()) { fail(fmt::format("%{} format: a real number is required, not {}", conv, v.type_name())); }
            int64_t x = v.is_float() ? static_cast<int64_t>(std::trunc(v.get_float())) : (v.is_bool() ? v.get_bool() : v.get_int());
            out += fmt::sprintf(spec + "lld", static_cast<long long>(x));
        } else if (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'g') {
            if (!v.is_number()) { fail(fmt::format("must be real number, not {}", v.type_name())); }
            out += fmt::sprintf(spec + conv, v.number());
        } else {
            fail(fmt::format("unsupported format character '{}'", conv));
        }
    }
    if (next < pos.size() && !mapping) { fail("not all arguments converted during string formatting"); }
    return out;
}

std::string py_strip(const std::string & s, const Value & chars, bool left, bool right) {
    std::u32string cps = utf8_decode(s);
    std::u32string set;
    const bool     ws = chars.is_none() || chars.is_undefined();
    if (!ws) { set = utf8_decode(need_str(chars, "strip arg")); }
    auto   strip_it = [&](char32_t c) { return ws ? is_py_space(c) : set.find(c) != std::u32string::npos; };
    size_t b = 0, e = cps.size();
    if (left) {
        while (b < e && strip_it(cps[b])) { ++b; }
    }
    if (right) {
        while (e > b && strip_it(cps[e - 1])) { --e; }
    }
    if (b == 0 && e == cps.size()) { return s; }
    return utf8_encode(std::u32string_view(cps).substr(b, e - b));
}

bool has_method(const Value & obj, const std::string & name) {
    if (obj.is_string()) { return in_list(kStrMethods, name); }
    if (obj.is_dict()) { return in_list(kDictMethods, name) || in_list(kUnsafeMethods, name); }
    if (obj.is_list()) { return in_list(kListMethods, name) || in_list(kUnsafeMethods, name); }
    return false;
}

Value call_method(const Value & obj, const std::string & m, const Args & a) {
    if (in_list(kUnsafeMethods, m) && (obj.is_dict() || obj.is_list())) {
        fail(fmt::format("access to attribute '{}' of '{}' object is unsafe.", m, obj.type_name()));
    }
    if (obj.is_string()) { return str_method(obj.str(), m, a); }
    if (obj.is_dict()) {
        const auto & d = obj.dict_data();
        if (m == "items") {
            std::vector<Value> out;
            for (const auto & [k, v] : d.items) { out.push_back(Value::list({Value(k), v}, Seq::tuple)); }
            return Value::list(std::move(out), Seq::dict_items);
        }
        if (m == "keys") { return Value::list(obj.iterate(), Seq::dict_keys); }
        if (m == "values") {
            std::vector<Value> out;
            for (const auto & kv : d.items) { out.push_back(kv.second); }
            return Value::list(std::move(out), Seq::dict_values);
        }
        if (m == "get") {
            const Value & k = a.get(0, "", kUndef);
            const Value * v = k.is_string() ? d.find(k.str()) : nullptr;
            return v ? *v : a.get(1, "", kNone);
        }
        if (m == "copy") { return obj; }
    }
    if (obj.is_list()) {
        const auto & items = obj.list_data().items;
        if (m == "copy") { return obj; }
        const Value & x = a.get(0, "", kUndef);
        int64_t       n = 0;
        for (size_t i = 0; i < items.size(); ++i) {
            if (items[i].equals(x)) {
                if (m == "index") { return Value(static_cast<int64_t>(i)); }
                ++n;
            }
        }
        if (m == "index") { fail(fmt::format("{} is not in list", x.repr())); }
        return Value(n);
    }
    fail(fmt::format("'{}' object has no attribute '{}'", obj.type_name(), m));
}

Value get_attr(const Value & obj, const std::string & name) {
    switch (obj.kind()) {
    case Value::Kind::undefined: fail(obj.undefined_hint());
    case Value::Kind::object: return obj.object().attr(name);
    case Value::Kind::dict:
        if (has_method(obj, name)) { break; }
        if (const Value * v = obj.dict_data().find(name)) { return *v; }
        return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name));
    default: break;
    }
    if (has_method(obj, name)) {
        return make_fn(name, [obj, name](const Args & a) { return call_method(obj, name, a); });
    }
    return Value::undefined(fmt::format("'{} object' has no attribute '{}'", obj.type_name(), name));
}

Value get_item(const Value & obj, const Value & key) {
    switch (obj.kind()) {
    case Value::Kind::undefined: fail(obj.undefined_hint());
    case Value::Kind::dict:
        if (key.is_string()) {
            if (const Value * v = obj.dict_data().find(key.str())) { return *v; }
            if (has_method(obj, key.str())) { return get_attr(obj, key.str()); }
        }
        return Value::undefined(fmt::format("'dict object' has no attribute {}", key.repr()));
    case Value::Kind::list:
    case Value::Kind::string: {
        if (key.is_string()) { return get_attr(obj, key.str()); }
        if (obj.is_list() && !obj.list_data().plain()) { fail(fmt::format("'{}' object is not subscriptable", obj.type_name())); }
        if (!key.is_int() && !key.is_bool()) { return Value::undefined(fmt::format("'{} object' has no attribute {}", obj.type_name(), key.repr())); }
        int64_t i = key.is_bool() ? int64_t{key.get_bool()} : key.get_int();
        if (obj.is_list()) {
            const auto & items = obj.list_data().items;
            int64_t      n     = static_cast<int64_t>(items.size());
            if (i < 0) { i += n; }
            if (i < 0 || i >= n) { return Value::undefined(fmt::format("list object has no element {}", key.repr())); }
            return items[static_cast<size_t>(i)];
        }
        std::u32string cps = utf8_decode(obj.str());
        int64_t        n   = static_cast<int64_t>(cps.size());
        if (i < 0) { i += n; }
        if (i < 0 || i >= n) { return Value::undefined(fmt::format("str object has no element {}", key.repr())); }
        return Value(utf8_encode(cps.substr(static_cast<size_t>(i), 1)));
    }
    case Value::Kind::object:
        if (key.is_string()) { return obj.object().attr(key.str()); }
        [[fallthrough]];
    default: return Value::undefined(fmt::format("'{} object' has no attribute {}", obj.type_name(), key.repr()));
    }
}

bool contains(const Value & c, const Value & x) {
    switch (c.kind()) {
    case Value::Kind::undefined: return false;
    case Value::Kind::string:
        if (!x.is_string()) { fail(fmt::format("'in <string>' requires string as left operand, not {}", x.type_name())); }
        return c.str().find(x.str()) != std::string::npos;
    case Value::Kind::list: {
        if (c.list_data().seq == Seq::dict_keys && (x.is_list() || x.is_dict())) { fail(fmt::format("unhashable type: '{}'", x.type_name())); }
        const std::vector<Value> items = c.iterate();  // a generator's deferred error surfaces here
        return std::any_of(items.begin(), items.end(), [&](const Value & v) { return v.equals(x); });
    }
    case Value::Kind::dict:
        if (x.is_list() || x.is_dict()) { fail(fmt::format("unhashable type: '{}'", x.type_name())); }
        return x.is_string() && c.dict_data().find(x.str()) != nullptr;
    default: fail(fmt::format("argument of type '{}' is not iterable", c.type_name()));
    }
}

Value global_function(const std::string & name) {
    static const Value range = make_fn("range", [](const Args & a) {
        a.check("range", 3, {});
        if (a.pos.empty()) { fail("range expected at least 1 argument, got 0"); }
        for (const auto & v : a.pos) {
            if (!v.is_int()) { fail(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name())); }
        }
        int64_t start = a.pos.size() == 1 ? 0 : a.pos[0].get_int();
        int64_t stop  = a.pos.size() == 1 ? a.pos[0].get_int() : a.pos[1].get_int();
        int64_t step  = a.pos.size() == 3 ? a.pos[2].get_int() : 1;
        if (step == 0) { fail("range() arg 3 must not be zero"); }
        std::vector<Value> out;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (out.size() >= 100000) { fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)."); }
            out.emplace_back(i);
        }
        return Value::list(std::move(out));
    });
    static const Value ns = make_fn("namespace", [](const Args & a) {
        auto obj = std::make_shared<NamespaceObject>();
        for (const auto & p : a.pos) {
            if (!p.is_dict()) { fail("namespace() positional argument must be a dict"); }
            for (const auto & kv : p.dict_data().items) { obj->set_attr(kv.first, kv.second); }
        }
        for (const auto & kv : a.kw) { obj->set_attr(kv.first, kv.second); }
        return Value(std::shared_ptr<Object>(std::move(obj)));
    });
    static const Value dict = make_fn("dict", [](const Args & a) {
        std::vector<std::pair<std::string, Value>> items;
        for (const auto & p : a.pos) {
            if (!p.is_dict()) { fail("dict() positional argument must be a dict"); }
            items = p.dict_data().items;
        }
        for (const auto & kv : a.kw) { items.push_back(kv); }
        return Value::dict(std::move(items));
    });
    static const Value raise = make_fn("raise_exception", [](const Args & a) -> Value {
        throw RaisedError(a.get(0, "message", kUndef).to_str());
    });
    static const Value strftime_now = make_fn("strftime_now", [](const Args & a) {
        const std::string & f   = need_str(a.get(0, "format", kUndef), "strftime_now format");
        std::time_t         now = std::time(nullptr);
        std::tm             tm{};
        localtime_r(&now, &tm);
        char   buf[512];
        size_t n = std::strftime(buf, sizeof(buf), f.c_str(), &tm);
        return Value(std::string(buf, n));
    });
    if (name == "range") { return range; }
    if (name == "namespace") { return ns; }
    if (name == "dict") { return dict; }
    if (name == "raise_exception") { return raise; }
    if (name == "strftime_now") { return strftime_now; }
    return Value();
}

}  // namespace fd::tokenizer::jinja
