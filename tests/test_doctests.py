"""The worked examples (`>>>`) in the docstrings of aotc/, passes/ and runtime/ run as tests.

Not `pytest --doctest-modules`: pytest would import passes/ and runtime/ as top-level `passes.*`
and `runtime.*`, names aotc never uses (see Note [One import name] in aotc/__init__.py), so
their modules would be second copies. Here each module holding an example is imported by its
installed name (`aotc.passes.provenance`) and its examples run with `doctest`. `make doctest`
runs just this file.
"""

from __future__ import annotations

import doctest
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Repository folder -> the package it installs as.
_PACKAGES = {"aotc": "aotc", "passes": "aotc.passes", "runtime": "aotc.runtime"}


def _modules_with_examples() -> list[str]:
    names = []
    for folder, package in _PACKAGES.items():
        for entry in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not entry.endswith(".py"):
                continue
            with open(os.path.join(ROOT, folder, entry), encoding="utf-8") as f:
                if ">>> " not in f.read():
                    continue
            stem = entry[: -len(".py")]
            names.append(package if stem == "__init__" else f"{package}.{stem}")
    return names


MODULES = _modules_with_examples()


def test_the_public_api_has_worked_examples():
    for name in ("aotc.api", "aotc.options"):
        assert name in MODULES, f"{name} lost its docstring examples"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch):
    monkeypatch.setenv("AOTC_CACHE", "0")  # examples compile from scratch, write nothing
    monkeypatch.delenv("AOTC_BACKEND", raising=False)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} mentions '>>> ' but holds no docstring example"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
