#!/usr/bin/env python3
"""The folders' dependencies point down only, and the public face stays public.

Every #include of the project's own headers is resolved to the folder it lands in; a
folder may include only itself and the folders below it:
    common <- kernels <- runtime <- layers, optim, data <- parallel <- train <- apps, benchmarks
(tests may include anything). The public headers under include/dptrain/<folder>/ belong
to that folder; include/dptrain/{error,types}.hpp are the vocabulary every folder shares.
A public header includes only public headers (<dptrain/...>), so that what is installed
compiles on its own, never common/, and the umbrella header (<dptrain/dptrain.hpp>)
includes all of them.
Internal headers are named by their path from the source root ("kernels/cpu/cpu.hpp"),
or from their own folder; a "../" path that leaves the folder is refused. common/ is
the internal library below everything: it includes nothing of the project but the error
types (<dptrain/error.hpp>).
Usage: layering_test.py SOURCE_DIR"""
import os, re, sys

src = os.path.abspath(sys.argv[1])
# Each folder and the folders it may include (besides itself and the shared vocabulary).
below = {
    'common': set(),
    'kernels': {'common'},
    'runtime': {'kernels', 'common'},
    'layers': {'runtime', 'kernels', 'common'},
    'optim': {'layers', 'runtime', 'kernels', 'common'},
    'data': {'runtime', 'kernels', 'common'},
    'parallel': {'optim', 'layers', 'data', 'runtime', 'kernels', 'common'},
    'train': {'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels', 'common'},
    'apps': {'train', 'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels', 'common'},
    'benchmarks': {'apps', 'train', 'parallel', 'optim', 'layers', 'data', 'runtime', 'kernels', 'common'},
}
include_re = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
error_types = os.path.join(src, 'include', 'dptrain', 'error.hpp')


def folder_of(path):
    rel = os.path.relpath(path, src).split(os.sep)
    if rel == ['include', 'dptrain', 'dptrain.hpp']:
        return 'umbrella'
    if rel[0] == 'include':
        # include/dptrain/<folder>/x.hpp, or the shared vocabulary include/dptrain/x.hpp
        return rel[2] if len(rel) > 3 else 'vocabulary'
    return rel[0]


def resolve(kind, target, dirpath):
    """The file an include lands in (None: not the project's), as the compiler finds it."""
    if kind == '<':
        return os.path.join(src, 'include', target) if target.startswith('dptrain/') else None
    for base in (dirpath, src):  # beside the file, then from the source root
        path = os.path.normpath(os.path.join(base, target))
        if os.path.exists(path):
            return path
    return None


problems, checked = [], 0
roots = list(below) + ['include', 'tests']
for top in roots:
    for dirpath, _, names in os.walk(os.path.join(src, top)):
        for name in names:
            if not re.search(r'\.(cpp|hpp|cu|cuh)$', name):
                continue
            path = os.path.join(dirpath, name)
            here = folder_of(path)
            rel = os.path.relpath(path, src)
            public = rel.startswith('include' + os.sep)
            for kind, target in include_re.findall(open(path, encoding='utf-8').read()):
                if public and target.startswith('common/'):  # however it is spelled
                    problems.append(f'{rel}: a public header includes common/ ({target}), which is not installed')
                resolved = resolve(kind, target, dirpath)
                if resolved is None or not os.path.exists(resolved):
                    if kind == '<' and target.startswith('dptrain/'):
                        problems.append(f'{rel}: <{target}> is no public header')
                    continue  # a header of another package, found by the compiler (catch.hpp), or none
                checked += 1
                there = folder_of(resolved)
                if public and kind != '<':
                    problems.append(f'{rel}: a public header includes "{target}" (only <dptrain/...> is installed)')
                if kind == '"' and '..' in target.split('/') and there != here:
                    problems.append(f'{rel}: includes "{target}" through ../ (name it from the source root)')
                if here == 'common' and there != 'common' and resolved != error_types:
                    problems.append(f'{rel}: common includes nothing of the project but <dptrain/error.hpp> ({target})')
                    continue
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
