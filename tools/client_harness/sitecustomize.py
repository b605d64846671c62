"""Loaded by every Python process tools/run_clients.py starts (its folder is first on PYTHONPATH); does
nothing unless ``ZERODP_CLIENT_OUT`` is set. It changes no client text; what it does, per variable:

- ``ZERODP_CLIENT_SEED``: ``torch.manual_seed`` at start (clients that seed nothing get the same
  initial weights at every stage, so their losses can be compared).
- ``ZERODP_WIKITEXT_LINES``: ``datasets.load_dataset("wikitext", ...)`` returns that many synthetic lines
  (a ``datasets.Dataset`` with a ``text`` column, every fourth line empty as in wikitext); other
  names go to the real ``load_dataset``.
- ``ZERODP_CLIENT_CLOCK`` (epoch seconds): ``datetime.datetime.now(pytz.timezone(...))`` returns that
  instant, the same on every rank (HelloDeepSpeed names its run folder from each rank's clock; set only on the runner's
  second try, after zerodp refused the ranks' different folders on the first).
- always: an observer on ``zerodp.deepspeed``'s engine records each ``backward(loss)``'s loss value and
  each ``save_checkpoint`` / ``load_checkpoint`` (directory, a digest of the module's weights after
  it; and the digest at the first backward) and writes them to ``$ZERODP_CLIENT_OUT/rank<RANK>.json`` at exit.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
from typing import Any

OUT = os.environ.get("ZERODP_CLIENT_OUT")
RECORD: dict[str, Any] = {"losses": [], "saves": [], "loads": []}


def _seed() -> None:
    import torch

    torch.manual_seed(int(os.environ["ZERODP_CLIENT_SEED"]))


def _synthetic_wikitext(n: int) -> Any:
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(200)]
    lines = ["" if i % 4 == 3 else " ".join(rng.choice(words, size=int(rng.integers(8, 40)))) + "\n" for i in range(n)]
    return datasets.Dataset.from_dict({"text": lines})


def _patch_load_dataset() -> None:
    import datasets

    real = datasets.load_dataset

    @functools.wraps(real)
    def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == "wikitext":
            return _synthetic_wikitext(int(os.environ["ZERODP_WIKITEXT_LINES"]))
        return real(path, *args, **kwargs)

    datasets.load_dataset = load_dataset


def _digest(engine: Any) -> str:
    """sha256 of the module's state_dict tensors in name order (stage 3: its partitioned parameters
    are placeholders, so the digest covers the unpartitioned ones only)."""
    from zerodp.zero import is_partitioned

    h = hashlib.sha256()
    for name, t in sorted(engine.module.state_dict(keep_vars=True).items()):
        if is_partitioned(t):
            continue
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _patch_engine() -> None:
    from zerodp.deepspeed.engine import DeepSpeedEngine

    backward, save, load = DeepSpeedEngine.backward, DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint

    def recorded_backward(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if not RECORD["losses"]:
            RECORD["initial_digest"] = _digest(self)  # the weights of the first step (after initialize/load)
        RECORD["losses"].append(float(loss.detach().float().item()))
        return backward(self, loss, *args, **kwargs)

    def recorded_save(self: Any, save_dir: Any, *args: Any, **kwargs: Any) -> Any:
        out = save(self, save_dir, *args, **kwargs)
        RECORD["saves"].append({"dir": str(save_dir), "step": len(RECORD["losses"]), "digest": _digest(self)})
        return out

    def recorded_load(self: Any, load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, load_dir, *args, **kwargs)
        client = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        RECORD["loads"].append(
            {
                "dir": str(load_dir),
                "digest": _digest(self),
                "client_state": {k: v for k, v in (client or {}).items() if isinstance(v, (int, float, str))},
            }
        )
        return out

    DeepSpeedEngine.backward = recorded_backward  # type: ignore[method-assign]
    DeepSpeedEngine.save_checkpoint = recorded_save  # type: ignore[method-assign]
    DeepSpeedEngine.load_checkpoint = recorded_load  # type: ignore[method-assign]


def _pin_clock() -> None:
    """``pytz.timezone(zone)`` answers ``datetime.datetime.now(tz)`` with the instant in
    ``ZERODP_CLIENT_CLOCK`` (the call HelloDeepSpeed names its folder from); nothing else changes."""
    import datetime

    import pytz

    real = pytz.timezone
    instant = datetime.datetime.fromtimestamp(float(os.environ["ZERODP_CLIENT_CLOCK"]), datetime.timezone.utc)

    def timezone(zone: str) -> Any:
        tz = real(zone)
        convert = tz.fromutc
        tz.fromutc = lambda dt: convert(instant.replace(tzinfo=dt.tzinfo))  # now(tz) calls tz.fromutc
        return tz

    pytz.timezone = timezone


def _write() -> None:
    rank = os.environ.get("RANK")
    if rank is None:  # the torchrun parent, not a rank
        return
    with open(os.path.join(str(OUT), f"rank{rank}.json"), "w") as f:
        json.dump(RECORD, f)


if OUT and os.environ.get("RANK") is not None:
    if os.environ.get("ZERODP_CLIENT_SEED"):
        _seed()
    if os.environ.get("ZERODP_CLIENT_CLOCK"):
        _pin_clock()
    if os.environ.get("ZERODP_WIKITEXT_LINES"):
        _patch_load_dataset()
    _patch_engine()
    atexit.register(_write)
