"""Cache entries for symbolic compilations (the torch.compile backend and the default capture
mode compile on Dynamo's fakes, whose sizes and Python floats may be symbols of Dynamo's ShapeEnv).

Stage: `ShapeFacts.of(shape_env, leaves)` before the cache key of a symbolic compilation;
`facts.text(value)` prints a size/SymInt/SymFloat with canonical symbol names (the key trace and the
signature use it); `facts.prior_text()` is what the ShapeEnv knows about the inputs' symbols
before the compile; `facts.added_guards(snapshot)` (after a cold compile) encodes the guards it
added; `facts.replay(encoded)` (on a hit) installs them again, or says the entry cannot be used.
Requires: every symbol of the leaves' geometry (and of the floats Dynamo passes as 0-d tensors)
is a backed symbol of `shape_env`.
Ensures: see Note [Symbolic cache entries].

Note [Symbolic cache entries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compile on Dynamo's fakes may add assumptions to Dynamo's ShapeEnv (a branch of a meta function
on `s0 == 1`, a replacement `s1 == s0`), and Dynamo turns the ShapeEnv's guards into the guards of
the compiled frame *after* the backend returns. A cache hit skips the compile, so it must add the
same assumptions itself, or Dynamo would run the entry for sizes it was never valid for. So:

- Symbols are named canonically, by first appearance in the inputs (`c0`, `c1`, ... over sizes,
  strides and offsets of the tensor leaves in order, then SymInt leaves, then float symbols), so
  two processes whose Dynamo named them differently (`s77`, `s3`) write the same key.
- The key covers, besides the key trace printed with these names, everything the ShapeEnv already
  knows about those symbols before the compile (their value ranges, replacements, the guards
  over them: `prior_text`); a guard that ties an input symbol to a symbol outside the inputs makes
  the compile unkeyable. Equal keys mean equal prior knowledge, so every decision the cold compile
  took either followed from that knowledge (and holds again) or was a hint-based decision the
  ShapeEnv recorded as a guard.
- The entry stores the guards the cold compile added (`added_guards`: every ShapeEnv guard from
  the start of the compile, key trace included, as an expression tree over canonical symbols).
  A compile that added a deferred runtime assertion or a guard over other symbols is not stored.
- A hit first checks every stored guard against this call's hints without installing anything;
  if one is false the entry is not used (a cold compile follows, and is sound as ever). Otherwise
  it installs them with `ShapeEnv.evaluate_expr`, in order (the same state the cold compile left:
  its ranges are compared with the stored ones, and a difference makes a cold compile).

Expressions are stored as JSON trees of an allowlist of sympy and torch sympy classes (never
parsed or evaluated as text), so a cache directory cannot run code here either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.utils._sympy.functions as symfn
from torch._subclasses.fake_tensor import FakeTensor

from aotc.keytrace import Unkeyable

_EXPR_CLASSES: dict[str, Any] = {
    cls.__name__: cls
    for cls in (
        sympy.Add,
        sympy.Mul,
        sympy.Pow,
        sympy.Eq,
        sympy.Ne,
        sympy.StrictLessThan,
        sympy.LessThan,
        sympy.StrictGreaterThan,
        sympy.GreaterThan,
        sympy.And,
        sympy.Or,
        sympy.Not,
        sympy.Abs,
        sympy.floor,
        sympy.ceiling,
        symfn.FloorDiv,
        symfn.ModularIndexing,
        symfn.Where,
        symfn.PythonMod,
        symfn.Mod,
        symfn.CleanDiv,
        symfn.CeilToInt,
        symfn.FloorToInt,
        symfn.CeilDiv,
        symfn.Max,
        symfn.Min,
        symfn.PowByNatural,
        symfn.FloatPow,
        symfn.FloatTrueDiv,
        symfn.IntTrueDiv,
        symfn.TruncToFloat,
        symfn.TruncToInt,
        symfn.RoundToInt,
        symfn.ToFloat,
        symfn.Identity,
    )
}
# sympy.Eq(...) is an Equality, and so on: register the classes' own names too.
_EXPR_CLASSES.update({type(sympy.Eq(sympy.Symbol("a"), 1)).__name__: sympy.Eq})
_EXPR_CLASSES.update({type(sympy.Ne(sympy.Symbol("a"), 1)).__name__: sympy.Ne})


def symbols_of(leaves: Sequence[object]) -> list[sympy.Symbol]:
    """The free symbols of the leaves, in canonical order (Note [Symbolic cache entries])."""
    out: list[sympy.Symbol] = []
    seen: set[sympy.Symbol] = set()

    def add(value: object) -> None:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = value.node.expr
            for s in sorted(expr.free_symbols, key=str):
                if s not in seen:
                    seen.add(s)
                    out.append(s)

    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            for v in (*leaf.shape, *leaf.stride(), leaf.storage_offset()):
                add(v)
            memo = getattr(leaf, "item_memo", None) if isinstance(leaf, FakeTensor) else None
            add(memo)
        else:
            add(leaf)
    return out


def is_symbolic(leaves: Sequence[object]) -> bool:
    return bool(symbols_of(leaves))


class ShapeFacts:
    """Canonical names of one symbolic compilation's input symbols, and what the ShapeEnv knows
    and learns about them (Note [Symbolic cache entries])."""

    def __init__(self, shape_env: Any, symbols: list[sympy.Symbol]) -> None:
        self.shape_env = shape_env
        self.symbols = symbols
        self.index = {s: k for k, s in enumerate(symbols)}
        self.canonical = {s: sympy.Symbol(f"c{k}", **s.assumptions0) for k, s in enumerate(symbols)}

    @staticmethod
    def of(shape_env: Any, leaves: Sequence[object]) -> ShapeFacts:
        return ShapeFacts(shape_env, symbols_of(leaves))

    # ------------------------------------------------------------------ printing

    def expr_text(self, expr: sympy.Basic) -> str:
        foreign = expr.free_symbols - self.index.keys()
        if foreign:
            raise Unkeyable(
                f"a size or scalar over symbols {sorted(map(str, foreign))} that no input has"
            )
        return str(expr.xreplace(self.canonical))

    def text(self, value: object) -> str:
        """An int, a float or a symbolic value, with canonical symbol names."""
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            node = value.node
            constant = node.maybe_as_int() if isinstance(value, torch.SymInt) else None
            if constant is not None:
                return repr(constant)
            return f"{type(value).__name__}({self.expr_text(node.expr)})"
        return repr(value)

    def dims(self, values: Sequence[object]) -> str:
        return "[" + ", ".join(self.text(v) for v in values) + "]"

    def prior_text(self) -> str:
        """Ranges, replacements and guards over the input symbols, before the compile."""
        env = self.shape_env
        lines = []
        for s, text in zip(self.symbols, self.ranges_text(), strict=True):
            lines.append(f"{self.canonical[s]}: range {text}")
        for guard in env.guards:
            free = guard.expr.free_symbols
            if free <= self.index.keys():
                lines.append(f"guard {self.expr_text(guard.expr)}")
            elif free & self.index.keys():
                raise Unkeyable("a shape guard ties an input's size to a symbol outside the inputs")
        for asserts in env.deferred_runtime_asserts.values():
            for a in asserts:
                if a.expr.free_symbols & self.index.keys():
                    raise Unkeyable("a deferred runtime assertion on an input's size")
        return "\n".join(lines)

    # ------------------------------------------------------------------ guards

    def snapshot(self) -> tuple[int, int]:
        env = self.shape_env
        return len(env.guards), sum(len(v) for v in env.deferred_runtime_asserts.values())

    def ranges_text(self) -> list[str]:
        env = self.shape_env
        out = []
        for s in self.symbols:
            vr = env.var_to_range.get(s)
            repl = env.replacements.get(s)
            out.append(
                f"[{vr.lower if vr else '?'}, {vr.upper if vr else '?'}]"
                + (f" = {self.expr_text(repl)}" if repl is not None and repl != s else "")
            )
        return out

    def added_guards(self, snapshot: tuple[int, int]) -> dict[str, Any] | None:
        """The guards added since `snapshot`, encoded, with the ranges they leave; None when the
        entry must not be stored (see the Note)."""
        env = self.shape_env
        guards, asserts = snapshot
        if sum(len(v) for v in env.deferred_runtime_asserts.values()) != asserts:
            return None
        try:
            encoded = [self._encode(g.expr) for g in env.guards[guards:]]
            ranges = self.ranges_text()
        except Unkeyable:
            return None
        return {"guards": encoded, "ranges": ranges}

    def replay(self, stored: object) -> bool:
        """Install the stored guards (see the Note); False when the entry cannot be used."""
        if not isinstance(stored, dict):
            return False
        try:
            exprs = [self._decode(g) for g in stored.get("guards", [])]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return False
        env = self.shape_env
        hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
        for expr in exprs:
            try:
                value = expr.xreplace(dict(hints))
            except Exception:  # noqa: BLE001 a malformed entry: not used
                return False
            if value is not sympy.true and value != True:  # noqa: E712 sympy booleans
                return False
        for expr in exprs:
            env.evaluate_expr(expr)
        try:
            return self.ranges_text() == list(stored.get("ranges", []))
        except Unkeyable:
            return False

    def _encode(self, expr: sympy.Basic) -> Any:
        if isinstance(expr, sympy.Symbol):
            k = self.index.get(expr)
            if k is None:
                raise Unkeyable(f"guard over {expr}, which no input has")
            return ["S", k]
        if expr is sympy.true or expr is sympy.false:
            return ["B", bool(expr)]
        if isinstance(expr, sympy.Integer):
            return ["I", str(int(expr))]
        if isinstance(expr, sympy.Rational):
            return ["Q", str(expr.p), str(expr.q)]
        if isinstance(expr, sympy.Float):
            return ["F", str(expr), int(expr._prec)]
        name = type(expr).__name__
        if _EXPR_CLASSES.get(name) is None:
            raise Unkeyable(f"guard with {name}")
        return [name, [self._encode(a) for a in expr.args]]

    def _decode(self, value: Any) -> sympy.Basic:
        tag = value[0]
        if tag == "S":
            return self.symbols[int(value[1])]
        if tag == "B":
            return sympy.true if value[1] is True else sympy.false
        if tag == "I":
            return sympy.Integer(int(value[1]))
        if tag == "Q":
            return sympy.Rational(int(value[1]), int(value[2]))
        if tag == "F":
            return sympy.Float(str(value[1]), precision=int(value[2]))
        cls = _EXPR_CLASSES.get(str(tag))
        if cls is None:
            raise ValueError(f"expression class {str(tag)[:40]!r} is not allowed")
        return cls(*(self._decode(a) for a in value[1]))


__all__ = ["ShapeFacts", "is_symbolic", "symbols_of"]
