#!/usr/bin/python3
"""The module-level include graph of fdrollout, and a check that it has no cycle.

A module is a folder that holds code of one concern:
  daemon/src/<m>/ and daemon/include/fd/<m>/   -> <m>   (model, runtime, comm, engine, api, ...)
  daemon/src/<f>.cpp, daemon/include/fd/<f>.h  -> <f>   (the daemon's top-level files: config, arena)
  daemon/main.cpp                              -> main
  checkpoint/, shm/, kernels/, common/, publish/, cli/ -> that folder's name
  the sub-modules in SUB_MODULES (daemon/src/<m>/<s>/, daemon/include/fd/<m>/<s>/) -> "<m>/<s>"
  (api/http: the HTTP transport apart from the handlers; tokenizer/jinja: the template
  interpreter), so the parent may use them but they never use the parent
An edge A -> B means a file of A includes a header of B (`#include "fd/..."`, or a header next
to the including file). Edges inside one module are dropped.

Usage: module_graph.py [REPO_ROOT]   (default: the folder above this script)
Prints the graph (one line per module: `A -> B, C`) and, when the graph has a cycle, every
strongly connected component of two or more modules with one cycle through it, and exits 1.
Exits 0 when the graph is a DAG (the modules are then also printed bottom-up, in layers).
"""
import os
import re
import sys

TOP_LIBS = ("checkpoint", "shm", "kernels", "common", "publish", "cli")
SUB_MODULES = ("api/http", "tokenizer/jinja")
SOURCE_EXT = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def module_of(rel):
    """The module of a repository-relative path, or None when the file is no module's code."""
    parts = rel.split("/")
    if parts[0] in TOP_LIBS:
        return parts[0]
    if parts[0] != "daemon":
        return None
    if parts[1:] == ["main.cpp"]:
        return "main"
    if len(parts) >= 3 and parts[1] == "src":
        if len(parts) > 4 and "/".join(parts[2:4]) in SUB_MODULES:
            return "/".join(parts[2:4])
        return parts[2] if len(parts) > 3 else os.path.splitext(parts[2])[0]
    if len(parts) >= 4 and parts[1] == "include" and parts[2] == "fd":
        if len(parts) > 5 and "/".join(parts[3:5]) in SUB_MODULES:
            return "/".join(parts[3:5])
        return parts[3] if len(parts) > 4 else os.path.splitext(parts[3])[0]
    return None


def include_roots(root):
    """The folders the build puts on the include path (each `<lib>/include`)."""
    roots = [os.path.join(root, "daemon", "include")]
    roots += [os.path.join(root, lib, "include") for lib in TOP_LIBS]
    return [r for r in roots if os.path.isdir(r)]


def source_files(root):
    for top in ("daemon",) + TOP_LIBS:
        base = os.path.join(root, top)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(SOURCE_EXT):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, root)


def build_graph(root):
    roots = include_roots(root)
    graph = {}
    for rel in source_files(root):
        src_mod = module_of(rel)
        if src_mod is None:
            continue
        graph.setdefault(src_mod, set())
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        here = os.path.dirname(os.path.join(root, rel))
        for inc in INCLUDE_RE.findall(text):
            target = None
            for base in [here] + roots:
                cand = os.path.normpath(os.path.join(base, inc))
                if os.path.isfile(cand):
                    target = os.path.relpath(cand, root)
                    break
            if target is None:
                continue  # generated (fd/build_info.h) or a system header in quotes
            dst_mod = module_of(target)
            if dst_mod is not None and dst_mod != src_mod:
                graph[src_mod].add(dst_mod)
                graph.setdefault(dst_mod, set())
    return graph


def strongly_connected(graph):
    """Tarjan's algorithm; returns the components (lists of modules)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def one_cycle(graph, comp):
    """A cycle through the component's first module (a shortest path back to it, BFS)."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


def layers(graph):
    """Modules bottom-up: layer 0 includes nothing, layer n only modules of lower layers."""
    depth = {}

    def d(v):
        if v not in depth:
            depth[v] = 1 + max((d(w) for w in graph[v]), default=-1)
        return depth[v]

    out = {}
    for v in graph:
        out.setdefault(d(v), []).append(v)
    return [sorted(out[k]) for k in sorted(out)]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = build_graph(root)
    print("module include graph (A -> what A includes):")
    for v in sorted(graph):
        print(f"  {v:<10} -> {', '.join(sorted(graph[v])) or '(nothing)'}")
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    if cycles:
        print(f"\nFAIL: {len(cycles)} cycle(s) in the module graph:")
        for comp in cycles:
            print(f"  modules {{{', '.join(comp)}}}: " + " -> ".join(one_cycle(graph, comp)))
        return 1
    print("\nOK: the module graph is a DAG. Layers, bottom-up:")
    for i, layer in enumerate(layers(graph)):
        print(f"  {i}: {', '.join(layer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
