"""DeepSpeed-Chat step 1's final save at ZeRO stage 3 under zerodp's DeepSpeed drop-in
(tests/chat_save_worker.py, world sizes 1 and 2).

Rank 0's ``torch.save(model.module.state_dict())`` succeeds as with DeepSpeed, but writes placeholders
with one PartitionedSaveWarning (count, first name, how to save weights), and the file refuses to load:
``torch.load(weights_only=True)`` names zerodp's placeholder global and the parameter,
``weights_only=False`` raises PartitionedParameterError naming the parameter and the ways to save. The
gathering save that follows writes the weights of plain PyTorch's same training. zerodp's own API still
refuses the first save.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("chat_save_worker.py")
RUNS = ("fp32_init", "fp32_plain", "fp32_init_offload", "bf16_init", "bf16_plain_offload")
SAVE_WORDS = ("save_16bit_model", "GatheredParameters", "zerodp consolidate")


@functools.cache
def results(world: int) -> list[dict]:
    out = run_worker(world, stages="3", scenarios=",".join((*RUNS, "native_refuses")), worker=WORKER)
    for rank, r in enumerate(out):
        for name, res in r.items():
            assert res["ok"], f"rank {rank} {name}:\n{res.get('error')}"
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("run", RUNS)
def test_ds_chat_stage3_save_sequence(world: int, run: str) -> None:
    ranks = [r[run] for r in results(world)]
    r0 = ranks[0]
    partitioned = r0["partitioned"]
    assert partitioned[0] == "model.decoder.embed_tokens.weight" and "lm_head.weight" in partitioned
    assert not any("final_layer_norm" in n for n in partitioned)  # persistent: saved with its values
    # the first save: one warning, naming the count and the first parameter, pointing at the saving line
    assert len(r0["warnings"]) == 1, r0["warnings"]
    category, message, filename = r0["warnings"][0]
    assert category == "PartitionedSaveWarning" and filename == "chat_save_worker.py"
    assert f"torch.save wrote {len(partitioned)} partitioned parameters (the first: '{partitioned[0]}')" in message
    assert "placeholders, not weights" in message and all(w in message for w in SAVE_WORDS), message
    assert r0["file_written"]
    # loading it fails loudly, both ways, naming zerodp and the parameter
    assert r0["load_weights_only"].startswith("UnpicklingError"), r0["load_weights_only"]
    assert (
        "zerodp.stage3.placeholder.partitioned_parameter_placeholder:model:decoder:embed_tokens:weight"
        in r0["load_weights_only"]
    )
    full = r0["load_full"]
    assert full.startswith("PartitionedParameterError: parameter 'model.decoder.embed_tokens.weight'"), full
    assert "placeholder, not weights" in full and all(w in full for w in SAVE_WORDS), full
    # the gathering save over the same file: the weights, equal to the engine's and to plain PyTorch's
    assert r0["keys_equal"] and r0["equal_own"]
    assert r0["moved"] > 1e-2, "training did not change the weights"
    if run.startswith("fp32"):
        assert r0["dtypes"] == ["torch.float32"] and r0["err"] <= 1, r0["err"]
    else:
        assert r0["dtypes"] == ["torch.bfloat16"]
        if world == 1:  # the same arithmetic in the same order: bit-identical
            assert r0["err"] == 0, r0["err"]
        assert r0["norm_err"] <= 0.016, r0["norm_err"]  # a few bf16 ulps, as tests/test_stages.py
    for r in ranks[1:]:
        assert r["partitioned"] == partitioned and "warnings" not in r


@pytest.mark.parametrize("world", [1, 2])
def test_native_api_still_refuses_the_first_save(world: int) -> None:
    for r in results(world):
        msg = r["native_refuses"]["refused"]
        assert "parameter 'model.decoder.embed_tokens.weight' is partitioned" in msg, msg
        assert "pickling/saving (torch.save)" in msg and all(w in msg for w in SAVE_WORDS), msg
