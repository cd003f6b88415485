// jinja_interp.h — the tree-walking renderer (internal to src/tokenizer/jinja_*.cpp).
//
// Scoping follows jinja2: each for-loop iteration and each macro call gets a fresh frame
// (assignments inside do not leak out; a macro sees its own frame and the template's top
// level), `if` blocks share their frame. Lookups fall back to the render context, then to the
// globals (range, namespace, dict, raise_exception, strftime_now).
#pragma once

#include "jinja_ast.h"

#include <string>
#include <vector>

namespace fd::tokenizer::jinja {

class Interp {
public:
    /// `context`: a dict value whose keys are the template's top-level variables.
    explicit Interp(Value context);

    /// Render `body` into `out`. Errors: RenderError / RaisedError.
    void render(const Body & body, std::string & out);
    /// Line of the statement being executed (for error messages).
    int line() const { return line_; }

    Value eval(const Expr & e);
    Value lookup(const std::string & name) const;
    Value call(const Value & callee, const Args & args, const std::string & what);

private:
    enum class Flow { normal, break_, continue_ };
    struct Frame {
        std::vector<std::pair<std::string, Value>> vars;
        int                                        parent = -1;  ///< index into frames_; -1: context
    };

    Flow  exec(const Body & body, std::string & out);
    Flow  exec_for(const Stmt & s, std::string & out);
    void  exec_set(const Stmt & s);
    void  define_macro(const Stmt & s);
    Value eval_binary(const Expr & e);
    Value eval_call(const Expr & e);
    Value eval_slice(const Expr & e);
    Value eval_filter_chain(const Expr & e, const Value & input);
    Args  eval_args(const Expr & e);
    void  assign(const std::string & name, Value v);
    void  assign_targets(const std::vector<std::string> & targets, const Value & v);

    /// Counts eval/exec frames in use: a template that recurses without end (a macro calling
    /// itself) is a RenderError at kMaxDepth, not a stack overflow of the daemon.
    struct DepthGuard {
        explicit DepthGuard(Interp & in);
        ~DepthGuard() { --in.depth_; }
        Interp & in;
    };
    static constexpr int kMaxDepth = 512;  ///< ~250 nested macro calls (jinja2: Python's 1000 frames, ~200)

    std::vector<Frame> frames_;
    Value              context_;
    int                line_ = 1;
    int                depth_ = 0;
};

// ---- built-ins (jinja_filters.cpp, jinja_methods.cpp) ---------------------------------------

/// Filter `name` (jinja2's builtin filters plus transformers' tojson) applied to `v`.
/// Errors: RenderError for an unknown filter or bad arguments.
Value apply_filter(Interp & in, const std::string & name, const Value & v, const Args & args);
/// Test `name` (`x is name(args)`). Errors: RenderError for an unknown test.
bool apply_test(Interp & in, const std::string & name, const Value & v, const Args & args);
/// `obj.name` as jinja2's sandboxed getattr: dict key, object attribute, or a bound method of
/// str/dict/list; undefined when absent. Errors: attribute of undefined.
Value get_attr(const Value & obj, const std::string & name);
/// `obj[key]`: list/str index (negative from the end), dict key, then attribute; undefined when
/// absent. Errors: subscript of undefined.
Value get_item(const Value & obj, const Value & key);
/// Whether str/dict/list `obj` has a method `name`.
bool has_method(const Value & obj, const std::string & name);
/// Python method `name` of str/dict/list `obj`. Errors: unknown or unsafe method, bad arguments.
Value call_method(const Value & obj, const std::string & name, const Args & args);
/// A global function (range, namespace, dict, raise_exception, strftime_now), or undefined.
Value global_function(const std::string & name);
/// Python `fmt % args` (%s %r %d %i %f %% with flags, width and precision).
std::string py_percent_format(const std::string & fmt, const Value & args);
/// Python `a in b`.
bool contains(const Value & container, const Value & item);
/// Python str.strip/lstrip/rstrip: `chars` empty = whitespace.
std::string py_strip(const std::string & s, const Value & chars, bool left, bool right);

}  // namespace fd::tokenizer::jinja
