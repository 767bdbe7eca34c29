"""When a request is compressed and which logical positions it still holds: one rule for both sides.

The worker (`centroidkv_vllm.tracker`) merges a request's entries; the scheduler
(`centroidkv_vllm.scheduler`) frees the blocks the request no longer holds. Neither tells the other
anything: both apply this rule to what they both see, the request's computed length at each step
(vLLM's `num_computed_tokens`, which the worker sees as `seq_lens - query_lens`).

- The **anchor** a is the computed length at the request's first step out of prefill (computed >= its
  prompt length; n for a request that was never preempted). Its budget is B = R (a + Gamma)
  (`centroidkv.cache.budget.budget_entries`, the harness's budget in entries).
- At the anchor the request is compressed to B entries if a > B; afterwards it is compressed back to B
  whenever it holds B + g entries (the harness's `CompressedLayer.needs_compression`).
- Layout: after a compression at computed length L the B entries are stored in the slots of the
  logical positions [L - B, L), and new tokens keep their own logical slots. So a request holds the
  logical positions [start, length): every block wholly before `start` can go back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from centroidkv.cache.budget import budget_entries


@dataclass(frozen=True)
class Plan:
    """A request's compression schedule from its anchor a, its budget B at the anchor and interval g.

    `budget_at` (heads kept whole, budgets in bytes: `centroidkv_vllm.heads.HeadLayout.budget_at`)
    gives B for a compression at computed length L: the heads kept whole grow while decoding, so the
    harness solves B again at each compression (`CompressedCache.plan_budget`) and compresses again
    once the compressed heads hold the last B + g entries, g tokens later. None: B is constant."""

    anchor: int
    budget: int
    interval: int
    budget_at: Callable[[int], int] | None = None

    @classmethod
    def at(
        cls,
        anchor: int,
        ratio: float,
        max_new_tokens: int,
        interval: int,
        budget_at: Callable[[int], int] | None = None,
    ) -> Plan:
        if budget_at is None:
            return cls(anchor, budget_entries(ratio, anchor, max_new_tokens), interval)
        return cls(anchor, budget_at(anchor), interval, budget_at)

    def entries_at(self, computed: int) -> int:
        """B of the compression at computed length `computed`."""
        return self.budget if self.budget_at is None else self.budget_at(computed)

    @property
    def first(self) -> int:
        """Computed length of the first compression: the anchor if it holds more than B, else once the
        cache has grown to B + g."""
        return self.anchor if self.anchor > self.budget else self.budget + self.interval

    def last_compression(self, computed: int) -> int | None:
        """Computed length of the last compression due at or before `computed` (None: none yet)."""
        if computed < self.anchor or self.budget < 1 or computed < self.first:
            return None
        return self.first + (computed - self.first) // self.interval * self.interval

    def start(self, computed: int) -> int:
        """First logical position the request holds once the compression due at `computed` is done."""
        last = self.last_compression(computed)
        return 0 if last is None else last - self.entries_at(last)

    def due(self, computed: int) -> bool:
        """Whether the step that finds `computed` entries in the cache compresses them first."""
        return self.last_compression(computed) == computed
