"""The scheduler side: vLLM's scheduler with a KV cache manager that frees the blocks a request merged.

Pass `scheduler_cls="centroidkv_vllm.scheduler.CentroidScheduler"` (vLLM's own `SchedulerConfig`
hook) together with `additional_config={"centroidkv": {...}}`. The scheduler gives vLLM's KV cache
manager a copy of the KV cache configuration whose full-attention groups carry a `CentroidSpec`;
vLLM's `KVCacheSpecRegistry` (its registry for out-of-tree specs) maps that spec to
`CentroidManager`. Nothing of vLLM is patched, and the worker's cache layout is vLLM's own.

`CentroidManager` is vLLM's full-attention manager whose `remove_skipped_blocks` (which vLLM's
`allocate_slots` calls for every scheduled request before it allocates the step's blocks) frees the
blocks wholly before the request's kept start (`centroidkv_vllm.plan`), replacing them by the null
block as vLLM's sliding-window manager does. The worker compresses each layer before it writes that
layer's entries of the step (`centroidkv_vllm.backend`) and never reads below that start again, so a
block freed here and given to another request in the same step is written only after it has been
read. New blocks are then allocated for the request's
logical length, minus the freed ones: a compressed request holds about (B + g) / block_size + 1
blocks instead of (n + t) / block_size. Prefill still needs all of its prompt's blocks.

With heads kept whole (`heads="whole"`, `centroidkv_vllm.heads`) B is solved per compression from the
byte budget (the same `Plan` as the worker's), and a compressed request keeps, of the blocks before its
kept start, as many as its side store's bytes take in the pool (`HeadLayout.reserved_blocks`), so
that admission counts the pool blocks and the side store together.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, fields
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from centroidkv_vllm.config import CentroidConfig, config_of
from centroidkv_vllm.heads import HeadLayout, head_layout
from centroidkv_vllm.plan import Plan

logger = logging.getLogger("vllm.centroidkv")


@dataclass(frozen=True, kw_only=True)
class CentroidSpec(FullAttentionSpec):
    """vLLM's full-attention spec plus the plugin's settings (the manager's only input): the heads kept
    whole (`layout`) and the bytes of one block id over the group's layers, in which their side store
    is counted."""

    centroid: CentroidConfig = CentroidConfig()
    layout: HeadLayout | None = None
    block_bytes: int = 0  # one block id's bytes over all the group's layers


class CentroidManager(FullAttentionManager):
    """Full attention that frees, after each compression, the blocks before the kept start."""

    def __init__(self, kv_cache_spec: CentroidSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.config = kv_cache_spec.centroid
        self.layout = kv_cache_spec.layout
        self.block_bytes = kv_cache_spec.block_bytes
        self.plans: dict[str, Plan] = {}
        self.freed_total = 0  # blocks returned to the pool before their request finished
        # the ids of blocks given back by finished or preempted requests, for the worker; None unless
        # the release connector (centroidkv_vllm.connector) drains it every step
        self.released: list[int] | None = None

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        if num_prompt_tokens is None:
            return
        plan = self.plans.get(request_id)
        if plan is None:
            if processed_computed_tokens < num_prompt_tokens:
                return  # still in prefill: the whole prompt is needed
            config, anchor = self.config, processed_computed_tokens
            budget_at = None if self.layout is None else self.layout.budget_at(config, anchor)
            plan = Plan.at(anchor, config.budget, config.max_new_tokens, config.compress_interval, budget_at)
            self.plans[request_id] = plan
        blocks = self.req_to_blocks[request_id]
        before = sum(block.is_null for block in blocks)
        start = plan.start(processed_computed_tokens)
        last = min(start // self.block_size, len(blocks))
        if self.layout is not None and start > 0:
            # the side store holds every token of the listed heads: it is counted as the blocks its
            # bytes take at n + Gamma tokens (more if the request outgrows that), kept of those before
            # the kept start (never read by the worker); freed with the request
            tokens = max(processed_computed_tokens, plan.anchor + self.config.max_new_tokens)
            last = max(0, last - self.layout.reserved_blocks(tokens, self.block_bytes))
        self._remove_blocks_in_range(request_id, 0, last)
        self.freed_total += sum(block.is_null for block in blocks) - before

    def pop_blocks_for_free(self, request_id: str) -> list:
        """The request finished or was preempted: a resumed one is prefilled and planned again."""
        self.plans.pop(request_id, None)
        blocks = super().pop_blocks_for_free(request_id)
        if self.released is not None:
            self.released += [block.block_id for block in blocks if not block.is_null]
        return blocks


def centroid_kv_cache_config(
    kv_cache_config: KVCacheConfig, config: CentroidConfig, vllm_config: Any = None
) -> KVCacheConfig:
    """A copy whose full-attention groups carry `CentroidSpec` (the worker keeps the original)."""
    result = copy.copy(kv_cache_config)
    result.kv_cache_groups = []
    for group in kv_cache_config.kv_cache_groups:
        group = copy.copy(group)
        spec = group.kv_cache_spec
        if type(spec) is FullAttentionSpec:
            values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
            layout = None if vllm_config is None else head_layout(config, vllm_config, spec.dtype)
            block_bytes = spec.page_size_bytes * len(group.layer_names)
            group.kv_cache_spec = CentroidSpec(
                **values, centroid=config, layout=layout, block_bytes=block_bytes
            )
        result.kv_cache_groups.append(group)
    return result


class CentroidScheduler(Scheduler):
    """vLLM's scheduler; with the plugin configured, its KV cache manager frees merged blocks."""

    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any) -> None:
        config = config_of(vllm_config)
        if config is not None:
            KVCacheSpecRegistry._ensure_registered(vllm_config)  # vLLM's own specs first
            KVCacheSpecRegistry.register(
                CentroidSpec, CentroidManager, uniform_type_base_spec=FullAttentionSpec
            )
            kv_cache_config = centroid_kv_cache_config(kv_cache_config, config, vllm_config)
            logger.info("centroidkv: the scheduler frees merged blocks (%s)", config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)

    def centroid_managers(self) -> list[CentroidManager]:
        managers = self.kv_cache_manager.coordinator.single_type_managers
        return [m for m in managers if isinstance(m, CentroidManager)]
