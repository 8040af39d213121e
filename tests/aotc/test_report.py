"""The HTML report over a dump folder: every graph listed, numbers match `aotc.inspect`, DOT files
written with or without Graphviz installed, dumped graph code parses."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import aotc
import aotc.report
from aotc.pipeline import CompiledRecord
from aotc.report import MISSING_DOT_NOTE, graph_dot, write_report


def mlp_step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.gelu(x @ w1).sin() @ w2).sum()  # under a budget, recomputed in the backward


def scaled_softmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ w * 0.5, dim=-1)


def make_dump(root: pathlib.Path) -> dict[str, CompiledRecord]:
    """Compile one training and one inference function into `root`; folder name -> record."""
    train = aotc.compile(mlp_step, dump=str(root), memory_budget=0.5)
    train(
        torch.randn(13, 7),
        torch.randn(7, 5, requires_grad=True),
        torch.randn(5, 3, requires_grad=True),
    )
    infer = aotc.compile(scaled_softmax, dump=str(root))
    with torch.no_grad():
        infer(torch.randn(11, 6), torch.randn(6, 4))
    records = {r.name: r for compiled in (train, infer) for r in aotc.inspect(compiled)}
    folders = {}
    for graph_json in sorted(root.glob("*/08_graph.json")):
        folders[graph_json.parent.name] = records[json.loads(graph_json.read_text())["name"]]
    assert sorted(r.name for r in folders.values()) == ["mlp_step", "scaled_softmax"]
    return folders


@pytest.fixture(scope="module")
def dump(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[pathlib.Path, dict[str, CompiledRecord]]:
    root = tmp_path_factory.mktemp("dump")
    return root, make_dump(root)


def _section(page: str, folder: str) -> str:
    match = re.search(rf'<section id="{re.escape(folder)}">(.*?)</section>', page, re.DOTALL)
    assert match, f"no section for {folder}"
    return match.group(1)


def test_page_lists_every_graph_with_its_saved_bytes(dump):
    root, records = dump
    result = write_report(str(root))
    page = pathlib.Path(result.html_path).read_text()
    assert result.html_path == str(root / "index.html")
    assert sorted(result.graphs) == sorted(records)
    for folder, record in records.items():
        section = _section(page, folder)
        shown = re.search(r'class="saved-bytes" data-bytes="(\d+)"', section)
        assert shown, section[:500]
        if record.training:
            assert int(shown.group(1)) == record.partition.saved_bytes > 0
            assert "training</td><td>yes" in section
        else:
            assert record.partition is None and int(shown.group(1)) == 0
            assert "training</td><td>no" in section
        assert record.source in section
        for name in ["00_signature.txt", "07_compile_time.txt", "08_graph.json", "graph.dot"]:
            assert f'href="{folder}/{name}"' in section
    # Self-contained: nothing to fetch (the SVG's xmlns URLs are names, not loads); the one
    # script (search, pan and zoom) is inline.
    assert not re.search(r"<script src|<link|<img|<iframe|@import|src=", page)
    assert page.count("<script>") == 1


def test_dumped_graph_code_parses(dump):
    root, _ = dump
    files = sorted(root.glob("*/04_forward.py")) + sorted(root.glob("*/05_backward.py"))
    assert len(files) >= 2  # the training graph has both
    for path in files:
        lines = path.read_text().splitlines()
        code = "\n".join(lines[next(i for i, ln in enumerate(lines) if not ln.startswith("#")) :])
        tree = ast.parse(code, filename=str(path))
        assert [type(n) for n in tree.body] == [ast.FunctionDef], path


def test_dot_files_mark_cut_and_recomputation(dump):
    root, records = dump
    write_report(str(root))
    for folder, record in records.items():
        dot = (root / folder / "graph.dot").read_text()
        assert dot.startswith(f'digraph "{record.name}" {{') and dot.endswith("}\n")
        assert "subgraph cluster_forward" in dot and "subgraph cluster_backward" in dot
        graph = json.loads((root / folder / "08_graph.json").read_text())
        assert graph_dot(graph) == dot  # deterministic
        for node in graph["nodes"]:
            assert f'"{node["name"]}" [label="{node["name"]}\\n' in dot
        if record.training:
            assert record.partition.recomputed  # else this test shows nothing
            assert '\\nsaved"' in dot and '\\nrecomputed"' in dot
            backward = dot.split("subgraph cluster_backward")[1].split("\n  }\n")[0]
            assert "placeholder tangent" in backward
            assert all(f'"{name}" [' in backward for name in record.partition.recomputed)


def test_dot_labels_are_escaped():
    graph = {
        "name": 'odd "name"',
        "nodes": [
            {
                "name": "a",
                "op": "placeholder",
                "role": "primal graph_arg0",
                "inputs": [],
                "side": "forward",
                "saved": True,
                "shape": [2],
                "dtype": "float32",
            },
            {
                "name": "b",
                "op": "call_function",
                "target": 'weird\\op"x"',
                "inputs": ["a"],
                "side": "backward",
                "saved": False,
            },
        ],
    }
    dot = graph_dot(graph)
    assert 'digraph "odd \\"name\\"" {' in dot
    assert '"b" [label="b\\ncall_function weird\\\\op\\"x\\""' in dot
    assert '"a" -> "b" [color=' in dot  # crosses the cut
    if shutil.which("dot"):
        import graphviz

        assert "<svg" in graphviz.Source(dot).pipe(format="svg", encoding="utf-8")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_pictures_are_inlined_when_dot_is_installed(dump):
    pytest.importorskip("graphviz", reason="the graphviz Python package is not installed")
    root, records = dump
    result = write_report(str(root))
    page = pathlib.Path(result.html_path).read_text()
    assert result.dot_available and result.notes == ()
    for folder in records:
        assert "<svg" in _section(page, folder)
    assert "<?xml" not in page and MISSING_DOT_NOTE not in page


def test_missing_dot_still_writes_dot_files_and_says_how_to_install(dump, tmp_path, monkeypatch):
    root, records = dump
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    for stale in copy.glob("*/graph.dot"):
        stale.unlink()
    monkeypatch.setattr(aotc.report.shutil, "which", lambda name: None)
    result = write_report(str(copy))
    page = pathlib.Path(result.html_path).read_text()
    assert not result.dot_available and result.notes == (MISSING_DOT_NOTE,)
    assert "apt-get install graphviz" in page and "<svg" not in page
    for folder in records:
        assert (copy / folder / "graph.dot").is_file()
        assert "No picture" in _section(page, folder)
