"""ZeRO stage 3 (P_os+g+p, paper section 5.3): parameters partitioned per submodule.

- :mod:`.units`: :class:`~.units.ShardedUnit`, one module's parameters as a flat shard, with the
  SHARDED -> GATHERING -> UNSHARDED state machine.
- :mod:`.coordinator`: fetch/release, the recorded trace and prefetch.
- :mod:`.hooks`: the module hooks (forward, and backward riding on them), registered in one place.
- :mod:`.ownership`: which unit owns each partitioned parameter (used by :mod:`zerodp.zero`).
- :mod:`.init_writes`: gather-on-touch for writes to parameters that ``zero.Init`` has partitioned.
- :mod:`.sharding`: :class:`~.sharding.Stage3`, building units for an engine and wiring the above.
"""
