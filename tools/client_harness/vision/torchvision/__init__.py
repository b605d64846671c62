"""A stand-in for torchvision (its CPU wheel matching the pinned torch is not on the package index
here): ``datasets.CIFAR10`` of synthetic images and the three ``transforms`` the cifar client uses.
Put first on PYTHONPATH by tools/run_clients.py; never installed."""

from . import datasets, transforms

__version__ = "0.0+zerodp.stub"
__all__ = ["datasets", "transforms"]
