"""Opt-in registration of :mod:`zerodp.deepspeed` as the ``deepspeed`` module, for libraries that import
``deepspeed`` themselves (HF transformers' ``Trainer(deepspeed=...)``, accelerate).

Those libraries decide whether DeepSpeed is there with ``importlib.util.find_spec("deepspeed")`` and
``importlib.metadata.version("deepspeed")`` (they compare it with minimum versions), and then import
``deepspeed`` and its submodules. :func:`install` answers both, and nothing else changes:

- ``sys.modules["deepspeed"]`` is :mod:`zerodp.deepspeed`, and a finder on ``sys.meta_path`` resolves
  ``deepspeed.X.Y`` to the module object ``zerodp.deepspeed.X.Y`` (the same object under both names: no
  second copy of any state). A submodule zerodp lacks raises ``ModuleNotFoundError`` naming it.
- a distribution finder answers ``importlib.metadata`` queries for the name ``deepspeed`` (and only
  for it) with metadata whose version is :data:`DEEPSPEED_API_VERSION` plus the local label
  ``+zerodp.<zerodp version>``: the DeepSpeed release whose API zerodp follows, so version checks
  pass, and the label says what it is. ``importlib.metadata.distributions()`` does not list it.

Nothing happens on ``import zerodp`` or ``import zerodp.deepspeed``: :func:`install` (or ``import
zerodp.deepspeed.as_deepspeed``, or the launcher ``zerodp run``) is the only way in. It refuses, with
:class:`DeepSpeedShadowError`, when a real DeepSpeed is importable or installed, already imported, or
when transformers/accelerate already decided DeepSpeed's availability (they were imported first).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

#: The DeepSpeed release whose Python API zerodp.deepspeed follows (the one the bench compares with).
DEEPSPEED_API_VERSION = "0.19.8"

#: Modules that read DeepSpeed's availability once, when they are imported; registering after them
#: would leave them without DeepSpeed (accelerate) or half-configured (transformers).
DECIDED_AT_IMPORT = (
    "accelerate.accelerator",
    "accelerate.utils.deepspeed",
    "transformers.integrations.deepspeed",
    "transformers.trainer",
)

#: submodules DeepSpeed's ``__init__`` imports, so ``deepspeed.comm.get_rank()`` works after ``import
#: deepspeed`` (transformers' ZeRO-3 weight initialisation); zerodp.deepspeed imports the others itself.
EAGER_SUBMODULES = ("comm",)

_NAME = "deepspeed"
_ANY_CONTEXT = importlib.metadata.DistributionFinder.Context()  # no name: every distribution, as importlib's default
_TARGET = "zerodp.deepspeed"


class DeepSpeedShadowError(RuntimeError):
    """zerodp refuses to stand in for ``deepspeed`` here (a real DeepSpeed exists, or it is too late)."""


def _zerodp_version() -> str:
    try:
        return importlib.metadata.version("zerodp")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def version() -> str:
    """The version ``importlib.metadata.version("deepspeed")`` reports once installed, e.g.
    ``"0.19.8+zerodp.0.2.0"`` (PEP 440: greater than 0.19.8's requirements, its label is local)."""
    return f"{DEEPSPEED_API_VERSION}+zerodp.{_zerodp_version()}"


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the already imported module object ``zerodp.deepspeed.X``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # executed once, under its zerodp name; the import system has just set __spec__ to the alias's
        module.__spec__ = self.own_spec


class _Distribution(importlib.metadata.Distribution):
    """The metadata of the ``deepspeed`` name while zerodp is registered (``METADATA`` only)."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                f"Metadata-Version: 2.1\nName: {_NAME}\nVersion: {version()}\n"
                "Summary: zerodp.deepspeed registered as deepspeed (zerodp.deepspeed.registration); "
                "not DeepSpeed\n"
            )
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class ZerodpDeepSpeedFinder(importlib.abc.MetaPathFinder):
    """``sys.meta_path`` entry: module specs for ``deepspeed.*`` and metadata for ``deepspeed``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        real = _TARGET + fullname[len(_NAME) :]
        if importlib.util.find_spec(real) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zerodp is registered as 'deepspeed' and has no {real} "
                "(that part of DeepSpeed is not implemented in zerodp; see docs/deepspeed.md)",
                name=fullname,
            )
        module = importlib.import_module(real)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec

    def find_distributions(self, context: Any = _ANY_CONTEXT) -> Iterator[Any]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("_", "-").lower() == _NAME:
            yield _Distribution()


def _finder() -> ZerodpDeepSpeedFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, ZerodpDeepSpeedFinder)), None)


def is_installed() -> bool:
    """True when :func:`install` has registered zerodp as ``deepspeed`` in this process."""
    return _finder() is not None and sys.modules.get(_NAME) is sys.modules.get(_TARGET)


def install() -> ModuleType:
    """Register :mod:`zerodp.deepspeed` as ``deepspeed`` (module and metadata); idempotent. Call it
    before importing transformers or accelerate. Returns the module.

    Raises:
        DeepSpeedShadowError: a ``deepspeed`` module is already imported or importable, or a
            ``deepspeed`` distribution is installed (a real DeepSpeed: zerodp never shadows it; import
            ``zerodp.deepspeed`` by that name instead, or uninstall DeepSpeed); or one of
            :data:`DECIDED_AT_IMPORT` is already imported (it has decided without DeepSpeed).
    """
    if is_installed():
        return sys.modules[_NAME]
    present = sys.modules.get(_NAME)
    if present is not None:
        raise DeepSpeedShadowError(
            f"a 'deepspeed' module is already imported ({getattr(present, '__file__', present)!r}); zerodp does "
            "not replace a real DeepSpeed. Use `import zerodp.deepspeed as deepspeed` in your own code instead"
        )
    spec = importlib.util.find_spec(_NAME)
    if spec is not None:
        raise DeepSpeedShadowError(
            f"a real DeepSpeed is installed ({spec.origin or list(spec.submodule_search_locations or [])}); "
            "zerodp refuses to shadow it. Uninstall it (`pip uninstall deepspeed`) to run on zerodp through "
            "this registration, or use `import zerodp.deepspeed as deepspeed` in your own code"
        )
    try:
        dist = importlib.metadata.distribution(_NAME)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        raise DeepSpeedShadowError(
            f"a 'deepspeed' distribution (version {dist.version}) is installed although its module is not "
            "importable; zerodp refuses to shadow it. Uninstall it (`pip uninstall deepspeed`) first"
        )
    early = [m for m in DECIDED_AT_IMPORT if m in sys.modules]
    if early:
        raise DeepSpeedShadowError(
            f"register zerodp as deepspeed before importing transformers' Trainer or accelerate: {early} "
            "already decided that DeepSpeed is unavailable. Put `import zerodp.deepspeed.as_deepspeed` "
            "first in the script, or start it with `zerodp run SCRIPT`"
        )
    module = importlib.import_module(_TARGET)
    for name in EAGER_SUBMODULES:  # attributes clients reach without importing them (deepspeed.comm.get_rank)
        importlib.import_module(f"{_TARGET}.{name}")
    sys.meta_path.insert(0, ZerodpDeepSpeedFinder())
    sys.modules[_NAME] = module
    return module


def uninstall() -> None:
    """Undo :func:`install`: drop the finder and every ``deepspeed``/``deepspeed.*`` alias (the
    ``zerodp.deepspeed`` modules stay imported). Libraries that imported ``deepspeed`` keep their
    references."""
    finder = _finder()
    if finder is not None:
        sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == _NAME or n.startswith(_NAME + ".")]:
        mod = sys.modules[name]
        if getattr(mod, "__name__", "").startswith(_TARGET):
            del sys.modules[name]
