"""Debug report: one self-contained HTML page over a dump folder's compiled graphs.

Not a pipeline stage: it reads what `aotc.pipeline.dump_record` wrote and touches no torch state.

    write_report(dump_dir) -> ReportResult
      reads   DIR/<name>_<n>/08_graph.json   (see aotc/debug.py::graph_json), every graph folder
      writes  DIR/<name>_<n>/graph.dot        the partitioned joint graph as Graphviz DOT
              DIR/index.html                  per graph: its facts, its picture, links to its files

The picture has two clusters. `forward` holds the primal inputs and every node only the forward
runs; `backward` holds the tangents, every node only the backward runs, and the recomputed nodes
(side `both`), drawn dashed and green. Saved values get a thick red border and an orange fill;
the edges that cross the cut from a forward node into the backward cluster are red too.

    MLP_0/graph.dot (excerpt)
      subgraph cluster_forward {
        "addmm" [label="addmm\\ncall_function aten.addmm.default\\n[32, 64] float32\\nsaved", ...];
      }
      "addmm" -> "gelu" [color="#c0392b", penwidth=2];

Requires: every graph folder holds 08_graph.json. SVG pictures need the system `dot`
(Debian: `apt-get install graphviz`) and the `graphviz` Python package; without them the .dot
files are still written and the page says what is missing and how to install it.
Ensures: the same dump gives byte-identical .dot files and page (no timestamps, no absolute
paths, nodes and edges in graph order); the page loads nothing from the network and runs no
JavaScript; links are relative, so the dump folder can be moved or zipped as a whole.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

GRAPH_JSON = "08_graph.json"
DOT_FILE = "graph.dot"
INDEX_FILE = "index.html"
MISSING_DOT_NOTE = (
    "Graphviz `dot` was not found on PATH, so the graphs are not drawn; each folder still has "
    "its graph.dot. Install it with `apt-get install graphviz` (Debian/Ubuntu) or "
    "`brew install graphviz` (macOS), then run the report again."
)
MISSING_PACKAGE_NOTE = (
    "The `graphviz` Python package is not installed, so the graphs are not drawn; each folder "
    "still has its graph.dot. Install it with `pip install graphviz`, then run the report again."
)

# Colors of the picture, shared by the DOT attributes and the page's legend.
_SAVED_BORDER = "#c0392b"
_SAVED_FILL = "#fde3c8"
_RECOMPUTED_FILL = "#dff3e4"
_TANGENT_FILL = "#e9e3f5"
_INPUT_FILL = "#e3eef9"


@dataclass(frozen=True, slots=True)
class ReportResult:
    html_path: str  # DIR/index.html
    graphs: tuple[str, ...]  # len == number of graph folders; folder names, in page order
    dot_available: bool  # whether SVG pictures were rendered
    notes: tuple[str, ...]  # why pictures are missing, how to fix it; empty when all is drawn


def write_report(dump_dir: str) -> ReportResult:
    """Write graph.dot into every graph folder under `dump_dir` and one index.html over them."""
    folders = _graph_folders(dump_dir)
    notes: list[str] = []
    can_draw = shutil.which("dot") is not None
    if not can_draw:
        notes.append(MISSING_DOT_NOTE)
    elif not _has_graphviz_package():
        can_draw = False
        notes.append(MISSING_PACKAGE_NOTE)
    sections = []
    for folder in folders:
        path = os.path.join(dump_dir, folder)
        with open(os.path.join(path, GRAPH_JSON)) as f:
            graph = json.load(f)
        dot = graph_dot(graph)
        with open(os.path.join(path, DOT_FILE), "w") as f:
            f.write(dot)
        svg = _render_svg(dot, prefix=folder) if can_draw else None
        sections.append(_section_html(folder, graph, svg, sorted(os.listdir(path))))
    html_path = os.path.join(dump_dir, INDEX_FILE)
    with open(html_path, "w") as f:
        f.write(_page_html(os.path.basename(os.path.abspath(dump_dir)), folders, notes, sections))
    return ReportResult(html_path, tuple(folders), can_draw, tuple(notes))


def _graph_folders(dump_dir: str) -> list[str]:
    """Folders holding a 08_graph.json, ordered by name and then numerically (MLP_2 < MLP_10)."""
    names = [
        d for d in os.listdir(dump_dir) if os.path.isfile(os.path.join(dump_dir, d, GRAPH_JSON))
    ]

    def key(name: str) -> tuple[str, int]:
        m = re.fullmatch(r"(.*)_(\d+)", name)
        return (m.group(1), int(m.group(2))) if m else (name, -1)

    return sorted(names, key=key)


# --- DOT ------------------------------------------------------------------------------------

_DOT_DEFAULTS = """\
  graph [newrank=true, rankdir=TB, fontname="Helvetica", fontsize=12, nodesep=0.25, ranksep=0.35];
  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=9];
  edge [color="#8a8a8a", arrowsize=0.6];"""


def graph_dot(graph: Mapping[str, Any]) -> str:
    """The joint graph of one 08_graph.json as DOT text: forward and backward clusters."""
    nodes = graph["nodes"]
    side = {n["name"]: n["side"] for n in nodes}
    clusters: dict[str, list[str]] = {"forward": [], "backward": []}
    for node in nodes:
        cluster = "forward" if node["side"] == "forward" else "backward"
        clusters[cluster].append(f"    {_quote(node['name'])} [{_attrs(_node_style(node))}];")
    lines = [f"digraph {_quote(graph['name'])} {{", _DOT_DEFAULTS]
    for cluster, body in clusters.items():
        fill = "#f4f8fc" if cluster == "forward" else "#fcf6f2"
        style = f'style="filled,rounded", fillcolor="{fill}", color="#b0b0b0"'
        lines += [f"  subgraph cluster_{cluster} {{", f"    graph [label={cluster}, {style}];"]
        lines += [*body, "  }"]
    for node in nodes:
        for src in node["inputs"]:
            style = _edge_style(side.get(src, ""), node)
            lines.append(f"  {_quote(src)} -> {_quote(node['name'])}{style};")
    lines += _layout_edges(nodes)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _layout_edges(nodes: list[Mapping[str, Any]]) -> list[str]:
    """Invisible edges through one invisible node, from the forward's last nodes to the
    backward's first ones: the backward cluster is drawn below the forward one, not beside it."""
    fwd = {n["name"] for n in nodes if n["side"] == "forward"}
    feeds_fwd = {i for n in nodes if n["side"] == "forward" for i in n["inputs"]}
    last = [n["name"] for n in nodes if n["name"] in fwd and n["name"] not in feeds_fwd]
    first = [n["name"] for n in nodes if n["name"] not in fwd and set(n["inputs"]) <= fwd]
    if not last or not first:
        return []
    return [
        '  "__cut__" [shape=point, style=invis, width=0, label=""];',
        *(f'  {_quote(name)} -> "__cut__" [style=invis];' for name in last),
        *(f'  "__cut__" -> {_quote(name)} [style=invis];' for name in first),
    ]


def _edge_style(src_side: str, dst: Mapping[str, Any]) -> str:
    if src_side == "forward" and dst["side"] in ("backward", "both"):
        return f' [color="{_SAVED_BORDER}", penwidth=2]'  # crosses the cut: the value is saved
    if dst["side"] == "forward" and src_side != "forward":
        # A recomputed node also feeds the forward. Drawing it only in the backward cluster
        # would pull the forward below the backward, so this edge does not rank the layout.
        return " [style=dashed, constraint=false]"
    return ""


def _node_label(node: Mapping[str, Any]) -> str:
    """name / op target (or role for inputs) / shape dtype / saved, recomputed."""
    what = node.get("target") or node.get("role") or ""
    lines = [node["name"], f"{node['op']} {what}".strip()]
    if "shape" in node:
        lines.append(f"{node['shape']} {node.get('dtype', '')}".strip())
    marks = []
    if node["saved"]:
        marks.append("saved")
    if node["side"] == "both":
        marks.append("recomputed")
    if marks:
        lines.append(", ".join(marks))
    return "\n".join(lines)


def _node_style(node: Mapping[str, Any]) -> dict[str, str]:
    attrs = {"label": _node_label(node)}
    if node["side"] == "tangent":
        attrs["fillcolor"] = _TANGENT_FILL
    elif node["op"] == "placeholder":
        attrs["fillcolor"] = _INPUT_FILL
    if node["side"] == "both":
        attrs.update(style="rounded,filled,dashed", fillcolor=_RECOMPUTED_FILL, color="#2e7d32")
    if node["saved"]:
        attrs.update(color=_SAVED_BORDER, penwidth="2.5", fillcolor=_SAVED_FILL)
        attrs["style"] = "rounded,filled,bold"
    return attrs


def _attrs(attrs: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items())


def _quote(text: str) -> str:
    """A DOT double-quoted string; backslashes are literal, newlines become centered breaks."""
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "").replace("\n", "\\n") + '"'


def _has_graphviz_package() -> bool:
    return importlib.util.find_spec("graphviz") is not None


def _render_svg(dot: str, prefix: str) -> str:
    """SVG markup to inline into HTML: XML prolog dropped, element ids made unique per graph."""
    import graphviz  # optional: imported only when drawing, see _has_graphviz_package

    svg = str(graphviz.Source(dot).pipe(format="svg", encoding="utf-8"))
    svg = svg[svg.index("<svg") :]
    return svg.replace(' id="', f' id="{prefix}-')


# --- HTML -----------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1600px; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 18px; margin: 0 0 8px; }
section { border: 1px solid #ccc; border-radius: 6px; padding: 14px 18px; margin: 18px 0; }
table.facts td:first-child { color: #555; padding-right: 16px; vertical-align: top; }
table.facts td { padding: 2px 0; }
.note { background: #fff4d6; border: 1px solid #e0b84c; padding: 8px 12px; border-radius: 4px; }
.graph { overflow: auto; border-top: 1px solid #eee; margin-top: 10px; padding-top: 10px; }
.graph svg { max-width: 100%; height: auto; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 8px; border-radius: 4px;
  border: 1px solid #999; font-size: 12px; }
ul.files { columns: 3; padding-left: 18px; margin: 4px 0; }
code { font-size: 12px; }
"""


def _page_html(title: str, folders: list[str], notes: list[str], sections: list[str]) -> str:
    toc = "".join(f'<li><a href="#{_esc(f)}">{_esc(f)}</a></li>' for f in folders)
    note_html = "".join(f'<p class="note missing-dot">{_esc(n)}</p>' for n in notes)
    legend = (
        '<p class="legend">'
        f'<span style="background:{_INPUT_FILL}">input</span>'
        f'<span style="background:{_TANGENT_FILL}">tangent</span>'
        f'<span style="background:{_SAVED_FILL};border:2px solid {_SAVED_BORDER}">'
        "saved for backward</span>"
        f'<span style="background:{_RECOMPUTED_FILL};border:1px dashed #2e7d32">'
        "recomputed in backward</span>"
        f'<span style="border-color:{_SAVED_BORDER};color:{_SAVED_BORDER}">'
        "red edge: crosses the cut</span>"
        '<span style="border-style:dashed">dashed edge: a recomputed value the forward also '
        "uses</span></p>"
    )
    if notes:  # no pictures, nothing for the legend to explain
        legend = ""
    empty = "" if folders else "<p>No compiled graphs (no folder with 08_graph.json).</p>"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>aotc report: {_esc(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>aotc report: {_esc(title)}</h1>\n{note_html}\n"
        f"<p>{len(folders)} compiled graph(s):</p><ul>{toc}</ul>{empty}\n{legend}\n"
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def _section_html(folder: str, graph: Mapping[str, Any], svg: str | None, files: list[str]) -> str:
    training = bool(graph["training"])
    saved, everything = int(graph["saved_bytes"]), int(graph["save_everything_bytes"])
    if training:
        share = f" ({saved / everything:.0%})" if everything else ""
        saved_text = f"{_bytes(saved)} of {_bytes(everything)} if everything were saved{share}"
    else:
        saved_text = f"{_bytes(saved)} (inference: no backward, nothing saved)"
    recomputed = ", ".join(f"<code>{_esc(r)}</code>" for r in graph["recomputed"]) or "none"
    seconds: dict[str, float] = graph["compile_seconds"]
    times = ", ".join(f"{_esc(k)} {v * 1e3:.1f} ms" for k, v in seconds.items())
    rows = [
        ("name", f"<code>{_esc(graph['name'])}</code>"),
        ("source", f"<code>{_esc(graph.get('source', '<unknown>'))}</code>"),
        ("training", "yes" if training else "no"),
        ("saved bytes", f'<span class="saved-bytes" data-bytes="{saved}">{saved_text}</span>'),
        ("recomputed ops", recomputed),
        ("compile time", f"{sum(seconds.values()) * 1e3:.1f} ms: {times}"),
    ]
    facts = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    links = "".join(
        f'<li><a href="{quote(folder)}/{quote(name)}">{_esc(name)}</a></li>' for name in files
    )
    picture = svg or (
        '<p class="note missing-dot">No picture: Graphviz is not available. '
        f'See <a href="{quote(folder)}/{DOT_FILE}">{DOT_FILE}</a>.</p>'
    )
    return (
        f'<section id="{_esc(folder)}">\n<h2>{_esc(folder)}</h2>\n'
        f'<table class="facts">{facts}</table>\n<ul class="files">{links}</ul>\n'
        f'<div class="graph">\n{picture}\n</div>\n</section>'
    )


def _bytes(n: int) -> str:
    return f"{n:,} B" if n < 1024 else f"{n:,} B ({n / 1024:.1f} KiB)"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)
