"""The deliberate faults ``make mutants`` applies (see tools/mutants.py), one per entry.

Each :class:`Mutant` replaces ``old`` (which must occur exactly once in ``file``) with ``new`` and names
the tests that must then fail. Selections are kept small (one world size, one stage) so the whole run
takes a few minutes; each is run first on the unmutated tree and must pass there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE = "src/zerodp/engine.py"
GRAD_REDUCER = "src/zerodp/runtime/grad_reducer.py"
FULL_GRAD_REDUCERS = "src/zerodp/runtime/full_grad_reducers.py"
PARTITIONED_REDUCER = "src/zerodp/runtime/partitioned_reducer.py"
PARTITION = "src/zerodp/runtime/partition.py"
PRECISION = "src/zerodp/runtime/precision.py"
STEP_CONTROL = "src/zerodp/runtime/step_control.py"
SHARDING = "src/zerodp/stage3/sharding.py"
HOOKS = "src/zerodp/stage3/hooks.py"
CHECKPOINT = "src/zerodp/checkpoint/load.py"
CHECKPOINT_SAVE = "src/zerodp/checkpoint/save.py"

FAULTS = "tests/test_faults.py"
STAGES = "tests/test_stages.py"
INIT = "src/zerodp/zero.py"
INIT_BUILD = "tests/test_init_build.py"
DEFERRED_GRADS = "src/zerodp/offload/deferred_grads.py"
NO_OFFLOAD = "src/zerodp/offload/no_offload.py"
CPU_ADAM = "src/zerodp/offload/cpu_adam.py"
PARAM_SWAP = "src/zerodp/offload/param_swap.py"
PARAM_OFFLOAD_SRC = "src/zerodp/offload/param_offload.py"
STEP_PIPELINE = "src/zerodp/offload/step_pipeline.py"
ZERO_PAGES = "src/zerodp/runtime/zero_pages.py"
COMM = "src/zerodp/runtime/comm.py"
TOPOLOGY = "src/zerodp/runtime/topology.py"
BACKWARD_AGREEMENT = "src/zerodp/runtime/backward_agreement.py"
PARAM_OFFLOAD = "tests/test_param_offload.py"
GRAD_ACCUM = "tests/test_grad_accumulation.py"
CONTROL = "src/zerodp/runtime/control.py"
DEVICE = "src/zerodp/runtime/device.py"
GRAD_NORM = "src/zerodp/runtime/grad_norm.py"
CLIP = "tests/test_clip_grad.py::test_user_clipping"
UNITS = "src/zerodp/stage3/units.py"
ACCOUNTING = "src/zerodp/runtime/accounting.py"
GUARDS = "src/zerodp/runtime/guards.py"
UNIT_PLAN = "tests/unit/test_partition_plan.py"  # the in-process tier (make test-unit): seconds per mutant
UNIT_SHARD = "tests/unit/test_shard_state.py"
STREAM_ORDER = "tests/unit/test_stream_order.py::test_collectives_are_ordered_against_the_compute_stream"
UNIT_PRECISION = "tests/unit/test_precision_scaler.py"
UNIT_ACCOUNTING = "tests/unit/test_accounting_formulas.py"
PLACEHOLDER = "src/zerodp/stage3/placeholder.py"
UNIT_PLACEHOLDER = "tests/unit/test_placeholder_save.py"


@dataclass(frozen=True)
class Mutant:
    """A named fault: replace ``old`` by ``new`` in ``file``; ``tests`` (pytest node ids) must fail."""

    name: str
    file: str
    old: str
    new: str
    tests: list[str] = field(default_factory=list)


MUTANTS: list[Mutant] = [
    Mutant(
        "drop_accumulation_division",
        ENGINE,
        "            loss = loss / self.gradient_accumulation_steps\n",
        "            loss = loss\n",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"],
    ),
    Mutant(
        "skip_fp16_unscale",
        ENGINE,
        "            self._scale_grads(1.0 / self.loss_scaler.scale)\n",
        "            pass\n",
        [f"{FAULTS}::test_mixed_precision_scale_sensitive[2-0-fp16_loss_scale]"],
    ),
    Mutant(
        "skip_a_bucket_reduce_scatter_stage2",
        PARTITIONED_REDUCER,
        "        del self._staging[id(b)]\n        buf.div_(self.world_size)\n",
        "        del self._staging[id(b)]\n        if b.index == 0:\n            return\n"
        "        buf.div_(self.world_size)\n",
        [f"{STAGES}::test_matches_reference[2-2-adam_buckets]"],
    ),
    Mutant(
        "average_over_wrong_world_size_stage0",
        FULL_GRAD_REDUCERS,
        "        grad.div_(self.world_size)\n        self.stream.after_compute()",
        "        grad.div_(max(self.world_size - 1, 1))\n        self.stream.after_compute()",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"],
    ),
    Mutant(
        "average_over_wrong_world_size_stage2",
        PARTITIONED_REDUCER,
        "        buf.div_(self.world_size)\n",
        "        buf.div_(self.world_size + 1)\n",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-2]"],
    ),
    Mutant(
        "skip_rank0_broadcast",
        ENGINE,
        "        if self.world_size == 1:\n            return\n        src = dist.get_global_rank(",
        "        if True:\n            return\n        src = dist.get_global_rank(",
        [f"{FAULTS}::test_ranks_built_from_different_seeds_train_rank0s_model[2-1]"],
    ),
    Mutant(
        "skip_rank0_broadcast_stage3",
        SHARDING,
        '            if world_size > 1:\n                comm.broadcast(full, src, pg, ledger, "init")',
        '            if False:\n                comm.broadcast(full, src, pg, ledger, "init")',
        [f"{FAULTS}::test_ranks_built_from_different_seeds_train_rank0s_model[2-3]"],
    ),
    Mutant(
        "release_stage3_unit_before_backward_without_regather",
        HOOKS,
        "            return _wrap(coordinator.fetch, module, output)\n",
        "            return None\n",
        [f"{STAGES}::test_matches_reference[2-3-adam_buckets]"],
    ),
    Mutant(
        "skip_restoring_loss_scaler_from_checkpoint",
        CHECKPOINT,
        "        engine.loss_scaler.load_state_dict(staged.loss_scaler)\n",
        "        pass\n",
        ["tests/test_checkpoint.py::test_loads_across_precisions"],
    ),
    Mutant(
        "write_checkpoint_without_checksum",
        CHECKPOINT_SAVE,
        "        **integrity.encode(integrity.checksums(tensors)),\n",
        "",
        ["tests/test_checkpoint_integrity.py::test_pristine_checkpoint_verifies_and_loads"],
    ),
    Mutant(
        "ignore_fp16_overflow",
        ENGINE,
        "local_overflow = self.loss_scaler is not None and self._has_inf_or_nan()",
        "local_overflow = False",
        [f"{STAGES}::test_fp16_overflow_on_one_rank_skips_on_all[2-2]"],
    ),
    Mutant(
        "loss_scale_not_halved_on_overflow",
        PRECISION,
        "self.scale = max(self.scale / 2.0, self.min_scale)",
        "self.scale = max(self.scale, self.min_scale)",
        [f"{STAGES}::test_fp16_overflow_on_one_rank_skips_on_all[2-0]"],
    ),
    Mutant(
        "clip_with_local_grad_norm",
        STEP_CONTROL,
        "        return False, float(control[:1].sqrt())\n",
        "        return False, float(local_sum_of_squares(step_grads(engine)).sqrt())\n",
        [f"{FAULTS}::test_accumulation_with_clipping_below_the_norm[2-1]"],
    ),
    Mutant(
        "skip_parameter_all_gather_after_step",
        ENGINE,
        "        elif self.stage >= 1:  # every rank's updated shards, all-gathered into the full parameters\n",
        "        elif False:\n",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-1]"],
    ),
    Mutant(
        "master_not_copied_back_to_module",
        NO_OFFLOAD,
        "                piece.tensor.copy_(piece.master)",
        "                pass",
        [f"{FAULTS}::test_mixed_precision_scale_sensitive[2-0-bf16_accum]"],
    ),
    Mutant(
        "stage2_overwrite_instead_of_accumulate",
        PARTITIONED_REDUCER,
        "            whole[off : off + b.shard_numel].add_(recv)",
        "            whole[off : off + b.shard_numel].copy_(recv)",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-2]"],
    ),
    Mutant(
        "stage2_keep_grad_after_bucketing",
        PARTITIONED_REDUCER,
        "            if view is not None and s.param.grad is view:\n                s.param.grad = None\n",
        "            if view is not None and s.param.grad is view:\n                pass\n",
        [f"{FAULTS}::test_storage_held_stages_0_to_2[2-2]"],
    ),
    Mutant(
        "stage2_first_gradient_not_copied_into_view",
        PARTITIONED_REDUCER,
        "            if grad is not view:  # a tensor autograd made (the first gradient, an out-of-place sum)\n",
        "            if False:\n",
        [f"{STAGES}::test_matches_reference[2-2-adam_buckets]"],
    ),
    Mutant(
        "parameters_copied_not_aliasing_flat_buffer",
        PARTITION,
        "        s.param.data = s.view(view)\n",
        "        s.param.data = s.view(view).clone()\n",
        [f"{FAULTS}::test_storage_held_stages_0_to_2[2-0]"],
    ),
    Mutant(
        "stage1_optimizer_states_not_partitioned",
        ENGINE,
        "assign_pieces(g, self.rank, owns_everything=self.stage == 0)",
        "assign_pieces(g, self.rank, owns_everything=self.stage <= 1)",
        [f"{FAULTS}::test_storage_held_stages_0_to_2[2-1]"],
    ),
    Mutant(
        "gradients_not_zeroed_after_step",
        FULL_GRAD_REDUCERS,
        "        for buf in self._zero_pages.values():\n            buf.zero_()\n",
        "        for buf in self._zero_pages.values():\n            pass\n",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"],
    ),
    Mutant(
        "unused_parameter_gets_zero_gradient",
        STEP_CONTROL,
        "            if present[piece.slot.index]:\n",
        "            if True:\n",
        [f"{STAGES}::test_matches_reference[2-2-no_grad_some_steps]"],
    ),
    Mutant(
        "skip_stage3_persistent_regather_after_step",
        SHARDING,
        '                comm.all_gather(u.full_buffer, u.shard, self.pg, self.ledger, "parameters")\n',
        "                pass\n",
        [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-3]"],
    ),
    Mutant(
        "init_touch_in_partition_dtype",
        INIT,
        "            self._touch.built_dtype[id(unit)] = built  # touched later: gathered in this dtype\n",
        "            pass\n",
        [f"{INIT_BUILD}::test_init_gives_the_same_weights_as_without_it[1-hf-bf16]"],
    ),
    Mutant(
        "init_partitions_only_on_attachment",
        INIT,
        "            register_module_parameter_registration_hook(self._on_parameter),\n",
        "",
        [f"{INIT_BUILD}::test_init_build_peak_is_one_layer_above_the_shards[2]"],
    ),
    Mutant(
        "swap_files_kept_on_sigterm",
        "src/zerodp/offload/swap_dir.py",
        "def _on_signal(signum: int, frame: Any) -> None:\n    unlink_live()\n",
        "def _on_signal(signum: int, frame: Any) -> None:\n    pass\n",
        ["tests/test_swap_dir.py::test_signal_to_the_rank_removes_its_swap_files"],
    ),
    Mutant(
        "live_job_swap_dir_judged_stale",
        "src/zerodp/offload/swap_dir.py",
        '    return start is not None and (rec.get("start") is None or start == rec["start"])\n',
        "    return False\n",
        ["tests/test_swap_dir.py::test_sigkill_leftovers_are_named_and_removed_only_when_asked"],
    ),
    Mutant(
        "nvme_auto_sub_group_ignores_the_budget",
        "src/zerodp/offload/sizing.py",
        "    cap = min(budget_bytes, AUTO_SHARE * moved_off_bytes(owned_numel, masters_moved))\n",
        "    cap = 1 << 40\n",
        ["tests/test_offload_rss.py::test_offload_lowers_rss_by_what_it_moves_off"],
    ),
    Mutant(
        "nvme_deferred_gradient_keeps_only_the_first_scale_factor",
        DEFERRED_GRADS,
        "        for f in self._factors:\n            out.mul_(f)\n",
        "        for f in self._factors[:1]:\n            out.mul_(f)\n",
        [
            "tests/test_offload.py::test_offload_equals_non_offloaded[1-1,2,3-bf16,fp16_overflow,edit_bf16,fp16_accum_clip]"
        ],
    ),
    Mutant(
        "offloaded_step_not_switched_to_fused_adam",
        CPU_ADAM,
        '    for g in groups:\n        g["fused"] = True\n',
        "    for g in groups:\n        pass\n",
        ["tests/test_cpu_adam.py::test_fused_offload_equals_non_offloaded[1-bf16-nvme]"],
    ),
    Mutant(
        "overlap_step_forward_uses_shards_before_their_update",
        PARAM_SWAP,
        "            self.swapper.before_use(self)\n",
        "            pass\n",
        [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"],
    ),
    Mutant(
        "overlap_step_uses_the_scheduler_s_next_lr",
        STEP_PIPELINE,
        "            g.update(v)\n",
        "            pass\n",
        [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"],
    ),
    Mutant(
        "shard_reads_counted_inside_the_all_gather_window",
        PARAM_OFFLOAD_SRC,
        "            if not any(h.state is Residency.SWAPPED for h in homes):\n                continue\n",
        "",
        [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"],
    ),
    Mutant(
        "gloo_reduce_scatter_keeps_only_own_chunk",
        COMM,
        "            torch.sum(received.view(-1, self._output.numel()), dim=0, out=self._output)\n",
        "            self._output.copy_(received.view(-1, self._output.numel())[0])\n",
        ["tests/test_comm.py::test_reduce_scatter_by_all_to_all_matches_torch[2]"],
    ),
    Mutant(
        "grad_norm_sums_norms_not_squares",
        TOPOLOGY,
        '        total += synchronize("grad_norm", torch.cat(per_device).double().pow(2).sum())  # one per device\n',
        '        total += synchronize("grad_norm", torch.cat(per_device).double().sum())  # one per device\n',
        ["tests/test_silent_wrong.py::test_full_state_accessors[2]"],
    ),
    Mutant(
        "backward_end_tag_without_fetch_digest",
        BACKWARD_AGREEMENT,
        "        self._post(0, self.end_identity(self.posted, self._fetches, self._digest))\n",
        "        self._post(0, self.posted)\n",
        ["tests/test_backward_guard.py::test_backward_fetch_order_is_compared_without_a_tag_per_fetch"],
    ),
    Mutant(
        "coalesced_reduce_tag_names_first_bucket_only",
        BACKWARD_AGREEMENT,
        "        digest = hashlib.blake2b(repr(buckets).encode(), digest_size=8).digest()\n",
        "        digest = hashlib.blake2b(repr(buckets[:1]).encode(), digest_size=8).digest()\n",
        ["tests/test_backward_guard.py::test_coalesced_reduction_differing_in_one_bucket_is_detected"],
    ),
    Mutant(
        "zero_page_buffer_not_cleared",
        ZERO_PAGES,
        "        self.mapping.madvise(mmap.MADV_DONTNEED, *self.released)\n",
        "        pass\n",
        ["tests/test_zero_pages.py"],
    ),
    Mutant(
        "grad_norm_batches_a_generator",
        TOPOLOGY,
        "    batch = isinstance(grads, list)",
        "    batch = True",
        ["tests/unit/test_grad_norm_batched.py::test_generator_reusing_one_buffer_is_read_as_it_goes"],
    ),
    Mutant(
        "added_parameter_walk_misses_it",
        GUARDS,
        "            if p is not None and id(p) not in known and p.requires_grad:\n                return True\n",
        "            if p is not None and id(p) not in known and p.requires_grad:\n                return False\n",
        ["tests/unit/test_guard_walks.py"],
    ),
    Mutant(
        "rebind_check_skips_every_slot",
        GUARDS,
        "                if step and s.numel and s.param.data_ptr() == ptr0 + (s.offset - shift) * step:\n",
        "                if step:\n",
        ["tests/unit/test_guard_walks.py::test_rebinding_adopted_and_wrong_shape_refused"],
    ),
    Mutant(
        "zero_page_tail_not_cleared",
        ZERO_PAGES,
        "            self.tail.zero_()",
        "            pass",
        ["tests/test_zero_pages.py::test_tail_under_a_huge_page_is_zeroed_in_place"],
    ),
    Mutant(
        "grad_accum_in_param_dtype",
        PRECISION,
        "    return torch.float32 if accumulation_steps > 1 else param_dtype\n",
        "    return param_dtype\n",
        [
            f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-0-bf16]",
            f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-2-fp16]",
        ],
    ),
    Mutant(
        "fp32_fold_overwrites",
        FULL_GRAD_REDUCERS,
        "                view.add_(param.grad)\n                param.grad = None\n",
        "                view.copy_(param.grad)\n                param.grad = None\n",
        [f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-1-bf16]"],
    ),
    Mutant(
        "scale_wrt_gas_ignored",
        ENGINE,
        "        if scale_wrt_gas and self.gradient_accumulation_steps > 1:\n",
        "        if self.gradient_accumulation_steps > 1:\n",
        [f"{GRAD_ACCUM}::test_token_weighted_loss_with_scale_wrt_gas_false[1-0]"],
    ),
    Mutant(
        "gradient_hook_holds_its_reducer",
        GRAD_REDUCER,
        "        reducer = weakref.ref(self)\n",
        "        reducer = (lambda owner=self: owner)\n",
        ["tests/test_engine_lifetime.py::test_dropped_engine_is_collected[0-None]"],
    ),
    Mutant(
        "module_state_holds_its_engine",
        "src/zerodp/runtime/zero_state.py",
        "    ref = weakref.ref(engine)\n",
        "    ref = (lambda e=engine: e)\n",
        ["tests/test_engine_lifetime.py::test_accessor_on_a_dropped_engine_says_so"],
    ),
    Mutant(
        "control_tensors_stay_on_an_nccl_only_group",
        CONTROL,
        "    return control_group(group)\n",
        "    return group\n",
        ["tests/test_device.py::test_comm_all_reduce_of_a_host_tensor_goes_to_the_side_group"],
    ),
    Mutant(
        "auto_device_ignores_the_group_backend",
        DEVICE,
        '    takes_cuda = cuda and group_takes("cuda", group)\n',
        "    takes_cuda = cuda\n",
        ["tests/test_device.py::test_auto_is_cpu_without_cuda_or_without_a_cuda_backend"],
    ),
    Mutant(
        "user_clip_not_applied_to_engine_grads",
        GRAD_NORM,
        "                t.mul_(coef)\n",
        "                pass\n",
        [f"{CLIP}[w1-stage2-fp32-none]"],
    ),
    Mutant(
        "user_clip_pending_factor_dropped_at_step",
        GRAD_NORM,
        "        scale_grads(state.pending)\n",
        "        pass\n",
        [f"{CLIP}[w1-stage2-fp32-cpu]"],
    ),
    Mutant(
        "user_clip_norm_of_loss_scaled_grads",
        GRAD_NORM,
        "    unscale = state.pending / engine.loss_scale",
        "    unscale = state.pending",
        [f"{CLIP}[w1-stage2-fp16-none]"],
    ),
    Mutant(
        "full_grad_ignores_pending_clip",
        "src/zerodp/accessors.py",
        "        out.mul_(pending)\n",
        "        pass\n",
        [f"{CLIP}[w1-stage1-fp32-cpu]"],
    ),
    Mutant(
        "param_grad_left_none_at_stage1",
        "src/zerodp/runtime/grad_placeholder.py",
        "            p.grad = entry[0]\n",
        "            pass\n",
        [f"{CLIP}[w3-stage1-fp32-none]"],
    ),
    Mutant(
        "excluded_frozen_not_recorded",
        CHECKPOINT_SAVE,
        "        excluded_frozen=[r.name for r in params if not r.trained] if exclude_frozen else [],\n",
        "        excluded_frozen=[],\n",
        ["tests/test_checkpoint_exclude_frozen.py::test_exclude_frozen_parameters[w1-stage1-fp32-none]"],
    ),
    Mutant(
        "load_overwrites_excluded_frozen_shards",
        CHECKPOINT,
        "            continue  # frozen, not saved (exclude_frozen_parameters): this engine's values stay\n",
        "            pass\n",
        ["tests/test_checkpoint_exclude_frozen.py::test_exclude_frozen_parameters[w1-stage3-fp32-none]"],
    ),
    # killed by the in-process tier (tests/unit), in seconds
    Mutant(
        "bucket_not_padded_to_world_size",
        PARTITION,
        "        padded = -(-(cursor - start) // world_size) * world_size\n",
        "        padded = cursor - start\n",
        [f"{UNIT_PLAN}::test_buckets_cover_every_element_once_within_bound"],
    ),
    Mutant(
        "bucket_closes_when_exactly_full",
        PARTITION,
        "        if current and filled + p.numel() > bucket_size:\n",
        "        if current and filled + p.numel() >= bucket_size:\n",
        [f"{UNIT_PLAN}::test_buckets_cover_every_element_once_within_bound"],
    ),
    Mutant(
        "every_rank_owns_shard_zero",
        PARTITION,
        "else b.shard_range(rank)\n",
        "else b.shard_range(0)\n",
        [f"{UNIT_PLAN}::test_pieces_partition_each_bucket_across_ranks"],
    ),
    Mutant(
        "hysteresis_not_restored_after_window",
        PRECISION,
        "            self.hysteresis_left = self.hysteresis\n",
        "            pass\n",
        [f"{UNIT_PRECISION}::test_dynamic_schedule_follows_hysteresis_and_window"],
    ),
    Mutant(
        "optimizer_states_partitioned_from_stage2",
        ACCOUNTING,
        '"optimizer_states": b.optimizer * numel / (n if stage >= 1 else 1),',
        '"optimizer_states": b.optimizer * numel / (n if stage >= 2 else 1),',
        [f"{UNIT_ACCOUNTING}::test_mixed_precision_adam_is_2_2_12_psi"],
    ),
    Mutant(
        "gather_does_not_enter_gathering",
        UNITS,
        "        self.state = ShardState.GATHERING\n",
        "        pass\n",
        [f"{UNIT_SHARD}::test_gather_release_cycle_restores_values"],
    ),
    Mutant(
        "stage3_unit_not_padded_to_world_size",
        UNITS,
        "    padded = max(-(-cursor // world_size) * world_size, world_size)\n",
        "    padded = max(cursor, world_size)\n",
        [f"{UNIT_SHARD}::test_shards_of_larger_worlds"],
    ),
    Mutant(
        "autograd_saves_gathered_storage",
        "src/zerodp/stage3/aliases.py",
        "            if hit is not None:\n                return _SavedAlias(",
        "            if False:\n                return _SavedAlias(",
        ["tests/test_escaping_views.py::test_escaping_view_trains_right[saved-False-3-3]"],
    ),
    Mutant(
        "returned_view_not_copied",
        HOOKS,
        "        if copies:  # views of the module's parameters returned",
        "        if copies and False:  # views of the module's parameters returned",
        ["tests/test_escaping_views.py::test_escaping_view_trains_right[returned-False-3-3]"],
    ),
    Mutant(
        "escaped_view_storage_freed",
        "src/zerodp/stage3/units.py",
        "        if self.refs:\n            self._leave_escaped_views(allow or {})",
        "        if False:\n            self._leave_escaped_views(allow or {})",
        ["tests/test_escaping_views.py::test_escaping_view_trains_right[stored-False-3-3]"],
    ),
    Mutant(
        "state_dict_value_reads_storage",
        "src/zerodp/stage3/sharded_param.py",
        "_DATA_METADATA = METADATA - _MEMORY_ACCESS",
        "_DATA_METADATA = METADATA",
        ["tests/test_escaping_views.py::test_state_dict_values_outside_zerodp[fp32-False-3-1]"],
    ),
    # [Note: comm streams]: the recording stand-in for the device's module (in-process tier)
    Mutant(
        "compute_does_not_wait_for_all_gather_stream",
        UNITS,
        "            self.stream.done(self.work)",
        "            self.work.wait()",
        [f"{STREAM_ORDER}[3]"],
    ),
    Mutant(
        "pooled_slab_reused_without_release_event",
        "src/zerodp/stage3/pool.py",
        "            waiter.wait_for(self._released.pop(id(slab), None))",
        "            self._released.pop(id(slab), None)",
        [f"{STREAM_ORDER}[3]"],
    ),
    Mutant(
        "demand_gather_skips_compute_wait",
        "src/zerodp/stage3/coordinator.py",
        "        if stream is not None and (not prefetch or stream.stale):",
        "        if False:",
        [f"{STREAM_ORDER}[3]"],
    ),
    Mutant(
        "reduce_before_gradient_event",
        PARTITIONED_REDUCER,
        "            self.stream.after_compute()  # the buckets' staging buffers are written on the compute stream",
        "            pass",
        [f"{STREAM_ORDER}[2]"],
    ),
    Mutant(
        "reduce_result_used_before_completion_event",
        GRAD_REDUCER,
        "            self.stream.done(work)  # the buckets' buffers are read or reused only after this",
        "            work.wait()",
        [f"{STREAM_ORDER}[0]"],
    ),
    Mutant(
        "registration_shadows_real_deepspeed",
        "src/zerodp/deepspeed/registration.py",
        "    if spec is not None:\n        raise DeepSpeedShadowError(",
        "    if False:\n        raise DeepSpeedShadowError(",
        ["tests/test_deepspeed_registration.py::test_refuses_to_shadow_a_real_deepspeed[package]"],
    ),
    Mutant(
        "registration_reports_no_version",
        "src/zerodp/deepspeed/registration.py",
        "            yield _Distribution()",
        "            yield from ()",
        ["tests/test_deepspeed_registration.py::test_install_registers_module_submodules_and_version"],
    ),
    Mutant(
        "accelerate_unstepped_backward_not_counted",
        "src/zerodp/deepspeed/engine.py",
        "            self.engine.step()  # a non-boundary micro-step: counts it, updates nothing",
        "            pass  # a non-boundary micro-step: counts it, updates nothing",
        ["tests/test_hf_trainer.py::test_trainer_on_zerodp_matches_ddp[zero3]"],
    ),
    Mutant(
        "gradient_partition_held_in_ram",
        ENGINE,
        "spill=None if self.loss_scaler is not None else self.optimizer_offload.gradient_spill,",
        "spill=None,",
        ["tests/test_infinity_rss.py::test_peak_rss_does_not_grow_with_the_model"],
    ),
    Mutant(
        "calibration_step_holds_every_bucket",
        GRAD_REDUCER,
        "        self._deferred = not self.repairs_late  #",
        "        self._deferred = True  #",
        [
            "tests/unit/test_reducer_world1.py::test_first_micro_step_stages_few_buckets[kwargs0]",
            "tests/test_infinity_rss.py::test_peak_rss_does_not_grow_with_the_model",
        ],
    ),
    Mutant(
        "late_contribution_not_reduced_again",
        GRAD_REDUCER,
        "            flags[1 + k] = int(id(b) in self._late)\n",
        "            flags[1 + k] = 0\n",
        [
            "tests/unit/test_reducer_world1.py::test_repeated_accumulation_in_one_backward_is_summed[2-kwargs2]",
            "tests/unit/test_reducer_world1.py::test_repeated_accumulation_in_one_backward_is_summed[2-kwargs3]",
        ],
    ),
    Mutant(
        "infinity_plan_sums_the_phases",
        "src/zerodp/app/infinity_ram.py",
        'f"transients per rank: {larger}": sums[larger],',
        'f"transients per rank: {larger}": sum(sums.values()),',
        ["tests/test_infinity_preset.py::test_dry_run_sizes_states_to_twice_the_assumed_ram"],
    ),
    Mutant(
        "gradient_reads_share_one_buffer",
        "src/zerodp/offload/nvme.py",
        "        on_read = None if reads is None else lambda sg, slot: reads.issue(sg.index, slot)",
        "        on_read = None if reads is None else lambda sg, slot: reads.issue(sg.index, 0)",
        ["tests/test_offload.py::test_offload_equals_non_offloaded[3-3-fp32,accum_clip,bf16_accum,edit_frozen]"],
    ),
    Mutant(
        "gradient_reads_issued_at_use",
        "src/zerodp/offload/nvme.py",
        "        on_read = None if reads is None else lambda sg, slot: reads.issue(sg.index, slot)",
        "        on_read = None",
        ["tests/unit/test_grad_swap_pool.py::test_each_gradient_read_is_queued_behind_its_regions_read_in_one_pool"],
    ),
    Mutant(
        "state_dict_keeps_gathered_view",
        "src/zerodp/checkpoint/layout.py",
        "                    del v  # a view of the gathered storage",
        "                    pass  # a view of the gathered storage",
        ["tests/test_hf_trainer.py::test_trainer_on_zerodp_matches_ddp[zero3]"],
    ),
    Mutant(
        "delayed_update_drops_edits",
        "src/zerodp/offload/delayed.py",
        "    if torch.equal(now, before):  # the common case: nothing edited",
        "    if True:  # the common case: nothing edited",
        [
            "tests/test_delayed_update.py::test_delayed_update_follows_stale_reference[2-1,2,3-plain,clip_sched_accum,edit]"
        ],
    ),
    Mutant(
        "delayed_update_not_delayed",
        "src/zerodp/offload/delayed.py",
        "        self.updates_launched += 1",
        "        self.updates_launched += 1\n        self.wait_update()\n        self.fold_edits()",
        ["tests/test_delayed_update.py::test_delayed_update_follows_stale_reference[1-1,2,3-plain,clip_sched_accum]"],
    ),
    Mutant(
        "torch_style_accumulation_unwarned",
        "src/zerodp/runtime/training_state.py",
        "        if new is S.BACKWARD and self.state is not S.IDLE and self.gradient_accumulation_steps > 1:",
        "        if False:",
        ["tests/unit/test_training_state.py::test_torch_style_accumulation_on_the_engine_warns_at_the_caller"],
    ),
    Mutant(
        "step_without_backward_unwarned",
        "src/zerodp/runtime/training_state.py",
        "        elif new is S.STEP and self.state is S.IDLE:",
        "        elif False:",
        ["tests/unit/test_training_state.py::test_step_before_backward_on_the_engine_warns_and_counts"],
    ),
    Mutant(
        "init_remote_nvme_ignored",
        INIT,
        '    device = po.device if remote in (None, "none") else remote',
        "    device = po.device",
        ["tests/test_init_remote.py::test_dropin_takes_remote_device_and_pin_memory"],
    ),
    Mutant(
        "gathered_plain_in_given_order",
        "src/zerodp/stage3/gathered.py",
        "        plain = [p for _, p in sorted(zip(known, plain, strict=True), key=lambda sp: sp[0])]\n",
        "",
        ["tests/test_clients.py::test_gathered_parameters_before_initialize_pairs_persistent_ones_by_creation"],
    ),
    Mutant(
        "gathered_broadcasts_state_dict_views",
        "src/zerodp/stage3/gathered.py",
        " and (isinstance(p, torch.nn.Parameter) or INIT_SEQ in p.__dict__)\n",
        "\n",
        ["tests/test_clients.py::test_gathered_parameters_before_initialize_pairs_persistent_ones_by_creation"],
    ),
    # stage 3 under the DeepSpeed drop-in: torch.save writes placeholders (zerodp.stage3.placeholder)
    Mutant(
        "placeholder_save_unwarned",
        PLACEHOLDER,
        "    if _Announced.covers(tensor, pickler):\n        return\n",
        "    if True:\n        return\n",
        [f"{UNIT_PLACEHOLDER}::test_one_warning_per_torch_save"],
    ),
    Mutant(
        "placeholder_warning_outlives_its_save",
        PLACEHOLDER,
        "            and cls.pickler() is pickler\n",
        "",
        [f"{UNIT_PLACEHOLDER}::test_interrupted_save_leaves_nothing_silent"],
    ),
    Mutant(
        "placeholder_loads_as_empty_tensor",
        PLACEHOLDER,
        "            _load_placeholder(name, shape, dtype)\n",
        "            return torch.empty(0)  # type: ignore[misc]\n",
        [f"{UNIT_PLACEHOLDER}::test_placeholder_refuses_to_load_every_way"],
    ),
    Mutant(
        "dropin_save_refused_as_native",
        "src/zerodp/deepspeed/zero.py",
        "        save_as_placeholders(p)\n",
        "",
        ["tests/test_chat_save.py::test_ds_chat_stage3_save_sequence[fp32_init-1]"],
    ),
    Mutant(
        "cleared_grads_applied_anyway",
        "src/zerodp/engine.py",
        "            self.grad_placeholders.check_not_cleared()  # module.zero_grad() between backward and step\n",
        "",
        ["tests/unit/test_cleared_grads.py::test_grad_set_to_none_between_backward_and_step_is_refused"],
    ),
    Mutant(
        "nvme_device_edit_fingerprints_ignored",
        "src/zerodp/offload/nvme_device.py",
        '            out.update(k for k, f in zip(keys, host_flags("offload_edits", flags), strict=True) if f)\n',
        '            host_flags("offload_edits", flags)\n',
        ["tests/unit/test_offload_nvme_device.py::test_nvme_optimizer_offload_on_a_device_uses_the_copy_stream[1]"],
    ),
    Mutant(
        "nvme_device_forward_before_param_copies",
        "src/zerodp/offload/nvme_device.py",
        "            self.copies.device_wait()\n",
        "            pass\n",
        ["tests/unit/test_offload_nvme_device.py::test_nvme_optimizer_offload_on_a_device_uses_the_copy_stream[1]"],
    ),
    # fresh-user report: optimizer state of another optimizer, the 16-bit save, config sources and messages
    Mutant(
        "load_optimizer_state_of_another_optimizer",
        CHECKPOINT,
        "                check_optimizer_state(reader, engine)\n",
        "                pass\n",
        ["tests/test_checkpoint_optimizer.py::test_other_optimizer_refused_then_loaded_without_states[1-2-SGD-AdamW]"],
    ),
    Mutant(
        "optimizer_state_keys_not_compared_within_a_class",
        "src/zerodp/checkpoint/optimizer_match.py",
        "            if keys != expected:\n",
        "            if keys != expected and saved != mine:\n",
        [
            "tests/test_checkpoint_optimizer.py::test_other_optimizer_refused_then_loaded_without_states"
            "[1-1-AdamW-AdamW+amsgrad]"
        ],
    ),
    Mutant(
        "save_16bit_model_writes_fp32",
        "src/zerodp/checkpoint/weights16.py",
        "v.to(dtypes[k]) if k in dtypes else v",
        "v",
        ["tests/test_save_16bit.py::test_save_16bit_model_equals_pytorch[2-bf16]"],
    ),
    Mutant(
        "deepspeed_config_from_args_and_call_silently_one",
        "src/zerodp/deepspeed/__init__.py",
        "    if len(named) > 1:\n",
        "    if False:\n",
        ["tests/test_deepspeed_dropin.py::test_initialize_refusals[args_and_config]"],
    ),
    Mutant(
        "betas_length_said_by_pydantic",
        "src/zerodp/config_base.py",
        "        if len(v) != len(args):\n",
        "        if False:\n",
        ["tests/test_config.py::test_sizes_and_numbers_said_in_config_terms[betas_one_value]"],
    ),
    Mutant(
        "empty_model_parameters_train_nothing",
        "src/zerodp/runtime/optim.py",
        "    if model_parameters is not None and not seen:",
        "    if False:",
        ["tests/unit/test_cleared_grads.py::test_model_parameters_without_any_parameter_is_refused"],
    ),
    Mutant(
        "estimate_stage2_traffic_ignores_accumulation",
        ACCOUNTING,
        "2: grad_accum + 1, 3: 3 * grad_accum}[stage]",
        "2: 2, 3: 3 * grad_accum}[stage]",
        [
            f"{UNIT_ACCOUNTING}::test_traffic_is_2_psi_or_3_psi_and_ledger_counts_all_reduce_twice",
            "tests/test_estimate_traffic.py::test_estimate_traffic_matches_the_engine[2-2]",
        ],
    ),
    Mutant(
        "config_adamw_keeps_torch_weight_decay",
        "src/zerodp/config_optimizer.py",
        '"params": {"weight_decay": 0.0, **params}}',
        '"params": params}',
        ["tests/test_config.py::test_optimizer_section_means_what_deepspeed_means[opt1-reference1]"],
    ),
    Mutant(
        "nvme_path_writability_not_probed",
        "src/zerodp/offload/swap_job.py",
        '        fd, probe = tempfile.mkstemp(prefix=".zerodp_probe_", dir=base)\n',
        '        fd, probe = tempfile.mkstemp(prefix=".zerodp_probe_")\n',
        ["tests/test_offload.py::test_missing_and_unwritable_path"],
    ),
    Mutant(
        "deepcopy_under_init_advises_gathering",
        "src/zerodp/stage3/sharded_param.py",
        "    if not INIT_ACTIVE[0]:\n",
        "    if True:\n",
        [
            "tests/unit/test_init_refusals.py::test_deepcopy_of_a_partitioned_layer_under_init_names_init_and_the_way_out"
        ],
    ),
    Mutant(
        "shutdown_mismatch_shows_no_step_counters",
        "src/zerodp/runtime/collective_guard.py",
        '            guard.agree(CallSite("shutdown_distributed", "", -1, -1, done=done))',
        '            guard.agree(CallSite("shutdown_distributed", "", -1, -1))',
        ["tests/test_collective_guard.py::test_shutdown_mismatch_names_the_steps_done"],
    ),
    Mutant(
        "early_norm_ignores_a_clip_factor",
        DEFERRED_GRADS,
        "        if self.spill is not None and not self._factors:",
        "        if self.spill is not None:",
        ["tests/unit/test_grad_norm_early.py::test_a_pending_clip_factor_makes_the_step_read_the_gradients"],
    ),
    Mutant(
        "early_norm_survives_a_put_without_norms",
        "src/zerodp/offload/grad_swap.py",
        "        self.span_norms.pop(index, None)\n",
        "",
        ["tests/unit/test_grad_norm_early.py::test_span_norms_always_describe_what_the_file_holds"],
    ),
    Mutant(
        "init_write_back_reads_the_shard",
        "src/zerodp/stage3/units.py",
        "        with self.resident(write=True, fill=False):",
        "        with self.resident(write=True):",
        ["tests/unit/test_build_reads.py::test_init_and_initialize_read_no_shard_they_overwrite_or_only_view"],
    ),
    Mutant(
        "blank_shard_kept_as_read_ahead",
        "src/zerodp/offload/param_swap.py",
        "        if keep and not s.blank and self._unused_bytes() <= self.cfg.max_in_cpu:",
        "        if keep and self._unused_bytes() <= self.cfg.max_in_cpu:",
        ["tests/unit/test_build_reads.py::test_a_shard_pinned_without_values_refuses_a_read_of_its_values"],
    ),
    Mutant(
        "step_cast_survives_another_dirty_release",
        "src/zerodp/offload/param_swap.py",
        "        s.changed = s.changed or (dirty and not by_step)\n",
        "",
        ["tests/unit/test_step_cast_reads.py::test_a_step_reads_no_shard_the_last_step_wrote_and_matches_reading_them"],
    ),
    Mutant(
        "step_blanks_a_unit_without_a_gradient",
        "src/zerodp/offload/shard_window.py",
        "    return trusted, frozenset(current - partial)",
        "    return trusted, frozenset(current)",
        ["tests/unit/test_step_cast_reads.py::test_a_unit_without_a_gradient_is_read_not_blanked"],
    ),
    Mutant(
        "blank_pin_leaves_padding",
        "src/zerodp/offload/param_offload.py",
        "    group.buffer[cursor:].zero_()\n",
        "",
        ["tests/unit/test_step_cast_reads.py::test_pinning_without_a_read_zeroes_what_no_piece_covers"],
    ),
    Mutant(
        "abandoned_loop_counts_as_cast",
        "src/zerodp/offload/shard_window.py",
        "            self.access.unpin(held, dirty=True, keep=self.keep, by_step=complete)",
        "            self.access.unpin(held, dirty=True, keep=self.keep, by_step=True)",
        ["tests/unit/test_step_cast_reads.py::test_an_abandoned_loop_does_not_count_its_shards_as_cast"],
    ),
    Mutant(
        "step_blanks_a_unit_with_a_frozen_parameter",
        "src/zerodp/offload/shard_window.py",
        "    partial |= {k for k in current if not pieces_cover_parameters(groups[k])}\n",
        "",
        ["tests/unit/test_step_cast_reads.py::test_a_frozen_parameter_in_a_trained_unit_keeps_its_values"],
    ),
    Mutant(
        "phase_bound_sums_compute_only",
        "src/zerodp/app/infinity_phases.py",
        "    return sum(max(t - w, b) for t, w, b in phases)",
        "    return sum(t - w for t, w, b in phases)",
        ["tests/test_infinity_preset.py::test_report_puts_each_step_against_its_per_phase_bound"],
    ),
    Mutant(
        "param_pool_drops_a_buffer_under_a_copy",
        "src/zerodp/offload/param_swap.py",
        "                self._copied_out(small)  # not freed under the copy\n",
        "",
        ["tests/unit/test_param_pool_buffers.py::test_a_dropped_small_buffer_waits_for_the_copy_still_reading_it"],
    ),
    Mutant(
        "steady_state_counts_the_first_loop",
        "src/zerodp/app/infinity_phases.py",
        "    steady = recs[2:-1]",
        "    steady = recs[1:-1]",
        ["tests/test_infinity_preset.py::test_report_names_the_steady_steps_and_their_ratios"],
    ),
]
