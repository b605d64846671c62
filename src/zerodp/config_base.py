"""The strict pydantic base of every config section and the error messages of a refused config.

:class:`StrictModel` refuses unknown keys (``extra="forbid"``), non-finite numbers and what pydantic's
lax mode would silently convert ("yes" for a bool, "3" for a number, true for a stage), so a typo or a
wrong type never falls back to a default. :func:`format_errors` turns a pydantic ``ValidationError``
into one line per offending key path, naming what was given and what is allowed.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A zerodp config (dict or JSON file) has an unknown key or a value outside what is allowed."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_coercion(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse what pydantic's lax mode would silently convert: "yes"/"off" for a bool, a string
        for a number, true/false for a number or a stage."""
        assert info.field_name is not None  # a field validator ("*"): always called for one field
        problem = _shape_problem(cls.model_fields[info.field_name].annotation, v)
        if problem:
            raise ValueError(problem)
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds:
            return v
        if isinstance(v, bool) and bool not in kinds:
            raise ValueError(f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, not a boolean")
        if isinstance(v, str) and str not in kinds:
            raise ValueError(f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, not a string")
        if bool in kinds and not isinstance(v, bool) and v is not None:
            raise ValueError("expected true or false")
        return v


def _shape_problem(annotation: Any, v: Any) -> str | None:
    """What pydantic would word by its internals for ``v``, said in the config's terms: a list of the
    wrong length for a fixed-length tuple (``betas``: pydantic says ``betas.1: Field required``), or a
    number outside an integer ``Literal`` (``stage``: pydantic's own message, except for a number too
    large for a 64-bit integer, which it reports as a parse failure). None: nothing to say here."""
    if get_origin(annotation) is Union or get_origin(annotation) is types.UnionType:
        return next((p for a in get_args(annotation) if a is not type(None) and (p := _shape_problem(a, v))), None)
    args = get_args(annotation)
    if get_origin(annotation) is tuple and args and Ellipsis not in args and isinstance(v, (list, tuple)):
        if len(v) != len(args):
            return f"needs exactly {len(args)} values, got {len(v)}"
    if get_origin(annotation) is Literal and all(type(a) is int for a in args):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in args:
            return f"Input should be {', '.join(map(str, args[:-1]))} or {args[-1]}"
    return None


def _scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types (bool, int, float, str) an annotation admits; empty for containers/models."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(a) for a in get_args(annotation)}
    if origin is Union or origin is types.UnionType:  # Optional[X] and X | None
        kinds: set[type] = set()
        for a in get_args(annotation):
            if a is type(None):
                continue
            sub = _scalar_kinds(a)
            if not sub:
                return set()
            kinds |= sub
        return kinds
    if annotation in (bool, int, float, str):
        return {annotation, float} if annotation is int else {annotation}
    return set()


def format_errors(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = allowed_keys(model, e["loc"][:-1])
            if prefix:
                return f"unknown key '{path}'; allowed keys here: {', '.join(allowed)}"
            lines.append(f"unknown key '{path}'; allowed keys here: {', '.join(allowed)}")
        else:
            given = e.get("input")
            msg = e["msg"].removeprefix("Value error, ")
            if msg.startswith("invalid zerodp config:\n"):  # nested (scheduler.params): already formatted
                lines.extend(line.strip() for line in msg.splitlines()[1:])
            elif isinstance(given, (dict, list)):
                lines.append(f"'{path}': {msg}")
            else:
                lines.append(f"'{path}': {msg} (got {given!r})")
    return "invalid zerodp config:\n  " + "\n  ".join(lines)


def allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return []
        ann = field.annotation
        current = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if current is None:
            return []
    return sorted(current.model_fields)
