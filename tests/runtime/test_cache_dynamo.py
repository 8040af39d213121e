"""The on-disk cache for graphs compiled through Dynamo (the default capture mode and
`torch.compile(backend="aotc")`): a warm process skips aotc's trace and partition for static and
symbolic graphs, and a symbolic hit installs the shape guards the cold compile added (Note
[Symbolic cache entries] in aotc/symkey.py), so Dynamo never runs an entry outside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from aotc.runtime import cache as store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, aotc
    how, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = aotc.compile(model) if how == "aotc" else torch.compile(model, backend="aotc")
    out = {"losses": [], "stages": [], "graphs": 0}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = aotc.compile(lambda: opt.step()) if how == "aotc" else None
    for i, b in enumerate(sizes):
        torch.manual_seed(b)
        x = torch.randn(b, 8)
        loss = compiled(x).square().mean()
        torch.testing.assert_close(loss, model(x).square().mean())
        loss.backward()
        out["losses"].append(loss.item())
        if step is not None:
            step()
            opt.param_groups[0]["lr"] = 0.01 / (i + 2)
        opt.zero_grad()
    records = aotc.inspect(compiled) if how == "aotc" else []
    if step is not None:
        records = records + aotc.inspect(step)
    out["stages"] = [sorted(r.stage_seconds) for r in records]
    out["graphs"] = len(records)
    print("RESULT " + json.dumps(out))
    """
)


def _run(tmp_path, how: str, sizes: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, AOTC_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, str(script), how, sizes],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _hit(stages: list[str]) -> bool:
    return "cache_load" in stages and "trace" not in stages


def test_warm_process_skips_trace_for_static_and_symbolic_graphs(tmp_path):
    cold = _run(tmp_path, "aotc", "4,6,9")
    warm = _run(tmp_path, "aotc", "4,6,9")
    # model: static graph, then symbolic batch; optimizer: static lr, then the lr as a graph input
    assert cold["graphs"] == warm["graphs"] == 4
    assert not any(_hit(s) for s in cold["stages"])
    # The optimizer graph taking the lr as a dynamic float is not cached (Note [Dynamic Python
    # floats] in aotc/backend.py: a hit would skip the trace that may specialize the float)
    assert [_hit(s) for s in warm["stages"]] == [True, True, True, False], warm["stages"]
    assert warm["losses"] == cold["losses"]


def _add_guard_to_symbolic_entry(cache_dir: str, guard: list, ranges: list[str]) -> None:
    """Give the (one) symbolic entry a shape guard, as if its cold compile had added it (and so
    left the symbols' ranges at `ranges`)."""
    changed = 0
    for name in os.listdir(cache_dir):
        key = name.removesuffix(".json")
        body = store.read_entry(cache_dir, key)
        if body is not None and "shape_guards" in body:
            body["shape_guards"]["guards"].append(guard)
            body["shape_guards"]["ranges"] = ranges
            store.write_entry(cache_dir, key, body, 1 << 30)
            changed += 1
    assert changed == 1


def test_torch_compile_graphs_are_cached_and_symbolic_hits_install_guards(tmp_path):
    """torch.compile(backend="aotc") stores both graphs. Then the symbolic entry is made valid
    only for batch <= 5: a warm process with batch 8 must not use it; one with batch 5 uses it,
    and Dynamo then recompiles for batch 7 instead of running the entry there."""
    _run(tmp_path, "torch.compile", "4,5")
    cache_dir = str(tmp_path / "cache")
    keys = [n.removesuffix(".json") for n in os.listdir(cache_dir) if n.endswith(".json")]
    bodies = [store.read_entry(cache_dir, k) for k in keys]
    assert len(bodies) == 2 and sum("shape_guards" in b for b in bodies) == 1
    batch_at_most_5 = ["LessThan", [["S", 0], ["I", "5"]]]  # c0: the batch size
    _add_guard_to_symbolic_entry(cache_dir, batch_at_most_5, ["[2, 5]"])
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys, torch, aotc, aotc.api
            seen = []
            aotc.api.COMPILE_LISTENERS.append(lambda f, rec, why: seen.append(sorted(rec.stage_seconds)))
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            compiled = torch.compile(model, backend="aotc")
            for b in [int(s) for s in sys.argv[1].split(",")]:
                x = torch.randn(b, 8)
                torch.testing.assert_close(compiled(x), model(x))
            print("RESULT " + json.dumps(seen))
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=ROOT, AOTC_CACHE_DIR=cache_dir)

    def probe(sizes: str) -> list[list[str]]:
        done = subprocess.run(
            [sys.executable, str(script), sizes],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
        return json.loads(line.removeprefix("RESULT "))

    # Forward-only calls under grad: same graphs as the cold run's forward.
    graphs = probe("4,8")
    assert _hit(graphs[0]) and not _hit(graphs[1])  # 8 > 5: the stored guard refused the entry
    _add_guard_to_symbolic_entry(cache_dir, batch_at_most_5, ["[2, 5]"])
    graphs = probe("4,5,7")
    assert len(graphs) == 3
    assert _hit(graphs[0]) and _hit(graphs[1])  # 5 <= 5: a hit, with the guard installed
    assert not _hit(graphs[2])  # Dynamo's guard (s0 <= 5) failed for 7: compiled anew
