"""zerodp: ZeRO (Zero Redundancy Optimizer) data parallelism on torch.distributed.

Public API: :func:`initialize` returns an :class:`Engine` (``engine(*inputs)``, ``engine.backward(loss)``,
``engine.step()``); :func:`init_distributed` sets up the default process group from torchrun's
environment. Config keys follow DeepSpeed's names (:mod:`zerodp.config`).
"""

from zerodp import zero
from zerodp.config import ConfigError, ZeroDPConfig, load_config
from zerodp.engine import Engine
from zerodp.entry import initialize
from zerodp.runtime.collective_guard import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankLostError,
)
from zerodp.runtime.comm import init_distributed, shutdown_distributed

__version__ = "0.2.0"
__all__ = [
    "zero",
    "initialize",
    "init_distributed",
    "shutdown_distributed",
    "Engine",
    "ConfigError",
    "ZeroDPConfig",
    "load_config",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "RankLostError",
]
