// The Jinja engine's values: Python semantics for truthiness, str(), repr(), ==, <, len(),
// iteration, and transformers' tojson (json.dumps with ensure_ascii=False, key order kept).
#include "jinja_value.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

namespace fd::tokenizer::jinja {

void fail(const std::string & msg) { throw RenderError(msg); }

Value Value::list(std::vector<Value> items, Seq seq) {
    auto l   = std::make_shared<ListData>();
    l->items = std::move(items);
    l->seq   = seq;
    return Value(std::shared_ptr<const ListData>(std::move(l)));
}

Value Value::broken_generator(std::string msg) {
    auto l            = std::make_shared<ListData>();
    l->seq            = Seq::generator;
    l->deferred_error = std::move(msg);
    return Value(std::shared_ptr<const ListData>(std::move(l)));
}

Value Value::dict(std::vector<std::pair<std::string, Value>> items) {
    auto d   = std::make_shared<DictData>();
    d->items = std::move(items);
    return Value(std::shared_ptr<const DictData>(std::move(d)));
}

Value Value::from_json(const nlohmann::ordered_json & j) {
    switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value(NoneT{});
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
        std::vector<Value> items;
        items.reserve(j.size());
        for (const auto & e : j) { items.push_back(from_json(e)); }
        return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
        std::vector<std::pair<std::string, Value>> items;
        items.reserve(j.size());
        for (const auto & [k, v] : j.items()) { items.emplace_back(k, from_json(v)); }
        return dict(std::move(items));
    }
    default: return Value();
    }
}

const std::string & Value::undefined_hint() const {
    static const std::string empty = "value is undefined";
    const auto & u = std::get<Undef>(v_);
    return u.hint ? *u.hint : empty;
}

double Value::number() const {
    switch (kind()) {
    case Kind::integer: return static_cast<double>(get_int());
    case Kind::floating: return get_float();
    case Kind::boolean: return get_bool() ? 1.0 : 0.0;
    default: fail(fmt::format("expected a number, got {}", type_name()));
    }
}

bool Value::truthy() const {
    switch (kind()) {
    case Kind::undefined:
    case Kind::none: return false;
    case Kind::boolean: return get_bool();
    case Kind::integer: return get_int() != 0;
    case Kind::floating: return get_float() != 0.0;
    case Kind::string: return !str().empty();
    case Kind::list: return list_data().seq == Seq::generator || !list_data().items.empty();
    case Kind::dict: return !dict_data().items.empty();
    default: return true;
    }
}

std::string Value::type_name() const {
    static const char * names[] = {"Undefined", "NoneType", "bool", "int", "float", "str", "list", "dict", "object", "function"};
    static const char * seqs[] = {"list", "tuple", "generator", "dict_keys", "dict_values", "dict_items"};
    if (is_list()) { return seqs[static_cast<int>(list_data().seq)]; }
    return names[static_cast<int>(kind())];
}

std::string float_repr(double d) {
    if (std::isnan(d)) { return "nan"; }
    if (std::isinf(d)) { return d > 0 ? "inf" : "-inf"; }
    if (d == 0) { return std::signbit(d) ? "-0.0" : "0.0"; }
    // Shortest round-trip digits, then Python's repr layout: fixed when -4 <= exp < 16.
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
    std::string sci(buf, r.ptr);
    bool neg = sci[0] == '-';
    if (neg) { sci.erase(0, 1); }
    size_t      epos = sci.find('e');
    int         exp  = std::stoi(sci.substr(epos + 1));
    std::string digits;
    for (size_t i = 0; i < epos; ++i) {
        if (sci[i] != '.') { digits += sci[i]; }
    }
    std::string out;
    if (exp >= -5 + 1 && exp < 16) {
        if (exp < 0) {
            out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        } else if (static_cast<int>(digits.size()) <= exp + 1) {
            out = digits + std::string(static_cast<size_t>(exp + 1 - static_cast<int>(digits.size())), '0') + ".0";
        } else {
            out = digits.substr(0, static_cast<size_t>(exp + 1)) + "." + digits.substr(static_cast<size_t>(exp + 1));
        }
    } else {
        out = digits.substr(0, 1);
        if (digits.size() > 1) { out += "." + digits.substr(1); }
        out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
    }
    return neg ? "-" + out : out;
}

namespace {

std::string str_repr(const std::string & s) {
    const bool  has_sq = s.find('\'') != std::string::npos;
    const bool  has_dq = s.find('"') != std::string::npos;
    const char  q      = has_sq && !has_dq ? '"' : '\'';
    std::string out(1, q);
    for (unsigned char c : s) {
        switch (c) {
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
            if (c == static_cast<unsigned char>(q)) {
                out += '\\';
                out += static_cast<char>(c);
            } else if (c < 0x20 || c == 0x7f) {
                out += fmt::format("\\x{:02x}", c);
            } else {
                out += static_cast<char>(c);
            }
        }
    }
    out += q;
    return out;
}

void json_string(std::string & out, const std::string & s) {
    out += '"';
    for (unsigned char c : s) {
        switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
            if (c < 0x20) {
                out += fmt::format("\\u{:04x}", c);
            } else {
                out += static_cast<char>(c);
            }
        }
    }
    out += '"';
}

void json_dump(std::string & out, const Value & v, int indent, int level) {
    auto newline = [&](int lvl) {
        out += '\n';
        out.append(static_cast<size_t>(indent * lvl), ' ');
    };
    const char * item_sep = indent < 0 ? ", " : ",";
    switch (v.kind()) {
    case Value::Kind::none: out += "null"; return;
    case Value::Kind::boolean: out += v.get_bool() ? "true" : "false"; return;
    case Value::Kind::integer: out += std::to_string(v.get_int()); return;
    case Value::Kind::floating: {
        double d = v.get_float();
        if (std::isnan(d)) {
            out += "NaN";
        } else if (std::isinf(d)) {
            out += d > 0 ? "Infinity" : "-Infinity";
        } else {
            out += float_repr(d);
        }
        return;
    }
    case Value::Kind::string: json_string(out, v.str()); return;
    case Value::Kind::list: {
        if (!v.list_data().plain()) { fail(fmt::format("Object of type {} is not JSON serializable", v.type_name())); }
        const auto & items = v.list_data().items;
        if (items.empty()) {
            out += "[]";
            return;
        }
        out += '[';
        for (size_t i = 0; i < items.size(); ++i) {
            if (i) { out += item_sep; }
            if (indent >= 0) { newline(level + 1); }
            json_dump(out, items[i], indent, level + 1);
        }
        if (indent >= 0) { newline(level); }
        out += ']';
        return;
    }
    case Value::Kind::dict: {
        const auto & items = v.dict_data().items;
        if (items.empty()) {
            out += "{}";
            return;
        }
        out += '{';
        for (size_t i = 0; i < items.size(); ++i) {
            if (i) { out += item_sep; }
            if (indent >= 0) { newline(level + 1); }
            json_string(out, items[i].first);
            out += ": ";
            json_dump(out, items[i].second, indent, level + 1);
        }
        if (indent >= 0) { newline(level); }
        out += '}';
        return;
    }
    default: fail(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
    }
}

}  // namespace

std::string Value::to_str() const {
    switch (kind()) {
    case Kind::undefined: return "";
    case Kind::string: return str();
    default: return repr();
    }
}

std::string Value::repr() const {
    switch (kind()) {
    case Kind::undefined: return "Undefined";
    case Kind::none: return "None";
    case Kind::boolean: return get_bool() ? "True" : "False";
    case Kind::integer: return std::to_string(get_int());
    case Kind::floating: return float_repr(get_float());
    case Kind::string: return str_repr(str());
    case Kind::list: {
        const auto & l = list_data();
        if (l.seq == Seq::generator) { return "<generator object>"; }
        std::string out = l.tuple() ? "(" : "[";
        for (size_t i = 0; i < l.items.size(); ++i) {
            if (i) { out += ", "; }
            out += l.items[i].repr();
        }
        if (l.tuple() && l.items.size() == 1) { out += ","; }
        out += l.tuple() ? ")" : "]";
        return l.plain() ? out : type_name() + "(" + out + ")";
    }
    case Kind::dict: {
        std::string out = "{";
        bool        first = true;
        for (const auto & [k, v] : dict_data().items) {
            if (!first) { out += ", "; }
            first = false;
            out += str_repr(k) + ": " + v.repr();
        }
        return out + "}";
    }
    case Kind::object: return object().repr();
    case Kind::callable: return "<function " + callable().name + ">";
    }
    return "";
}

std::string Value::to_json_text(int indent) const {
    std::string out;
    json_dump(out, *this, indent, 0);
    return out;
}

std::vector<Value> Value::iterate() const {
    switch (kind()) {
    case Kind::undefined: return {};
    case Kind::list:
        if (!list_data().deferred_error.empty()) { fail(list_data().deferred_error); }
        return list_data().items;
    case Kind::dict: {
        std::vector<Value> keys;
        keys.reserve(dict_data().items.size());
        for (const auto & kv : dict_data().items) { keys.emplace_back(kv.first); }
        return keys;
    }
    case Kind::string: {
        std::vector<Value> chars;
        for (char32_t c : utf8_decode(str())) { chars.emplace_back(utf8_encode(std::u32string(1, c))); }
        return chars;
    }
    default: fail(fmt::format("'{}' object is not iterable", type_name()));
    }
}

bool Value::equals(const Value & o) const {
    if (is_number() && o.is_number()) {
        if ((is_int() || is_bool()) && (o.is_int() || o.is_bool())) {
            auto as_int = [](const Value & v) { return v.is_bool() ? int64_t{v.get_bool()} : v.get_int(); };
            return as_int(*this) == as_int(o);
        }
        return number() == o.number();
    }
    if (kind() != o.kind()) { return false; }
    if (is_list() && (list_data().seq != o.list_data().seq || list_data().seq == Seq::generator)) {
        return &list_data() == &o.list_data();
    }
    switch (kind()) {
    case Kind::undefined:
    case Kind::none: return true;
    case Kind::string: return str() == o.str();
    case Kind::list: {
        const auto & a = list_data().items;
        const auto & b = o.list_data().items;
        if (a.size() != b.size()) { return false; }
        for (size_t i = 0; i < a.size(); ++i) {
            if (!a[i].equals(b[i])) { return false; }
        }
        return true;
    }
    case Kind::dict: {
        const auto & a = dict_data();
        const auto & b = o.dict_data();
        if (a.items.size() != b.items.size()) { return false; }
        for (const auto & [k, v] : a.items) {
            const Value * w = b.find(k);
            if (!w || !v.equals(*w)) { return false; }
        }
        return true;
    }
    case Kind::object: return &object() == &o.object();
    case Kind::callable: return &callable() == &o.callable();
    default: return false;
    }
}

bool Value::less(const Value & o) const {
    if (is_number() && o.is_number()) {
        if (is_int() && o.is_int()) { return get_int() < o.get_int(); }
        return number() < o.number();
    }
    if (is_string() && o.is_string()) { return str() < o.str(); }  // UTF-8 byte order = code point order
    if (is_list() && o.is_list() && list_data().plain() && list_data().seq == o.list_data().seq) {
        const auto & a = list_data().items;
        const auto & b = o.list_data().items;
        for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
            if (!a[i].equals(b[i])) { return a[i].less(b[i]); }
        }
        return a.size() < b.size();
    }
    fail(fmt::format("'<' not supported between instances of '{}' and '{}'", type_name(), o.type_name()));
}

int64_t Value::length() const {
    switch (kind()) {
    case Kind::undefined: return 0;
    case Kind::string: return static_cast<int64_t>(utf8_decode(str()).size());
    case Kind::list:
        if (list_data().seq == Seq::generator) { fail("object of type 'generator' has no len()"); }
        return static_cast<int64_t>(list_data().items.size());
    case Kind::dict: return static_cast<int64_t>(dict_data().items.size());
    default: fail(fmt::format("object of type '{}' has no len()", type_name()));
    }
}

const Value * DictData::find(std::string_view key) const {
    for (const auto & kv : items) {
        if (kv.first == key) { return &kv.second; }
    }
    return nullptr;
}

void Object::set_attr(const std::string & name, Value) {
    fail(fmt::format("cannot assign attribute '{}' on this object", name));
}

Value Args::get(size_t i, std::string_view name, const Value & fallback) const {
    if (i < pos.size()) { return pos[i]; }
    for (const auto & kv : kw) {
        if (kv.first == name) { return kv.second; }
    }
    return fallback;
}

void Args::check(std::string_view fn, size_t n_max, std::initializer_list<std::string_view> names) const {
    if (pos.size() > n_max) { fail(fmt::format("{}() takes at most {} positional arguments ({} given)", fn, n_max, pos.size())); }
    for (const auto & kv : kw) {
        bool known = false;
        for (auto n : names) { known = known || n == kv.first; }
        if (!known) { fail(fmt::format("{}() got an unexpected keyword argument '{}'", fn, kv.first)); }
    }
}

std::u32string utf8_decode(std::string_view s) {
    std::u32string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
        auto     c = static_cast<unsigned char>(s[i]);
        char32_t cp;
        size_t   n;
        if (c < 0x80) {
            cp = c, n = 1;
        } else if ((c >> 5) == 0x6) {
            cp = c & 0x1f, n = 2;
        } else if ((c >> 4) == 0xe) {
            cp = c & 0x0f, n = 3;
        } else if ((c >> 3) == 0x1e) {
            cp = c & 0x07, n = 4;
        } else {
            out += U'\uFFFD';
            ++i;
            continue;
        }
        if (i + n > s.size()) {
            out += U'\uFFFD';
            ++i;
            continue;
        }
        bool ok = true;
        for (size_t k = 1; k < n; ++k) {
            auto cc = static_cast<unsigned char>(s[i + k]);
            if ((cc >> 6) != 0x2) { ok = false; }
            cp = (cp << 6) | (cc & 0x3f);
        }
        if (!ok) {
            out += U'\uFFFD';
            ++i;
            continue;
        }
        out += cp;
        i += n;
    }
    return out;
}

std::string utf8_encode(std::u32string_view s) {
    std::string out;
    out.reserve(s.size());
    for (char32_t c : s) {
        if (c < 0x80) {
            out += static_cast<char>(c);
        } else if (c < 0x800) {
            out += static_cast<char>(0xc0 | (c >> 6));
            out += static_cast<char>(0x80 | (c & 0x3f));
        } else if (c < 0x10000) {
            out += static_cast<char>(0xe0 | (c >> 12));
            out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (c & 0x3f));
        } else {
            out += static_cast<char>(0xf0 | (c >> 18));
            out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
            out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (c & 0x3f));
        }
    }
    return out;
}

bool is_py_space(char32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

}  // namespace fd::tokenizer::jinja
