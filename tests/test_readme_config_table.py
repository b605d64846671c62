"""The table of DeepSpeed config keys in docs/deepspeed.md agrees with the config schema: every key the schema
accepts is listed as supported (or accepted), and every key listed as refused is refused by
:func:`zerodp.load_config` with a message naming it."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

import zerodp
from zerodp.config import ZeroDPConfig

TABLE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md"
SECTION = "## DeepSpeed config keys"


def table_rows() -> list[tuple[list[str], str]]:
    """(key paths, status) for each row of docs/deepspeed.md's config-key table. In a row, a key written
    ``.name`` continues the parent path of the key before it (``fp16.enabled``, ``.hysteresis``)."""
    text = TABLE_PAGE.read_text()
    section = text[text.index(SECTION):]
    end = section.find("\n## ", len(SECTION))
    section = section if end < 0 else section[:end]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("key", "---"):
            continue
        keys: list[str] = []
        parent = ""
        for token in re.findall(r"`([^`]+)`", cells[0]):
            for part in (t.strip() for t in token.split("/")):
                if not part:
                    continue
                if part.startswith("."):
                    part = parent + part
                keys.append(part)
                parent = part.rsplit(".", 1)[0] if "." in part else ""
        rows.append((keys, cells[1]))
    return rows


def schema_keys(model: type[BaseModel] = ZeroDPConfig, prefix: str = "") -> set[str]:
    """Dotted paths of every leaf key the schema accepts."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _model_in(field.annotation)
        if sub is not None:
            keys |= schema_keys(sub, path + ".")
        else:
            keys.add(path)
    return keys


def _model_in(annotation: typing.Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def nested(path: str, value: typing.Any) -> dict:
    out: typing.Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def test_table_is_parsed():
    rows = table_rows()
    assert len(rows) >= 20
    listed = {k for keys, _ in rows for k in keys}
    assert "fp16.hysteresis" in listed and "zero_optimization.offload_param.device" in listed


def test_every_schema_key_is_listed_as_supported():
    supported = {k for keys, status in table_rows() for k in keys
                 if status.startswith(("supported", "accepted", "zerodp's own key"))}
    missing = sorted(schema_keys() - supported)
    assert not missing, f"config keys missing from the docs/deepspeed.md table (as supported): {missing}"


def test_no_key_is_listed_as_supported_that_the_schema_lacks():
    supported = {k for keys, status in table_rows() for k in keys
                 if status.startswith(("supported", "accepted", "zerodp's own key"))}
    extra = sorted(supported - schema_keys())
    assert not extra, f"docs/deepspeed.md lists as supported keys the schema does not accept: {extra}"


REFUSED = sorted({k for keys, status in table_rows() for k in keys if status.startswith("refused")})


def test_refused_keys_exist():
    assert len(REFUSED) >= 20


@pytest.mark.parametrize("key", REFUSED)
def test_refused_key_is_refused(key):
    with pytest.raises(zerodp.ConfigError) as err:
        zerodp.load_config(nested(key, {}))
    assert f"'{key}'" in str(err.value)
