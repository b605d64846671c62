"""``tools/disk_mix_probe.py --sustained`` in a thread while the main thread of the same process works, to
see what a training process's own work costs its I/O threads (a development tool; issue 31 item 4).

    python tools/disk_probe_under_load.py DIR {idle,python,torch,membw,small} [SECONDS] [FILE_BYTES]

``python``: a pure-Python loop (holds the GIL); ``torch``: 2048 x 2048 matmuls on 2 threads (releases
it); ``membw``: ``add_`` over two 200 MB tensors (memory-bound, as Adam and the bf16 casts); ``small``:
tiny in-place ops (the GIL taken and released often).
"""

from __future__ import annotations

import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from disk_mix_probe import sustained  # noqa: E402  # the tool next to this one


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 25.0
    file_bytes = int(float(sys.argv[4])) if len(sys.argv) > 4 else int(16e9)
    if mode not in ("idle", "python", "torch", "membw", "small"):
        raise SystemExit(f"unknown load {mode!r}: idle, python, torch, membw or small")
    stop = threading.Event()

    def load() -> None:
        if mode == "python":
            x = 0
            while not stop.is_set():
                for i in range(1000):
                    x += i
        elif mode == "torch":
            torch.set_num_threads(2)
            a = torch.randn(2048, 2048)
            while not stop.is_set():
                a @ a
        elif mode == "membw":
            torch.set_num_threads(2)
            a, b = torch.randn(50_000_000), torch.randn(50_000_000)
            while not stop.is_set():
                a.add_(b, alpha=1e-9)
        elif mode == "small":
            a = torch.randn(64, 64)
            while not stop.is_set():
                a.add_(1e-6)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        os.makedirs(directory, exist_ok=True)
        sustained(directory, seconds, file_bytes)
    finally:
        stop.set()
        worker.join()


if __name__ == "__main__":
    main()
