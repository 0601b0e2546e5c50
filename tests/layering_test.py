#!/usr/bin/env python3
"""The folders' dependencies point down only, and the public face stays public.

Every #include of the project's own headers is resolved to the folder it lands in; a
folder may include only itself and the folders below it:
    kernels <- runtime <- layers, optim, data <- parallel <- train <- apps, benchmarks
(tests may include anything). The public headers under include/dptrain/<folder>/ belong
to that folder; include/dptrain/{error,types}.hpp are the vocabulary every folder shares.
A public header includes only public headers (<dptrain/...>), so that what is installed
compiles on its own, and the umbrella header (<dptrain/dptrain.hpp>) includes all of them.
Usage: layering_test.py SOURCE_DIR"""
import os, re, sys

src = os.path.abspath(sys.argv[1])
# Each folder and the folders it may include (besides itself and the shared vocabulary).
below = {
    'kernels': set(),
    'runtime': {'kernels'},
    'layers': {'runtime', 'kernels'},
    'optim': {'layers', 'runtime', 'kernels'},
    'data': {'runtime', 'kernels'},
    'parallel': {'optim', 'layers', 'data', 'runtime', 'kernels'},
    'train': {'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels'},
    'apps': {'train', 'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels'},
    'benchmarks': {'apps', 'train', 'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels'},
}
include_re = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def folder_of(path):
    rel = os.path.relpath(path, src).split(os.sep)
    if rel == ['include', 'dptrain', 'dptrain.hpp']:
        return 'umbrella'
    if rel[0] == 'include':
        # include/dptrain/<folder>/x.hpp, or the shared vocabulary include/dptrain/x.hpp
        return rel[2] if len(rel) > 3 else 'vocabulary'
    return rel[0]


problems, checked = [], 0
roots = list(below) + ['include', 'tests']
for top in roots:
    for dirpath, _, names in os.walk(os.path.join(src, top)):
        for name in names:
            if not re.search(r'\.(cpp|hpp|cu|cuh)$', name):
                continue
            path = os.path.join(dirpath, name)
            here = folder_of(path)
            public = os.path.relpath(path, src).startswith('include' + os.sep)
            for kind, target in include_re.findall(open(path, encoding='utf-8').read()):
                if kind == '<':
                    if not target.startswith('dptrain/'):
                        continue  # the standard library and other packages
                    resolved = os.path.join(src, 'include', target)
                else:
                    resolved = os.path.normpath(os.path.join(dirpath, target))
                if not os.path.exists(resolved):
                    if kind == '<':
                        problems.append(f'{path}: <{target}> is no public header')
                    continue  # a header found next to it by the compiler (catch.hpp) or none
                checked += 1
                rel = os.path.relpath(path, src)
                if public and kind != '<':
                    problems.append(f'{rel}: a public header includes "{target}" (only <dptrain/...> is installed)')
                there = folder_of(resolved)
                if here in ('tests', 'umbrella') or there in ('vocabulary', here):
                    continue
                if there == 'umbrella' and here in ('apps', 'benchmarks'):  # programs that embed the library
                    continue
                if here == 'vocabulary' or there not in below.get(here, set()):
                    problems.append(f'{rel}: {here} may not include {there} ({target})')
umbrella = open(os.path.join(src, 'include', 'dptrain', 'dptrain.hpp'), encoding='utf-8').read()
for dirpath, _, names in os.walk(os.path.join(src, 'include', 'dptrain')):
    for name in names:
        header = os.path.relpath(os.path.join(dirpath, name), os.path.join(src, 'include'))
        if header != os.path.join('dptrain', 'dptrain.hpp') and f'<{header}>' not in umbrella:
            problems.append(f'include/dptrain/dptrain.hpp does not include <{header}>')
for p in problems:
    print('FAIL:', p)
print(f'layering: {checked} includes checked, {len(problems)} problem(s)')
sys.exit(1 if problems else 0)
