"""The report's pictures: module trees, DOT text, and layout with a deadline (aotc/report.py).

`graph_dot(graph)` is the whole joint graph of one 08_graph.json (forward and backward clusters,
nested module clusters); `pictures_of(folder, graph, budget)` the pictures the page shows (the
whole graph when it fits the budget, else one per module, see Note [Pictures per module] in
aotc/report.py); `render_all(pictures, seconds)` their SVGs from Graphviz `dot`, for those laid
out before the deadline.
"""

from __future__ import annotations

import html
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Heuristic: dot lays out a 150-node picture in well under a second; pictures of ~1000 nodes
# took minutes (a 6-layer GPT-2 joint graph of 1,078 nodes ran 20 minutes without finishing).
NODE_BUDGET = 150
LAYOUT_SECONDS = 40.0  # for every picture of one report together
_STUB_LIMIT = 24  # outside inputs drawn per picture; the rest are one "+N more" stub
_BATCH = 12  # pictures per dot process

# Colors of the picture, shared by the DOT attributes and the page's legend.
SAVED_BORDER = "#c0392b"
SAVED_FILL = "#fde3c8"
RECOMPUTED_FILL = "#dff3e4"
TANGENT_FILL = "#e9e3f5"
INPUT_FILL = "#e3eef9"
BOX_FILL = "#fff7d6"


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
class ModuleTree:
    """Module paths of one graph: own nodes per path, and the paths under each path."""

    own: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    module: dict[str, str] = field(default_factory=dict)  # node name -> module path

    @staticmethod
    def build(nodes: Sequence[Mapping[str, Any]]) -> ModuleTree:
        tree = ModuleTree()
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


def cluster_of(node: Mapping[str, Any]) -> str:
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
    tree = ModuleTree.build(nodes)
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


def _module_clusters(
    tree: ModuleTree, path: str, cluster: str, node_id: str, depth: int
) -> list[str]:
    pad = "  " * depth
    out = [
        f"{pad}{_quote(n['name'])} [{_attrs(_node_style(n, node_id))}];"
        for n in tree.own.get(path, [])
        if cluster_of(n) == cluster
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
        return f' [color="{SAVED_BORDER}", penwidth=2]'  # crosses the cut: the value is saved
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
        attrs["fillcolor"] = TANGENT_FILL
    elif node["op"] == "placeholder":
        attrs["fillcolor"] = INPUT_FILL
    if node["side"] == "both":
        attrs.update(style="rounded,filled,dashed", fillcolor=RECOMPUTED_FILL, color="#2e7d32")
    if node["saved"]:
        attrs.update(color=SAVED_BORDER, penwidth="2.5", fillcolor=SAVED_FILL)
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
class Picture:
    key: str  # unique in the page: "<folder>/<scope>"
    folder: str
    scope: str  # module path, "" for the root, "<path>#k" for a part of its own nodes, "*" whole
    dot: str
    members: tuple[str, ...] = ()  # names of the nodes drawn one by one


def pictures_of(folder: str, graph: Mapping[str, Any], budget: int) -> list[Picture]:
    nodes = graph["nodes"]
    if len(nodes) <= budget:
        prefix = f"{folder}::*::"
        return [Picture(f"{folder}/*", folder, "*", graph_dot(graph, node_id=prefix))]
    tree = ModuleTree.build(nodes)
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
    tree: ModuleTree,
    path: str,
    scope_nodes: Sequence[Mapping[str, Any]],
    part_of: Mapping[str, int],
) -> dict[str, tuple[str, str]]:
    """Node name -> (box target scope, cluster) for the nodes drawn inside a box."""
    boxes = {}
    for node in scope_nodes:
        module = tree.module[node["name"]]
        if module == path:
            if node["name"] in part_of:
                boxes[node["name"]] = (f"{path}#{part_of[node['name']]}", cluster_of(node))
            continue
        boxes[node["name"]] = (_child_under(module, path), cluster_of(node))
    return boxes


def _picture(
    folder: str,
    scope: str,
    own: Sequence[Mapping[str, Any]],
    boxes: Mapping[str, tuple[str, str]],
    scope_nodes: Sequence[Mapping[str, Any]],
    side: Mapping[str, str],
    tree: ModuleTree,
) -> Picture:
    prefix = f"{folder}::{scope}::"
    own_names = {n["name"] for n in own}
    box_count: dict[tuple[str, str], int] = {}
    for target, cluster in boxes.values():
        box_count[(target, cluster)] = box_count.get((target, cluster), 0) + 1
    clusters: dict[str, list[str]] = {"forward": [], "backward": []}
    for node in own:
        clusters[cluster_of(node)].append(
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
            "fillcolor": BOX_FILL,
            "href": f"#{anchor(folder, target)}",
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
    return Picture(f"{folder}/{scope}", folder, scope, dot, tuple(n["name"] for n in own))


def _box_name(target: str, cluster: str) -> str:
    return f"box:{target}:{cluster}"


def anchor(folder: str, scope: str) -> str:
    return f"{folder}--m--{scope}" if scope else f"{folder}--m--"


# --- layout ---------------------------------------------------------------------------------


def render_all(pictures: Sequence[Picture], budget_s: float) -> dict[str, str]:
    """SVG text per picture key, for those laid out before the deadline."""
    deadline = time.monotonic() + budget_s
    batches = [list(pictures[i : i + _BATCH]) for i in range(0, len(pictures), _BATCH)]
    out: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(lambda b: _render_batch(b, deadline), batches):
            out.update(result)
    return out


def _render_batch(batch: Sequence[Picture], deadline: float) -> dict[str, str]:
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


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)
