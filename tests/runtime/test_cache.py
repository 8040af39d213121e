"""The persistent compile cache: hits give eager's results, programs that differ miss, corrupt or
foreign entries are rebuilt, concurrent writers leave a valid entry, the size cap evicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import aotc
from aotc import persist
from aotc.options import CompileOptions
from aotc.runtime import cache as store
from tests.conftest import Double, assert_matches_eager, assert_module_matches_eager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def entries(d: str) -> list[str]:
    aotc.cache_flush()  # entries are written on a background thread (Note [Deferred cache stores])
    return sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".tmp"))


def stages(compiled: object) -> set[str]:
    return set(aotc.inspect(compiled)[0].stage_seconds)


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w1) @ w2


def mlp_args() -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(7, 11),
        torch.randn(11, 5, requires_grad=True),
        torch.randn(5, 3, requires_grad=True),
    )


def test_second_compile_hits_and_matches_eager(tmp_path):
    d = str(tmp_path)
    first = assert_matches_eager(mlp, mlp_args, cache_dir=d)
    assert "cache_load" not in stages(first)
    assert len(entries(d)) == 1
    second = assert_matches_eager(mlp, mlp_args, cache_dir=d)
    assert "cache_load" in stages(second) and "trace" not in stages(second)
    # The record of a hit is complete: every stage prints as on the cold compile.
    cold, warm = aotc.inspect(first)[0], aotc.inspect(second)[0]
    for (name_a, text_a), (name_b, text_b) in zip(cold.stages[:-1], warm.stages[:-1]):
        assert name_a == name_b
        assert text_a == text_b, name_a
    assert warm.partition is not None and warm.saved_bytes == cold.saved_bytes


def test_hit_with_mutation_alias_and_module(tmp_path):
    d = str(tmp_path)

    def f(x, y):
        y.mul_(2)
        return x.t(), (x * y).sum()

    def make():
        return torch.randn(4, 3, requires_grad=True) * 1, torch.randn(4, 3)

    for _ in range(2):
        assert_matches_eager(f, make, cache_dir=d)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh())

    for _ in range(2):
        compiled = assert_module_matches_eager(model, lambda: (torch.randn(5, 6),), cache_dir=d)
    assert "cache_load" in stages(compiled)


def keys(fn, *args, **options) -> str:
    """The cache key aotc computes for fn(*args)."""
    leaves = list(args)
    names = [f"a{i}" for i in range(len(args))]

    def program(user_leaves):
        out = fn(*user_leaves)
        import torch.utils._pytree as pytree

        return pytree.tree_flatten(out)

    opts = CompileOptions.from_env(cache_dir="/unused", **options)
    result = persist.cache_key(program, leaves, names, opts, torch.is_grad_enabled())
    assert result.key is not None, result.reason
    return result.key


def test_key_changes_with_body_closure_and_hyperparameters():
    x = torch.randn(3, 4, requires_grad=True)

    def body_a(x):
        return (x * 2).sin()

    def body_b(x):
        return (x * 2).cos()

    def same_as_a(x):  # different name and local, same program: may share the entry
        two = 2
        return (x * two).sin()

    assert keys(body_a, x) != keys(body_b, x)
    assert keys(body_a, x) == keys(same_as_a, x)

    def make_closure(scale):
        return lambda x: x * scale

    assert keys(make_closure(2.0), x) != keys(make_closure(2.0000001), x)
    assert keys(make_closure(2.0), x) == keys(make_closure(2.0), x)

    def module_key(module):
        params = list(module.parameters())

        def call(x, *ps):
            return torch.func.functional_call(
                module, dict(zip([n for n, _ in module.named_parameters()], ps)), (x,)
            )

        return keys(call, x, *params)

    torch.manual_seed(0)
    ln_a, ln_b = torch.nn.LayerNorm(4, eps=1e-5), torch.nn.LayerNorm(4, eps=1e-6)
    assert module_key(ln_a) != module_key(ln_b)
    drop = torch.nn.Dropout(0.1)
    train_key = module_key(drop)
    drop.eval()
    assert module_key(drop) != train_key
    # A Python int argument, requires_grad, grad mode and options are all in the key.
    f = lambda x, n: x.sum(n)
    assert keys(f, x, 0) != keys(f, x, 1)
    assert keys(body_a, x) != keys(body_a, x.detach())
    with torch.no_grad():
        no_grad_key = keys(body_a, x)
    assert no_grad_key != keys(body_a, x)
    assert keys(body_a, x, partitioner="simple") != keys(body_a, x)
    assert keys(body_a, x, memory_budget=0.5) != keys(body_a, x)


def test_key_changes_with_no_grad_region_inside():
    x = torch.randn(3, requires_grad=True)

    def plain(x):
        return x * 2

    def inside_no_grad(x):
        with torch.no_grad():
            y = x * 2
        return y

    assert keys(plain, x) != keys(inside_no_grad, x)


def test_custom_autograd_function_is_not_cached(tmp_path):
    x = torch.randn(3, requires_grad=True)
    program = lambda leaves: ([Double.apply(leaves[0])], None)
    result = persist.cache_key(program, [x], ["x"], CompileOptions(cache_dir="/unused"), True)
    assert result.key is None and "autograd.Function" in result.reason


def _compile_once(d: str) -> tuple[object, torch.Tensor, torch.Tensor]:
    args = mlp_args()
    compiled = aotc.compile(mlp, cache_dir=d)
    out = compiled(*args)
    return compiled, out, mlp(*args)


def _only_entry(d: str) -> str:
    (name,) = entries(d)
    return os.path.join(d, name)


def _rewrite_body(path: str, edit) -> None:
    """Edit the body and fix the checksum, as a malicious or foreign writer could."""
    with open(path, "rb") as f:
        head, _, body = f.read().partition(b"\n")
    new = json.dumps(edit(json.loads(body))).encode()
    header = json.loads(head)
    header["sha256"] = store.checksum(header["key"], new)
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + new)


CORRUPTIONS = {
    "truncated": lambda p: os.truncate(p, os.path.getsize(p) // 2),
    "flipped_byte": lambda p: _flip(p),
    "wrong_version": lambda p: _edit_header(p, version=999),
    "foreign_json": lambda p: _write(p, b'{"hello": "world"}\n{"a": 1}'),
    "empty": lambda p: _write(p, b""),
    "foreign_key": lambda p: _edit_header(p, key="0" * 64),
    "disallowed_op": lambda p: _rewrite_body(p, _evil_target),
    "unknown_record": lambda p: _rewrite_body(
        p,
        lambda b: json.loads(
            json.dumps(b).replace("aotc.runtime.wrappers.RuntimePlan", "os.system")
        ),
    ),
}


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) * 3 // 4] ^= 0x01
        f.seek(0)
        f.write(data)


def _edit_header(path: str, **changes: object) -> None:
    with open(path, "rb") as f:
        head, _, body = f.read().partition(b"\n")
    header = json.loads(head)
    header.update(changes)
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + body)


def _evil_target(body: dict) -> dict:
    for graph in body["graphs"]:
        for node in graph["nodes"]:
            if node["op"] == "call_function":
                node["target"] = "builtins::eval.default"
                return body
    raise AssertionError("no call node")


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_entry_is_rebuilt(tmp_path, corruption):
    d = str(tmp_path)
    _compile_once(d)
    path = _only_entry(d)
    CORRUPTIONS[corruption](path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, out, want = _compile_once(d)
    assert any("aotc cache: ignoring entry" in str(w.message) for w in caught), corruption
    assert "cache_load" not in stages(compiled)
    torch.testing.assert_close(out, want)
    # Rebuilt: the entry verifies again and the next compile hits it.
    compiled, out, want = _compile_once(d)
    assert "cache_load" in stages(compiled)
    torch.testing.assert_close(out, want)


def test_forged_entry_from_another_function_is_rejected(tmp_path):
    """An entry copied from another program with the same signature, with only its header's key
    changed, is not a hit: the checksum binds the body to its key."""
    d = str(tmp_path)

    def other(x, w1, w2):
        return torch.relu(x @ w1) @ w2 * 3

    args = mlp_args()
    aotc.compile(mlp, cache_dir=d)(*args)
    (mlp_entry,) = entries(d)
    aotc.compile(other, cache_dir=d)(*args)
    (other_entry,) = set(entries(d)) - {mlp_entry}
    with open(os.path.join(d, other_entry), "rb") as f:
        head, _, body = f.read().partition(b"\n")
    header = json.loads(head)
    header["key"] = mlp_entry.removesuffix(".json")
    with open(os.path.join(d, mlp_entry), "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + body)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, out, want = _compile_once(d)
    assert any("checksum mismatch" in str(w.message) for w in caught)
    assert "cache_load" not in stages(compiled)
    torch.testing.assert_close(out, want)


def test_entry_is_plain_json_without_code(tmp_path):
    d = str(tmp_path)
    _compile_once(d)
    with open(_only_entry(d), "rb") as f:
        head, _, body = f.read().partition(b"\n")
    header, value = json.loads(head), json.loads(body)
    assert header["format"] == "aotc-cache" and header["version"] == store.FORMAT_VERSION
    targets = {
        n.get("target") for g in value["graphs"] for n in g["nodes"] if n["op"] == "call_function"
    }
    assert targets and all(
        t.startswith(("aten::", "prims::")) or t == "operator.getitem" for t in targets
    )
    assert b"pickle" not in body and value["kernels"] == []


def _random_from(x):
    return torch.empty(4).random_(0, 5) + x, x.new_empty(3).random_(-3, 3)


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
def test_op_named_by_a_python_keyword_compiles_and_round_trips(tmp_path, capture):
    """`random_(0, 5)` traces as `aten.random.from` (`from` is a keyword): fx's generated code
    was a SyntaxError (Note [Op names that are Python keywords] in runtime/fxnames.py). It
    matches eager (same draws) on the ATen backend, from a disk-cache hit too, and every graph's
    code is valid Python."""
    d = str(tmp_path)
    make = lambda: (torch.randn(4),)  # noqa: E731
    first = assert_matches_eager(_random_from, make, cache_dir=d, capture=capture)
    second = assert_matches_eager(_random_from, make, cache_dir=d, capture=capture)
    assert "cache_load" in stages(second) and "trace" not in stages(second)
    for compiled in (first, second):
        records = aotc.inspect(compiled)
        codes = [r.forward.code for r in records]
        if capture == "trace":  # Dynamo runs `random_` itself, between its graphs
            assert any("getattr(torch.ops.aten.random, 'from')" in code for code in codes)
        for code in codes:
            compile(code, "<forward>", "exec")
        assert all(text for r in records for _, text in r.stages)  # every dump prints


def test_size_cap_evicts_least_recently_used(tmp_path):
    d = str(tmp_path)
    fns = [lambda x, k=k: x * k for k in (2.0, 3.0, 4.0)]
    x = torch.randn(5)
    sizes = []
    for f in fns:
        # Strict mode: one entry per constant (in the default mode, Dynamo makes the float
        # dynamic once it changes, and the third function reuses the second's graph).
        aotc.compile(f, cache_dir=d, capture="trace")(x)
        sizes.append(max(os.path.getsize(os.path.join(d, n)) for n in entries(d)))
    assert len(entries(d)) == 3
    oldest = sorted(entries(d), key=lambda n: os.path.getmtime(os.path.join(d, n)))
    # A hit on the oldest entry makes it the youngest.
    os.utime(os.path.join(d, oldest[0]), (1, 1))
    os.utime(os.path.join(d, oldest[1]), (2, 2))
    os.utime(os.path.join(d, oldest[2]), (3, 3))
    compiled = aotc.compile(fns[0], cache_dir=d, capture="trace")
    compiled(x)
    assert "cache_load" in stages(compiled)
    removed = store.evict(d, max_bytes=2 * max(sizes) + 10)
    assert len(entries(d)) == 2 and len(removed) == 1
    assert os.path.basename(removed[0]) != max(
        entries(d) + [os.path.basename(removed[0])],
        key=lambda n: (
            os.path.getmtime(os.path.join(d, n)) if os.path.exists(os.path.join(d, n)) else 0
        ),
    )


def test_env_options(monkeypatch, tmp_path):
    monkeypatch.setenv("AOTC_CACHE_DIR", str(tmp_path / "x"))
    assert CompileOptions.from_env().cache_dir == str(tmp_path / "x")
    monkeypatch.delenv("AOTC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert CompileOptions.from_env().cache_dir == str(tmp_path / "xdg" / "aotc")
    monkeypatch.setenv("AOTC_CACHE", "0")
    assert not persist.is_enabled(CompileOptions.from_env())
    d = str(tmp_path / "off")
    aotc.compile(mlp, cache_dir=d, cache=False)(*mlp_args())
    assert not os.path.exists(d)


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import aotc

    def mlp(x, w1, w2):
        return torch.nn.functional.gelu(x @ w1) @ w2

    torch.manual_seed(int(sys.argv[1]))
    args = (torch.randn(7, 11), torch.randn(11, 5, requires_grad=True),
            torch.randn(5, 3, requires_grad=True))
    compiled = aotc.compile(mlp, cache_dir={d!r})
    out = compiled(*args)
    out.sum().backward()
    grads = [a.grad.clone() for a in args[1:]]
    for a in args[1:]:
        a.grad = None
    ref = mlp(*args)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for g, a in zip(grads, args[1:]):
        torch.testing.assert_close(g, a.grad)
    print("hit" if "cache_load" in aotc.inspect(compiled)[0].stage_seconds else "miss")
""")


@pytest.mark.parametrize("writers", [2, pytest.param(6, marks=pytest.mark.slow)])
def test_concurrent_writers_share_one_valid_entry(tmp_path, writers):
    d = str(tmp_path / "shared")
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(root=ROOT, d=d))
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(writers)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() in ("hit", "miss")
    (name,) = entries(d)
    assert not [n for n in os.listdir(d) if n.startswith(".tmp")]
    body = store.read_entry(d, name.removesuffix(".json"))
    assert body is not None and body["graphs"]
    # This process now hits the entry the writers left.
    compiled, out, want = _compile_once(d)
    assert "cache_load" in stages(compiled)
    torch.testing.assert_close(out, want)
