"""The error zerodp raises when it refuses a use it would otherwise train wrongly with.

Defined apart from :mod:`zerodp.runtime.guards` (which re-exports it) so that low-level modules, such
as the stage-3 sharded-parameter type (:mod:`zerodp.stage3.sharded_param`), can raise it without
importing the guards.
"""

from __future__ import annotations


class RefusedError(RuntimeError):
    """A use that zerodp would otherwise train wrongly with; the message says what to do instead."""
