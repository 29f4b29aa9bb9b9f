#!/usr/bin/env python3
"""Import circles in src/: the graph of which file's `use` lines (and `crate::` / `super::`
paths) name which module, and its strongly connected components of more than two files.

Usage: scripts/import_cycles.py [SRC_DIR] [--edges]   (prints one line per circle, largest
first; with --edges, each circle's imports between its files under it)
A reading of the text, not of the compiler's resolution: a `#[cfg(test)]` tail is skipped.
"""
def expand(tree):
    """Expands a Rust use tree string (no `use`, no `;`) into full paths."""
    tree = tree.strip()
    out = []
    depth = 0; i = tree.find('{')
    if i < 0:
        p = tree.split(' as ')[0].strip()
        return [p] if p else []
    prefix = tree[:i].rstrip(':').strip()
    # matching brace
    j = i; depth = 0
    for k in range(i, len(tree)):
        if tree[k] == '{': depth += 1
        elif tree[k] == '}':
            depth -= 1
            if depth == 0: j = k; break
    inner = tree[i+1:j]
    parts = []; depth = 0; cur = ''
    for ch in inner:
        if ch == '{': depth += 1
        if ch == '}': depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur); cur = ''
        else: cur += ch
    parts.append(cur)
    for p in parts:
        for e in expand(p):
            if e == 'self': out.append(prefix)
            else: out.append(prefix + '::' + e if prefix else e)
    return out

import re, os, sys, glob
args = [a for a in sys.argv[1:] if a != '--edges']
show_edges = '--edges' in sys.argv[1:]
root = args[0] if args else 'src'
files = {}
for f in glob.glob(f'{root}/**/*.rs', recursive=True):
    rel = os.path.relpath(f, root)[:-3]
    parts = rel.split('/')
    if parts[-1] in ('mod', 'lib', 'main'):
        parts = parts[:-1]
    files['::'.join(parts)] = f
mods = set(files)
def resolve(path):
    segs = path.split('::')
    while segs:
        m = '::'.join(segs)
        if m in mods:
            return m
        segs = segs[:-1]
    return None
edges = {m: set() for m in mods}
code_re = re.compile(r'crate::([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)')
for m, f in files.items():
    text = open(f).read()
    # drop comments and test modules roughly
    text = re.sub(r'//[^\n]*', '', text)
    cut = text.find('#[cfg(test)]')
    if cut >= 0: text = text[:cut]
    here = m.split('::') if m else []
    paths = []
    for tree in re.findall(r'\buse\s+([^;]+);', text, re.S):
        paths += expand(' '.join(tree.split()))
    text2 = re.sub(r'\buse\s+[^;]+;', '', text, flags=re.S)
    paths += ['crate::' + u for u in code_re.findall(text2)]
    paths += ['super::' + u for u in re.findall(r'\bsuper::((?:super::)*[A-Za-z_][A-Za-z0-9_:]*)', text2)]
    for path in paths:
        if path.startswith('crate::'):
            t = resolve(path[len('crate::'):])
        elif path.startswith('super::'):
            base = here[:-1]; u = path[len('super::'):]
            while u.startswith('super::'):
                base = base[:-1]; u = u[len('super::'):]
            t = resolve('::'.join(base + u.split('::')))
        elif path.startswith('self::'):
            t = resolve('::'.join(here + path[len('self::'):].split('::')))
        else:
            first = path.split('::')[0]
            t = resolve('::'.join(here + path.split('::'))) if first and '::'.join(here+[first]) in mods else None
        if t is not None and t != m: edges[m].add(t)
    for u in []:
        t = resolve(u)
        if t is not None and t != m: edges[m].add(t)

# Tarjan
sys.setrecursionlimit(100000)
idx = {}; low = {}; st = []; on = set(); sccs = []; c = [0]
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx:
            sc(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(comp)
for v in mods:
    if v not in idx: sc(v)
big = [s for s in sccs if len(s) > 2]
for s in sorted(big, key=len, reverse=True):
    print(len(s), sorted(s))
    if show_edges:
        for a in sorted(s):
            for b in sorted(edges[a] & set(s)):
                print(f'    {a} -> {b}')
