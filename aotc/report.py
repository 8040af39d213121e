"""Debug report: one self-contained HTML page over a dump folder's compiled graphs.

Not a pipeline stage: it reads what `aotc.pipeline.dump_record` (and `dump_failure`) wrote, and
`dynamo.json` when the `aotc` command recorded Dynamo's side of the run; it touches no torch
state, so `aotc report DIR` can re-render a dump later (after installing Graphviz, say).

    write_report(dump_dir) -> ReportResult
      reads   DIR/<name>_<n>/08_graph.json   (see aotc/debug.py::graph_json), every graph folder
              DIR/dynamo.json                 (optional; see aotc/dynamo_log.py)
      writes  DIR/<name>_<n>/graph.dot        the partitioned joint graph as Graphviz DOT
              DIR/index.html                  per graph: facts, pictures, nodes by module, code

Pictures. A graph of at most `node_budget` nodes is drawn whole: a `forward` and a `backward`
cluster (primal inputs and forward-only nodes; tangents, backward nodes and recomputed nodes,
side `both`, drawn dashed and green), each holding one nested cluster per nn.Module path (from
the nodes' module stack, see passes/provenance.py). Saved values get a thick red border and an
orange fill; edges that cross the cut are red. A larger graph is drawn per module instead (see
Note [Pictures per module]), so a 12-layer model is a tree of small pictures, not one poster.

Layout runs Graphviz `dot` in a few processes with a deadline (`layout_seconds` for the whole
report): a picture whose layout does not finish in time, or every picture when `dot` is missing,
is left out with a note saying so, and the page still lists every node by module with its code.

The page: a search box (node names, ops, module paths, source lines, parameter names; the
matches are highlighted in the lists and pictures and listed as links), pan and zoom on each
picture (wheel, drag, buttons), collapsible modules, and the graph code inline. `index.html?q=text`
opens with a search. Everything is inline (no network, no files outside the dump folder); links
are relative, so the folder can be moved or zipped. Deterministic: the same dump gives the same
.dot files and page.

Note [Pictures per module]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every module path with nodes is a node of a tree ("" the root, then "transformer",
"transformer.h", "transformer.h.0", ...). A graph input belongs to the module its name is a
parameter or buffer of (`transformer.h.0.attn.c_attn.weight` -> `transformer.h.0.attn.c_attn`).
The picture of module M draws M's own nodes one by one and each child module as one box per side
(`attn  forward: 40 nodes`), linked to the child's own picture; inputs from outside M appear as
small stubs. Own nodes beyond the budget are split, in graph order, into boxes of `node_budget`
nodes, each with its picture. So no picture has more than about `node_budget` nodes plus stubs,
and the layout time grows linearly with the graph.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from aotc.report_assets import SCRIPT as _SCRIPT
from aotc.report_assets import STYLE as _STYLE
from aotc.report_graph import (
    BOX_FILL,
    INPUT_FILL,
    LAYOUT_SECONDS,
    NODE_BUDGET,
    RECOMPUTED_FILL,
    SAVED_BORDER,
    SAVED_FILL,
    TANGENT_FILL,
    ModuleTree,
    Picture,
    anchor,
    cluster_of,
    graph_dot,
    pictures_of,
    render_all,
)

GRAPH_JSON = "08_graph.json"
DOT_FILE = "graph.dot"
INDEX_FILE = "index.html"
DYNAMO_FILE = "dynamo.json"
EXPLAIN_FILE = "explain.txt"  # what `aotc explain` prints, written by `aotc dump`
CODE_FILES = ("02_joint.py", "04_forward.py", "05_backward.py", "03_partition.txt", "error.txt")
_LISTED = 24  # recomputed ops named in a graph's facts
MISSING_DOT_NOTE = (
    "Graphviz `dot` was not found on PATH, so the graphs are not drawn; each folder still has "
    "its graph.dot and the page lists every node by module. Install it with "
    "`apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (macOS), then run "
    "`aotc report DIR` to draw them."
)


@dataclass(frozen=True, slots=True)
class ReportResult:
    html_path: str  # DIR/index.html
    graphs: tuple[str, ...]  # len == number of graph folders; folder names, in page order
    dot_available: bool  # whether `dot` was found (pictures were drawn where in time)
    notes: tuple[str, ...]  # why pictures are missing, how to fix it; empty when all is drawn
    pictures: int = 0  # pictures drawn
    pictures_skipped: int = 0  # pictures whose layout missed the deadline
    layout_seconds: float = 0.0  # wall time spent in dot


def write_report(
    dump_dir: str, node_budget: int = NODE_BUDGET, layout_seconds: float = LAYOUT_SECONDS
) -> ReportResult:
    """Write graph.dot into every graph folder under `dump_dir` and one index.html over them."""
    folders = _graph_folders(dump_dir)
    dynamo = _read_json(os.path.join(dump_dir, DYNAMO_FILE)) or {}
    notes: list[str] = []
    can_draw = shutil.which("dot") is not None
    if not can_draw:
        notes.append(MISSING_DOT_NOTE)
    graphs = {}
    pictures: list[Picture] = []
    for folder in folders:
        path = os.path.join(dump_dir, folder)
        graph = _read_json(os.path.join(path, GRAPH_JSON)) or {}
        graphs[folder] = graph
        if graph.get("failed"):
            continue
        with open(os.path.join(path, DOT_FILE), "w") as f:
            f.write(graph_dot(graph))
        pictures += pictures_of(folder, graph, node_budget)
    start = time.perf_counter()
    svgs = render_all(pictures, layout_seconds) if can_draw else {}
    spent = time.perf_counter() - start
    skipped = sum(1 for p in pictures if p.key not in svgs) if can_draw else 0
    if can_draw and skipped:
        notes.append(
            f"{skipped} of {len(pictures)} pictures were not drawn: their layout did not finish "
            f"within the report's {layout_seconds:.0f} s layout budget. Their nodes are still "
            "listed by module below."
        )
    sections = [
        _section_html(folder, graphs[folder], svgs, pictures, dynamo, dump_dir)
        for folder in folders
    ]
    html_path = os.path.join(dump_dir, INDEX_FILE)
    title = os.path.basename(os.path.abspath(dump_dir))
    with open(html_path, "w") as f:
        has_explain = os.path.isfile(os.path.join(dump_dir, EXPLAIN_FILE))
        f.write(_page_html(title, folders, graphs, notes, sections, dynamo, can_draw, has_explain))
    return ReportResult(
        html_path, tuple(folders), can_draw, tuple(notes), len(svgs), skipped, round(spent, 3)
    )


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


def _graph_folders(dump_dir: str) -> list[str]:
    """Folders holding a 08_graph.json, ordered by name and then numerically (MLP_2 < MLP_10)."""
    names = [
        d for d in os.listdir(dump_dir) if os.path.isfile(os.path.join(dump_dir, d, GRAPH_JSON))
    ]

    def key(name: str) -> tuple[str, int]:
        m = re.fullmatch(r"(.*)_(\d+)", name)
        return (m.group(1), int(m.group(2))) if m else (name, -1)

    return sorted(names, key=key)


# --- HTML -----------------------------------------------------------------------------------


def _page_html(
    title: str,
    folders: list[str],
    graphs: Mapping[str, Mapping[str, Any]],
    notes: list[str],
    sections: list[str],
    dynamo: Mapping[str, Any],
    can_draw: bool,
    has_explain: bool = False,
) -> str:
    toc = "".join(
        f'<li><a href="#{_esc(f)}">{_esc(f)}</a>'
        + (' <b style="color:#c0392b">failed</b>' if graphs[f].get("failed") else "")
        + "</li>"
        for f in folders
    )
    failed = sum(1 for f in folders if graphs[f].get("failed"))
    note_html = "".join(f'<p class="note missing-dot">{_esc(n)}</p>' for n in notes)
    legend = (
        '<p class="legend">'
        f'<span style="background:{INPUT_FILL}">input</span>'
        f'<span style="background:{TANGENT_FILL}">tangent</span>'
        f'<span style="background:{SAVED_FILL};border:2px solid {SAVED_BORDER}">'
        "saved for backward</span>"
        f'<span style="background:{RECOMPUTED_FILL};border:1px dashed #2e7d32">'
        "recomputed in backward</span>"
        f'<span style="background:{BOX_FILL}">module (click to open)</span>'
        f'<span style="border-color:{SAVED_BORDER};color:{SAVED_BORDER}">'
        "red edge: crosses the cut</span>"
        '<span style="border-style:dashed">dashed edge: a recomputed value the forward also '
        "uses</span> Wheel: zoom; drag: pan.</p>"
    )
    if not can_draw:  # no pictures, nothing for the legend to explain
        legend = ""
    empty = "" if folders else "<p>No compiled graphs (no folder with 08_graph.json).</p>"
    summary = f"{len(folders) - failed} compiled graph(s)" + (
        f", {failed} failed" if failed else ""
    )
    explain = (
        f'<p>The summary `aotc explain` prints: <a href="{EXPLAIN_FILE}">{EXPLAIN_FILE}</a></p>\n'
        if has_explain
        else ""
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>aotc report: {_esc(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<header><h1>aotc report: {_esc(title)}</h1>\n"
        '<input id="search" type="search" placeholder="search nodes: name, op, module, '
        'parameter, source line" autocomplete="off">\n<div id="search-results"></div></header>\n'
        f"{note_html}\n<p>{summary}:</p><ul>{toc}</ul>{empty}\n{explain}"
        f"{_dynamo_summary_html(dynamo)}\n{legend}\n"
        + "\n".join(sections)
        + f"\n<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def _dynamo_summary_html(dynamo: Mapping[str, Any]) -> str:
    breaks = list(dynamo.get("graph_breaks", []))
    frames = dynamo.get("frames", {})
    if not frames and not breaks:
        return ""
    rows = "".join(
        f"<li><b>{_esc(b.get('reason', ''))}</b> in frame {_esc(b.get('compile_id', '?'))}"
        + (f" at <code>{_esc(b['where'])}</code>" if b.get("where") else "")
        + "</li>"
        for b in breaks
    )
    text = f"<p>Dynamo compiled {len(frames)} frame(s); {len(breaks)} graph break(s)"
    return text + (f":</p><ul class='graph-breaks'>{rows}</ul>" if rows else ".</p>")


def _facts_rows(graph: Mapping[str, Any]) -> list[tuple[str, str]]:
    training = bool(graph["training"])
    saved, everything = int(graph["saved_bytes"]), int(graph["save_everything_bytes"])
    if training:
        share = f" ({saved / everything:.0%})" if everything else ""
        saved_text = f"{_bytes(saved)} of {_bytes(everything)} if everything were saved{share}"
    else:
        saved_text = f"{_bytes(saved)} (inference: no backward, nothing saved)"
    names = list(graph["recomputed"])
    recomputed = ", ".join(f"<code>{_esc(r)}</code>" for r in names[:_LISTED]) or "none"
    if len(names) > _LISTED:
        recomputed = f"{len(names)} ops: {recomputed} ... ({len(names) - _LISTED} more)"
    return [
        ("name", f"<code>{_esc(graph['name'])}</code>"),
        ("source", f"<code>{_esc(graph.get('source', '<unknown>'))}</code>"),
        ("training", "yes" if training else "no"),
        ("saved bytes", f'<span class="saved-bytes" data-bytes="{saved}">{saved_text}</span>'),
        ("recomputed ops", recomputed),
        ("compile time", _time_html(graph)),
    ]


def _times(seconds: Mapping[str, float]) -> str:
    return ", ".join(f"{_esc(k)} {v * 1e3:.1f} ms" for k, v in seconds.items())


def _time_html(graph: Mapping[str, Any]) -> str:
    seconds: dict[str, float] = graph.get("compile_seconds", {})
    total = f"{sum(seconds.values()) * 1e3:.1f} ms: {_times(seconds)}"
    cold = graph.get("cold_compile_seconds") or {}
    if graph.get("cache_hit") and cold:
        return (
            f'<span class="cache-hit">cache hit: loaded in {total}</span>; the compile that '
            f"stored the entry took {sum(cold.values()) * 1e3:.1f} ms: {_times(cold)}"
        )
    return total


def _dynamo_rows(graph: Mapping[str, Any], dynamo: Mapping[str, Any]) -> list[tuple[str, str]]:
    compile_id = graph.get("dynamo_compile_id")
    frame = dynamo.get("frames", {}).get(compile_id) if compile_id else None
    if compile_id is None:
        return []
    if frame is None:
        return [("Dynamo frame", f"{_esc(compile_id)} (no Dynamo record; run through `aotc`)")]
    where = f"<code>{_esc(frame.get('function', '?'))}</code> at <code>{_esc(frame.get('where', '?'))}</code>"
    rows = [("Dynamo frame", f"{_esc(compile_id)}: {where}")]
    if frame.get("dynamo_seconds") is not None:
        rows.append(
            (
                "Dynamo time",
                f"{frame['dynamo_seconds'] * 1e3:.1f} ms tracing Python (the whole frame "
                f"{frame.get('frame_seconds', 0) * 1e3:.1f} ms, of which the aotc backend "
                f"{frame.get('backend_seconds', 0) * 1e3:.1f} ms)",
            )
        )
    breaks = frame.get("graph_breaks", [])
    if breaks:
        items = "".join(
            f"<li>{_esc(b.get('reason', ''))}"
            + (f" at <code>{_esc(b['where'])}</code>" if b.get("where") else "")
            + "</li>"
            for b in breaks
        )
        rows.append(("graph break", f'<ul class="graph-breaks">{items}</ul>'))
    if frame.get("resumes_after"):
        rows.append(("resumes after", f"<code>{_esc(frame['resumes_after'])}</code>"))
    guards = frame.get("guards", [])
    if guards:
        listing = _esc("\n".join(guards))
        rows.append(
            (
                "Dynamo guards",
                f"<details><summary>{len(guards)} guards</summary>"
                f'<pre class="code">{listing}</pre></details>',
            )
        )
    return rows


def _section_html(
    folder: str,
    graph: Mapping[str, Any],
    svgs: Mapping[str, str],
    pictures: Sequence[Picture],
    dynamo: Mapping[str, Any],
    dump_dir: str,
) -> str:
    path = os.path.join(dump_dir, folder)
    files = sorted(_files_under(path))
    links = "".join(
        f'<li><a href="{quote(folder)}/{quote(name)}">{_esc(name)}</a></li>' for name in files
    )
    if graph.get("failed"):
        rows = [
            ("name", f"<code>{_esc(graph['name'])}</code>"),
            ("source", f"<code>{_esc(graph.get('source', '<unknown>'))}</code>"),
            ("compile time", _time_html(graph)),
            *_dynamo_rows(graph, dynamo),
        ]
        facts = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
        error = f"{graph.get('error_type', 'Error')}: {graph.get('error', '')}"
        return (
            f'<section id="{_esc(folder)}" class="failed">\n<h2>{_esc(folder)}: compile failed</h2>\n'
            f'<table class="facts">{facts}</table>\n<pre class="error">{_esc(error)}</pre>\n'
            f'<ul class="files">{links}</ul>\n</section>'
        )
    rows = _facts_rows(graph) + _dynamo_rows(graph, dynamo)
    facts = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    mine = {p.scope: p for p in pictures if p.folder == folder}
    whole = mine.get("*")
    if whole is not None:
        picture = _viewport(svgs.get(whole.key), folder)
    else:
        picture = ""
    tree = ModuleTree.build(graph["nodes"])
    modules = _module_html(folder, tree, "", svgs, mine, graph)
    code = "".join(_code_html(folder, path, name) for name in CODE_FILES)
    return (
        f'<section id="{_esc(folder)}">\n<h2>{_esc(folder)}</h2>\n'
        f'<table class="facts">{facts}</table>\n<ul class="files">{links}</ul>\n'
        f'<div class="graph">\n{picture}\n</div>\n'
        f"<h3>Nodes by module</h3>\n{modules}\n<h3>Graph code</h3>\n{code}\n</section>"
    )


def _files_under(path: str) -> Iterable[str]:
    for root, _, names in os.walk(path):
        for name in names:
            yield os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")


def _viewport(svg: str | None, folder: str) -> str:
    if svg is None:
        return (
            '<p class="note missing-dot">No picture: Graphviz is not available or the layout '
            f'did not finish in time. See <a href="{quote(folder)}/{DOT_FILE}">{DOT_FILE}</a>.</p>'
        )
    buttons = (
        '<div class="zoom"><button class="zin" title="zoom in">+</button>'
        '<button class="zout" title="zoom out">&minus;</button>'
        '<button class="zfit" title="fit">fit</button></div>'
    )
    return f'<div class="viewport">{buttons}\n{svg}\n</div>'


def _module_html(
    folder: str,
    tree: ModuleTree,
    path: str,
    svgs: Mapping[str, str],
    pictures: Mapping[str, Picture],
    graph: Mapping[str, Any],
) -> str:
    nodes = tree.subtree_nodes(path)
    if not nodes:
        return ""
    sides = {"forward": 0, "backward": 0}
    for n in nodes:
        sides[cluster_of(n)] += 1
    label = path.rsplit(".", 1)[-1] if path else "top level"
    kind = f" ({_esc(tree.types[path])})" if path in tree.types else ""
    count = (
        f'<span class="count">{sides["forward"]} forward, {sides["backward"]} backward nodes</span>'
    )
    body = []
    picture = pictures.get(path)
    if picture is not None:
        body.append(_viewport(svgs.get(picture.key), folder))
    own = tree.own.get(path, [])
    parts = [k for k in pictures if k.startswith(f"{path}#")] if own else []
    if parts:
        for k in sorted(parts, key=lambda s: int(s.rsplit("#", 1)[1])):
            index = int(k.rsplit("#", 1)[1])
            members = set(pictures[k].members)
            chunk = [n for n in own if n["name"] in members]
            body.append(
                f'<details class="module" id="{_esc(anchor(folder, k))}"><summary>part '
                f"{index + 1} of {label}</summary>{_viewport(svgs.get(pictures[k].key), folder)}"
                f"{_nodes_html(folder, chunk, path)}</details>"
            )
    elif own:
        body.append(_nodes_html(folder, own, path))
    for child in tree.children.get(path, []):
        body.append(_module_html(folder, tree, child, svgs, pictures, graph))
    opened = " open" if path == "" else ""
    return (
        f'<details class="module" id="{_esc(anchor(folder, path))}"{opened}>'
        f"<summary><b>{_esc(label)}</b>{kind} {count}</summary>\n" + "\n".join(body) + "</details>"
    )


def _nodes_html(folder: str, nodes: Sequence[Mapping[str, Any]], module: str) -> str:
    items = []
    for n in nodes:
        code = n.get("code") or f"{n['name']} = {n['op']} {n.get('role', '')}".strip()
        extra = []
        if n.get("input_name"):
            extra.append(str(n["input_name"]))
        if n.get("grad_of"):
            extra.append(f"grad of {n['grad_of']}")
        if "shape" in n:
            extra.append(f"{n['shape']} {n.get('dtype', '')}".strip())
        if n["saved"]:
            extra.append("saved")
        if n["side"] == "both":
            extra.append("recomputed")
        where = f"  # {n['source']}" if n.get("source") else ""
        key = " ".join(
            str(x)
            for x in (
                n["name"],
                n.get("target", ""),
                n.get("module", ""),
                n.get("line", ""),
                *extra,
            )
        ).lower()
        items.append(
            f'<li id="{_esc(folder)}--n--{_esc(n["name"])}" class="side-{_esc(n["side"])}" '
            f'data-g="{_esc(folder)}" data-n="{_esc(n["name"])}" data-m="{_esc(module)}" '
            f'data-k="{_esc(key)}">{_esc(code)}  <b>{_esc(", ".join(extra))}</b>'
            f'<span class="where">{_esc(where)}</span></li>'
        )
    return f'<ul class="nodes">{"".join(items)}</ul>'


def _code_html(folder: str, path: str, name: str) -> str:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return ""
    with open(full) as f:
        text = f.read()
    lines = text.count("\n")
    return (
        f'<details class="code"><summary><code>{_esc(name)}</code> ({lines} lines; '
        f'<a href="{quote(folder)}/{quote(name)}">file</a>)</summary>'
        f'<pre class="code">{_esc(text)}</pre></details>'
    )


def _bytes(n: int) -> str:
    return f"{n:,} B" if n < 1024 else f"{n:,} B ({n / 1024:.1f} KiB)"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)
