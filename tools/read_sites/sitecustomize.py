"""Count the bytes each call site reads from zerodp's swap files, per phase of a run (a development tool,
not part of the library): which code reads ``params.swp`` during ``zero.Init``, ``initialize`` and the
steps.

    PYTHONPATH=tools/read_sites ZERODP_READ_SITES=/tmp/rs/rs \\
        zerodp train --preset infinity --nvme-path /work/nvme --nproc 1 --states-ratio 0.3 --steps 1
    python tools/read_sites/sitecustomize.py /tmp/rs/rs

Python imports this file at start-up when its folder is on PYTHONPATH. Once zerodp is imported it wraps
``AsyncIO.read`` (bytes and the zerodp frames of the caller's stack, 7 deep) and ``zerodp.initialize``
(the phase: ``zero.Init`` before it, ``initialize`` inside, ``steps`` after). At exit the totals go to
``$ZERODP_READ_SITES.<pid>.json``: rows ``[bytes, calls, phase, file, stack]``, largest first.
"""

import atexit
import builtins
import collections
import glob
import json
import os
import sys
import traceback

_OUT = os.environ.get("ZERODP_READ_SITES")
BYTES: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
PHASE = ["zero.Init"]


def _patch_reads() -> None:
    from zerodp.offload import aio

    real = aio.AsyncIO.read

    def read(self, f, buf, offset):
        frames = [fr for fr in traceback.extract_stack()[:-1] if "/zerodp/" in fr.filename]
        stack = " <- ".join(f"{os.path.basename(fr.filename)}:{fr.lineno}:{fr.name}" for fr in reversed(frames[-7:]))
        key = (PHASE[0], os.path.basename(f.path), stack)
        BYTES[key] += buf.numel() * buf.element_size()
        CALLS[key] += 1
        return real(self, f, buf, offset)

    aio.AsyncIO.read = read


def _patch_initialize() -> None:
    import zerodp

    real = zerodp.initialize

    def initialize(*args, **kwargs):
        PHASE[0] = "initialize"
        try:
            return real(*args, **kwargs)
        finally:
            PHASE[0] = "steps"

    zerodp.initialize = initialize


def _report(prefix: str) -> None:
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        with open(path) as fh:
            rows = json.load(fh)
        if not rows:
            continue
        totals: collections.Counter = collections.Counter()
        for nbytes, _, phase, name, _ in rows:
            totals[(phase, name)] += nbytes
        print(path)
        for (phase, name), nbytes in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {phase:10} {name:14} {nbytes / 1e9:8.2f} GB")
        for nbytes, calls, phase, name, stack in rows[:15]:
            print(f"  {nbytes / 1e9:8.2f} GB {calls:6} {phase:10} {name:14} {stack}")


if _OUT:
    _real_import = builtins.__import__
    _done = {"reads": False, "initialize": False}

    def _import(name, *args, **kwargs):
        module = _real_import(name, *args, **kwargs)
        if not _done["reads"] and hasattr(sys.modules.get("zerodp.offload.aio"), "AsyncIO"):
            _done["reads"] = True
            _patch_reads()
        if _done["reads"] and not _done["initialize"] and hasattr(sys.modules.get("zerodp"), "initialize"):
            _done["initialize"] = True
            _patch_initialize()
        return module

    builtins.__import__ = _import

    @atexit.register
    def _dump():
        rows = sorted(((v, CALLS[k], *k) for k, v in BYTES.items()), reverse=True)
        if rows:
            with open(f"{_OUT}.{os.getpid()}.json", "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    _report(sys.argv[1])
