"""``zerodp.deepspeed.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` names, which are
zerodp's own activation checkpointing (:mod:`zerodp.checkpointing`: ``checkpoint``, ``configure``,
``is_configured``, ``reset``, ``timings``, with DeepSpeed's semantics)."""

from __future__ import annotations

from zerodp.checkpointing import checkpoint, configure, is_configured, reset, timings

__all__ = ["checkpoint", "configure", "is_configured", "reset", "timings"]
