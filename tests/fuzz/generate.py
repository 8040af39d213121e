"""Random programs as Python source text, for the differential fuzzer.

`generate(seed) -> Program` builds one program: a `make_inputs()` (independent, non-leaf,
aliased-view, duplicate and non-contiguous inputs), a function `f` of views, in-place ops on
inputs, views and intermediates, metadata mutations, detach/requires_grad_, no_grad/enable_grad
regions, dtype casts and seeded RNG, its outputs, and which outputs a backward uses. Each
statement is chosen against live eager tensors (the candidate is executed as it is generated and
dropped if eager rejects it, except, rarely, as the program's last statement, so refusals are
fuzzed too). `Program.source()` is a runnable file: a failure prints a program anyone can run.
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from collections.abc import Callable

import torch

SHAPES = [(3,), (4,), (2, 3), (3, 4), (1, 3), (4, 1), (2, 3, 4), (3, 1, 2)]


@dataclasses.dataclass
class Program:
    """One program: source lines of `make_inputs`, the body of `f`, its outputs, and the
    positions of the outputs whose gradients a backward uses."""

    seed: int
    input_lines: list[str]  # body of make_inputs(); ends with `return [...]`
    num_args: int
    body: list[list[str]]  # statements of f; a statement is one line or a `with` block
    outputs: list[str]  # expressions f returns
    backward: list[int]  # positions in outputs that get a cotangent
    write_outputs: bool = False  # after backward, write into each output in place

    def function_source(self) -> str:
        args = ", ".join(f"a{i}" for i in range(self.num_args))
        lines = [f"def f({args}):"]
        for stmt in self.body:
            lines += ["    " + line for line in stmt]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines) + "\n"

    def inputs_source(self) -> str:
        return "def make_inputs():\n" + textwrap.indent("\n".join(self.input_lines), "    ") + "\n"

    def source(self, mode: str = "trace") -> str:
        return (
            f"# aotc fuzz program, seed {self.seed}; run from the repository root:\n"
            f"#   PYTHONPATH=. python this_file.py\n"
            "import torch\n\n\n"
            + self.inputs_source()
            + "\n\n"
            + self.function_source()
            + "\n\nif __name__ == '__main__':\n"
            "    from tests.fuzz.compare import check\n\n"
            f"    print(check(f, make_inputs, backward={self.backward!r}, "
            f"write_outputs={self.write_outputs!r}, mode={mode!r}))\n"
        )

    def compile(self) -> tuple[Callable[..., object], Callable[[], list[object]]]:
        """The program's `f` and `make_inputs` as Python functions."""
        namespace: dict[str, object] = {"torch": torch}
        exec(compile(self.inputs_source(), f"<fuzz inputs {self.seed}>", "exec"), namespace)  # noqa: S102
        code = compile(self.function_source(), f"<fuzz program {self.seed}>", "exec")
        exec(code, namespace)  # noqa: S102
        return namespace["f"], namespace["make_inputs"]  # type: ignore[return-value]


# ------------------------------------------------------------------------------------- inputs


def _shape(rng: random.Random) -> tuple[int, ...]:
    return rng.choice(SHAPES)


def _randn(shape: tuple[int, ...], dtype: str, rg: bool) -> str:
    extra = f", dtype=torch.{dtype}" if dtype != "float32" else ""
    return f"torch.randn({shape!r}{extra}{', requires_grad=True' if rg else ''})"


def _inputs(rng: random.Random) -> tuple[list[str], int]:
    lines: list[str] = []
    args: list[str] = []
    n = rng.randint(1, 3)
    k = 0
    while len(args) < n:
        kind = rng.choices(
            ["leaf", "nonleaf", "plain", "views", "dup", "strided"], [3, 2, 3, 2, 1, 1]
        )[0]
        dtype = "float64" if rng.random() < 0.1 else "float32"
        name = f"x{k}"
        k += 1
        if kind == "leaf":
            lines.append(f"{name} = {_randn(_shape(rng), dtype, True)}")
            args.append(name)
        elif kind == "nonleaf":
            lines.append(f"{name} = {_randn(_shape(rng), dtype, True)} * 1.0")
            args.append(name)
        elif kind == "plain" or (kind == "dup" and not args):
            lines.append(f"{name} = {_randn(_shape(rng), dtype, False)}")
            args.append(name)
        elif kind == "dup":
            args.append(rng.choice(args))
        elif kind == "strided":
            lines.append(f"{name} = {_randn((4, 3), dtype, rng.random() < 0.5)}.t()")
            args.append(name)
        else:  # two or three views of one base
            rg = rng.random() < 0.6
            base = _randn((3, 2, 4), dtype, rg) + (" * 1.0" if rg and rng.random() < 0.5 else "")
            lines.append(f"{name} = {base}")
            views = [f"{name}[0]", f"{name}[2]", f"{name}[:, 1]", f"{name}.view(-1)", f"{name}[1]"]
            for v in rng.sample(views, rng.randint(2, 3)):
                args.append(v)
    lines.append(f"return [{', '.join(args)}]")
    return lines, len(args)


# --------------------------------------------------------------------------------- statements

FLOAT_UNARY = [
    "{a}.sin()",
    "{a}.tanh()",
    "{a}.relu()",
    "{a}.neg()",
    "torch.sigmoid({a})",
    "{a} * 2.5",
    "{a} + 1.0",
    "{a}.exp()",
    "{a}.clone()",
    "{a}.contiguous()",
    "{a} ** 2",
    "{a}.abs()",
]
BINARY = [
    "{a} + {b}",
    "{a} * {b}",
    "{a} - {b}",
    "torch.maximum({a}, {b})",
    "torch.where({a} > 0, {a}, {b})",
]
REDUCE = [
    "{a}.sum()",
    "{a}.sum({d})",
    "{a}.sum({d}, keepdim=True)",
    "{a}.mean({d})",
    "{a}.amax({d})",
]
VIEW = [
    "{a}.t()",
    "{a}.transpose(0, {d})",
    "{a}.unsqueeze({d})",
    "{a}.squeeze()",
    "{a}.squeeze({d})",
    "{a}.view(-1)",
    "{a}.reshape(-1)",
    "{a}[1:]",
    "{a}[..., ::2]",
    "{a}[0]",
    "{a}[-1]",
    "{a}.narrow({d}, 1, 1)",
    "{a}.expand(2, *{a}.shape)",
    "{a}.diagonal()",
    "{a}.unbind({d})[{k}]",
    "{a}.split(1, {d})[{k}]",
    "{a}.chunk(2, {d})[{k}]",
    "{a}.movedim(0, -1)",
    "{a}.flatten()[1:]",
    "{a}.as_strided((2,), (1,), 1)",
]
DETACH = ["{a}.detach()", "{a}.detach().requires_grad_()", "{a}.detach().clone()"]
CAST = ["{a}.double()", "{a}.float()", "{a}.to(torch.float16).float()", "({a} > 0).float()"]
RANDOM = [
    "torch.rand_like({a})",
    "torch.nn.functional.dropout({a}, 0.5, training=True)",
    "{a} * torch.randn({shape})",
]
IN_PLACE = [
    "{a}.add_({b})",
    "{a}.mul_(2.0)",
    "{a}.mul_({b})",
    "{a}.zero_()",
    "{a}.fill_(0.5)",
    "{a}.copy_({b})",
    "{a}.clamp_(min=-0.5)",
    "{a}.relu_()",
    "{a}.sigmoid_()",
    "{a}.masked_fill_({a} > 0, 1.0)",
    "{a}.index_put_((torch.tensor([0]),), torch.tensor(3.0, dtype={a}.dtype))",
    "{a}[0] = 1.5",
    "{a}.detach().zero_()",
    "{a}.detach().mul_(3.0)",
    "{a}.expand(2, *{a}.shape).zero_()",
    "{a}.expand(2, *{a}.shape).fill_(1.0)",
    "{a}.expand(2, *{a}.shape).masked_fill_({a}.expand(2, *{a}.shape) > 0, 2.0)",
    "{a}.requires_grad_()",
]
METADATA = [
    "{a}.t_()",
    "{a}.transpose_(0, {d})",
    "{a}.squeeze_()",
    "{a}.squeeze_({d})",
    "{a}.unsqueeze_({d})",
    "{a}.as_strided_({a}.shape, {a}.stride())",
]
GRAD_MODES = [
    "torch.no_grad()",
    "torch.enable_grad()",
    "torch.set_grad_enabled(False)",
    "torch.inference_mode(False)",
]
# Heuristic: weights of the statement kinds, chosen so views, in-place ops and metadata mutations
# dominate (the classes of issue #13) while every kind stays frequent.
KINDS = {
    "unary": 3,
    "binary": 3,
    "reduce": 1,
    "view": 4,
    "detach": 2,
    "cast": 1,
    "random": 1,
    "inplace": 5,
    "metadata": 2,
    "block": 2,
}


class _Env:
    """Live eager values of one generation run, to keep candidate statements valid."""

    def __init__(self, make_inputs_source: str, num_args: int) -> None:
        self.scope: dict[str, object] = {"torch": torch}
        exec(make_inputs_source, self.scope)  # noqa: S102
        torch.manual_seed(0)
        args = self.scope["make_inputs"]()  # type: ignore[operator]
        for i, a in enumerate(args):
            self.scope[f"a{i}"] = a
        self.names = [f"a{i}" for i in range(num_args)]
        self.count = 0

    def tensors(self) -> list[str]:
        return [n for n in self.names if isinstance(self.scope.get(n), torch.Tensor)]

    def run(self, lines: list[str]) -> BaseException | None:
        try:
            exec("\n".join(lines), self.scope)  # noqa: S102
        except Exception as e:  # noqa: BLE001 eager refused the candidate
            return e
        return None


def _pick(rng: random.Random, names: list[str]) -> str:
    # Heuristic: prefer recent values, so chains (view of a view, write into a view) form.
    weights = [1 + i for i in range(len(names))]
    return rng.choices(names, weights)[0]


def _fill(rng: random.Random, template: str, env: _Env, names: list[str]) -> str:
    a = _pick(rng, names)
    t = env.scope[a]
    assert isinstance(t, torch.Tensor)
    dim = max(t.dim(), 1)
    return template.format(
        a=a,
        b=_pick(rng, names),
        d=rng.randrange(dim),
        k=rng.randrange(2),
        shape=tuple(t.shape),
    )


def _statement(rng: random.Random, env: _Env, depth: int = 0) -> list[str] | None:
    names = env.tensors()
    if not names:
        return None
    kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
    if kind == "block" and depth == 0:
        inner = [s for _ in range(rng.randint(1, 3)) if (s := _statement(rng, env, 1))]
        # the inner statements already ran: run them again under the mode to keep env exact
        return [f"with {rng.choice(GRAD_MODES)}:"] + ["    " + line for s in inner for line in s]
    if kind == "block":
        kind = "inplace"
    table = {
        "unary": FLOAT_UNARY,
        "binary": BINARY,
        "reduce": REDUCE,
        "view": VIEW,
        "detach": DETACH,
        "cast": CAST,
        "random": RANDOM,
        "inplace": IN_PLACE,
        "metadata": METADATA,
    }[kind]
    expr = _fill(rng, rng.choice(table), env, names)
    if kind in ("inplace", "metadata"):
        return [expr]
    name = f"v{env.count}"
    env.count += 1
    env.names.append(name)
    return [f"{name} = {expr}"]


def generate(seed: int, max_statements: int = 8) -> Program:
    rng = random.Random(seed)
    input_lines, num_args = _inputs(rng)
    program = Program(seed, input_lines, num_args, [], [], [])
    env = _Env(program.inputs_source(), num_args)
    failed_last = False
    for _ in range(rng.randint(1, max_statements)):
        for _attempt in range(6):
            saved_names, saved_count = list(env.names), env.count
            stmt = _statement(rng, env)
            if stmt is None:
                break
            candidate = Program(seed, input_lines, num_args, [*program.body, stmt], [], [])
            error = _replay(candidate, env)
            if error is None:
                program.body.append(stmt)
                break
            env.names, env.count = saved_names, saved_count
            if rng.random() < 0.04:  # keep an eager refusal as the last statement
                program.body.append(stmt)
                failed_last = True
                break
        if failed_last:
            break
    names = [n for n in env.names if n in env.scope] if not failed_last else env.names[:num_args]
    program.outputs = _outputs(rng, env, names)
    live = _run_outputs(program)
    diff = [j for j, o in enumerate(live) if isinstance(o, torch.Tensor) and o.requires_grad]
    program.backward = sorted(rng.sample(diff, rng.randint(0, len(diff)))) if diff else []
    program.write_outputs = rng.random() < 0.3
    return program


def _replay(program: Program, env: _Env) -> BaseException | None:
    """Run the program so far from fresh inputs (so `with` blocks and in-place ops see exactly
    the values the final program will); on success the env holds its values."""
    fresh = _Env(program.inputs_source(), program.num_args)
    lines = [line for stmt in program.body for line in stmt]
    error = fresh.run(lines)
    if error is None:
        env.scope = fresh.scope
    return error


def _outputs(rng: random.Random, env: _Env, names: list[str]) -> list[str]:
    tensors = [n for n in names if isinstance(env.scope.get(n), torch.Tensor)]
    outs = [_pick(rng, tensors) for _ in range(rng.randint(1, 3))] if tensors else []
    if tensors and rng.random() < 0.1:
        outs.append(f"{rng.choice(tensors)}.shape[0]")
    if rng.random() < 0.05:
        outs.append("None")
    return outs or ["None"]


def _run_outputs(program: Program) -> list[object]:
    f, make_inputs = program.compile()
    torch.manual_seed(0)
    try:
        return list(f(*make_inputs()))
    except Exception:  # noqa: BLE001 a program ending in an eager refusal
        return []
