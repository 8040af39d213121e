"""How long `aotc dump` takes on a GPT-2-small-shaped 12-layer training step (issue #16).

Runs `aotc dump` (the command, in a fresh process, as a user would) on a script that trains one
step of Hugging Face's GPT2LMHeadModel built from a config (12 layers, width 768, 12 heads,
GPT-2's vocabulary, random weights, batch 1 x 32) through `torch.compile(backend="aotc")`, then
`aotc report` on the dump. Records the whole command's wall time, what it says the script and the
report took, Dynamo's and aotc's share (from dump/dynamo.json and the graphs' compile times), the
number of joint-graph nodes and pictures, and the page size. Same run: the script alone, without
`aotc dump`, for the command's overhead as a ratio.

Run from the repo root: .venv/bin/python bench/inspect_dump.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, fmt_table, write_results  # noqa: E402

SCRIPT = textwrap.dedent("""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=128,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    idx = torch.randint(0, config.vocab_size, (1, 32))
    torch.compile(model, backend="aotc")(input_ids=idx, labels=idx).loss.backward()
""")


def _run(args: list[str], cwd: str) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), AOTC_CACHE="0")
    start = time.perf_counter()
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, done.stdout


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "gpt2_step.py"
        script.write_text(SCRIPT)
        plain_s, _ = _run([sys.executable, str(script)], tmp)
        dump = Path(tmp) / "dump"
        dump_s, out = _run(
            [sys.executable, "-m", "aotc.cli", "dump", str(script), "--out", str(dump)], tmp
        )
        said = re.search(
            r"the script ran ([\d.]+) s; the report took ([\d.]+) s \((\d+) pictures", out
        )
        report_s, _ = _run([sys.executable, "-m", "aotc.cli", "report", str(dump)], tmp)
        frames = json.loads((dump / "dynamo.json").read_text())["frames"]
        graphs = [json.loads(p.read_text()) for p in sorted(dump.glob("*/08_graph.json"))]
        results = {
            "script_alone_s": round(plain_s, 2),
            "aotc_dump_command_s": round(dump_s, 2),
            "ratio_dump_vs_script_alone": round(dump_s / plain_s, 3),
            "script_under_dump_s": float(said.group(1)) if said else None,
            "report_in_dump_s": float(said.group(2)) if said else None,
            "pictures": int(said.group(3)) if said else None,
            "aotc_report_command_s": round(report_s, 2),
            "dynamo_s": round(sum(f.get("dynamo_seconds", 0.0) for f in frames.values()), 2),
            "aotc_backend_s": round(sum(sum(g["compile_seconds"].values()) for g in graphs), 2),
            "joint_nodes": [len(g["nodes"]) for g in graphs],
            "page_bytes": (dump / "index.html").stat().st_size,
        }
    path = write_results(
        "inspect_dump",
        results,
        goal="a 12-layer GPT-2-small-shaped training step dumps in well under a minute",
    )
    print(fmt_table(["figure", "value"], [(k, str(v)) for k, v in results.items()]))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
