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
    section = text[text.index(SECTION) :]
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
    supported = {
        k
        for keys, status in table_rows()
        for k in keys
        if status.startswith(("supported", "accepted", "zerodp's own key"))
    }
    missing = sorted(schema_keys() - supported)
    assert not missing, f"config keys missing from the docs/deepspeed.md table (as supported): {missing}"


def test_no_key_is_listed_as_supported_that_the_schema_lacks():
    supported = {
        k
        for keys, status in table_rows()
        for k in keys
        if status.startswith(("supported", "accepted", "zerodp's own key"))
    }
    extra = sorted(supported - schema_keys())
    assert not extra, f"docs/deepspeed.md lists as supported keys the schema does not accept: {extra}"


REFUSED = sorted({k for keys, status in table_rows() for k in keys if status.startswith("refused")})


def test_refused_keys_exist():
    assert len(REFUSED) >= 20


@pytest.mark.parametrize("key", REFUSED)
def test_refused_key_is_refused(key):
    # {"enabled": true}: a value that turns the feature on (keys at DeepSpeed's default or disabled
    # value are accepted, see test_deepspeed_defaults_are_accepted)
    with pytest.raises(zerodp.ConfigError) as err:
        zerodp.load_config(nested(key, {"enabled": True}))
    assert f"'{key}'" in str(err.value)


#: DeepSpeed configs from public clients (DeepSpeedExamples cifar, DeepSpeed-Chat, accelerate) write
#: these at DeepSpeed's default or disabled value: accepted, the config equals the one without them.
DEFAULTS_OFF = {
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "communication_data_type": None,
    "zero_optimization": {"stage": 2, "cpu_offload": False, "memory_efficient_linear": False},
    "fp16": {
        "enabled": False,
        "fp16_master_weights_and_grads": False,
        "auto_cast": False,
        "consecutive_hysteresis": False,
    },
    "dataloader_drop_last": False,
    "memory_breakdown": False,
    "dump_state": False,
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
    "tensorboard": {"enabled": False, "output_path": "x/", "job_name": "t"},
    "wandb": {"enabled": False},
    "csv_monitor": {"enabled": False},
    "flops_profiler": {"enabled": False},
    "comms_logger": {"enabled": False},
    "amp": {"enabled": False},
    "steps_per_print": float("inf"),
}


def test_deepspeed_defaults_are_accepted():
    cfg = zerodp.load_config(DEFAULTS_OFF)
    plain = zerodp.load_config({"zero_optimization": {"stage": 2}})
    assert cfg.steps_per_print is None  # never prints, as accelerate's inf means
    assert cfg.model_dump(exclude={"steps_per_print", "zero_optimization"}) == plain.model_dump(
        exclude={"steps_per_print", "zero_optimization"}
    )
    assert cfg.zero_optimization.memory_efficient_linear is False


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("prescale_gradients", True, "only false is accepted"),
        ("gradient_predivide_factor", 2.0, "only 1.0 is accepted"),
        ("zero_optimization.cpu_offload", True, "only false is accepted"),
        ("fp16.fp16_master_weights_and_grads", True, "masters are always fp32"),
        ("communication_data_type", "fp32", "only null is accepted"),
        ("fp16.consecutive_hysteresis", True, "restored when the loss scale grows"),
        ("dataloader_drop_last", True, "no data loader"),
        ("memory_breakdown", True, "memory_report()"),
        ("dump_state", True, "only false is accepted"),
        ("hybrid_engine", {"enabled": True}, "the hybrid (training + inference) engine"),
        ("tensorboard", {"enabled": True, "output_path": "x"}, "accepted only when disabled"),
        ("steps_per_print", float("nan"), "steps_per_print"),
        ("steps_per_print", 0, "steps_per_print"),
    ],
)
def test_enabled_features_are_refused_by_name(key, value, fragment):
    with pytest.raises(zerodp.ConfigError) as err:
        zerodp.load_config(nested(key, value))
    assert f"'{key}'" in str(err.value) and fragment in str(err.value), str(err.value)


def test_stage3_gather_fp16_weights_is_the_16bit_key():
    """DeepSpeed's deprecated zero_optimization.stage3_gather_fp16_weights_on_model_save (older HF
    example configs carry it) is read as stage3_gather_16bit_weights_on_model_save; it was refused as
    an unknown key."""
    old = "stage3_gather_fp16_weights_on_model_save"
    cfg = zerodp.load_config({"zero_optimization": {"stage": 3, old: True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    both = {"stage": 3, old: True, "stage3_gather_16bit_weights_on_model_save": False}
    with pytest.raises(zerodp.ConfigError, match=f"'zero_optimization.{old}'.*are both given"):
        zerodp.load_config({"zero_optimization": both})


def test_bfloat16_is_bf16():
    assert zerodp.load_config({"bfloat16": {"enabled": True}}).bf16.enabled
    assert zerodp.load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}).bf16.enabled
    with pytest.raises(zerodp.ConfigError, match="'bfloat16'.*'bf16' are both given"):
        zerodp.load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
