"""A KV connector that moves no KV: it tells the worker which blocks the scheduler took back, so that
the states of finished (or preempted) requests, side stores included, are dropped at the next step.

The worker's attention never sees request ids; it knows a request by the block of its last entry
(`centroidkv_vllm.tracker`). Without this connector a finished request's state, and with `heads="whole"`
its side store (dense keys and values outside the pool, `centroidkv_vllm.heads`), stays until another
request's entries land in one of its blocks. vLLM 0.32 hands the worker nothing of a finished request
except through a KV connector, so this one carries the block ids:

- scheduler side: `CentroidManager.pop_blocks_for_free` (a request finished or preempted) lists the
  blocks it gives back; `build_connector_meta` drains that list into the step's `ReleasedBlocks`;
- worker side: `handle_preemptions`, which vLLM calls at the start of every step before the batch is
  built, drops the states keyed by those blocks. A block given back before this step's scheduling
  can only be some other request's from this step on, and that request's state is made after the
  drop, so no running request's state is keyed by one of them.

Configure it with `kv_transfer_config=centroidkv_vllm.KV_TRANSFER_CONFIG` beside `scheduler_cls`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from centroidkv_vllm.scheduler import CentroidManager
from centroidkv_vllm.tracker import forget_released

logger = logging.getLogger("vllm.centroidkv")


@dataclass
class ReleasedBlocks(KVConnectorMetadata):
    """The block ids the scheduler has given back since the last step."""

    block_ids: tuple[int, ...] = ()


class ReleaseConnector(KVConnectorBase_V1, SupportsHMA):
    """No KV is loaded or saved; the released blocks go from the scheduler to the worker. It claims
    hybrid-allocator support (`SupportsHMA`) so that vLLM keeps its hybrid KV cache manager as without
    a connector: it keeps no blocks of any group."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.managers: list[CentroidManager] = []  # scheduler side: they list the released blocks

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request is recomputed as without a connector

    # scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        managers = kv_cache_manager.coordinator.single_type_managers
        self.managers = [manager for manager in managers if isinstance(manager, CentroidManager)]
        for manager in self.managers:
            manager.released = []
        if not self.managers:
            logger.warning("centroidkv: the release connector found no CentroidKV manager (scheduler_cls?)")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # no external cache

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None  # the blocks are freed now (the manager lists them)

    def build_connector_meta(self, scheduler_output: Any) -> ReleasedBlocks:
        released: list[int] = []
        for manager in self.managers:
            released += manager.released
            manager.released.clear()
        return ReleasedBlocks(tuple(released))

    # worker side
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, ReleasedBlocks) and kv_connector_metadata.block_ids:
            forget_released(kv_connector_metadata.block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
