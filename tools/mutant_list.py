"""The deliberate faults ``make mutants`` applies (see tools/mutants.py), one per entry.

Each :class:`Mutant` replaces ``old`` (which must occur exactly once in ``file``) with ``new`` and names
the tests that must then fail. Selections are kept small (one world size, one stage) so the whole run
takes a few minutes; each is run first on the unmutated tree and must pass there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE = "src/zerodp/engine.py"
REDUCER = "src/zerodp/runtime/reducer.py"
PARTITION = "src/zerodp/runtime/partition.py"
PRECISION = "src/zerodp/runtime/precision.py"
SHARDING = "src/zerodp/stage3/sharding.py"
HOOKS = "src/zerodp/stage3/hooks.py"
CHECKPOINT = "src/zerodp/checkpoint/load.py"
CHECKPOINT_SAVE = "src/zerodp/checkpoint/save.py"

FAULTS = "tests/test_faults.py"
STAGES = "tests/test_stages.py"
INIT = "src/zerodp/zero.py"
INIT_BUILD = "tests/test_init_build.py"
NVME = "src/zerodp/offload/nvme.py"
NO_OFFLOAD = "src/zerodp/offload/no_offload.py"
CPU_ADAM = "src/zerodp/offload/cpu_adam.py"
PARAM_SWAP = "src/zerodp/offload/param_swap.py"
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
UNIT_PLAN = "tests/unit/test_partition_plan.py"  # the in-process tier (make test-unit): seconds per mutant
UNIT_SHARD = "tests/unit/test_shard_state.py"
UNIT_PRECISION = "tests/unit/test_precision_scaler.py"
UNIT_ACCOUNTING = "tests/unit/test_accounting_formulas.py"


@dataclass(frozen=True)
class Mutant:
    """A named fault: replace ``old`` by ``new`` in ``file``; ``tests`` (pytest node ids) must fail."""

    name: str
    file: str
    old: str
    new: str
    tests: list[str] = field(default_factory=list)


MUTANTS: list[Mutant] = [
    Mutant("drop_accumulation_division", ENGINE,
           "            loss = loss / self.gradient_accumulation_steps\n",
           "            loss = loss\n",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"]),
    Mutant("skip_fp16_unscale", ENGINE,
           "            self._scale_grads(1.0 / self.loss_scaler.scale)\n",
           "            pass\n",
           [f"{FAULTS}::test_mixed_precision_scale_sensitive[2-0-fp16_loss_scale]"]),
    Mutant("skip_a_bucket_reduce_scatter_stage2", REDUCER,
           "        del self._staging[id(b)]\n        buf.div_(self.world_size)\n",
           "        del self._staging[id(b)]\n        if b.index == 0:\n            return\n"
           "        buf.div_(self.world_size)\n",
           [f"{STAGES}::test_matches_reference[2-2-adam_buckets]"]),
    Mutant("average_over_wrong_world_size_stage0", REDUCER,
           "        grad.div_(self.world_size)\n        work = comm.all_reduce(",
           "        grad.div_(max(self.world_size - 1, 1))\n        work = comm.all_reduce(",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"]),
    Mutant("average_over_wrong_world_size_stage2", REDUCER,
           "        buf.div_(self.world_size)\n",
           "        buf.div_(self.world_size + 1)\n",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-2]"]),
    Mutant("skip_rank0_broadcast", ENGINE,
           "        if self.world_size == 1:\n            return\n        src = dist.get_global_rank(",
           "        if True:\n            return\n        src = dist.get_global_rank(",
           [f"{FAULTS}::test_ranks_built_from_different_seeds_train_rank0s_model[2-1]"]),
    Mutant("skip_rank0_broadcast_stage3", SHARDING,
           '            if world_size > 1:\n                comm.broadcast(full, src, pg, ledger, "init")',
           '            if False:\n                comm.broadcast(full, src, pg, ledger, "init")',
           [f"{FAULTS}::test_ranks_built_from_different_seeds_train_rank0s_model[2-3]"]),
    Mutant("release_stage3_unit_before_backward_without_regather", HOOKS,
           "            return _wrap(coordinator.fetch, module, output)\n",
           "            return None\n",
           [f"{STAGES}::test_matches_reference[2-3-adam_buckets]"]),
    Mutant("skip_restoring_loss_scaler_from_checkpoint", CHECKPOINT,
           "        engine.loss_scaler.load_state_dict(staged.loss_scaler)\n",
           "        pass\n",
           ["tests/test_checkpoint.py::test_loads_across_precisions"]),
    Mutant("write_checkpoint_without_checksum", CHECKPOINT_SAVE,
           "                **integrity.encode(integrity.checksums(tensors))}",
           "                }",
           ["tests/test_checkpoint_integrity.py::test_pristine_checkpoint_verifies_and_loads"]),
    Mutant("ignore_fp16_overflow", ENGINE,
           "local_overflow = self.loss_scaler is not None and self._has_inf_or_nan()",
           "local_overflow = False",
           [f"{STAGES}::test_fp16_overflow_on_one_rank_skips_on_all[2-2]"]),
    Mutant("loss_scale_not_halved_on_overflow", PRECISION,
           "self.scale = max(self.scale / 2.0, self.min_scale)",
           "self.scale = max(self.scale, self.min_scale)",
           [f"{STAGES}::test_fp16_overflow_on_one_rank_skips_on_all[2-0]"]),
    Mutant("clip_with_local_grad_norm", GRAD_NORM,
           "    norm = norm_of(grads, engine.topology, _reduce_dp(engine), _all_reduce(engine), 2.0)\n",
           "    norm = norm_of(grads, engine.topology, False, _all_reduce(engine), 2.0)\n",
           [f"{FAULTS}::test_accumulation_with_clipping_below_the_norm[2-1]"]),
    Mutant("skip_parameter_all_gather_after_step", ENGINE,
           "        elif self.stage >= 1:\n            self._all_gather_params()\n",
           "        elif self.stage >= 1:\n            pass\n",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-1]"]),
    Mutant("master_not_copied_back_to_module", NO_OFFLOAD,
           "                piece.tensor.copy_(piece.master)",
           "                pass",
           [f"{FAULTS}::test_mixed_precision_scale_sensitive[2-0-bf16_accum]"]),
    Mutant("stage2_overwrite_instead_of_accumulate", REDUCER,
           "            self.owned[g.index][off : off + b.shard_numel].add_(recv)",
           "            self.owned[g.index][off : off + b.shard_numel].copy_(recv)",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-2]"]),
    Mutant("stage2_keep_grad_after_bucketing", REDUCER,
           "                target.copy_(slot.flat_values(param.grad))\n            param.grad = None\n",
           "                target.copy_(slot.flat_values(param.grad))\n",
           [f"{FAULTS}::test_storage_held_stages_0_to_2[2-2]"]),
    Mutant("parameters_copied_not_aliasing_flat_buffer", PARTITION,
           "        s.param.data = s.view(view)\n",
           "        s.param.data = s.view(view).clone()\n",
           [f"{FAULTS}::test_storage_held_stages_0_to_2[2-0]"]),
    Mutant("stage1_optimizer_states_not_partitioned", ENGINE,
           "assign_pieces(g, self.rank, owns_everything=self.stage == 0)",
           "assign_pieces(g, self.rank, owns_everything=self.stage <= 1)",
           [f"{FAULTS}::test_storage_held_stages_0_to_2[2-1]"]),
    Mutant("gradients_not_zeroed_after_step", REDUCER,
           "        for buf in self._zero_pages.values():\n            buf.zero_()\n",
           "        for buf in self._zero_pages.values():\n            pass\n",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-0]"]),
    Mutant("unused_parameter_gets_zero_gradient", ENGINE,
           "                if present[piece.slot.index]:\n",
           "                if True:\n",
           [f"{STAGES}::test_matches_reference[2-2-no_grad_some_steps]"]),
    Mutant("skip_stage3_persistent_regather_after_step", SHARDING,
           '                comm.all_gather(u.full, u.shard, self.pg, self.ledger, "parameters")\n',
           "                pass\n",
           [f"{FAULTS}::test_accumulation_is_scale_sensitive[2-3]"]),
    Mutant("init_touch_in_partition_dtype", INIT,
           "            self._touch.built_dtype[id(unit)] = built  # touched later: gathered in this dtype\n",
           "            pass\n",
           [f"{INIT_BUILD}::test_init_gives_the_same_weights_as_without_it[1-hf-bf16]"]),
    Mutant("init_partitions_only_on_attachment", INIT,
           "        self._handles = [register_module_parameter_registration_hook(self._on_parameter),\n"
           "                         register_module_module_registration_hook(self._on_register)]\n",
           "        self._handles = [register_module_module_registration_hook(self._on_register)]\n",
           [f"{INIT_BUILD}::test_init_build_peak_is_one_layer_above_the_shards[2]"]),
    Mutant("swap_files_kept_on_sigterm", "src/zerodp/offload/swap_dir.py",
           "def _on_signal(signum: int, frame: Any) -> None:\n    unlink_live()\n",
           "def _on_signal(signum: int, frame: Any) -> None:\n    pass\n",
           ["tests/test_swap_dir.py::test_signal_to_the_rank_removes_its_swap_files"]),
    Mutant("live_job_swap_dir_judged_stale", "src/zerodp/offload/swap_dir.py",
           "    return start is not None and (rec.get(\"start\") is None or start == rec[\"start\"])\n",
           "    return False\n",
           ["tests/test_swap_dir.py::test_sigkill_leftovers_are_named_and_removed_only_when_asked"]),
    Mutant("nvme_auto_sub_group_ignores_the_budget", "src/zerodp/offload/sizing.py",
           "    cap = min(budget_bytes, AUTO_SHARE * moved_off_bytes(owned_numel, masters_moved))\n",
           "    cap = 1 << 40\n",
           ["tests/test_offload_rss.py::test_offload_lowers_rss_by_what_it_moves_off"]),
    Mutant("nvme_deferred_gradient_keeps_only_the_first_scale_factor", NVME,
           "        for f in self._factors:\n            out.mul_(f)\n",
           "        for f in self._factors[:1]:\n            out.mul_(f)\n",
           ["tests/test_offload.py::test_offload_equals_non_offloaded[1-1,2,3-bf16,fp16_overflow,edit_bf16,fp16_accum_clip]"]),
    Mutant("offloaded_step_not_switched_to_fused_adam", CPU_ADAM,
           "    for g in groups:\n        g[\"fused\"] = True\n",
           "    for g in groups:\n        pass\n",
           ["tests/test_cpu_adam.py::test_fused_offload_equals_non_offloaded[1-bf16-nvme]"]),
    Mutant("overlap_step_forward_uses_shards_before_their_update", PARAM_SWAP,
           "            self.swapper.before_use(self)\n",
           "            pass\n",
           [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"]),
    Mutant("overlap_step_uses_the_scheduler_s_next_lr", STEP_PIPELINE,
           "            g.update(v)\n",
           "            pass\n",
           [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"]),
    Mutant("shard_reads_counted_inside_the_all_gather_window", PARAM_SWAP,
           "            if not any(h.state is Residency.SWAPPED for h in homes):\n                continue\n",
           "",
           [f"{PARAM_OFFLOAD}::test_param_offload_equals_stage3[1-reused,prefetch,init,overlap,beyond]"]),
    Mutant("gloo_reduce_scatter_keeps_only_own_chunk", COMM,
           "            torch.sum(received.view(-1, self._output.numel()), dim=0, out=self._output)\n",
           "            self._output.copy_(received.view(-1, self._output.numel())[0])\n",
           ["tests/test_comm.py::test_reduce_scatter_by_all_to_all_matches_torch[2]"]),
    Mutant("grad_norm_sums_norms_not_squares", TOPOLOGY,
           "        total += synchronize(\"grad_norm\", torch.cat(per_device).double().pow(2).sum())  # one per device\n",
           "        total += synchronize(\"grad_norm\", torch.cat(per_device).double().sum())  # one per device\n",
           ["tests/test_silent_wrong.py::test_full_state_accessors[2]"]),
    Mutant("backward_end_tag_without_fetch_digest", BACKWARD_AGREEMENT,
           "        self._post(0, self.end_identity(self.posted, self._fetches, self._digest))\n",
           "        self._post(0, self.posted)\n",
           ["tests/test_backward_guard.py::test_backward_fetch_order_is_compared_without_a_tag_per_fetch"]),
    Mutant("coalesced_reduce_tag_names_first_bucket_only", BACKWARD_AGREEMENT,
           "        digest = hashlib.blake2b(repr(buckets).encode(), digest_size=8).digest()\n",
           "        digest = hashlib.blake2b(repr(buckets[:1]).encode(), digest_size=8).digest()\n",
           ["tests/test_backward_guard.py::test_coalesced_reduction_differing_in_one_bucket_is_detected"]),
    Mutant("zero_page_buffer_not_cleared", ZERO_PAGES,
           "            self.mapping.madvise(mmap.MADV_DONTNEED)",
           "            pass",
           ["tests/test_zero_pages.py"]),
    Mutant("grad_accum_in_param_dtype", PRECISION,
           "    return torch.float32 if accumulation_steps > 1 else param_dtype\n",
           "    return param_dtype\n",
           [f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-0-bf16]",
            f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-2-fp16]"]),
    Mutant("fp32_fold_overwrites", REDUCER,
           "                view.add_(param.grad)\n                param.grad = None\n",
           "                view.copy_(param.grad)\n                param.grad = None\n",
           [f"{GRAD_ACCUM}::test_small_micro_steps_are_not_lost[1-1-bf16]"]),
    Mutant("scale_wrt_gas_ignored", ENGINE,
           "        if scale_wrt_gas and self.gradient_accumulation_steps > 1:\n",
           "        if self.gradient_accumulation_steps > 1:\n",
           [f"{GRAD_ACCUM}::test_token_weighted_loss_with_scale_wrt_gas_false[1-0]"]),
    Mutant("gradient_hook_holds_its_reducer", REDUCER,
           "        reducer = weakref.ref(self)\n",
           "        reducer = (lambda owner=self: owner)\n",
           ["tests/test_engine_lifetime.py::test_dropped_engine_is_collected[0-None]"]),
    Mutant("owner_registry_holds_its_values", "src/zerodp/stage3/ownership.py",
           "weakref.ref(value),",
           "(lambda v=value: v),",
           ["tests/test_engine_lifetime.py::test_dropped_engine_is_collected[3-None]"]),
    Mutant("control_tensors_stay_on_an_nccl_only_group", CONTROL,
           "    return control_group(group)\n",
           "    return group\n",
           ["tests/test_device.py::test_comm_all_reduce_of_a_host_tensor_goes_to_the_side_group"]),
    Mutant("auto_device_ignores_the_group_backend", DEVICE,
           "    takes_cuda = cuda and group_takes(\"cuda\", group)\n",
           "    takes_cuda = cuda\n",
           ["tests/test_device.py::test_auto_is_cpu_without_cuda_or_without_a_cuda_backend"]),
    Mutant("user_clip_not_applied_to_engine_grads", GRAD_NORM,
           "                t.mul_(coef)\n",
           "                pass\n",
           [f"{CLIP}[w1-stage2-fp32-none]"]),
    Mutant("user_clip_pending_factor_dropped_at_step", GRAD_NORM,
           "        scale_grads(state.pending)\n",
           "        pass\n",
           [f"{CLIP}[w1-stage2-fp32-cpu]"]),
    Mutant("user_clip_norm_of_loss_scaled_grads", GRAD_NORM,
           "    unscale = state.pending / engine.loss_scale",
           "    unscale = state.pending",
           [f"{CLIP}[w1-stage2-fp16-none]"]),
    Mutant("full_grad_ignores_pending_clip", "src/zerodp/accessors.py",
           "        out.mul_(pending)\n",
           "        pass\n",
           [f"{CLIP}[w1-stage1-fp32-cpu]"]),
    Mutant("param_grad_left_none_at_stage1", "src/zerodp/runtime/grad_placeholder.py",
           "            p.grad = ph\n",
           "            pass\n",
           [f"{CLIP}[w2-stage1-fp32-none]"]),
    Mutant("excluded_frozen_not_recorded", CHECKPOINT_SAVE,
           "        excluded_frozen=[r.name for r in params if not r.trained] if exclude_frozen else [],\n",
           "        excluded_frozen=[],\n",
           ["tests/test_checkpoint_exclude_frozen.py::test_exclude_frozen_parameters[w1-stage1-fp32-none]"]),
    Mutant("load_overwrites_excluded_frozen_shards", CHECKPOINT,
           "            continue  # frozen, not saved (exclude_frozen_parameters): this engine's values stay\n",
           "            pass\n",
           ["tests/test_checkpoint_exclude_frozen.py::test_exclude_frozen_parameters[w1-stage3-fp32-none]"]),
    # killed by the in-process tier (tests/unit), in seconds
    Mutant("bucket_not_padded_to_world_size", PARTITION,
           "        padded = -(-(cursor - start) // world_size) * world_size\n",
           "        padded = cursor - start\n",
           [f"{UNIT_PLAN}::test_buckets_cover_every_element_once_within_bound"]),
    Mutant("bucket_closes_when_exactly_full", PARTITION,
           "        if current and filled + p.numel() > bucket_size:\n",
           "        if current and filled + p.numel() >= bucket_size:\n",
           [f"{UNIT_PLAN}::test_buckets_cover_every_element_once_within_bound"]),
    Mutant("every_rank_owns_shard_zero", PARTITION,
           "else b.shard_range(rank)\n",
           "else b.shard_range(0)\n",
           [f"{UNIT_PLAN}::test_pieces_partition_each_bucket_across_ranks"]),
    Mutant("hysteresis_not_restored_after_window", PRECISION,
           "            self.hysteresis_left = self.hysteresis\n",
           "            pass\n",
           [f"{UNIT_PRECISION}::test_dynamic_schedule_follows_hysteresis_and_window"]),
    Mutant("optimizer_states_partitioned_from_stage2", ACCOUNTING,
           '"optimizer_states": b.optimizer * numel / (n if stage >= 1 else 1),',
           '"optimizer_states": b.optimizer * numel / (n if stage >= 2 else 1),',
           [f"{UNIT_ACCOUNTING}::test_mixed_precision_adam_is_2_2_12_psi"]),
    Mutant("gather_does_not_enter_gathering", UNITS,
           "        self.state = ShardState.GATHERING\n",
           "        pass\n",
           [f"{UNIT_SHARD}::test_gather_release_cycle_restores_values"]),
    Mutant("stage3_unit_not_padded_to_world_size", UNITS,
           "    padded = max(-(-cursor // world_size) * world_size, world_size)\n",
           "    padded = max(cursor, world_size)\n",
           [f"{UNIT_SHARD}::test_shards_of_larger_worlds"]),
    Mutant("autograd_saves_gathered_storage", "src/zerodp/stage3/aliases.py",
           "            if hit is not None:\n                return _SavedAlias(",
           "            if False:\n                return _SavedAlias(",
           ["tests/test_escaping_views.py::test_escaping_view_trains_right[saved-False-3-2]"]),
    Mutant("returned_view_not_copied", HOOKS,
           "        if copies:  # views of the module's parameters returned",
           "        if copies and False:  # views of the module's parameters returned",
           ["tests/test_escaping_views.py::test_escaping_view_trains_right[returned-False-3-2]"]),
    Mutant("escaped_view_storage_freed", "src/zerodp/stage3/units.py",
           "        if self.refs:\n            self._leave_escaped_views(allow or {})",
           "        if False:\n            self._leave_escaped_views(allow or {})",
           ["tests/test_escaping_views.py::test_escaping_view_trains_right[stored-False-3-2]"]),
    Mutant("state_dict_value_reads_storage", "src/zerodp/stage3/sharded_param.py",
           "_DATA_METADATA = METADATA - _MEMORY_ACCESS",
           "_DATA_METADATA = METADATA",
           ["tests/test_escaping_views.py::test_state_dict_values_outside_zerodp[fp32-False-3-1]"]),
]
