"""The HTML report: one self-contained page naming every compiled graph, a Graphviz picture per
graph (or .dot files and a note without `dot`), and the page checked in headless Chromium."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
import torch

import aotc
import aotc.report as report


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> tuple[pathlib.Path, list]:
    out = tmp_path_factory.mktemp("dump")
    train = aotc.compile(lambda x, w: (x @ w).tanh().sum(), dump=str(out))
    w = torch.randn(6, 3, requires_grad=True)
    train(torch.randn(4, 6), w).backward()
    infer = aotc.compile(lambda x: x.sin() * 2, dump=str(out))
    with torch.no_grad():
        infer(torch.randn(5))
    return out, [*train.records, *infer.records]


def test_index_names_every_graph_and_links_its_files(dump):
    out, records = dump
    result = report.write_report(str(out))
    html = pathlib.Path(result.html_path).read_text()
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(folders) == 2 and list(result.graphs) == folders
    for folder in folders:
        assert folder in html
        assert (out / folder / "graph.dot").exists()
        for f in (out / folder).iterdir():
            assert f"{folder}/{f.name}" in html, f"no link to {folder}/{f.name}"
    # self-contained: nothing loaded from elsewhere (SVG namespace URIs are not loads)
    for external in ('src="http', "src='http", 'href="http', "<link", "<script src", "@import"):
        assert external not in html
    training = next(r for r in records if r.training)
    assert (
        f"{training.partition.saved_bytes:,}" in html or str(training.partition.saved_bytes) in html
    )


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_pictures_are_inline_svg(dump):
    out, _ = dump
    result = report.write_report(str(out))
    html = pathlib.Path(result.html_path).read_text()
    assert result.dot_available and html.count("<svg") >= 2 and not result.notes


def test_missing_dot_writes_dot_files_and_says_so(dump, monkeypatch):
    out, _ = dump
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    result = report.write_report(str(out))
    html = pathlib.Path(result.html_path).read_text()
    assert not result.dot_available and result.notes
    assert "graphviz" in html.lower() and "<svg" not in html
    for folder in result.graphs:
        text = (out / folder / "graph.dot").read_text()
        assert text.startswith("digraph") and "cluster" in text


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    try:  # the test set-up installs Debian's chromium when absent
        subprocess.run(
            "apt-get update -qq && apt-get install -y -qq chromium",
            shell=True,
            check=True,
            timeout=900,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return shutil.which("chromium")


def test_page_renders_in_headless_chromium(dump, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed and could not be installed (needs root + apt)")
    out, _ = dump
    result = report.write_report(str(out))
    url = pathlib.Path(result.html_path).resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for folder in result.graphs:
        assert folder in dom
    if result.dot_available:
        assert dom.count("<svg") >= len(result.graphs)
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1400,1600", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.exists() and shot.stat().st_size > 20_000
