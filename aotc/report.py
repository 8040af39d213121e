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
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

GRAPH_JSON = "08_graph.json"
DOT_FILE = "graph.dot"
INDEX_FILE = "index.html"
DYNAMO_FILE = "dynamo.json"
EXPLAIN_FILE = "explain.txt"  # what `aotc explain` prints, written by `aotc dump`
CODE_FILES = ("02_joint.py", "04_forward.py", "05_backward.py", "03_partition.txt", "error.txt")
# Heuristic: dot lays out a 150-node picture in well under a second; pictures of ~1000 nodes
# took minutes (a 6-layer GPT-2 joint graph of 1,078 nodes ran 20 minutes without finishing).
NODE_BUDGET = 150
LAYOUT_SECONDS = 40.0  # for every picture of one report together
_STUB_LIMIT = 24  # outside inputs drawn per picture; the rest are one "+N more" stub
_BATCH = 12  # pictures per dot process
_LISTED = 24  # recomputed ops named in a graph's facts
MISSING_DOT_NOTE = (
    "Graphviz `dot` was not found on PATH, so the graphs are not drawn; each folder still has "
    "its graph.dot and the page lists every node by module. Install it with "
    "`apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (macOS), then run "
    "`aotc report DIR` to draw them."
)

# Colors of the picture, shared by the DOT attributes and the page's legend.
_SAVED_BORDER = "#c0392b"
_SAVED_FILL = "#fde3c8"
_RECOMPUTED_FILL = "#dff3e4"
_TANGENT_FILL = "#e9e3f5"
_INPUT_FILL = "#e3eef9"
_BOX_FILL = "#fff7d6"


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
    pictures: list[_Picture] = []
    for folder in folders:
        path = os.path.join(dump_dir, folder)
        graph = _read_json(os.path.join(path, GRAPH_JSON)) or {}
        graphs[folder] = graph
        if graph.get("failed"):
            continue
        with open(os.path.join(path, DOT_FILE), "w") as f:
            f.write(graph_dot(graph))
        pictures += _pictures(folder, graph, node_budget)
    start = time.perf_counter()
    svgs = _render_all(pictures, layout_seconds) if can_draw else {}
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


# --- modules ----------------------------------------------------------------------------------


def _module_of(node: Mapping[str, Any], modules: set[str]) -> str:
    """See Note [Pictures per module]: inputs go to the module they are a parameter of."""
    name = node.get("input_name")
    if name and "." in name:
        owner = name.rsplit(".", 1)[0]
        if owner in modules:
            return str(owner)
    return str(node.get("module", ""))


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _child_under(path: str, scope: str) -> str:
    """The child of `scope` on the way to `path` (path is inside scope, not scope itself)."""
    rest = path[len(scope) + 1 :] if scope else path
    head = rest.split(".", 1)[0]
    return f"{scope}.{head}" if scope else head


def _inside(path: str, scope: str) -> bool:
    return scope == "" or path == scope or path.startswith(scope + ".")


@dataclass
class _Tree:
    """Module paths of one graph: own nodes per path, and the paths under each path."""

    own: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    module: dict[str, str] = field(default_factory=dict)  # node name -> module path

    @staticmethod
    def build(nodes: Sequence[Mapping[str, Any]]) -> _Tree:
        tree = _Tree()
        known = {str(n["module"]) for n in nodes if n.get("module")}
        for node in nodes:
            path = _module_of(node, known)
            tree.module[node["name"]] = path
            tree.own.setdefault(path, []).append(node)
            if node.get("module") == path and node.get("module_type"):
                tree.types.setdefault(path, str(node["module_type"]))
        paths = set(tree.own)
        for path in list(paths):
            while path:
                paths.add(path)
                path = _parent(path)
        paths.add("")
        for path in sorted(paths, key=_path_key):
            tree.own.setdefault(path, [])
            tree.children.setdefault(path, [])
            if path:
                tree.children.setdefault(_parent(path), []).append(path)
        return tree

    def subtree_nodes(self, path: str) -> list[Mapping[str, Any]]:
        out = list(self.own.get(path, []))
        for child in self.children.get(path, []):
            out += self.subtree_nodes(child)
        return out


def _path_key(path: str) -> list[tuple[int, int | str]]:
    """h.2 < h.10: numeric parts compare as numbers."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in path.split(".")] if path else []


def _cluster(node: Mapping[str, Any]) -> str:
    return "forward" if node["side"] == "forward" else "backward"


# --- DOT ------------------------------------------------------------------------------------

_DOT_DEFAULTS = """\
  graph [newrank=true, rankdir=TB, fontname="Helvetica", fontsize=12, nodesep=0.25, ranksep=0.35];
  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=9];
  edge [color="#8a8a8a", arrowsize=0.6];"""
# Heuristic: bounds on dot's network-simplex and mincross iterations; on the 150-node pictures
# of a 12-layer GPT-2 they change little in the drawing and keep the worst picture's layout
# under a second.
_DOT_LIMITS = "  graph [nslimit=4, nslimit1=4, mclimit=0.5, searchsize=20];"


def graph_dot(graph: Mapping[str, Any], node_id: str = "") -> str:
    """The joint graph of one 08_graph.json as DOT text: forward and backward clusters, with
    one nested cluster per module path inside each. `node_id`: a prefix for SVG element ids."""
    nodes = graph["nodes"]
    tree = _Tree.build(nodes)
    side = {n["name"]: n["side"] for n in nodes}
    lines = [f"digraph {_quote(graph['name'])} {{", _DOT_DEFAULTS]
    for cluster in ("forward", "backward"):
        fill = "#f4f8fc" if cluster == "forward" else "#fcf6f2"
        style = f'style="filled,rounded", fillcolor="{fill}", color="#b0b0b0"'
        lines += [f"  subgraph cluster_{cluster} {{", f"    graph [label={cluster}, {style}];"]
        lines += _module_clusters(tree, "", cluster, node_id, depth=2)
        lines.append("  }")
    for node in nodes:
        for src in node["inputs"]:
            style = _edge_style(side.get(src, ""), node)
            lines.append(f"  {_quote(src)} -> {_quote(node['name'])}{style};")
    lines += _layout_edges(nodes)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _module_clusters(tree: _Tree, path: str, cluster: str, node_id: str, depth: int) -> list[str]:
    pad = "  " * depth
    out = [
        f"{pad}{_quote(n['name'])} [{_attrs(_node_style(n, node_id))}];"
        for n in tree.own.get(path, [])
        if _cluster(n) == cluster
    ]
    for child in tree.children.get(path, []):
        body = _module_clusters(tree, child, cluster, node_id, depth + 1)
        if not body:
            continue
        label = child.rsplit(".", 1)[-1] + (
            f" ({tree.types[child]})" if child in tree.types else ""
        )
        ident = _quote(f"cluster_{cluster}_{child}")
        out += [
            f"{pad}subgraph {ident} {{",
            f'{pad}  graph [label={_quote(label)}, style="rounded,dashed", color="#9a9a9a", '
            "fontsize=10];",
            *body,
            f"{pad}}}",
        ]
    return out


def _layout_edges(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
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
    if dst["side"] == "forward" and src_side not in ("forward", ""):
        # A recomputed node also feeds the forward. Drawing it only in the backward cluster
        # would pull the forward below the backward, so this edge does not rank the layout.
        return " [style=dashed, constraint=false]"
    return ""


def _node_label(node: Mapping[str, Any]) -> str:
    """name / op target (or role) / input or gradient name / shape dtype / saved, recomputed."""
    what = node.get("target") or node.get("role") or ""
    lines = [node["name"], f"{node['op']} {what}".strip()]
    if node.get("input_name"):
        lines.append(str(node["input_name"]))
    if node.get("grad_of"):
        lines.append(f"grad of {node['grad_of']}")
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


def _node_style(node: Mapping[str, Any], node_id: str = "") -> dict[str, str]:
    attrs = {"label": _node_label(node)}
    if node_id:
        attrs["id"] = f"{node_id}{node['name']}"
    if node.get("line"):
        attrs["tooltip"] = str(node["line"])
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


# --- pictures -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Picture:
    key: str  # unique in the page: "<folder>/<scope>"
    folder: str
    scope: str  # module path, "" for the root, "<path>#k" for a part of its own nodes, "*" whole
    dot: str
    members: tuple[str, ...] = ()  # names of the nodes drawn one by one


def _pictures(folder: str, graph: Mapping[str, Any], budget: int) -> list[_Picture]:
    nodes = graph["nodes"]
    if len(nodes) <= budget:
        prefix = f"{folder}::*::"
        return [_Picture(f"{folder}/*", folder, "*", graph_dot(graph, node_id=prefix))]
    tree = _Tree.build(nodes)
    side = {n["name"]: n["side"] for n in nodes}
    out = []
    for path in tree.own:
        own = tree.own[path]
        parts = [own[i : i + budget] for i in range(0, len(own), budget)] if own else [[]]
        scope_nodes = tree.subtree_nodes(path)
        if len(parts) > 1:  # too many own nodes: one box per part, one picture per part
            part_of = {n["name"]: k for k, part in enumerate(parts) for n in part}
            boxes = _child_boxes(tree, path, scope_nodes, part_of)
            out.append(_picture(folder, path, [], boxes, scope_nodes, side, tree))
            for k, part in enumerate(parts):
                scope = f"{path}#{k}"
                out.append(_picture(folder, scope, part, {}, part, side, tree))
        elif own or tree.children.get(path):
            boxes = _child_boxes(tree, path, scope_nodes, {})
            out.append(_picture(folder, path, own, boxes, scope_nodes, side, tree))
    return out


def _child_boxes(
    tree: _Tree, path: str, scope_nodes: Sequence[Mapping[str, Any]], part_of: Mapping[str, int]
) -> dict[str, tuple[str, str]]:
    """Node name -> (box target scope, cluster) for the nodes drawn inside a box."""
    boxes = {}
    for node in scope_nodes:
        module = tree.module[node["name"]]
        if module == path:
            if node["name"] in part_of:
                boxes[node["name"]] = (f"{path}#{part_of[node['name']]}", _cluster(node))
            continue
        boxes[node["name"]] = (_child_under(module, path), _cluster(node))
    return boxes


def _picture(
    folder: str,
    scope: str,
    own: Sequence[Mapping[str, Any]],
    boxes: Mapping[str, tuple[str, str]],
    scope_nodes: Sequence[Mapping[str, Any]],
    side: Mapping[str, str],
    tree: _Tree,
) -> _Picture:
    prefix = f"{folder}::{scope}::"
    own_names = {n["name"] for n in own}
    box_count: dict[tuple[str, str], int] = {}
    for target, cluster in boxes.values():
        box_count[(target, cluster)] = box_count.get((target, cluster), 0) + 1
    clusters: dict[str, list[str]] = {"forward": [], "backward": []}
    for node in own:
        clusters[_cluster(node)].append(
            f"    {_quote(node['name'])} [{_attrs(_node_style(node, prefix))}];"
        )
    for (target, cluster), count in sorted(box_count.items()):
        if "#" in target:
            base, k = target.rsplit("#", 1)
            label = f"{base or 'top level'}, part {int(k) + 1}\n{cluster}: {count} nodes"
        else:
            kind = f" ({tree.types[target]})" if target in tree.types else ""
            label = f"{target.rsplit('.', 1)[-1]}{kind}\n{cluster}: {count} nodes"
        attrs = {
            "label": label,
            "shape": "box3d",
            "style": "filled",
            "fillcolor": _BOX_FILL,
            "href": f"#{_anchor(folder, target)}",
            "tooltip": f"open {target or 'top level'}",
            "id": f"{prefix}box:{target}:{cluster}",
        }
        clusters[cluster].append(f"    {_quote(_box_name(target, cluster))} [{_attrs(attrs)}];")

    def rep(name: str) -> str | None:
        if name in own_names:
            return name
        if name in boxes:
            return _box_name(*boxes[name])
        return None

    lines = [f"digraph {_quote(scope)} {{", _DOT_DEFAULTS, _DOT_LIMITS]
    for cluster, body in clusters.items():
        if body:
            fill = "#f4f8fc" if cluster == "forward" else "#fcf6f2"
            lines += [
                f"  subgraph cluster_{cluster} {{",
                f'    graph [label={cluster}, style="filled,rounded", fillcolor="{fill}", '
                'color="#b0b0b0"];',
                *body,
                "  }",
            ]
    edges: dict[tuple[str, str], str] = {}
    stubs: dict[str, str] = {}
    extra = 0
    for node in scope_nodes:
        dst = rep(node["name"])
        if dst is None:
            continue
        for src_name in node["inputs"]:
            src = rep(src_name)
            if src is None:
                if src_name not in stubs and len(stubs) >= _STUB_LIMIT:
                    extra += 1
                    continue
                src = stubs.setdefault(src_name, f"in:{src_name}")
            if src != dst and (src, dst) not in edges:
                style = _edge_style(side.get(src_name, ""), node) if src_name in own_names else ""
                edges[(src, dst)] = style
    for name, stub in stubs.items():
        module = tree.module.get(name, "")
        label = f"{name}\n{module}" if module else name
        attrs = {"label": label, "shape": "note", "fontsize": "8", "color": "#9a9a9a"}
        lines.append(f"  {_quote(stub)} [{_attrs(attrs)}];")
    if extra:
        lines.append(f'  "in:more" [label="+{extra} more inputs", shape=note, fontsize=8];')
    lines += [f"  {_quote(a)} -> {_quote(b)}{style};" for (a, b), style in edges.items()]
    lines.append("}")
    dot = "\n".join(lines) + "\n"
    return _Picture(f"{folder}/{scope}", folder, scope, dot, tuple(n["name"] for n in own))


def _box_name(target: str, cluster: str) -> str:
    return f"box:{target}:{cluster}"


def _anchor(folder: str, scope: str) -> str:
    return f"{folder}--m--{scope}" if scope else f"{folder}--m--"


# --- layout ---------------------------------------------------------------------------------


def _render_all(pictures: Sequence[_Picture], budget_s: float) -> dict[str, str]:
    """SVG text per picture key, for those laid out before the deadline."""
    deadline = time.monotonic() + budget_s
    batches = [list(pictures[i : i + _BATCH]) for i in range(0, len(pictures), _BATCH)]
    out: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(lambda b: _render_batch(b, deadline), batches):
            out.update(result)
    return out


def _render_batch(batch: Sequence[_Picture], deadline: float) -> dict[str, str]:
    """One dot process for several pictures; when it misses the deadline, each picture alone
    (so one slow picture does not cost the others), each with what time is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        return {}
    svgs = _run_dot("".join(p.dot for p in batch), left)
    if svgs is not None and len(svgs) == len(batch):
        return {p.key: _inline_svg(s, p.key) for p, s in zip(batch, svgs)}
    out = {}
    for picture in batch if len(batch) > 1 else ():
        left = deadline - time.monotonic()
        one = _run_dot(picture.dot, left) if left > 0 else None
        if one:
            out[picture.key] = _inline_svg(one[0], picture.key)
    return out


def _run_dot(dot: str, timeout: float) -> list[str] | None:
    try:
        done = subprocess.run(
            ["dot", "-Tsvg"],
            input=dot,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    if done.returncode != 0:
        return None
    return [part for part in re.split(r"(?=<\?xml)", done.stdout) if "<svg" in part]


def _inline_svg(svg: str, key: str) -> str:
    """SVG markup to inline into HTML: XML prolog and doctype dropped, ids unique per picture."""
    svg = svg[svg.index("<svg") :]
    return re.sub(r' id="(graph|clust|edge|a_)', lambda m: f' id="{_esc(key)}-{m.group(1)}', svg)


# --- HTML -----------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 24px 24px; color: #222; }
header { position: sticky; top: 0; background: #fff; padding: 10px 0; z-index: 5;
  border-bottom: 1px solid #ddd; }
h1 { font-size: 22px; margin: 0 0 6px; } h2 { font-size: 18px; margin: 0 0 8px; }
section { border: 1px solid #ccc; border-radius: 6px; padding: 14px 18px; margin: 18px 0; }
section.failed { border-color: #c0392b; background: #fff6f5; }
table.facts td:first-child { color: #555; padding-right: 16px; vertical-align: top;
  white-space: nowrap; }
table.facts td { padding: 2px 0; }
.note { background: #fff4d6; border: 1px solid #e0b84c; padding: 8px 12px; border-radius: 4px; }
pre.error { background: #fdecea; border: 1px solid #e5a19b; padding: 8px; white-space: pre-wrap; }
.viewport { position: relative; overflow: hidden; height: 70vh; min-height: 160px;
  border: 1px solid #ddd; border-radius: 4px; background: #fcfcfc; cursor: grab; margin: 6px 0; }
.viewport svg { transform-origin: 0 0; position: absolute; left: 0; top: 0; }
.zoom { position: absolute; right: 6px; top: 6px; z-index: 2; }
.zoom button { width: 30px; height: 26px; margin-left: 2px; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 8px; border-radius: 4px;
  border: 1px solid #999; font-size: 12px; }
details.module { margin: 2px 0 2px 14px; }
details.module > summary { cursor: pointer; }
details.module > summary .count { color: #777; font-size: 12px; }
ul.nodes { list-style: none; padding-left: 14px; margin: 4px 0; font: 12px/1.4 monospace; }
ul.nodes li { white-space: pre; overflow-x: auto; }
ul.nodes li .where { color: #777; }
ul.nodes li.hit, g.node.hit > * { background: #ffe25c; outline: 2px solid #e0a800; }
g.node.hit polygon, g.node.hit path, g.node.hit ellipse { stroke: #e0a800; stroke-width: 4px; }
.side-backward, .side-both, .side-tangent { color: #8a4b08; }
ul.files { columns: 3; padding-left: 18px; margin: 4px 0; }
pre.code { max-height: 60vh; overflow: auto; background: #f7f7f7; padding: 8px; font-size: 12px; }
#search { width: 420px; font-size: 14px; padding: 3px 6px; }
#search-results { max-height: 30vh; overflow: auto; font-size: 13px; }
code { font-size: 12px; }
"""

_SCRIPT = """
(function () {
  function reveal(el) {
    for (var p = el; p; p = p.parentElement) if (p.tagName === 'DETAILS') p.open = true;
  }
  function setup(vp) {
    var svg = vp.querySelector('svg');
    if (!svg || vp.dataset.ready) return;
    vp.dataset.ready = '1';
    var w = parseFloat(svg.getAttribute('width')) * 4 / 3, h = parseFloat(svg.getAttribute('height')) * 4 / 3;
    svg.style.width = w + 'px'; svg.style.height = h + 'px';
    var s = 1, x = 0, y = 0, drag = null;
    function apply() { svg.style.transform = 'translate(' + x + 'px,' + y + 'px) scale(' + s + ')'; }
    function fit() {
      var W = vp.clientWidth || 800, H = Math.max(240, 0.7 * window.innerHeight);
      s = Math.min(W / w, H / h, 1.5);
      vp.style.height = Math.max(160, Math.ceil(h * s) + 12) + 'px';
      x = (W - w * s) / 2; y = 6; apply();
    }
    function zoom(k, px, py) { x = px - (px - x) * k; y = py - (py - y) * k; s *= k; apply(); }
    vp.addEventListener('wheel', function (e) {
      e.preventDefault(); var r = vp.getBoundingClientRect();
      zoom(Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
    }, { passive: false });
    vp.addEventListener('mousedown', function (e) {
      if (e.target.closest('a') || e.target.closest('button')) return;
      drag = [e.clientX - x, e.clientY - y];
    });
    window.addEventListener('mousemove', function (e) {
      if (drag) { x = e.clientX - drag[0]; y = e.clientY - drag[1]; apply(); }
    });
    window.addEventListener('mouseup', function () { drag = null; });
    vp.querySelector('.zin').onclick = function () { zoom(1.25, vp.clientWidth / 2, vp.clientHeight / 2); };
    vp.querySelector('.zout').onclick = function () { zoom(0.8, vp.clientWidth / 2, vp.clientHeight / 2); };
    vp.querySelector('.zfit').onclick = fit;
    vp.centerOn = function (g) {
      var b = g.getBBox(), ctm = g.getCTM(), root = svg.getCTM();
      var cx = (b.x + b.width / 2), cy = (b.y + b.height / 2);
      if (ctm && root) { var m = root.inverse().multiply(ctm); cx = m.a * cx + m.c * cy + m.e; cy = m.b * cx + m.d * cy + m.f; }
      var vb = svg.viewBox.baseVal, kx = w / (vb.width || w), ky = h / (vb.height || h);
      s = Math.max(s, 1); x = vp.clientWidth / 2 - (cx - vb.x) * kx * s; y = vp.clientHeight / 2 - (cy - vb.y) * ky * s; apply();
    };
    fit();
  }
  function setupVisible(root) {
    (root || document).querySelectorAll('.viewport').forEach(function (vp) {
      if (vp.offsetParent !== null) setup(vp);
    });
  }
  document.querySelectorAll('details').forEach(function (d) {
    d.addEventListener('toggle', function () { if (d.open) setupVisible(d); });
  });
  function openHash() {
    var id = decodeURIComponent(location.hash.slice(1)); var el = id && document.getElementById(id);
    if (el) { reveal(el); setupVisible(el); el.scrollIntoView(); }
  }
  window.addEventListener('hashchange', openHash);
  var box = document.getElementById('search'), out = document.getElementById('search-results');
  var items = Array.prototype.slice.call(document.querySelectorAll('ul.nodes li[data-k]'));
  var svgNodes = Array.prototype.slice.call(document.querySelectorAll('g.node[id]'));
  function search() {
    var q = box.value.trim().toLowerCase();
    document.querySelectorAll('.hit').forEach(function (e) { e.classList.remove('hit'); });
    out.innerHTML = '';
    out.dataset.count = '0';
    if (!q) return;
    var hits = items.filter(function (li) { return li.dataset.k.indexOf(q) >= 0; });
    var keys = {};
    hits.forEach(function (li) { li.classList.add('hit'); keys[li.dataset.g + '::' + li.dataset.n] = 1; });
    svgNodes.forEach(function (g) {
      var parts = g.id.split('::');
      if (parts.length >= 3 && keys[parts[0] + '::' + parts.slice(2).join('::')]) g.classList.add('hit');
    });
    out.dataset.count = String(hits.length);
    var head = document.createElement('p');
    head.textContent = hits.length + ' node(s) match "' + q + '"' + (hits.length > 200 ? ' (first 200 listed)' : '');
    out.appendChild(head);
    var ol = document.createElement('ol');
    hits.slice(0, 200).forEach(function (li) {
      var a = document.createElement('a'); a.href = '#' + li.id;
      a.textContent = li.dataset.g + ' / ' + (li.dataset.m || 'top level') + ' / ' + li.dataset.n;
      a.onclick = function (e) {
        e.preventDefault(); reveal(li); setupVisible(li.closest('section'));
        li.scrollIntoView({ block: 'center' });
        var det = li.closest('details.module') || li.closest('section');
        var g = det && det.querySelector('g.node.hit');
        var vp = g && g.closest('.viewport'); if (vp && vp.centerOn) vp.centerOn(g);
      };
      var item = document.createElement('li'); item.appendChild(a); ol.appendChild(item);
    });
    out.appendChild(ol);
    hits.slice(0, 50).forEach(function (li) { reveal(li); });
    setupVisible();
  }
  var timer = null;
  box.addEventListener('input', function () { clearTimeout(timer); timer = setTimeout(search, 200); });
  var q = new URLSearchParams(location.search).get('q');
  if (q) { box.value = q; search(); }
  setupVisible();
  openHash();
})();
"""


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
        f'<span style="background:{_INPUT_FILL}">input</span>'
        f'<span style="background:{_TANGENT_FILL}">tangent</span>'
        f'<span style="background:{_SAVED_FILL};border:2px solid {_SAVED_BORDER}">'
        "saved for backward</span>"
        f'<span style="background:{_RECOMPUTED_FILL};border:1px dashed #2e7d32">'
        "recomputed in backward</span>"
        f'<span style="background:{_BOX_FILL}">module (click to open)</span>'
        f'<span style="border-color:{_SAVED_BORDER};color:{_SAVED_BORDER}">'
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
    pictures: Sequence[_Picture],
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
    tree = _Tree.build(graph["nodes"])
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
    tree: _Tree,
    path: str,
    svgs: Mapping[str, str],
    pictures: Mapping[str, _Picture],
    graph: Mapping[str, Any],
) -> str:
    nodes = tree.subtree_nodes(path)
    if not nodes:
        return ""
    sides = {"forward": 0, "backward": 0}
    for n in nodes:
        sides[_cluster(n)] += 1
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
                f'<details class="module" id="{_esc(_anchor(folder, k))}"><summary>part '
                f"{index + 1} of {label}</summary>{_viewport(svgs.get(pictures[k].key), folder)}"
                f"{_nodes_html(folder, chunk, path)}</details>"
            )
    elif own:
        body.append(_nodes_html(folder, own, path))
    for child in tree.children.get(path, []):
        body.append(_module_html(folder, tree, child, svgs, pictures, graph))
    opened = " open" if path == "" else ""
    return (
        f'<details class="module" id="{_esc(_anchor(folder, path))}"{opened}>'
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
