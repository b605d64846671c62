"""``deepspeed.runtime.lr_schedules``: the schedule names (accelerate checks a config's
``scheduler.type`` against :data:`VALID_LR_SCHEDULES`). zerodp builds ``WarmupLR``,
``WarmupDecayLR`` and ``WarmupCosineLR`` (:mod:`zerodp.runtime.schedulers`); ``LRRangeTest`` and
``OneCycle`` are listed, as in DeepSpeed, and refused by the config."""

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]
