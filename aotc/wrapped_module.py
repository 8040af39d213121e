"""The state methods shared by the two module wrappers `aotc.compile` returns
(`aotc.api.CompiledModule`, strict mode; `aotc.capture.DynamoModule`, the default mode): each
wraps the user's module as `_orig_mod` and hands its state to it, so `state_dict()`,
`load_state_dict()` and the named parameters and buffers are the original's, under the
original's names (no `_orig_mod.` prefix)."""

from __future__ import annotations

from typing import Any

import torch


class OriginalState(torch.nn.Module):
    """Mixin for a module wrapper whose `_orig_mod` holds the state."""

    _orig_mod: torch.nn.Module
    _options: Any

    def __reduce__(self) -> tuple[Any, ...]:
        """`copy.deepcopy` (an EMA copy of the model) and `torch.save` copy the original module
        and compile the copy again with the same options: compiled entries, caches and locks are
        per object (and not picklable). Hooks on the wrapper itself are not copied."""
        return (_recompile, (type(self), self._orig_mod, self._options))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.named_buffers(*args, **kwargs)


def _recompile(cls: type, module: torch.nn.Module, options: Any) -> Any:
    return cls(module, options)
