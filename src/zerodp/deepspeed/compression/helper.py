"""``deepspeed.compression.helper``: :func:`recursive_getattr` / :func:`recursive_setattr` on dotted
module names (DeepSpeed-Chat's LoRA conversion uses them)."""

from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name`` ``"a.b.c"``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name`` ``"a.b.c"``."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
