"""Every knob of a compilation. Environment variables are read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class CompileOptions:
    backend: str = "aten"  # how graphs run; "aten" runs the fx graphs as ATen ops
    dynamic: bool = False  # symbolic shapes (not yet supported: raises)
    recompile_warn_limit: int = 8  # warn once a function has this many compiled signatures
    max_signatures: int = 64  # refuse to compile more signatures than this (GuardError)
    check_invariants: bool = False  # lint graphs between stages
    dump_dir: str | None = None  # write every stage's record for each compiled signature

    @staticmethod
    def from_env(**overrides: object) -> CompileOptions:
        opts = CompileOptions(
            dump_dir=os.environ.get("AOTC_DUMP_DIR") or None,
            check_invariants=os.environ.get("AOTC_CHECK_INVARIANTS", "0") == "1",
        )
        unknown = set(overrides) - set(CompileOptions.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"aotc.compile() got unknown option(s) {sorted(unknown)}; known options: "
                f"{sorted(CompileOptions.__dataclass_fields__)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        opts = replace(opts, **given)  # type: ignore[arg-type]
        if opts.backend not in ("aten", "auto"):
            raise ValueError(
                f"aotc.compile(backend={opts.backend!r}): only 'aten' and 'auto' are available "
                "in this version (Triton code generation is not built yet)."
            )
        return opts
