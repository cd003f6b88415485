"""Seeded random expressions and statements for the reference comparison (test_jinja_reference.py):
each case is one small template printing one random expression over a fixed context, so a
divergence from python3-jinja2 (value, formatting, or error vs no error) shows up alone."""
import random

CONTEXT = {
    "s": "  Héllo, wörld! a-b  ", "t": "x,y,,z", "e": "", "n": 7, "m": -3, "z": 0, "f": 2.5, "g": -0.1,
    "b": True, "c": False, "o": None,
    "l": [3, 1, 2, 3], "w": ["b", "A", "c"], "el": [], "nl": [[1, 2], [3]],
    "d": {"k": "v", "a": 1, "z": [1, 2]}, "ed": {},
    "ms": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yo "}, {"role": "user", "content": ""}],
}
ATOMS = list(CONTEXT) + ["u", "1", "0", "-1", "2", "1.5", "'a'", "'k'", "''", "none", "true", "false", "[1, 2]", "{'k': 1}", "('p', 'q')"]
# No "**": jinja2 compiles `-1 ** x` to Python text where it means -(1 ** x), against its own
# parse tree ((-1) ** x); fdrollout follows the parse tree (features_expr.jinja covers `**`).
BINOPS = ["+", "-", "*", "/", "//", "%", "~", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "and", "or"]
FILTERS = ["length", "trim", "upper", "lower", "title", "capitalize", "first", "last", "list", "reverse", "string", "int",
           "float", "default('x')", "default('x', true)", "join(',')", "join", "tojson", "tojson(indent=2)", "abs", "round",
           "round(1)", "sort", "sort(reverse=true)", "unique", "items", "dictsort", "sum", "max", "min", "map('string')",
           "map(attribute='role')", "selectattr('role', 'eq', 'user')", "rejectattr('content')", "select('odd')",
           "reject", "replace('l', 'L')", "trim('! ')", "count", "indent(2)", "wordcount", "e", "safe", "batch(2)"]
TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "mapping", "iterable", "sequence",
         "true", "false", "boolean", "odd", "even", "eq 1", "eq('a')", "in l", "in('ab')", "divisibleby(2)", "lower",
         "upper", "callable", "sameas none", "gt 1", "le(2)"]
METHODS = ["strip()", "strip('! ')", "lstrip()", "rstrip()", "split()", "split(',')", "split(',', 1)", "rsplit(',', 1)", "rsplit(None, 1)", "rsplit()", "split(None, 1)", "upper()",
           "lower()", "title()", "capitalize()", "startswith('a')", "startswith(('  H', 'x'))", "endswith('  ')",
           "replace('l', '')", "replace('', '-')", "find('o')", "count('l')", "format(1, 2)", "join(['1', '2'])",
           "get('k')", "get('nope', 0)", "items()", "keys()", "values()", "isdigit()", "splitlines()", "index(3)"]


def expr(r, depth):
    if depth <= 0 or r.random() < 0.25:
        return r.choice(ATOMS)
    k = r.random()
    if k < 0.25:
        return f"({expr(r, depth - 1)} {r.choice(BINOPS)} {expr(r, depth - 1)})"
    if k < 0.45:
        return f"{expr(r, depth - 1)} | {r.choice(FILTERS)}"
    if k < 0.55:
        return f"({expr(r, depth - 1)} is {'not ' if r.random() < 0.3 else ''}{r.choice(TESTS)})"
    if k < 0.70:
        return f"{r.choice(['s', 't', 'e', 'd', 'ed', 'l', 'w', 'n', 'o', 'u', '(s ~ n)'])}.{r.choice(METHODS)}"
    if k < 0.82:
        idx = r.choice(["0", "1", "-1", "5", "'k'", "'role'", "1:", ":-1", "::-1", "::2", "1:3", "-2:", "'a'"])
        return f"{r.choice(['s', 'l', 'w', 'd', 'nl', 'ms', 'e', 'el', 'u', 'o', 'ms[0]', 'n'])}[{idx}]"
    if k < 0.90:
        return f"({expr(r, depth - 1)} if {expr(r, depth - 1)} else {expr(r, depth - 1)})"
    if k < 0.95:
        return f"{r.choice(['not ', '-'])}{expr(r, depth - 1)}"
    return f"{r.choice(['ms', 'd', 'o', 'u', 'ms[1]'])}.{r.choice(['role', 'content', 'k', 'z', 'items', 'nope'])}"


STATEMENTS = [
    "{% for x in XS %}{{ loop.index }}{{ x }}{% else %}E{% endfor %}",
    "{% for k, v in XS %}{{ k }}={{ v }};{% endfor %}",
    "{% for x in XS if x %}{{ loop.length }}{{ x }}{% endfor %}",
    "{% set y = XS %}{{ y }}",
    "{% if XS %}T{% elif XS %}E{% else %}F{% endif %}",
    "{% set ns = namespace(v=XS) %}{% for i in range(2) %}{% set ns.v = ns.v ~ i %}{% endfor %}{{ ns.v }}",
    "{% macro m(a, b=XS) %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1) }}{{ m(XS, b=2) }}",
    "{% set a, b = XS %}{{ a }}/{{ b }}",
    "{% filter upper %}{{ XS }}{% endfilter %}",
    "{% set blk %}  {{ XS }}  {% endset %}[{{ blk | trim }}]",
]


def cases(n, seed=11):
    r = random.Random(seed)
    out = []
    for i in range(n):
        if r.random() < 0.75:
            src = "{{ " + expr(r, 3) + " }}"
        else:
            src = r.choice(STATEMENTS).replace("XS", expr(r, 2))
        out.append({"source": src, "mode": "raw", "context": CONTEXT, "id": f"fuzz/{i}: {src}"})
    return out
