"""Durable file writes for checkpoints: atomic replace of small text files and fsync of files and
directories, so a checkpoint that a rename published survives a power loss (see [Note: crash safety])."""

from __future__ import annotations

import os
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text`` (write ``path.tmp``, fsync, os.replace)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync(path)
    except OSError:  # some filesystems cannot fsync a directory
        pass
