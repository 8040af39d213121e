"""The `aotc` command: dump and explain on real scripts, exit codes, help, logging."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import aotc

    @aotc.compile
    def step(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    w = torch.randn(8, 3, requires_grad=True)
    step(torch.randn(n, 8), w).backward()
    step(torch.randn(n + 1, 8), w).backward()      # a second signature: one recompile
    with torch.no_grad():
        step(torch.randn(n, 8), w)                  # an inference graph
    print("script done", n)
""")


def run_cli(*args: str, cwd: pathlib.Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "aotc.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def script(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_explain_prints_a_table_per_graph(script, tmp_path):
    result = run_cli("explain", str(script), "--", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "script done 5" in out  # script args passed through
    assert out.count("== graph") == 3
    assert "training (forward + backward)" in out and "inference (forward)" in out
    assert "compiled because  first call" in out
    # The default capture mode: Dynamo's guards say why it recompiled.
    assert "tensor 'x' size mismatch at index 0. expected 5, actual 6" in out
    assert "grad_mode" in out
    assert "aotc: compiling step" in result.stderr  # progress lines


def test_explain_gives_strict_mode_reasons(script, tmp_path):
    script.write_text(SCRIPT.replace("@aotc.compile\n", '@aotc.compile(capture="trace")\n'))
    result = run_cli("explain", str(script), "--", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "input 0 shape (5, 8) -> (6, 8)" in result.stdout
    assert "grad mode True -> False" in result.stdout


def test_dump_writes_every_graph_and_an_index(script, tmp_path):
    out_dir = tmp_path / "out"
    result = run_cli("dump", str(script), "--out", str(out_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folders = sorted(p for p in out_dir.iterdir() if p.is_dir())
    assert len(folders) == 3
    html = (out_dir / "index.html").read_text()
    for folder in folders:
        assert folder.name in html
        graph = json.loads((folder / "08_graph.json").read_text())
        assert graph["name"] == "step" and "train.py" in graph["source"]
        for code_file in ("04_forward.py", "05_backward.py"):
            if (folder / code_file).exists():
                code = "\n".join(
                    ln
                    for ln in (folder / code_file).read_text().splitlines()
                    if not ln.startswith("#")
                )
                ast.parse(code)
        partition = folder / "03_partition.txt"
        if partition.exists():
            saved = int(
                partition.read_text().split("# saved: ")[1].split(" values, ")[1].split()[0]
            )
            assert saved == graph["saved_bytes"]
    assert "index.html" in result.stdout


def test_script_failure_exits_1_with_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch, aotc\nraise ValueError('boom from the script')\n")
    result = run_cli("explain", str(bad), cwd=tmp_path)
    assert result.returncode == 1
    assert "boom from the script" in result.stderr and "Traceback" in result.stderr


def test_unsupported_program_exits_1_with_aotc_error(tmp_path):
    bad = tmp_path / "dd.py"
    bad.write_text(
        textwrap.dedent("""
        import torch, aotc
        f = aotc.compile(lambda x: x * 2 if x.sum() > 0 else x, capture="trace")
        f(torch.randn(3))
    """)
    )
    result = run_cli("dump", str(bad), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert result.returncode == 1
    assert "UnsupportedError" in result.stderr and "depends on tensor values" in result.stderr


def test_usage_errors_exit_2(tmp_path):
    assert run_cli("dump", cwd=tmp_path).returncode == 2
    assert run_cli("no-such-command", cwd=tmp_path).returncode == 2
    missing = run_cli("explain", "missing.py", cwd=tmp_path)
    assert missing.returncode == 2 and "no such script" in missing.stderr


@pytest.mark.parametrize("command", [[], ["dump"], ["explain"], ["report"]])
def test_help_on_every_subcommand(command, tmp_path):
    result = run_cli(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0 and "usage" in result.stdout.lower()


def test_aotc_log_categories(script, tmp_path):
    result = run_cli(
        "explain",
        str(script),
        cwd=tmp_path,
        env={"AOTC_LOG": "graphs,partition,recompiles,kernels"},
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert "[aotc.graphs]" in err and "# stage: joint" in err
    assert "[aotc.partition]" in err and "# stage: partition" in err
    assert "[aotc.recompiles] recompiling step" in err
    assert "[aotc.kernels]" in err and "def forward(" in err
    bad = run_cli("explain", str(script), cwd=tmp_path, env={"AOTC_LOG": "nonsense"})
    assert bad.returncode != 0 and "AOTC_LOG" in bad.stderr


def test_dump_env_var_without_cli(script, tmp_path):
    out_dir = tmp_path / "env_dump"
    env = dict(os.environ, PYTHONPATH=str(ROOT), AOTC_DUMP_DIR=str(out_dir))
    subprocess.run(
        [sys.executable, str(script)], env=env, check=True, capture_output=True, timeout=300
    )
    assert len([p for p in out_dir.iterdir() if p.is_dir()]) == 3


def test_dump_captures_torch_compile_backend(tmp_path):
    script = tmp_path / "dyn.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        compiled = torch.compile(model, backend="aotc")
        compiled(torch.randn(2, 4)).sum().backward()
    """)
    )
    out_dir = tmp_path / "out"
    result = run_cli("dump", str(script), "--out", str(out_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folders = [p for p in out_dir.iterdir() if p.is_dir()]
    assert folders and (out_dir / "index.html").exists()
    assert all((f / "04_forward.py").exists() for f in folders)


def test_metadata_dump_shows_dedupe_and_synthetic_bases(tmp_path):
    import torch

    import aotc

    def f(a, b, c):
        a.add_(1)
        return a * b + c

    compiled = aotc.compile(f, dump=str(tmp_path), capture="trace")  # aotc's own conventions
    base = torch.randn(2, 3)
    x = torch.randn(3)
    compiled(base[0], base[1], x)
    compiled(x, x, x)
    texts = sorted((p / "01_metadata.txt").read_text() for p in tmp_path.iterdir())
    joined = "\n".join(texts)
    assert "synthetic base of user_arg0, user_arg1" in joined
    assert "user_arg1 is a duplicate of user_arg0 (deduped)" in joined
