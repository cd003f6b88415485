// jinja_value.h — the Jinja engine's data model (internal to src/tokenizer/jinja_*.cpp).
//
// Values follow Python's semantics as jinja2 sees them: undefined (jinja2's default Undefined:
// prints empty, falsy, iterates empty, errors on attribute access or arithmetic), None, bool,
// int (int64), float (double), str (UTF-8; indexing, slicing and length count code points),
// list/tuple and dict (insertion-ordered, string keys). Lists and dicts are shared and
// immutable (transformers renders in jinja2's ImmutableSandboxedEnvironment); only objects
// (namespace(), the loop variable) have mutable attributes. Cheap to copy (shared pointers).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace fd::tokenizer::jinja {

/// A render-time error (jinja2's TypeError/UndefinedError/SecurityError...); the interpreter
/// prefixes the template name and line.
struct RenderError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
/// raise_exception(msg) from the template: its message reaches the user unchanged.
struct RaisedError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string & msg);

class Value;
struct ListData;

/// What a sequence value is in Python: what it prints as, whether it has len() and takes
/// subscripts, and whether it is always truthy (generators, as jinja2's lazy filters return).
enum class Seq : uint8_t { list, tuple, generator, dict_keys, dict_values, dict_items };
struct DictData;
struct Object;
struct Callable;

struct NoneT {};
struct Undef {
    std::shared_ptr<const std::string> hint;  ///< "'x' is undefined" etc., for the error message
};

class Value {
public:
    enum class Kind : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, object, callable };

    Value() = default;  ///< undefined
    Value(NoneT) : v_(NoneT{}) {}
    Value(bool b) : v_(b) {}
    Value(int i) : v_(int64_t{i}) {}
    Value(int64_t i) : v_(i) {}
    Value(double d) : v_(d) {}
    Value(std::string s) : v_(std::make_shared<const std::string>(std::move(s))) {}
    Value(const char * s) : Value(std::string(s)) {}
    Value(std::shared_ptr<const std::string> s) : v_(std::move(s)) {}
    Value(std::shared_ptr<const ListData> l) : v_(std::move(l)) {}
    Value(std::shared_ptr<const DictData> d) : v_(std::move(d)) {}
    Value(std::shared_ptr<Object> o) : v_(std::move(o)) {}
    Value(std::shared_ptr<const Callable> c) : v_(std::move(c)) {}

    static Value undefined(std::string hint) { return Value(Undef{std::make_shared<const std::string>(std::move(hint))}); }
    static Value list(std::vector<Value> items, Seq seq = Seq::list);
    /// A generator whose iteration fails with `msg` (a lazy jinja2 filter over a bad input:
    /// the error surfaces only when the result is consumed).
    static Value broken_generator(std::string msg);
    static Value dict(std::vector<std::pair<std::string, Value>> items);
    static Value from_json(const nlohmann::ordered_json & j);

    Kind kind() const { return static_cast<Kind>(v_.index()); }
    bool is_undefined() const { return kind() == Kind::undefined; }
    bool is_none() const { return kind() == Kind::none; }
    bool is_bool() const { return kind() == Kind::boolean; }
    bool is_int() const { return kind() == Kind::integer; }
    bool is_float() const { return kind() == Kind::floating; }
    bool is_number() const { return is_int() || is_float() || is_bool(); }
    bool is_string() const { return kind() == Kind::string; }
    bool is_list() const { return kind() == Kind::list; }
    bool is_dict() const { return kind() == Kind::dict; }
    bool is_object() const { return kind() == Kind::object; }
    bool is_callable() const { return kind() == Kind::callable; }

    bool                    get_bool() const { return std::get<bool>(v_); }
    int64_t                 get_int() const { return std::get<int64_t>(v_); }
    double                  get_float() const { return std::get<double>(v_); }
    /// int, bool or float as double.
    double                  number() const;
    const std::string &     str() const { return *std::get<std::shared_ptr<const std::string>>(v_); }
    const ListData &        list_data() const { return *std::get<std::shared_ptr<const ListData>>(v_); }
    const DictData &        dict_data() const { return *std::get<std::shared_ptr<const DictData>>(v_); }
    Object &                object() const { return *std::get<std::shared_ptr<Object>>(v_); }
    const Callable &        callable() const { return *std::get<std::shared_ptr<const Callable>>(v_); }
    const std::string &     undefined_hint() const;

    /// Python truthiness.
    bool truthy() const;
    /// Python str() (what `{{ x }}` prints): undefined → "", None → "None", True → "True".
    std::string to_str() const;
    /// Python repr() (strings quoted, as inside printed lists).
    std::string repr() const;
    /// Python json.dumps(x, ensure_ascii=False, indent=indent) — transformers' tojson.
    /// indent < 0: one line with ", " and ": " separators.
    std::string to_json_text(int indent) const;
    /// The element sequence `for` iterates: list items, dict keys, string characters,
    /// undefined → empty. Errors on None/numbers.
    std::vector<Value> iterate() const;
    /// Python ==.
    bool equals(const Value & o) const;
    /// Python <; errors on unorderable types.
    bool less(const Value & o) const;
    /// Python len(); errors where Python does.
    int64_t length() const;
    /// Short type name for error messages ("str", "dict", ...).
    std::string type_name() const;

private:
    explicit Value(Undef u) : v_(std::move(u)) {}
    std::variant<Undef, NoneT, bool, int64_t, double, std::shared_ptr<const std::string>,
                 std::shared_ptr<const ListData>, std::shared_ptr<const DictData>, std::shared_ptr<Object>,
                 std::shared_ptr<const Callable>>
        v_;
};

struct ListData {
    std::vector<Value> items;
    Seq                seq = Seq::list;
    std::string        deferred_error;  ///< generator only: raised when consumed
    bool               tuple() const { return seq == Seq::tuple; }
    /// list or tuple: has len(), takes subscripts, serializes to JSON.
    bool               plain() const { return seq == Seq::list || seq == Seq::tuple; }
};

struct DictData {
    std::vector<std::pair<std::string, Value>> items;  ///< insertion order
    /// nullptr when absent.
    const Value * find(std::string_view key) const;
};

/// Something with attributes: namespace() (settable) and the loop variable.
struct Object {
    virtual ~Object() = default;
    /// Attribute `name`, or undefined.
    virtual Value attr(const std::string & name) const = 0;
    /// `{% set obj.name = v %}`; errors unless the object is a namespace.
    virtual void set_attr(const std::string & name, Value v);
    virtual std::string repr() const = 0;
};

/// Call arguments: positional then keyword.
struct Args {
    std::vector<Value>                         pos;
    std::vector<std::pair<std::string, Value>> kw;
    /// The argument named `name` or at position `i` (positional first), else `fallback`.
    Value get(size_t i, std::string_view name, const Value & fallback) const;
    /// Errors when more positional arguments than `n_max`, or a keyword not in `names`.
    void check(std::string_view fn, size_t n_max, std::initializer_list<std::string_view> names) const;
};

struct Callable {
    std::string                              name;
    std::function<Value(const Args & args)> fn;
};

/// Code points of UTF-8 `s` (invalid bytes map to U+FFFD, like a lenient decoder).
std::u32string utf8_decode(std::string_view s);
std::string    utf8_encode(std::u32string_view s);
/// Python str.isspace() for one code point.
bool is_py_space(char32_t c);
/// Python repr(float).
std::string float_repr(double d);

}  // namespace fd::tokenizer::jinja
