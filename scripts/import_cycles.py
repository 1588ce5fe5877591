#!/usr/bin/env python3
"""Fails when the modules (files) of a crate import each other in a circle.

Usage: scripts/import_cycles.py CRATE_DIR... (default: every workspace crate with a src/lib.rs).

An edge runs from a file to the file that defines what it names through `crate::`, `super::` or
`self::` (in `use` trees and in inline paths). A name re-exported by a facade (`pub use`) is
followed to the file that defines it, so a module that imports `crate::Thing` depends on Thing's
own file, not on lib.rs. Test-only code (`#[cfg(test)]` modules, inline or in their own files) is
left out: a test may reach anywhere in its crate. Every strongly connected group of two or more
files is printed with the imports that close it; the exit status is 1 if there is any.
"""
import os
import re
import sys

ITEM_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+|const\s+|unsafe\s+|extern\s+\"C\"\s+)*"
    r"(?:fn|struct|enum|trait|type|const|static|mod|union|macro_rules!)\s+(\w+)",
    re.M,
)


def strip_comments_and_strings(text):
    """Blanks comments, string and char literals, keeping line breaks (line numbers stay)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 8]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:i + 12]):
            m = re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:i + 12])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text, open_at):
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text)


def drop_test_modules(text):
    """Removes `#[cfg(test)] mod x { ... }` blocks; returns the text and the names of
    `#[cfg(test)] mod x;` declarations (test-only files)."""
    test_files = set(re.findall(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text))
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
        if not m:
            return text, test_files
        end = matching_brace(text, m.end() - 1)
        text = text[: m.start()] + "\n" * text.count("\n", m.start(), end + 1) + text[end + 1:]


def split_top(s, sep=","):
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def expand_use_tree(tree):
    """`a::{b, c::{d as e}}` -> [['a','b'], ['a','c','d']]."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [[seg for seg in tree.split("::") if seg]]
    head, rest = tree.split("{", 1)
    inner = rest[: rest.rfind("}")]
    prefix = [seg for seg in head.split("::") if seg]
    paths = []
    for part in split_top(inner):
        for sub in expand_use_tree(part):
            paths.append(prefix + sub)
    return paths


class Crate:
    def __init__(self, root):
        self.root = root
        self.src = os.path.join(root, "src")
        self.files = {}  # module path tuple -> file
        self.test_only = set()
        self.texts = {}
        self._walk((), os.path.join(self.src, "lib.rs"))

    def _walk(self, modpath, path):
        raw = open(path, encoding="utf-8").read()
        text, test_files = drop_test_modules(strip_comments_and_strings(raw))
        self.files[modpath] = path
        self.texts[modpath] = text
        base = os.path.dirname(path)
        if not (path.endswith("lib.rs") or path.endswith("mod.rs")):
            base = os.path.join(base, os.path.splitext(os.path.basename(path))[0])
        for m in re.finditer(r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.M):
            name = m.group(1)
            if name in test_files:
                continue
            attr = re.search(r"#\[path\s*=\s*\"([^\"]+)\"\]", m.group(0))
            candidates = [os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")]
            if attr:
                candidates = [os.path.join(base, attr.group(1))]
            for cand in candidates:
                if os.path.exists(cand):
                    self._walk(modpath + (name,), cand)
                    break

    def absolute(self, modpath, path, inline_depth=0):
        """Resolves a use path relative to a module into a path from the crate root, or None.
        `inline_depth` counts the inline `mod x { ... }` blocks around the reference: a `self::`
        or the first `super::`s inside them stay in the same file (None: no edge)."""
        if not path:
            return None
        if path[0] == "crate":
            return list(path[1:])
        if inline_depth and path[0] == "self":
            return None
        if path[0] == "self":
            return list(modpath) + list(path[1:])
        if path[0] == "super":
            cur = list(modpath)
            rest = list(path)
            for _ in range(inline_depth):
                if not rest or rest[0] != "super":
                    return None
                rest.pop(0)
            while rest and rest[0] == "super":
                if not cur:
                    return None
                cur.pop()
                rest.pop(0)
            return cur + rest
        return None

    def defines(self, modpath, name):
        return name in set(ITEM_RE.findall(self.texts[modpath]))

    def reexports(self, modpath):
        """Every (name, absolute target path) re-exported by `pub use` in a module."""
        found = []
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", self.texts[modpath]):
            for p in expand_use_tree(m.group(1)):
                target = self.absolute(modpath, p) if p[0] in ("crate", "self", "super") else None
                if target is None and p[0] not in ("crate", "self", "super"):
                    # `pub use child::X` inside a module names a child module relative to it.
                    if (modpath + (p[0],)) in self.files:
                        target = list(modpath) + p
                if target is None:
                    continue
                last = p[-1]
                found.append((last, target))
        return found

    def resolve(self, path, seen=None):
        """The file (module path) defining what an absolute path names."""
        seen = seen or set()
        mod = ()
        i = 0
        while i < len(path) and mod + (path[i],) in self.files:
            mod = mod + (path[i],)
            i += 1
        if i >= len(path) or path[i] == "*":
            return mod
        name = path[i]
        if self.defines(mod, name):
            return mod
        key = (mod, name)
        if key in seen:
            return mod
        seen.add(key)
        for exported, target in self.reexports(mod):
            if exported == name:
                return self.resolve(target, seen)
            if exported == "*":
                inner = self.resolve(target[:-1] + [name], seen)
                if inner != mod and inner != tuple(target[:-1]) or self.defines(tuple(target[:-1]), name):
                    return inner
        return mod

    def edges(self):
        graph = {m: {} for m in self.files}
        for mod, text in self.texts.items():
            spans = [
                (m.end() - 1, matching_brace(text, m.end() - 1))
                for m in re.finditer(r"(?<![\w])mod\s+\w+\s*\{", text)
            ]

            def depth(pos):
                return sum(1 for a, b in spans if a < pos < b)

            refs = []
            for m in re.finditer(r"\buse\s+([^;]+);", text):
                line = text.count("\n", 0, m.start()) + 1
                for p in expand_use_tree(m.group(1)):
                    refs.append((p, line, depth(m.start())))
            for m in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text):
                line = text.count("\n", 0, m.start()) + 1
                refs.append((m.group(1).split("::"), line, depth(m.start())))
            for p, line, inline in refs:
                if p[0] not in ("crate", "super", "self"):
                    if not inline and (mod + (p[0],)) in self.files:
                        p = ["self"] + p
                    else:
                        continue
                target_path = self.absolute(mod, p, inline)
                if target_path is None:
                    continue
                target = self.resolve(target_path)
                if target != mod and target in graph:
                    graph[mod].setdefault(target, line)
        return graph


def strongly_connected(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(argv):
    roots = argv[1:]
    if not roots:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        roots = sorted(
            os.path.join(here, d) for d in os.listdir(here)
            if os.path.exists(os.path.join(here, d, "src", "lib.rs"))
        )
    failed = False
    for root in roots:
        crate = Crate(root)
        graph = crate.edges()
        for group in strongly_connected(graph):
            failed = True
            members = set(group)
            print(f"{os.path.basename(root)}: import cycle through {len(group)} files:")
            for mod in sorted(group):
                for target, line in sorted(graph[mod].items()):
                    if target in members:
                        src = os.path.relpath(crate.files[mod], root)
                        dst = os.path.relpath(crate.files[target], root)
                        print(f"  {src}:{line} -> {dst}")
    if failed:
        return 1
    print(f"no import cycles in {len(roots)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
