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

from dataclasses import dataclass

from centroidkv.cache.budget import budget_entries


@dataclass(frozen=True)
class Plan:
    """A request's compression schedule from its anchor a, budget B and interval g."""

    anchor: int
    budget: int
    interval: int

    @classmethod
    def at(cls, anchor: int, ratio: float, max_new_tokens: int, interval: int) -> Plan:
        return cls(anchor, budget_entries(ratio, anchor, max_new_tokens), interval)

    def start(self, computed: int) -> int:
        """First logical position the request holds once the compression due at `computed` is done."""
        if computed < self.anchor or self.budget < 1:
            return 0
        first_start = self.anchor - self.budget if self.anchor > self.budget else 0
        second = first_start + self.budget + self.interval  # computed length of the next compression
        if computed < second:
            return first_start
        return second + (computed - second) // self.interval * self.interval - self.budget

    def due(self, computed: int) -> bool:
        """Whether the step that finds `computed` entries in the cache compresses them first."""
        return computed >= self.anchor and self.start(computed) > self.start(computed - 1)
