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
    tmp1 = tl.max(tl.where(xmask & rmask, tmp0, float("-inf")), 1)[:, None]
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
from aotc.passes.loop_ir import Const, Expr, FloorDiv, IndexValue, Load, ModIdx, Op, is_static
from aotc.passes.lowering import Computed
from aotc.runtime.kernels import KernelSource

# Heuristic: rows up to this many elements are reduced in registers in one pass (as in common
# softmax/LayerNorm widths); longer rows loop over r.
PERSISTENT_RNUMEL = 2048
LOOP_RBLOCK = 256
LAUNCH_RBLOCK = -1  # KernelSource.persistent_rblock: the next power of two of rnumel at launch

_TL = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float32",
    torch.bfloat16: "tl.float32",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
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
    "tanh": "(2.0 / (1.0 + tl.exp(-2.0 * {0})) - 1.0)",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))",
    "relu": "tl.where({0} < 0, 0, {0})",
    "erf": "tl.math.erf({0})",
    "log1p": "tl.log(1.0 + {0})",
    "expm1": "(tl.exp({0}) - 1.0)",
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
    "pow2": "({0} * {0})",
    "pow3": "({0} * {0} * {0})",
    "pow0_5": "tl.sqrt({0})",
    "powm0_5": "tl.math.rsqrt({0})",
    "powm1": "(1.0 / {0})",
    "pow1": "{0}",
    "powm2": "(1.0 / ({0} * {0}))",
}


class CodegenError(Exception):
    pass


def index_code(e: sympy.Expr) -> str:
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
    if isinstance(e, FloorDiv):
        return f"({index_code(e.args[0])} // {index_code(e.args[1])})"
    if isinstance(e, ModIdx):
        return f"({index_code(e.args[0])} % {index_code(e.args[1])})"
    raise CodegenError(f"cannot print index {e}")


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


def _uses_r(e: Expr) -> bool:
    if isinstance(e, (Load, IndexValue)):
        return RINDEX in e.index.free_symbols
    if isinstance(e, Op):
        return any(_uses_r(a) for a in e.args)
    return False


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

    def var(self) -> str:
        self.counter += 1
        return f"tmp{self.counter - 1}"

    def emit(self, e: Expr, scope: _Scope) -> str:
        if isinstance(e, Const):
            return _const(e.value, e.dtype)
        target = scope
        if scope.level == "r" and not _uses_r(e) and scope.parent is not None:
            target = scope.parent
        hit = target.find(e)
        if hit is not None:
            return hit
        if isinstance(e, Load):
            if e.buf in self.registers:
                return self.registers[e.buf]
            size, _, _, dtype = self.buffers[e.buf]
            if 0 in size:  # only a reduction over an empty dim reads it: every lane is masked
                shape = (
                    "[XBLOCK, RBLOCK]"
                    if self.group.kind is GroupKind.REDUCTION
                    else "[YBLOCK, XBLOCK]"
                    if self.cols
                    else "[XBLOCK]"
                )
                name = self.var()
                target.lines.append(f"{target.indent}{name} = tl.zeros({shape}, {_TL[dtype]})")
                target.cache[e] = name
                return name
            mask = "xmask & rmask" if RINDEX in e.index.free_symbols else "xmask"
            code = f"tl.load(in_{e.buf} + {_block_index(e.index, self.blocks)}, {mask}, other=0)"
            if dtype in (torch.float16, torch.bfloat16):
                code += ".to(tl.float32)"
            elif dtype == torch.bool:
                code = f"({code} != 0)"
        elif isinstance(e, IndexValue):
            code = f"({_block_index(e.index, self.blocks)}).to({_TL[e.dtype]})"
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
            code = f"{args[0]}.to({_TL[e.dtype]})"
            if e.dtype in _STORE_TL and src != e.dtype:
                code = f"{self.round_half(args[0], e.dtype)}.to(tl.float32)"
            return code
        if e.name == "maximum" or e.name == "minimum":
            fn = "tl.maximum" if e.name == "maximum" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if e.dtype.is_floating_point else ""
            return f"{fn}({args[0]}, {args[1]}{nan})"
        if e.name not in _TEMPLATES:
            raise CodegenError(f"no Triton template for op {e.name}")
        return _TEMPLATES[e.name].format(*args)

    def dtype_of(self, e: Expr) -> torch.dtype:
        return self.buffers[e.buf][3] if isinstance(e, Load) else e.dtype

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
    persistent = reduction and (r <= PERSISTENT_RNUMEL if is_static(r) else interpret)
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
    exprs = {m.name: member_expr(m, members, x, r, cols) for m in members}
    late: list[Computed] = []
    for m in members:
        e = exprs[m.name]
        if m.reduction is not None:
            em.registers[m.name] = _reduce(em, m, e, outer, persistent)
            if m.name in stores:
                em.store(m, em.registers[m.name], outer, "xmask")
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
    helpers = _ROUND_BF16 if "_round_bf16(" in "\n".join(body) else ""
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
        symbols=symbols,
    )


def _reduce(em: _Emitter, m: Computed, e: Expr, outer: _Scope, persistent: bool) -> str:
    red = m.reduction
    assert red is not None
    acc_tl = _TL[m.dtype]
    init = _init(red.kind, m.dtype)
    combine = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[red.kind]
    if persistent:
        value = em.emit(e, outer)
        if isinstance(e, Const):
            value = _full(value, m.dtype, "[XBLOCK, RBLOCK]")
        masked, name = em.var(), em.var()
        outer.lines += [
            f"    {masked} = tl.where(xmask & rmask, {value}, {init})",
            f"    {name} = {combine}({masked}, 1)[:, None].to({acc_tl})",
        ]
        outer.lines += _propagate_nan(red.kind, m.dtype, masked, name, "    ")
        return name
    acc = em.var()
    loop = _Scope("        ", outer, "r")
    value = em.emit(e, loop)
    if isinstance(e, Const):
        value = _full(value, m.dtype, "[XBLOCK, RBLOCK]")
    masked = f"tl.where(xmask & rmask, {value}, {init})"
    nan = ", propagate_nan=tl.PropagateNan.ALL" if m.dtype.is_floating_point else ""
    step = {
        "sum": f"{acc} + {masked}",
        "max": f"tl.maximum({acc}, {masked}{nan})",
        "min": f"tl.minimum({acc}, {masked}{nan})",
    }[red.kind]
    outer.lines += [
        f"    {acc} = tl.full([XBLOCK, RBLOCK], {init}, {acc_tl})",
        "    for roffset in range(0, rnumel, RBLOCK):",
        "        rindex = roffset + rbase",
        "        rmask = rindex < rnumel",
        *loop.lines,
        f"        {acc} = {step}",
    ]
    name = em.var()
    outer.lines.append(f"    {name} = {combine}({acc}, 1)[:, None]")
    outer.lines += _propagate_nan(red.kind, m.dtype, acc, name, "    ")
    return name


def _propagate_nan(
    kind: str, dtype: torch.dtype, block: str, result: str, indent: str
) -> list[str]:
    """torch's amax/amin return NaN for a row with a NaN; tl.max/tl.min may skip it."""
    if kind == "sum" or not dtype.is_floating_point:
        return []
    line = (
        f"{indent}{result} = tl.where(tl.sum(({block} != {block}).to(tl.int32), 1)[:, None]"
        f' > 0, float("nan"), {result})'
    )
    return [line]


_ROUND_BF16 = """@triton.jit
def _round_bf16(v):
    # fp32 -> bf16 with round-to-nearest-even (the interpreter's cast truncates)
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)

"""


def kernel_numel(group: FusionGroup) -> int:
    return group.xnumel * max(group.rnumel, 1)
