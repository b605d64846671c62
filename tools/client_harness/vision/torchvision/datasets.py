"""``CIFAR10``: synthetic, deterministic images of CIFAR-10's shapes (32x32x3 uint8, labels 0-9)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np


class CIFAR10:
    """``CIFAR10(root, train, download, transform)`` as torchvision's; nothing is downloaded or read.

    Sizes: ``ZERODP_CIFAR_TRAIN`` (default 64) and ``ZERODP_CIFAR_TEST`` (default 20) samples; every class
    occurs when there are at least 10 (the client divides by each class's count). Each class
    has its own mean colour plus noise, so a small net can learn it. Items: (transform(HWC uint8
    array), int label)."""

    def __init__(
        self, root: str, train: bool = True, download: bool = False, transform: Callable[[Any], Any] | None = None
    ) -> None:
        n = int(os.environ.get("ZERODP_CIFAR_TRAIN" if train else "ZERODP_CIFAR_TEST", "64" if train else "20"))
        rng = np.random.default_rng(0 if train else 1)
        self.targets = [int(t) for t in rng.permutation(np.arange(n) % 10)]  # every class present
        means = np.random.default_rng(2).integers(40, 216, size=(10, 1, 1, 3))
        noise = rng.normal(0.0, 40.0, size=(n, 32, 32, 3))
        self.data = np.clip(means[self.targets] + noise, 0, 255).astype(np.uint8)
        self.transform = transform
        self.root, self.train = root, train

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img = self.data[index]
        return (self.transform(img) if self.transform else img), self.targets[index]
