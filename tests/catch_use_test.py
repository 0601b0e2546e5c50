#!/usr/bin/env python3
"""The tests reach Catch2 only through tests/catch.hpp, so that they build with Catch2 2.x
(Debian 12, CI) and 3.x (Ubuntu 24.04, the GPU machine) alike; twice a test built with
one major and not the other (a matcher by its 2.x name, CHECK_THROWS_WITH without 3.x's
matcher header), and only the GPU machine found out.

Outside tests/catch.hpp, a file under tests/ may not
  - include a Catch2 header (<catch2/...>),
  - name anything of Catch2's own (`Catch::`: its names differ between the majors; add a
    helper to catch.hpp that covers both),
  - use a macro that only one major has (SKIP: 3.x only).
Usage: catch_use_test.py SOURCE_DIR"""
import os, re, sys

tests = os.path.join(os.path.abspath(sys.argv[1]), 'tests')
rules = [
    (re.compile(r'#\s*include\s*[<"]catch2/'), 'includes a Catch2 header (include "catch.hpp")'),
    (re.compile(r'\bCatch::'), "names Catch2's own Catch:: (add a helper for both majors to catch.hpp)"),
    (re.compile(r'\bSKIP\s*\('), 'uses SKIP, which Catch2 2.x lacks'),
]
problems, checked = [], 0
for dirpath, _, names in os.walk(tests):
    for name in sorted(names):
        path = os.path.join(dirpath, name)
        if not re.search(r'\.(cpp|hpp|cu|cuh)$', name) or os.path.relpath(path, tests) == 'catch.hpp':
            continue
        checked += 1
        for number, line in enumerate(open(path, encoding='utf-8'), 1):
            code = line.split('//', 1)[0]  # a comment may name them
            for pattern, what in rules:
                if pattern.search(code):
                    problems.append(f'tests/{os.path.relpath(path, tests)}:{number}: {what}')
for p in problems:
    print('FAIL:', p)
print(f'catch_use: {checked} files checked, {len(problems)} problem(s)')
sys.exit(1 if problems else 0)
