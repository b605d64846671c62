"""The order of the engine's collectives against the compute stream (see [Note: comm streams] in
zerodp.runtime.streams), checked on the CPU with a recording stand-in for the device's module.

``torch.cpu``'s streams and events are no-ops, so the real training run cannot show a missing wait.
Here :func:`zerodp.runtime.device.device_handle` returns :class:`FakeDeviceModule`, whose streams keep
vector clocks: an operation on a stream ticks its own entry, an event copies its stream's clock when
recorded, a wait merges the event's clock into the waiting stream's. "A happens before B" is then
``B.clock[A's stream] >= A's tick``. The collectives themselves still run (gloo, world of one, in
this process) and are logged with the stream current at their launch; the model's forwards, the
gradient copies of the reducer and the gather pool's releases are logged as compute-stream work.

Checked at stages 0-3 over three steps (the first records the stage-3 trace, the later ones prefetch
and reuse pooled slabs):
- every parameter all-gather is issued on the all-gather stream, every gradient collective on the
  reduce stream;
- a layer's forward runs after the compute stream waited for the all-gather stream past the last
  all-gather of that layer's unit;
- an all-gather writing pooled memory runs after every earlier release of that memory on the compute
  stream (through the slab's release event or a wait for the compute stream), and the release-event
  path is taken;
- a gradient collective runs after the compute stream's gradient copies issued before it, and the
  compute stream uses its result (``_complete``) only after waiting for it.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import zerodp
from zerodp.runtime import comm, device
from zerodp.stage3 import pool as pool_mod


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        into[k] = max(into.get(k, 0), v)


class FakeStream:
    def __init__(self, world: FakeDeviceModule, name: str | None = None) -> None:
        self.world = world
        self.name = name or f"side{next(world.ids)}"
        self.clock: dict[str, int] = {}

    def tick(self) -> dict[str, int]:
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return dict(self.clock)

    def wait_event(self, event: FakeEvent) -> None:
        self.world.log.append(("wait", self.name, event))
        _merge(self.clock, event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self.world.log.append(("wait_stream", self.name, other.name))
        _merge(self.clock, other.clock)

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self.world)
        event.record(self)
        return event


class FakeEvent:
    def __init__(self, world: FakeDeviceModule, **_: Any) -> None:
        self.world = world
        self.clock: dict[str, int] = {}
        self.stream: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.world.current
        self.clock, self.stream = stream.tick(), stream.name
        self.world.log.append(("record", stream.name, self))

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.world.current).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeDeviceModule:
    """Stands in for ``torch.cuda`` as far as zerodp.runtime.device uses it."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.log: list[tuple] = []
        self.default = FakeStream(self, "compute")
        self.current = self.default

    def Stream(self, priority: int = 0) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream(self)

    def Event(self, **kwargs: Any) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, **kwargs)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize",))

    def compute_op(self, what: str, *info: Any) -> None:
        """Work on the compute stream (a forward, a gradient copy, a release)."""
        self.log.append(("op", what, *info, self.default.tick()))


class Layer(nn.Linear):
    fake: FakeDeviceModule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake.compute_op("forward", self.tag)
        return super().forward(x)


def _train(stage: int, fake: FakeDeviceModule, monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layer = Layer(16, 16)
        layer.tag, layer.fake = f"{i}", fake
        layers.append(layer)
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2], nn.Tanh(), layers[3])
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300},
    }
    engine = zerodp.initialize(model, config)
    for name, side in (
        ("reduce", engine.reducer.stream),
        ("all_gather", getattr(engine.sharding, "gather_stream", None)),
    ):
        if side is not None:
            side.stream.name = name

    def logged(kind, fn):
        def call(*args, **kwargs):
            out, inp = (args[0], args[1]) if kind != "all_reduce" else (args[0], args[0])
            purpose = args[3 if kind == "all_reduce" else 4]
            if purpose in ("gradients", "parameters"):  # not the control collectives (host tensors)
                fake.log.append(
                    (
                        "collective",
                        kind,
                        fake.current.name,
                        out.data_ptr(),
                        inp.data_ptr(),
                        dict(fake.default.clock),
                        fake.current.tick(),
                    )
                )
            return fn(*args, **kwargs)

        return call

    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        monkeypatch.setattr(comm, kind, logged(kind, getattr(comm, kind)))
    reducer = engine.reducer
    on_grad, complete = reducer._on_grad, reducer._complete
    monkeypatch.setattr(reducer, "_on_grad", lambda s, p: (fake.compute_op("grad", s.name), on_grad(s, p))[1])
    monkeypatch.setattr(
        reducer, "_complete", lambda g, b, payload: (fake.compute_op("complete", b.index), complete(g, b, payload))[1]
    )
    shard_of = {}
    if engine.sharding is not None:
        pool = engine.sharding.pool
        take_back, release_event = pool.take_back, pool.release_event
        releasing: list[int] = []

        def take_back_logged(t):
            releasing.append(t.untyped_storage().data_ptr())
            try:
                return take_back(t)
            finally:
                releasing.pop()

        def release_logged():
            event = release_event()
            fake.log.append(("release", releasing[-1], event, dict(fake.default.clock)))
            return event

        monkeypatch.setattr(pool, "take_back", take_back_logged)
        pool.release_event = release_logged
        shard_of = {u.shard.data_ptr(): s.param for u in engine.sharding.units for s in u.slots}
    fake.log.clear()
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine, layers, shard_of


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_are_ordered_against_the_compute_stream(world1, monkeypatch, stage):
    if stage == 3 and not pool_mod.SWAPS_STORAGE:
        pytest.skip(f"torch {torch.__version__} cannot swap storages: the pool keeps no slabs (the next test)")
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    engine, layers, shard_of = _train(stage, fake, monkeypatch)
    log = fake.log
    collectives = [e for e in log if e[0] == "collective"]
    gathers = [e for e in collectives if e[1] == "all_gather"]
    reductions = [e for e in collectives if e[1] != "all_gather"]
    assert reductions and all(e[2] == "reduce" for e in reductions), reductions[:3]
    if stage < 3:  # stages 1-2 rebuild the parameters after the step on the compute stream
        assert all(e[2] == "compute" for e in gathers)
    else:
        assert len(gathers) >= 3 * 2 * len(layers) // 4 and all(e[2] == "all_gather" for e in gathers)

    # a gradient collective runs after the gradient copies issued before it; its result is used after
    # the compute stream waited for it (one _complete per bucket, in launch order)
    completes = [e for e in log if e[:2] == ("op", "complete")]
    assert len(completes) == len(reductions) > 0
    for r, c in zip(reductions, completes, strict=True):
        issued_compute_clock, reduce_tick = r[5], r[6]
        assert reduce_tick.get("compute", 0) >= issued_compute_clock.get("compute", 0), r
        assert c[-1].get("reduce", 0) >= reduce_tick["reduce"], (r, c)
    assert any(e[:2] == ("op", "grad") for e in log)

    if stage < 3:
        return
    # a layer's forward runs after the compute stream waited past its unit's last all-gather
    weight_ptr = {id(p): layer.tag for layer in layers for p in (layer.weight, layer.bias)}
    last_gather: dict[str, dict] = {}
    forwards = 0
    for e in log:
        if e[0] == "collective" and e[1] == "all_gather":
            param = shard_of.get(e[4])
            if param is not None:
                last_gather[weight_ptr[id(param)]] = e[6]
        elif e[:2] == ("op", "forward"):
            tag, clock = e[2], e[3]
            assert tag in last_gather, f"layer {tag} ran before any all-gather of its unit"
            assert clock.get("all_gather", 0) >= last_gather[tag]["all_gather"], (tag, clock, last_gather[tag])
            forwards += 1
    assert forwards == 3 * len(layers)

    # an all-gather writing pooled memory runs after every earlier release of that memory
    released: dict[int, list[dict]] = {}
    release_waits = 0
    release_events = {id(e[2]) for e in log if e[0] == "release"}
    for e in log:
        if e[0] == "release":
            released.setdefault(e[1], []).append(e[3])
        elif e[0] == "wait" and e[1] == "all_gather" and id(e[2]) in release_events:
            release_waits += 1
        elif e[0] == "collective" and e[1] == "all_gather":
            for clock in released.get(e[3], []):
                assert e[6].get("compute", 0) >= clock.get("compute", 0), "all-gather into memory still in use"
    assert release_waits > 0  # prefetches reuse slabs through their release events
    assert any(e[3] in released for e in gathers)  # and pooled memory is reused by all-gathers

    # a gather on demand (here an evaluation forward, reusing the slabs of the previous one) waits for
    # what the compute stream wrote before it, e.g. a checkpoint load into the shards
    x = torch.randn(4, 16)
    with torch.no_grad():
        engine(x)
        fake.compute_op("shard_write")
        written = fake.default.clock["compute"]
        fake.log.clear()
        engine(x)
    after = [e for e in fake.log if e[:2] == ("collective", "all_gather")]
    assert len(after) == len(layers) and all(e[6]["compute"] >= written for e in after)


def test_without_storage_swaps_every_all_gather_waits_for_the_compute_stream(world1, monkeypatch):
    """Torch before 2.12 (zerodp.stage3.pool.SWAPS_STORAGE false): each gather's memory is a fresh
    allocation made on the compute stream, so every all-gather waits for the compute stream as it was
    when the all-gather was issued (not only for a release event), and the layers' forwards still
    come after their unit's all-gather."""
    monkeypatch.setattr(pool_mod, "SWAPS_STORAGE", False)
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    engine, layers, shard_of = _train(3, fake, monkeypatch)
    assert not engine.sharding.pool.swap_storage and engine.sharding.pool.free_bytes() == 0
    gathers = [e for e in fake.log if e[:2] == ("collective", "all_gather") and e[2] == "all_gather"]
    assert len(gathers) >= 3 * 2 * len(layers) // 4
    for e in gathers:
        assert e[6].get("compute", 0) >= e[5].get("compute", 0), "all-gather ran ahead of the compute stream"
    assert not any(e[0] == "release" for e in fake.log)  # no slab kept, no release event
    forwards = [e for e in fake.log if e[:2] == ("op", "forward")]
    assert len(forwards) == 3 * len(layers)


def test_cpu_run_uses_torch_cpu_no_op_streams(world1):
    """Without the stand-in, the same lines run with torch.cpu's streams (no-ops)."""
    engine = zerodp.initialize(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    assert isinstance(engine.sharding.gather_stream.stream, torch.cpu.Stream)
    assert isinstance(engine.reducer.stream.stream, torch.cpu.Stream)
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
