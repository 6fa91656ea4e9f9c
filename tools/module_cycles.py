#!/usr/bin/env python3
"""Fails when the modules of a workspace crate depend on each other in a circle.

Reads every library crate of the workspace (each member's `src/`, binaries left out),
names each file's module (`src/a/b.rs` is `a::b`, `src/a/mod.rs` is `a`, `src/lib.rs`
the crate root), and draws an edge from a module to every other module of the same
crate its code names: `crate::x::…`, `super::…`, `self::…`, or a child module's name
(`child::…`); test code (`#[cfg(test)]` items) is left out. A path names the deepest module it walks through (`crate::a::b::Item`
names `a::b` when that module exists, else `a`). Declaring a child (`mod x;`) and
re-exporting from it (`pub use x::Item;`) are not edges: a parent may gather its
children's items. A circle is a set of modules that reach each other through edges;
each one found is printed with one edge per step, and the exit status is 1.

Usage: tools/module_cycles.py [WORKSPACE_DIR]
"""

import pathlib
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+|::\{)")
CHILD = re.compile(r"(?<![:\w])(\w+)::")


def crate_dirs(root):
    """The `src/` folders of the workspace members that have a library."""
    manifest = (root / "Cargo.toml").read_text()
    members = re.search(r"members\s*=\s*\[(.*?)\]", manifest, re.S)
    for member in re.findall(r'"([^"]+)"', members.group(1) if members else ""):
        src = root / member / "src"
        if (src / "lib.rs").exists():
            yield member, src


def module_of(src, path):
    """The module path of a file below `src` (`()` for the crate root)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts and parts[0] == "bin":
        return None
    if parts[-1] in ("lib", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text):
    """The code without comments and string literals (they name no module)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def strip_tests(text):
    """The code without its `#[cfg(test)]` items (tests may reach anywhere)."""
    out, at = [], 0
    for match in re.finditer(r"#\[cfg\(test\)\]", text):
        if match.start() < at:
            continue
        out.append(text[at:match.start()])
        open_at = text.find("{", match.end())
        semi = text.find(";", match.end())
        if open_at < 0 or (0 <= semi < open_at):
            at = semi + 1
            continue
        depth, end = 0, open_at
        for end in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        at = end + 1
    out.append(text[at:])
    return "".join(out)


def brace_paths(text, start):
    """The first segments of each entry of the `{…}` group opening at `start`."""
    depth, entry, entries = 0, "", []
    for char in text[start:]:
        if char == "{":
            depth += 1
            if depth == 1:
                continue
        elif char == "}":
            depth -= 1
            if depth == 0:
                entries.append(entry)
                break
        if char == "," and depth == 1:
            entries.append(entry)
            entry = ""
        elif depth >= 1:
            entry += char
    return [e.strip().split("{")[0].strip(": \n") for e in entries if e.strip()]


def resolve(modules, base, segments):
    """The deepest module reached from `base` by walking `segments`."""
    at = base
    for segment in segments:
        if at + (segment,) in modules:
            at = at + (segment,)
        else:
            break
    return at


def edges_of(modules, module, code):
    """The modules `module`'s code names, other than itself."""
    found = set()
    reexports = set(re.findall(r"pub(?:\([^)]*\))?\s+use\s+(\w+)::", code))
    for match in PATH.finditer(code):
        anchor, rest = match.group(1), match.group(2)
        if anchor == "crate":
            base = ()
        elif anchor == "self":
            base = module
        else:
            base = module
            tail = code[match.end(1):]
            while tail.startswith("::super"):
                base, tail = base[:-1], tail[len("::super"):]
            base = base[:-1]
        if rest == "::{":
            groups = brace_paths(code, match.end() - 1)
        else:
            groups = [rest.strip(":")]
        for group in groups:
            segments = [s for s in group.split("::") if s and s not in ("super", "self")]
            target = resolve(modules, base, segments)
            if target != module:
                found.add(target)
    for name in set(CHILD.findall(code)):
        child = module + (name,)
        if child in modules and name not in reexports:
            found.add(child)
    return found


def circles(graph):
    """The strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for next_node in graph[node]:
            if next_node not in index:
                visit(next_node)
                low[node] = min(low[node], low[next_node])
            elif next_node in on_stack:
                low[node] = min(low[node], index[next_node])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                result.append(sorted(group))

    sys.setrecursionlimit(10000)
    for node in graph:
        if node not in index:
            visit(node)
    return result


def name(module):
    return "::".join(module) or "(crate root)"


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    failed = False
    for member, src in crate_dirs(root):
        files = {}
        for path in sorted(src.rglob("*.rs")):
            module = module_of(src, path)
            if module is not None:
                files[module] = strip_tests(strip_comments(path.read_text()))
        modules = set(files)
        graph = {m: sorted(edges_of(modules, m, code)) for m, code in files.items()}
        for group in circles(graph):
            failed = True
            members = set(group)
            print(f"{member}: modules in a circle: {', '.join(name(m) for m in group)}")
            for module in group:
                for target in graph[module]:
                    if target in members:
                        print(f"    {name(module)} -> {name(target)}")
    if not failed:
        print("no module circles")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
