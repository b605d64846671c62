"""``zerodp estimate``: the ``--params`` spec (a count, a JSON :class:`~zerodp.app.model.GPTConfig` file
or ``gpt:key=value,...``) and the ZeRO paper's per-rank model-state memory and per-step traffic for
stages 0-3 (:func:`zerodp.runtime.accounting.estimate_table`), with and without offload."""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import json
import os
import re

from zerodp.app.model import GPTConfig, count_parameters
from zerodp.offload.report import configured_offload_table, offload_estimate_table
from zerodp.runtime import accounting

_NUMBER = re.compile(r"^[+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def parse_params(spec: str) -> tuple[int, GPTConfig | None]:
    """Resolve ``--params`` to ``(Psi, GPTConfig or None)``.

    Accepts a positive count (``7.5e9``, ``7500000000``, ``7_500_000_000``), a path to a JSON object of
    :class:`GPTConfig` fields, or ``gpt:key=value,...`` with GPTConfig fields (omitted ones default).

    Raises:
        ValueError: none of those forms, a non-integral or non-positive count, an unreadable/invalid
            JSON file, or invalid GPTConfig fields.
    """
    s = spec.strip()
    if s.lower().startswith("gpt:"):
        fields: dict[str, object] = {}
        for item in filter(None, (p.strip() for p in s[4:].split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"expected key=value in gpt: spec, got {item!r}")
            fields[key.strip()] = _spec_value(value.strip())
        cfg = GPTConfig.from_dict(fields)
        return count_parameters(cfg), cfg
    if _NUMBER.match(s):
        v = decimal.Decimal(s.replace("_", ""))  # exact: 7.5e9 and 1e30 without float rounding
        if not v.is_finite() or v < 1 or v != v.to_integral_value():
            raise ValueError(f"parameter count must be a positive integer, got {spec!r}")
        return int(v), None
    if os.path.isfile(s) or s.lower().endswith(".json"):
        try:
            with open(s, encoding="utf-8") as f:
                obj = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read model config {s!r}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"model config {s!r} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"model config {s!r} must hold a JSON object of GPTConfig fields")
        cfg = GPTConfig.from_dict(obj)
        return count_parameters(cfg), cfg
    raise ValueError(
        f"expected a parameter count (e.g. 7.5e9), a JSON GPTConfig file or "
        f"gpt:n_layer=..,d_model=..,n_head=..; got {spec!r}"
    )


def _spec_value(v: str) -> object:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"gpt: spec values must be numbers or true/false, got {v!r}") from None


def run_estimate(args: argparse.Namespace) -> int:
    """``zerodp estimate``: the per-rank memory and traffic tables for ``--params``, ``--dp`` and precision
    flags (and ``--config``'s offload buffers); a bad flag exits through ``args.parser.error``."""
    try:
        numel, cfg = parse_params(args.params)
    except ValueError as exc:
        args.parser.error(f"argument --params: {exc}")
    if cfg is not None:
        print(f"{cfg}: {numel:,} parameters")
    import torch

    from zerodp.runtime.precision import grad_accum_dtype

    b = accounting.FP32_ADAM if args.fp32 else accounting.MIXED_PRECISION_ADAM
    if args.fp32 and args.grad_accum_dtype not in (None, "fp32"):
        args.parser.error(
            f"argument --grad-accum-dtype: {args.grad_accum_dtype} accumulation of fp32 "
            "gradients is not supported; allowed with --fp32: fp32"
        )
    dtype = grad_accum_dtype(torch.float32 if args.fp32 else torch.bfloat16, args.grad_accum, args.grad_accum_dtype)
    b = dataclasses.replace(b, grad=dtype.itemsize)  # the accumulation buffer holds the gradients
    print(accounting.estimate_table(numel, args.dp, b, args.grad_accum))
    print()
    print(offload_estimate_table(numel, args.dp, b))
    if args.config is not None:
        from zerodp.config import ConfigError, load_config

        try:
            zdp_cfg = load_config(args.config)
        except (ConfigError, ValueError, OSError) as exc:
            args.parser.error(f"argument --config: {exc}")
        print()
        print(configured_offload_table(numel, args.dp, zdp_cfg))
    return 0


__all__ = ["parse_params", "run_estimate"]
