"""vLLM's CPU attention backend with CentroidKV: log-degrees in the attention, compression before it.

`CentroidBackend` replaces CPU_ATTN (registered by `centroidkv_vllm.register`). Without
`additional_config["centroidkv"]` it is the stock backend. With it:

- the metadata builder (once per step) builds metadata only: it asks the `Tracker` which requests
  are compressed in this step and where each request's kept entries start (a compressed request holds
  its logical positions [start, length), `centroidkv_vllm.plan`; new tokens keep their logical slots,
  so vLLM's `slot_mapping` and positions are used as they are), and puts the step's compressions
  (`CompressionStep`) and new slots into `CentroidMetadata`;
- each layer's attention (`CentroidImpl`, one per layer, holding that layer's log-degree table,
  `LayerCache`) runs three steps: the compression step on its own cache (before anything of this
  step is written: a block freed in this step may be written by another request), the write of the
  step's keys and values (vLLM's own op; this backend's forward includes the cache update) with
  log-degree 0 at their slots (which may hold a former centroid's), then the attention;
- the attention runs vLLM's C++ kernel for the whole batch, then recomputes the rows of requests that
  hold centroids with `degree_attention` (softmax(scale q.k + log n) v, arXiv 2506.11418, Sec. 3;
  decoding rows of a bf16 or float32 cache by the plugin's own C++ loop, `centroidkv_vllm.compiled`)
  over their entries [start, length): the kernel has no per-key additive term and reads a request
  from position 0. Those rows are handed to the kernel with a length of their query only (its output
  for them is discarded), so it never reads the blocks the scheduler has freed at length cost.
  Requests without centroids keep the kernel's output; when every token of the step is such a
  decoding row the kernel is not run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from centroidkv_vllm import KV_TRANSFER_CONFIG, SCHEDULER_PATH
from centroidkv_vllm.compiled import compiled, decode_attention
from centroidkv_vllm.config import config_of, refusal
from centroidkv_vllm.heads import HeadLayout, SideStore, head_layout
from centroidkv_vllm.paged import DecodeBatch, degree_attention, read_entries, request_slots
from centroidkv_vllm.tracker import CompressionStep, LayerCache, Tracker

logger = logging.getLogger("vllm.centroidkv")


@dataclass
class CentroidMetadata(CPUAttentionMetadata):
    """The stock metadata plus this step's compressions and new slots, and the requests whose entries
    include centroids: those decoding one token, gathered by blocks for one batched attention per
    layer, and the others as (index, start, length)."""

    compression: CompressionStep | None = None
    new_slots: Tensor | None = None  # the slots this step's tokens are written to (int64)
    merged: tuple[tuple[int, int, int], ...] = ()
    decoding: DecodeBatch | None = None
    compiled_attention: bool = True
    # heads kept whole: the layout, and (batch index, side store) of each request that has one
    layout: HeadLayout | None = None
    stores: tuple[tuple[int, SideStore], ...] = ()


class CentroidBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = config_of(vllm_config)
        self.tracker: Tracker | None = None
        if self.config is None:
            return
        line = refusal(vllm_config, self.isa, self.window_size)
        if line:
            raise ValueError(line)
        scale = self.head_dim**-0.5
        self.layout = head_layout(self.config, vllm_config, kv_cache_spec.dtype)
        self.tracker = Tracker(self.config, self.block_size, scale, self.layout)
        if self.config.compiled_attention:
            compiled()  # built (or found in torch's cache) now, not inside the first timed step
        logger.info("centroidkv: plugin on for layers %s..., %s", layer_names[:1], self.config)
        if str(vllm_config.scheduler_config.scheduler_cls) != SCHEDULER_PATH:
            logger.warning("centroidkv: merged blocks are not freed; pass scheduler_cls=%r", SCHEDULER_PATH)
        connector = getattr(vllm_config.kv_transfer_config, "kv_connector", None)
        if self.layout is not None and connector != KV_TRANSFER_CONFIG["kv_connector"]:
            logger.warning(
                "centroidkv: a finished request's side store stays until its blocks are reused; "
                "pass kv_transfer_config=centroidkv_vllm.KV_TRANSFER_CONFIG"
            )

    def _caches_bound(self) -> bool:
        """Whether vLLM has bound this group's caches (not yet in its profiling run)."""
        context = self.vllm_config.compilation_config.static_forward_context
        caches = [context[name].kv_cache for name in self.layer_names]
        return all(isinstance(cache, Tensor) and cache.dim() == 4 for cache in caches)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        if self.tracker is None or not self._caches_bound():
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        start = cm.query_start_loc_cpu[: num_reqs + 1]
        query_lens = start[1:] - start[:-1]
        seq_lens = cm.seq_lens[:num_reqs].cpu()
        starts, due = self.tracker.step(seq_lens, query_lens, cm.is_prefilling, cm.block_table_tensor)
        listed = self.layout.listed if self.layout is not None else ()
        compression = CompressionStep(
            due, self.tracker.method, tuple(self.layer_names), self.tracker.scale, listed
        )
        new_slots = cm.slot_mapping[: cm.num_actual_tokens]
        # CSM only merges, so a request with a kept start > 0 holds centroids in every layer
        own = self.config.own_attention
        merged = tuple(
            (i, s, int(seq_lens[i]))
            for i, s in enumerate(starts)
            if s > 0 or (own and query_lens[i] == 1 and seq_lens[i] > 0)
        )
        if merged:
            kernel_lens = cm.seq_lens.clone()
            for i, _, _ in merged:
                kernel_lens[i] = query_lens[i]
            cm = replace(cm, seq_lens=kernel_lens, max_seq_len=int(kernel_lens[:num_reqs].max()))
        metadata = super().build(common_prefix_len, cm, fast_build)
        single = [(i, int(start[i]), s, n) for i, s, n in merged if query_lens[i] == 1]
        decoding = DecodeBatch.of(cm.block_table_tensor, single, self.block_size) if single else None
        others = tuple(row for row in merged if query_lens[row[0]] != 1)
        return CentroidMetadata(
            **vars(metadata),
            compression=compression,
            new_slots=new_slots[new_slots >= 0].long(),
            merged=others,
            decoding=decoding,
            compiled_attention=self.config.compiled_attention,
            layout=self.layout,
            stores=tuple((i, store) for i, store in enumerate(self.tracker.stores) if store is not None),
        )


class CentroidImpl(CPUAttentionBackendImpl):
    """CPU_ATTN's attention of one layer; with CentroidKV's metadata it holds the layer's cache and
    log-degree table and runs the step's compression, the cache write and the attention, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer_cache: LayerCache | None = None  # bound at the layer's first CentroidKV step
        self.layer_index: int | None = None  # the model's layer index (heads kept whole)

    def _layer_cache(self, layer, kv_cache: Tensor) -> LayerCache:
        """This layer's cache and log-degrees (a new table when vLLM has bound another cache)."""
        if self.layer_cache is None or self.layer_cache.kv_cache is not kv_cache:
            self.layer_cache = LayerCache(kv_cache, layer.isa)
        return self.layer_cache

    def _write_entries(self, layer, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata) -> None:
        """The step's keys and values into the cache by vLLM's own write (this backend's forward
        includes the cache update), then log-degree 0 at their slots (a former centroid's may be there)."""
        if self.kv_sharing_target_layer_name is not None or key is None or value is None:
            return
        n_tokens = attn_metadata.num_actual_tokens
        slot_mapping = attn_metadata.slot_mapping[:n_tokens]
        self.do_kv_cache_update(layer, key[:n_tokens], value[:n_tokens], kv_cache, slot_mapping)
        if isinstance(attn_metadata, CentroidMetadata):
            self.layer_cache.log_degree.index_fill_(0, attn_metadata.new_slots, 0.0)
            listed = self._listed(layer, attn_metadata)
            for index, store in attn_metadata.stores if listed else ():  # their side stores grow
                tokens = self._tokens(attn_metadata, index)
                store.append(
                    self.layer_index,
                    key[tokens, listed].transpose(0, 1),
                    value[tokens, listed].transpose(0, 1),
                )

    def _listed(self, layer, attn_metadata) -> list[int]:
        """This layer's KV heads kept whole (none without a head layout)."""
        if attn_metadata.layout is None:
            return []
        if self.layer_index is None:
            self.layer_index = extract_layer_index(layer.layer_name)
        return list(attn_metadata.layout.listed[self.layer_index])

    @staticmethod
    def _tokens(attn_metadata, index: int) -> slice:
        """The step's tokens of request `index`."""
        start = attn_metadata.query_start_loc
        return slice(int(start[index]), int(start[index + 1]))

    def _whole_heads(self, layer, query: Tensor, output: Tensor, attn_metadata) -> None:
        """The output of the heads kept whole of every request that has a side store: plain attention
        (every degree 1) over all its tokens there, replacing what was computed from the pool."""
        listed = self._listed(layer, attn_metadata)
        if not listed or not attn_metadata.stores:
            return
        group = query.shape[1] // attn_metadata.layout.n_kv_heads
        query_heads = [h * group + j for h in listed for j in range(group)]
        for index, store in attn_metadata.stores:
            tokens = self._tokens(attn_metadata, index)
            keys, values = store.read(self.layer_index)
            zeros = keys.new_zeros(keys.shape[:2], dtype=torch.float32)
            output[tokens, query_heads] = degree_attention(
                query[tokens, query_heads], keys, values, zeros, self.scale
            )

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata,
        output: Tensor,
        output_scale=None,
        output_block_scale=None,
    ) -> Tensor:
        if attn_metadata is None:  # vLLM's warm-up
            return output
        if isinstance(attn_metadata, CentroidMetadata):
            attn_metadata.compression.run(layer.layer_name, self._layer_cache(layer, kv_cache))
        self._write_entries(layer, key, value, kv_cache, attn_metadata)
        merged = getattr(attn_metadata, "merged", ())
        decoding = getattr(attn_metadata, "decoding", None)
        n_tokens = attn_metadata.num_actual_tokens
        # vLLM's kernel runs unless every token is a decoding row of ours (its output all replaced)
        only_ours = decoding is not None and not merged and len(decoding.rows) == n_tokens
        if not only_ours:
            output = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if not merged and decoding is None:
            return output
        log_degree = self.layer_cache.log_degree
        if decoding is not None:
            rows = slice(0, n_tokens) if only_ours else decoding.rows  # all rows: in token order
            output[rows] = decode_attention(
                query[rows], kv_cache, log_degree, decoding, self.scale, attn_metadata.compiled_attention
            )
        block_size = kv_cache.shape[2]
        for index, first, length in merged:
            tokens = self._tokens(attn_metadata, index)
            slots = request_slots(attn_metadata.block_table[index], first, length, block_size)
            keys, values = read_entries(kv_cache, slots)
            output[tokens] = degree_attention(query[tokens], keys, values, log_degree[slots].t(), self.scale)
        self._whole_heads(layer, query, output, attn_metadata)
        return output


class CentroidBackend(CPUAttentionBackend):
    """CPU_ATTN with CentroidKV (module docstring)."""

    # the attention writes the step's entries itself, after the step's compression (`CentroidImpl`)
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[CentroidImpl]:
        return CentroidImpl

    @staticmethod
    def get_builder_cls() -> type[CentroidBuilder]:
        return CentroidBuilder
