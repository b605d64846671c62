"""``deepspeed.moe.layer.MoE``: refused (mixture-of-experts is outside zerodp's scope)."""

from __future__ import annotations

from typing import Any


class MoE:
    """Raises ``NotImplementedError`` when built: MoE layers (expert parallelism) are not implemented."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE is not implemented in zerodp (mixture-of-experts / "
            "expert parallelism is outside its scope)"
        )


__all__ = ["MoE"]
