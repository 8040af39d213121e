"""The HTML report as a real browser shows it: headless Chromium loads the page from disk, its
DOM names every graph and holds the inlined SVG pictures, and a screenshot renders.

Needs Debian's `chromium` package. When it is missing and the tests run as root with apt-get,
the fixture installs it; otherwise these tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from aotc.report import MISSING_DOT_NOTE, write_report
from tests.aotc.test_report import make_dump

INSTALL_TIMEOUT_S = 600
BROWSER_TIMEOUT_S = 120


def _find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find_chromium()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        command = "apt-get update -qq && apt-get install -y -qq chromium"
        try:
            subprocess.run(
                ["bash", "-c", command],
                check=True,
                capture_output=True,
                timeout=INSTALL_TIMEOUT_S,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"chromium is not installed and `{command}` failed: {e}")
        path = _find_chromium()
    if path is None:
        pytest.skip(
            "chromium is not on PATH and cannot be installed here (needs root and apt-get); "
            "install it with `apt-get install chromium` to run the browser tests"
        )
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str]]:
    """The report page of a fresh dump, and the name of every graph in it."""
    root = tmp_path_factory.mktemp("browser_dump")
    make_dump(root)
    result = write_report(str(root))
    names = [
        json.loads((root / folder / "08_graph.json").read_text())["name"]
        for folder in result.graphs
    ]
    return pathlib.Path(result.html_path), [*result.graphs, *names]


def _run_headless(chromium: str, profile: pathlib.Path, *args: str) -> str:
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={profile}",
        *args,
    ]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_dom_names_every_graph_and_holds_pictures(chromium, report, tmp_path):
    page, names = report
    dom = _run_headless(chromium, tmp_path / "profile", "--dump-dom", page.as_uri())
    assert "<h1>aotc report" in dom, dom[:500]
    for name in names:
        assert name in dom
    if shutil.which("dot"):
        assert dom.count("<svg") >= 2  # one picture per graph
    else:
        assert MISSING_DOT_NOTE.split(",")[0] in dom


def test_screenshot_renders(chromium, report, tmp_path):
    page, _ = report
    shot = tmp_path / "shot.png"
    _run_headless(
        chromium,
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1400,2000",
        page.as_uri(),
    )
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(data) > 20_000  # a blank page of this size compresses to a few KiB
