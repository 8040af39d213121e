"""Triton source emission for fused groups.

Stage: `generate_kernel(plan, group, device) -> KernelSource`.
Requires: a `FusionGroup` of kind POINTWISE or REDUCTION from `passes.fusion.plan_fusion`.
Ensures: one `@triton.jit` function per group, named after the ops it fuses, with a header
comment of its source ATen ops and bytes read/written. Loads and stores are masked; fp16/bf16
values are computed and accumulated in fp32 and rounded once when stored; indices are int64
when an index can reach 2**31. Reductions are persistent (a whole row per program, values kept
in registers) when `rnumel <= PERSISTENT_RNUMEL`, else looped (one loop over r per reduction,
one more for the stored row values). Pointwise groups are 1-D over the flat element index.
With symbolic sizes (see Note [Symbolic sizes] in passes.loop_ir) the size symbols a kernel's
indices use become integer parameters after `xnumel`/`rnumel` (`KernelSource.symbols`), and
decisions that need a concrete size are conservative: such reductions are looped, indices are
int64, pointwise kernels are 1-D; block sizes are chosen at launch. One source serves all sizes.

Worked example (softmax rows of float[4, 5], persistent):

    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]; rindex = tl.arange(0, RBLOCK)[None, :]
    tmp0 = tl.load(in_x + (rindex + 5*xindex), xmask & rmask, other=0)
    tmp1 = tl.reduce(tl.where(xmask & rmask, tmp0, float("-inf")), 1,
                     tl.standard._elementwise_max)[:, None]
    ...
    tl.store(out_div + (rindex + 5*xindex), tmp5, xmask & rmask)
"""

from __future__ import annotations

import math
import re

import sympy
import torch

from aotc.passes.fusion import (
    RINDEX,
    XINDEX,
    YINDEX,
    FusionGroup,
    FusionPlan,
    GroupKind,
    is_row_level,
    member_expr,
    store_index,
    tile_columns,
)
from aotc.passes.loop_ir import (
    Const,
    Expr,
    FloorDiv,
    IndexValue,
    Indirect,
    Load,
    ModIdx,
    Op,
    is_static,
    loads_of,
)
from aotc.passes.lowering_ir import Computed
from aotc.runtime.kernels import KernelSource

# Heuristic: rows up to this many elements are reduced in registers in one pass (as in common
# softmax/LayerNorm widths); longer rows loop over r. Measured on an H200 (bench/gpu_variants.py,
# rows of 4096): softmax forward+backward at 0.75 of the copy bandwidth in registers, 0.61 looped
# (float32; bfloat16 0.76 and 0.69).
PERSISTENT_RNUMEL = 4096
# Heuristic: a reduction whose loads are contiguous along x (a sum over rows: bias and weight
# gradients) is persistent only for short rows; longer ones loop over r with wide x blocks
# (runtime.kernels.candidate_configs), so each load is a contiguous run of columns.
OUTER_PERSISTENT_RNUMEL = 64
LOOP_RBLOCK = 256
LAUNCH_RBLOCK = -1  # KernelSource.persistent_rblock: the next power of two of rnumel at launch

_TL = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float32",
    torch.bfloat16: "tl.float32",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.bool: "tl.int1",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
}
_STORE_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}

_TEMPLATES = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "neg": "(-{0})",
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.math.rsqrt({0})",
    "abs": "tl.abs({0})",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))",
    "relu": "tl.where({0} < 0, 0, {0})",
    "erf": "tl.math.erf({0})",
    "reciprocal": "(1.0 / {0})",
    "silu": "({0} / (1.0 + tl.exp(-{0})))",
    "sign": "(({0} > 0).to(tl.int8) - ({0} < 0).to(tl.int8))",
    "logical_and": "(({0} != 0) & ({1} != 0))",
    "logical_or": "(({0} != 0) | ({1} != 0))",
    "logical_not": "({0} == 0)",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "where": "tl.where({0}, {1}, {2})",
    "clamp_min": "tl.where({0} < {1}, {1}, {0})",
    "clamp_max": "tl.where({0} > {1}, {1}, {0})",
    "gelu": "(0.5 * {0} * (1.0 + tl.math.erf({0} * 0.7071067811865476)))",
    "gelu_tanh": "(0.5 * {0} * (2.0 / (1.0 + tl.exp(-2.0 * 0.7978845608028654 * ({0} + "
    "0.044715 * {0} * {0} * {0}))) ))",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    "trunc": "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))",
    "round": "_round_half_even({0})",
    "isnan": "({0} != {0})",
    "isinf": '(tl.abs({0}) == float("inf"))',
    "bitwise_and": "({0} & {1})",
    "bitwise_or": "({0} | {1})",
    "bitwise_xor": "({0} ^ {1})",
    "bitwise_not": "(~{0})",
    "lshift": "({0} << {1})",
    "rshift": "({0} >> {1})",
    # integer division and remainders, exact whichever way `//` rounds (see _HELPERS)
    "floordiv": "_floordiv({0}, {1})",
    "truncdiv": "_truncdiv({0}, {1})",
    "remainder": "({0} - _floordiv({0}, {1}) * {1})",
    "fmod": "({0} - _truncdiv({0}, {1}) * {1})",
}


# Note [Accurate tanh, log1p and expm1]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The textbook formulas cancel for small |x|: `2 / (1 + exp(-2x)) - 1`, `log(1 + x)` and
# `exp(x) - 1` all give 0 for x = 1e-10 (eager: 1e-10), and so did everything built on them by
# decompositions (softplus(-20), logsigmoid(20) and mish(-20) gave 0 instead of ~2e-9, celu(-1e-6)
# was 4.6% off; float64 tanh(1e-10) 8e-8 relative). On CUDA these ops call libdevice (`__nv_tanhf`,
# `__nv_log1pf`, `__nv_expm1f` and their double versions, what eager's CUDA kernels call too). The
# interpreter has no libdevice, so a kernel defines `_expm1` (Kahan: `(u - 1) * x / log(u)` with
# `u = exp(x)`, exact where `u` rounds to 1), `_log1p` (Goldberg: `log(u) * x / (u - 1)` with
# `u = 1 + x`) and `_tanh` (`-e / (e + 2)` with `e = expm1(-2|x|)`, the sign and a zero's sign
# put back), all in fp64, and rounds once to the op's type: within an ulp of eager's float32
# results, a few ulps of its float64 ones.
_ACCURATE = frozenset({"tanh", "log1p", "expm1"})


class CodegenError(Exception):
    pass


# Note [Interpreter-safe Triton]
# Triton's standard library (`tl.sum`, `tl.max`, `tl.zeros`, `tl.cumsum`, ...) is made of
# `@triton.jit` functions decorated when triton is imported, as interpreter functions only if
# TRITON_INTERPRET=1 was set *then*. A kernel that calls them runs in the interpreter only when
# triton was imported after that switch, so a program that imported triton (or torch._dynamo)
# before aotc could not run CPU kernels. Generated kernels therefore call only Triton builtins
# (`tl.reduce`, `tl.associative_scan`, `tl.full`, math functions) and pass the standard combine
# functions (`tl.standard._sum_combine`, ...) by reference: the interpreter recognizes them and
# never calls them, the compiler inlines them. Helpers a kernel defines itself are rebuilt as
# interpreter or compiler functions when its module is loaded (runtime.kernels.load_kernel), so
# the choice is made per kernel (by its device) and never depends on import order.

_COMBINE = {
    "sum": "tl.standard._sum_combine",
    "prod": "tl.standard._prod_combine",
    "max": "tl.standard._elementwise_max",
    "min": "tl.standard._elementwise_min",
}


def reduce_rows(kind: str, block: str) -> str:
    """A sum/max/min of a [XBLOCK, RBLOCK] block over r, as [XBLOCK] (see Note
    [Interpreter-safe Triton])."""
    return f"tl.reduce({block}, 1, {_COMBINE[kind]})"


def index_code(e: sympy.Expr) -> str:
    if e is sympy.true or e is sympy.false:  # a condition that simplified away
        return "1" if e is sympy.true else "0"
    if isinstance(e, sympy.core.relational.Relational):
        return f"({index_code(e.lhs)} {e.rel_op} {index_code(e.rhs)})"
    if isinstance(e, (sympy.And, sympy.Or)):
        op = " & " if isinstance(e, sympy.And) else " | "
        return "(" + op.join(index_code(a) for a in e.args) + ")"
    if isinstance(e, sympy.Not):
        return f"(~{index_code(e.args[0])})"
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return str(e)
    if e.is_Add:
        return "(" + " + ".join(index_code(a) for a in e.args) + ")"
    if e.is_Mul:
        return "(" + " * ".join(index_code(a) for a in e.args) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([index_code(e.base)] * int(e.exp)) + ")"
    if isinstance(e, (FloorDiv, ModIdx)):
        a, b = index_code(e.args[0]), index_code(e.args[1])
        if _nonneg(e.args[0]):
            return f"({a} // {b})" if isinstance(e, FloorDiv) else f"({a} % {b})"
        # A dividend that may be negative (a cat input's index, rewritten by the simplifier
        # under Python's rounding): floor semantics whichever way `%` rounds (C on CUDA).
        rem = f"((({a}) % {b} + {b}) % {b})"
        return f"((({a}) - {rem}) // {b})" if isinstance(e, FloorDiv) else rem
    raise CodegenError(f"cannot print index {e}")


def _nonneg(e: sympy.Expr) -> bool:
    """`e` >= 0 by its form: index and size symbols, non-negative constants, and sums,
    products, quotients and remainders of those (data symbols are not)."""
    if e.is_Integer:
        return int(e) >= 0
    if e.is_Symbol:
        return bool(e.is_nonnegative)
    if e.is_Add or e.is_Mul or isinstance(e, (FloorDiv, ModIdx)):
        return all(_nonneg(a) for a in e.args)
    if e.is_Pow:
        return _nonneg(e.base)
    return False


def _block_index(e: sympy.Expr, blocks: tuple[sympy.Symbol, ...] = (XINDEX,)) -> str:
    """An index expression with the kernel's full block shape even when it does not depend on
    every block index (pointers must be blocks of the mask's shape)."""
    code = index_code(e)
    missing = [str(b) for b in blocks if b not in e.free_symbols]
    return " + ".join([code, *[f"0 * {b}" for b in missing]])


def _const(value: object, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "1" if value else "0"
    if dtype.is_floating_point:
        v = float(value)  # type: ignore[arg-type]
        if math.isnan(v):
            return 'float("nan")'
        if v in (float("inf"), float("-inf")):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    return str(int(value))  # type: ignore[call-overload]


class _Scope:
    def __init__(self, indent: str, parent: _Scope | None, level: str) -> None:
        self.indent, self.parent, self.level = indent, parent, level
        self.lines: list[str] = []
        self.cache: dict[object, str] = {}

    def find(self, key: object) -> str | None:
        s: _Scope | None = self
        while s is not None:
            if key in s.cache:
                return s.cache[key]
            s = s.parent
        return None


class _Emitter:
    def __init__(self, group: FusionGroup, plan: FusionPlan, interpret: bool, cols: int) -> None:
        self.group, self.plan, self.interpret, self.cols = group, plan, interpret, cols
        self.blocks = (YINDEX, XINDEX) if cols else (XINDEX,)
        self.counter = 0
        self.registers: dict[str, str] = {}  # reduction member -> its row value variable
        self.buffers = plan.lowered.buffers
        self.r_symbols: set[sympy.Symbol] = {RINDEX}  # r, and data symbols whose value uses r

    def uses_r(self, e: Expr) -> bool:
        """Whether `e` varies along r (then it is computed inside the r loop)."""
        if isinstance(e, (Load, IndexValue)):
            syms = e.index.free_symbols
            if isinstance(e, Load) and e.mask is not None:
                syms = syms | e.mask.free_symbols
            return bool(syms & self.r_symbols)
        if isinstance(e, Op):
            return any(self.uses_r(a) for a in e.args)
        if isinstance(e, Indirect):
            return self.uses_r(e.index) or self.uses_r(e.body)
        return False

    def var(self) -> str:
        self.counter += 1
        return f"tmp{self.counter - 1}"

    def emit(self, e: Expr, scope: _Scope) -> str:
        if isinstance(e, Const):
            return _const(e.value, e.dtype)
        target = scope
        if scope.level == "r" and not self.uses_r(e) and scope.parent is not None:
            target = scope.parent
        hit = target.find(e)
        if hit is not None:
            return hit
        if isinstance(e, Load):
            if e.buf in self.registers:
                return self.registers[e.buf]
            size, _, _, dtype = self.buffers[e.buf]
            # only a reduction over an empty dim reads an empty buffer; a load whose mask is
            # never true (a cat input no lane reads) reads nothing: every lane is masked
            if 0 in size or e.mask is sympy.false:
                shape = (
                    "[XBLOCK, RBLOCK]"
                    if self.group.kind is GroupKind.REDUCTION
                    else "[YBLOCK, XBLOCK]"
                    if self.cols
                    else "[XBLOCK]"
                )
                name = self.var()
                target.lines.append(f"{target.indent}{name} = tl.full({shape}, 0, {_TL[dtype]})")
                target.cache[e] = name
                return name
            mask = "xmask & rmask" if self.uses_r(e) else "xmask"
            if e.mask is not None:
                mask += f" & {index_code(e.mask)}"
            code = f"tl.load(in_{e.buf} + {_block_index(e.index, self.blocks)}, {mask}, other=0)"
            if dtype in (torch.float16, torch.bfloat16):
                code += ".to(tl.float32)"
            elif dtype == torch.bool:
                code = f"({code} != 0)"
        elif isinstance(e, IndexValue):
            code = f"({_block_index(e.index, self.blocks)}).to({_TL[e.dtype]})"
        elif isinstance(e, Indirect):  # see Note [Data-dependent indices] in passes.loop_ir
            value = self.emit(e.index, scope)
            name = str(e.symbol)
            lanes = "xmask & rmask" if self.uses_r(e.index) else "xmask"
            if self.uses_r(e.index):
                self.r_symbols.add(e.symbol)
            bound = index_code(sympy.sympify(e.size))
            target.lines += [
                f"{target.indent}{name} = {value}",
                f"{target.indent}tl.device_assert((({name} >= 0) & ({name} < {bound})) | "
                f'~({lanes}), "index out of bounds")',
            ]
            body = self.emit(e.body, scope)
            target.cache[e] = body
            return body
        else:
            args = [self.emit(a, scope) for a in e.args]
            code = self.op_code(e, args)
        name = self.var()
        target.lines.append(f"{target.indent}{name} = {code}")
        target.cache[e] = name
        return name

    def op_code(self, e: Op, args: list[str]) -> str:
        if e.name == "cast":
            if e.dtype == torch.bool:
                return f"({args[0]} != 0)"
            src = self.dtype_of(e.args[0])
            if isinstance(e.args[0], Const):  # a literal has no `.to` (`2.5.to(...)` failed)
                args = [f"tl.full([], {args[0]}, {_TL[src]})"]
            code = f"{args[0]}.to({_TL[e.dtype]})"
            if e.dtype in _STORE_TL and src != e.dtype:
                code = f"{self.round_half(args[0], e.dtype)}.to(tl.float32)"
            return code
        if e.name == "maximum" or e.name == "minimum":
            fn = "tl.maximum" if e.name == "maximum" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if e.dtype.is_floating_point else ""
            return f"{fn}({args[0]}, {args[1]}{nan})"
        if e.name == "pow":
            if self.interpret:  # Triton's interpreter has no libdevice: see _HELPERS["_pow"]
                return f"_pow({args[0]}, {args[1]}).to({_TL[e.dtype]})"
            # libdevice picks powf/pow by the argument types: make constants that type
            typed = [
                f"tl.full([], {a}, {_TL[e.dtype]})" if isinstance(x, Const) else a
                for a, x in zip(args, e.args, strict=True)
            ]
            return f"libdevice.pow({typed[0]}, {typed[1]})"
        if e.name in _ACCURATE:  # Note [Accurate tanh, log1p and expm1]
            (arg,) = args
            if isinstance(e.args[0], Const):
                arg = f"tl.full([], {arg}, {_TL[e.dtype]})"
            elif _TL.get(self.dtype_of(e.args[0])) != _TL[e.dtype]:
                arg = f"{arg}.to({_TL[e.dtype]})"
            if self.interpret:
                return f"_{e.name}({arg}).to({_TL[e.dtype]})"
            return f"libdevice.{e.name}({arg})"
        if e.name not in _TEMPLATES:
            raise CodegenError(f"no Triton template for op {e.name}")
        return _TEMPLATES[e.name].format(*args)

    def dtype_of(self, e: Expr) -> torch.dtype:
        if isinstance(e, Load):
            return self.buffers[e.buf][3]
        if isinstance(e, Indirect):  # the value of its body, read at the bound index
            return self.dtype_of(e.body)
        return e.dtype

    def round_half(self, value: str, dtype: torch.dtype) -> str:
        if dtype == torch.bfloat16 and self.interpret:
            # Triton's interpreter truncates fp32 -> bf16; round to nearest even by hand.
            return f"_round_bf16({value})"
        return f"{value}.to({_STORE_TL[dtype]})"

    def store(self, comp: Computed, value: str, scope: _Scope, mask: str) -> None:
        idx = _block_index(
            store_index(comp, self.group.xnumel, self.group.rnumel, self.cols), self.blocks
        )
        if comp.dtype in _STORE_TL:
            value = self.round_half(value, comp.dtype)
        elif comp.dtype == torch.bool:
            value = f"{value}.to(tl.int1)"
        scope.lines.append(f"{scope.indent}tl.store(out_{comp.name} + {idx}, {value}, {mask})")


def _full(value: str, dtype: torch.dtype, shape: str) -> str:
    return f"tl.full({shape}, {value}, {_TL[dtype]})"


def _init(kind: str, dtype: torch.dtype) -> str:
    if kind == "sum":
        return "0"
    if kind == "prod":
        return "1"
    if dtype.is_floating_point:
        return 'float("-inf")' if kind == "max" else 'float("inf")'
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is None:
        return "0" if kind == "max" else "1"
    return str(info.min if kind == "max" else info.max)


def _needs_int64(group: FusionGroup, plan: FusionPlan) -> bool:
    limit = 2**31 - 1
    if plan.lowered.symbols:
        return True  # symbolic sizes: any size may reach 2**31
    if group.xnumel * max(group.rnumel, 1) >= limit:
        return True
    for name in (*group.reads, *group.stores):
        if name in plan.lowered.buffers:
            size, stride, _, _ = plan.lowered.buffers[name]
            if sum((s - 1) * st for s, st in zip(size, stride)) >= limit:
                return True
    return False


def generate_kernel(
    plan: FusionPlan, group: FusionGroup, device: str, interpret: bool
) -> KernelSource:
    members = [m for m in group.members if isinstance(m, Computed)]
    cols = tile_columns(group)
    em = _Emitter(group, plan, interpret, cols)
    x, r = group.xnumel, group.rnumel
    reduction = group.kind is GroupKind.REDUCTION
    # A symbolic row length: looped on CUDA (one compile for all sizes); in the interpreter
    # (which cannot loop to a runtime bound, and compiles nothing) persistent, RBLOCK at launch.
    exprs = {m.name: member_expr(m, members, x, r, cols) for m in members}
    columns = reduction and not cols and is_static(x) and is_static(r) and outer_reduction(exprs)
    persistent = reduction and (
        (r <= (OUTER_PERSISTENT_RNUMEL if columns else PERSISTENT_RNUMEL))
        if is_static(r)
        else interpret
    )
    if persistent and not is_static(r):
        rblock = LAUNCH_RBLOCK
    else:
        rblock = max(1, 1 << (max(r, 1) - 1).bit_length()) if persistent else LOOP_RBLOCK
    int64 = _needs_int64(group, plan)
    body: list[str] = []
    pid = "tl.program_id(0).to(tl.int64)" if int64 else "tl.program_id(0)"
    if cols:
        body += [
            f"    pid = {pid}",
            "    xtiles = (xnumel + XBLOCK - 1) // XBLOCK",
            "    yindex = (pid // xtiles) * YBLOCK + tl.arange(0, YBLOCK)[:, None]",
            "    xindex = (pid % xtiles) * XBLOCK + tl.arange(0, XBLOCK)[None, :]",
            "    xmask = (xindex < xnumel) & (yindex < ynumel)",
        ]
    else:
        body.append(f"    xoffset = {pid} * XBLOCK")
    if cols:
        pass  # the 2-D index lines are above
    elif reduction:
        body += [
            "    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
            "    xmask = xindex < xnumel",
            "    rbase = tl.arange(0, RBLOCK)[None, :]"
            + (".to(tl.int64)" if plan.lowered.symbols else ""),
        ]  # r * size may pass 2**31
    else:
        body += ["    xindex = xoffset + tl.arange(0, XBLOCK)", "    xmask = xindex < xnumel"]
    outer = _Scope("    ", None, "x")
    stores = set(group.stores)
    if persistent:
        outer.lines += ["    rindex = rbase", "    rmask = rindex < rnumel"]
        outer.level = "r"
    late: list[Computed] = []
    for m in members:
        e = exprs[m.name]
        if m.reduction is not None:
            em.registers[m.name] = _reduce(em, m, e, outer, persistent)
            if m.name in stores:
                scan = m.reduction.is_scan  # every element: at (x, r)
                em.store(m, em.registers[m.name], outer, "xmask & rmask" if scan else "xmask")
        elif m.name in stores:
            row = reduction and is_row_level(m, x, r)
            if row or not reduction or persistent:
                shape = (
                    "[XBLOCK, 1]"
                    if row
                    else "[XBLOCK, RBLOCK]"
                    if reduction
                    else "[YBLOCK, XBLOCK]"
                    if cols
                    else "[XBLOCK]"
                )
                value = em.emit(e, outer)
                if isinstance(e, Const):
                    value = _full(value, m.dtype, shape)
                em.store(m, value, outer, "xmask" if row or not reduction else "xmask & rmask")
            else:
                late.append(m)
    body += outer.lines
    if late:
        loop = _Scope("        ", outer, "r")
        outer.lines = []
        for m in late:
            value = em.emit(exprs[m.name], loop)
            if isinstance(exprs[m.name], Const):
                value = _full(value, m.dtype, "[XBLOCK, RBLOCK]")
            em.store(m, value, loop, "xmask & rmask")
        body += outer.lines
        body += [
            "    for roffset in range(0, rnumel, RBLOCK):",
            "        rindex = roffset + rbase",
            "        rmask = rindex < rnumel",
            *loop.lines,
        ]
    params = [f"in_{b}" for b in group.reads] + [f"out_{s}" for s in group.stores]
    second = "Y" if cols else "R"
    if isinstance(r, (int, sympy.Integer)):
        # A static row length is a literal loop bound: Triton's interpreter cannot iterate to a
        # runtime scalar under numpy >= 2.4 (its scalars are 1-element arrays), and on CUDA a
        # literal bound is what the traced shape promises anyway (sizes are baked into indices).
        bound = f"range(0, {int(r)}, RBLOCK)"
        body = [line.replace("range(0, rnumel, RBLOCK)", bound) for line in body]
    text = "\n".join(body)
    symbols = tuple(str(sym) for sym in plan.lowered.symbols if re.search(rf"\b{sym}\b", text))
    sig = ", ".join(
        [
            *params,
            "xnumel",
            f"{second.lower()}numel",
            *symbols,
            "XBLOCK: tl.constexpr",
            f"{second}BLOCK: tl.constexpr",
        ]
    )
    # Sizes vary between calls of a symbolic kernel: no value specialization, so one compile
    # serves all sizes (Triton's interpreter compiles nothing and rejects the option in loops).
    jit = (
        f"@triton.jit(do_not_specialize={['xnumel', 'rnumel', *symbols]!r})"
        if plan.lowered.symbols and not interpret
        else "@triton.jit"
    )
    header = [
        f"# kernel {group.name}: {group.kind.value}, x={x} r={r}"
        + (" (persistent)" if persistent else (" (looped)" if reduction else ""))
        + (f" (2-D tiles over {x // cols}x{cols})" if cols else ""),
        f"# bytes_read={group.bytes_read} bytes_written={group.bytes_written}",
        "# source ops:",
        *[f"#   {op}" for op in group.source_ops],
    ]
    helpers = _helpers("\n".join(body))
    source = "\n".join(
        [
            *header,
            "import triton",
            "import triton.language as tl",
            "",
            helpers,
            jit,
            f"def {group.name}({sig}):",
            *body,
            "",
        ]
    )
    return KernelSource(
        name=group.name,
        source=source,
        reduction=reduction,
        inputs=group.reads,
        outputs=group.stores,
        xnumel=cols or x,
        rnumel=x // cols if cols else r,
        persistent_rblock=rblock if persistent else 0,
        device=device,
        bytes_read=group.bytes_read,
        bytes_written=group.bytes_written,
        tiled=bool(cols),
        outer=columns,
        symbols=symbols,
        arg_dtypes=tuple(plan.lowered.buffers[b][3] for b in (*group.reads, *group.stores)),
    )


def outer_reduction(exprs: dict[str, Expr]) -> bool:
    """Do the group's loads that move along both x and r have unit stride along x and a larger
    one along r (a reduction over the rows of a row-major tensor)? Then an [XBLOCK, RBLOCK]
    block reads XBLOCK-long contiguous runs, and wide x blocks are what coalesce."""
    votes = 0
    for e in exprs.values():
        for load in loads_of(e):
            index = load.index
            if not isinstance(index, sympy.Expr) or not index.free_symbols <= {XINDEX, RINDEX}:
                continue
            index = index.replace(FloorDiv, lambda a, b: sympy.floor(a / b)).replace(
                ModIdx, sympy.Mod
            )
            at = [int(index.subs({XINDEX: a, RINDEX: b})) for a, b in ((0, 0), (1, 0), (0, 1))]
            dx, dr = abs(at[1] - at[0]), abs(at[2] - at[0])
            if dx and dr:
                votes += 1 if dx == 1 and dr > 1 else -1
    return votes > 0


def _reduce(em: _Emitter, m: Computed, e: Expr, outer: _Scope, persistent: bool) -> str:
    red = m.reduction
    assert red is not None
    if red.is_scan:
        return _scan(em, m, e, outer, persistent)
    if red.kind in ("argmax", "argmin"):
        return _arg_reduce(em, m, e, outer, persistent)
    kind, dtype, post = red.kind, m.dtype, ""
    if kind in ("any", "all"):  # of (x != 0), as an int32 max/min (Triton reduces no int1)
        kind, dtype, post = ("max" if kind == "any" else "min"), torch.int32, " != 0"
    acc_tl = _TL[dtype]
    init = _init(kind, dtype)
    if persistent:
        value = _block_value(em, e, outer, dtype, post)
        masked, name = em.var(), em.var()
        outer.lines += [
            f"    {masked} = tl.where(xmask & rmask, {value}, {init})",
            f"    {name} = {reduce_rows(kind, masked)}[:, None].to({acc_tl})",
        ]
        outer.lines += _propagate_nan(kind, dtype, masked, name, "    ")
        return _post(em, outer, name, post)
    acc = em.var()
    loop = _Scope("        ", outer, "r")
    value = _block_value(em, e, loop, dtype, post)
    masked = f"tl.where(xmask & rmask, {value}, {init})"
    outer.lines += [
        f"    {acc} = tl.full([XBLOCK, RBLOCK], {init}, {acc_tl})",
        *_r_loop(loop),
        f"        {acc} = {_combine_step(kind, dtype, acc, masked)}",
    ]
    name = em.var()
    outer.lines.append(f"    {name} = {reduce_rows(kind, acc)}[:, None]")
    outer.lines += _propagate_nan(kind, dtype, acc, name, "    ")
    return _post(em, outer, name, post)


def _block_value(em: _Emitter, e: Expr, scope: _Scope, dtype: torch.dtype, post: str) -> str:
    """`e` emitted in `scope` as a [XBLOCK, RBLOCK] block (of int32 for any/all)."""
    value = em.emit(e, scope)
    if isinstance(e, Const):
        value = _full(value, dtype, "[XBLOCK, RBLOCK]")
    return f"{value}.to(tl.int32)" if post else value


def _post(em: _Emitter, outer: _Scope, name: str, post: str) -> str:
    if not post:
        return name
    out = em.var()
    outer.lines.append(f"    {out} = {name}{post}")
    return out


def _r_loop(loop: _Scope) -> list[str]:
    return [
        "    for roffset in range(0, rnumel, RBLOCK):",
        "        rindex = roffset + rbase",
        "        rmask = rindex < rnumel",
        *loop.lines,
    ]


def _combine_step(kind: str, dtype: torch.dtype, acc: str, masked: str) -> str:
    nan = ", propagate_nan=tl.PropagateNan.ALL" if dtype.is_floating_point else ""
    return {
        "sum": f"{acc} + {masked}",
        "prod": f"{acc} * {masked}",
        "max": f"tl.maximum({acc}, {masked}{nan})",
        "min": f"tl.minimum({acc}, {masked}{nan})",
    }[kind]


def _arg_reduce(em: _Emitter, m: Computed, e: Expr, outer: _Scope, persistent: bool) -> str:
    """argmax/argmin along r as torch defines them: the first index of the max (min); a NaN
    counts as the max (min), so a row with a NaN gives its first NaN. One pass finds the value
    (NaN-propagating), a second the smallest r holding it (both in registers when persistent)."""
    red = m.reduction
    assert red is not None
    dtype = em.dtype_of(e)
    kind = "max" if red.kind == "argmax" else "min"
    init = _init(kind, dtype)
    isfloat = dtype.is_floating_point

    def hit(value: str, best: str) -> str:
        same = f"({value} == {best})"
        return f"({same} | (({value} != {value}) & ({best} != {best})))" if isfloat else same

    if persistent:
        value = _block_value(em, e, outer, dtype, "")
        masked, best, idx = em.var(), em.var(), em.var()
        outer.lines += [
            f"    {masked} = tl.where(xmask & rmask, {value}, {init})",
            f"    {best} = {reduce_rows(kind, masked)}[:, None]",
            *_propagate_nan(kind, dtype, masked, best, "    "),
            f"    {idx} = {reduce_rows('min', f'tl.where(xmask & rmask & {hit(value, best)}, rindex, rnumel)')}"
            "[:, None].to(tl.int64)",
        ]
        return idx
    acc, best, acc_idx, idx = em.var(), em.var(), em.var(), em.var()
    first, second = _Scope("        ", outer, "r"), _Scope("        ", outer, "r")
    value = _block_value(em, e, first, dtype, "")
    outer.lines += [
        f"    {acc} = tl.full([XBLOCK, RBLOCK], {init}, {_TL[dtype]})",
        *_r_loop(first),
        f"        {acc} = {_combine_step(kind, dtype, acc, f'tl.where(xmask & rmask, {value}, {init})')}",
        f"    {best} = {reduce_rows(kind, acc)}[:, None]",
        *_propagate_nan(kind, dtype, acc, best, "    "),
        f"    {acc_idx} = tl.full([XBLOCK, RBLOCK], 0, tl.int64) + rnumel",
    ]
    value = _block_value(em, e, second, dtype, "")
    candidate = f"tl.where(xmask & rmask & {hit(value, best)}, rindex, rnumel)"
    outer.lines += [
        *_r_loop(second),
        f"        {acc_idx} = tl.minimum({acc_idx}, {candidate}.to(tl.int64))",
        f"    {idx} = {reduce_rows('min', acc_idx)}[:, None]",
    ]
    return idx


def _scan(em: _Emitter, m: Computed, e: Expr, outer: _Scope, persistent: bool) -> str:
    """An inclusive cumsum/cumprod of each row, kept in registers ([XBLOCK, RBLOCK])."""
    red = m.reduction
    assert red is not None
    if not persistent:  # lowering keeps scans to rows it can hold (MAX_SCAN_RNUMEL)
        raise CodegenError(f"{m.name}: a scan over rows longer than {PERSISTENT_RNUMEL}")
    combine = "tl.standard._sum_combine" if red.kind == "cumsum" else "tl.standard._prod_combine"
    value = _block_value(em, e, outer, m.dtype, "")
    masked, name = em.var(), em.var()
    outer.lines += [
        f"    {masked} = tl.where(xmask & rmask, {value}, {0 if red.kind == 'cumsum' else 1})",
        f"    {name} = tl.associative_scan({masked}.to({_TL[m.dtype]}), 1, {combine})",
    ]
    return name


def _propagate_nan(
    kind: str, dtype: torch.dtype, block: str, result: str, indent: str
) -> list[str]:
    """torch's amax/amin return NaN for a row with a NaN; a max/min reduction may skip it."""
    if kind not in ("max", "min") or not dtype.is_floating_point:
        return []
    line = (
        f"{indent}{result} = tl.where("
        f"{reduce_rows('sum', f'({block} != {block}).to(tl.int32)')}[:, None]"
        f' > 0, float("nan"), {result})'
    )
    return [line]


# Triton helpers a kernel defines when its body calls them (by name), in definition order.
_HELPERS = {
    "_round_bf16": """@triton.jit
def _round_bf16(v):
    # fp32 -> bf16 with round-to-nearest-even (the interpreter's cast truncates)
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
""",
    "_floordiv": """@triton.jit
def _floordiv(a, b):
    # integer floor division (torch's //) whether `//` truncates (CUDA) or floors (interpreter)
    q = a // b
    r = a - q * b
    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)
""",
    "_truncdiv": """@triton.jit
def _truncdiv(a, b):
    # integer division rounding toward zero, whichever way `//` rounds
    q = a // b
    r = a - q * b
    return q + ((r != 0) & ((r < 0) != (a < 0))).to(q.dtype)
""",
    "_round_half_even": """@triton.jit
def _round_half_even(x):
    # torch.round: to the nearest integer, ties to even (exact: no x + 0.5); a zero result keeps
    # x's sign, as nearbyint's (round(-0.5) is -0.0)
    f = tl.floor(x)
    d = x - f
    up = (d > 0.5) | ((d == 0.5) & ((f - 2.0 * tl.floor(f * 0.5)) != 0))
    r = tl.where(up, f + 1.0, f)
    return tl.where(r == 0, x * 0.0, r)
""",
    "_expm1": """@triton.jit
def _expm1(x):
    # expm1 in Triton's interpreter (Note [Accurate tanh, log1p and expm1]), in fp64
    xf = x.to(tl.float64)
    u = tl.exp(xf)
    um1 = u - 1.0
    r = tl.where(um1 == 0.0, xf, um1 * xf / tl.log(tl.where(um1 == 0.0, 2.0, u)))
    r = tl.where(um1 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)
""",
    "_log1p": """@triton.jit
def _log1p(x):
    # log1p in Triton's interpreter (Note [Accurate tanh, log1p and expm1]), in fp64
    xf = x.to(tl.float64)
    u = 1.0 + xf
    d = u - 1.0
    r = tl.where(d == 0.0, xf, tl.log(u) * (xf / tl.where(d == 0.0, 1.0, d)))
    return tl.where(u == float("inf"), u, r)
""",
    "_tanh": """@triton.jit
def _tanh(x):
    # tanh in Triton's interpreter (Note [Accurate tanh, log1p and expm1]), in fp64
    xf = x.to(tl.float64)
    e = _expm1(-2.0 * tl.abs(xf))
    t = -e / (e + 2.0)
    return tl.where(xf < 0, -t, tl.where(xf == 0, xf, t))
""",
    "_pow": """@triton.jit
def _pow(x, y):
    # torch.pow in Triton's interpreter (no libdevice there): exp(y * log|x|) in fp64, with the
    # sign of a negative base to an odd integer power, NaN for a negative base to a non-integer
    # power, and pow(x, 0) = pow(1, y) = 1 (also for NaN), pow(-1, +-inf) = 1
    xf = (x + 0 * y).to(tl.float64)
    yf = (y + 0 * x).to(tl.float64)
    mag = tl.exp(yf * tl.log(tl.abs(xf)))
    y_int = yf == tl.floor(yf)
    y_odd = y_int & ((yf - 2.0 * tl.floor(yf * 0.5)) == 1.0)
    r = tl.where(xf < 0, tl.where(y_int, tl.where(y_odd, -mag, mag), float("nan")), mag)
    r = tl.where((tl.abs(xf) == 1.0) & (tl.abs(yf) == float("inf")), 1.0, r)
    return tl.where((yf == 0) | (xf == 1.0), 1.0, r)
""",
}


def _helpers(body: str) -> str:
    """The helper definitions `body` calls, directly or through another helper, and the imports
    it needs."""
    used = {name for name in _HELPERS if f"{name}(" in body}
    for name in list(used):  # one level of helpers calling helpers is all we have
        used |= {other for other in _HELPERS if f"{other}(" in _HELPERS[name]}
    text = "".join(_HELPERS[name] + "\n" for name in _HELPERS if name in used)
    if "libdevice." in body:
        text = "from triton.language.extra import libdevice\n\n" + text
    return text


def kernel_numel(group: FusionGroup) -> int:
    return group.xnumel * max(group.rnumel, 1)
