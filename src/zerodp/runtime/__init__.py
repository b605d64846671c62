"""The sharding runtime shared by every stage: collectives and their ledger (:mod:`.comm`), flat
buffers cut into buckets and owned pieces (:mod:`.partition`), gradient reducers (:mod:`.reducer`),
mixed precision and loss scaling (:mod:`.precision`), the optimizer over owned pieces (:mod:`.optim`),
DeepSpeed's LR schedules (:mod:`.schedulers`), activation checkpointing (:mod:`.activation_checkpointing`,
public as :mod:`zerodp.checkpointing`) and the ZeRO paper's memory/traffic formulas (:mod:`.accounting`).
Nothing here knows about stage 3's per-module units (:mod:`zerodp.stage3`).
"""
