"""The release connector (`centroidkv_vllm.connector`): the blocks a finished or preempted request gives
back reach the worker, whose trackers drop that request's state (its side store included) at the next
step, not when another request's entries land in one of its blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_engine import ENV, needs_model  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from centroidkv_vllm.config import CentroidConfig  # noqa: E402
from centroidkv_vllm.connector import ReleaseConnector, ReleasedBlocks  # noqa: E402
from centroidkv_vllm.scheduler import CentroidManager, CentroidSpec  # noqa: E402
from centroidkv_vllm.tracker import Tracker  # noqa: E402

BLOCK = 16
CONFIG = CentroidConfig(budget=0.5, max_new_tokens=8, n_sink=4, n_recent=8, compress_interval=8)


def connector(role: KVConnectorRole) -> ReleaseConnector:
    return ReleaseConnector(SimpleNamespace(kv_transfer_config=object()), role)


def test_the_scheduler_hands_each_finished_requests_blocks_to_the_worker_once():
    spec = CentroidSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, centroid=CONFIG)
    pool = BlockPool(num_gpu_blocks=20, enable_caching=False, hash_block_size=BLOCK)
    manager = CentroidManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK
    )
    scheduler_side = connector(KVConnectorRole.SCHEDULER)
    manager.allocate_new_blocks("a", 50, 50)
    manager.pop_blocks_for_free("a")  # before the connector: nobody drains a list, none is kept
    assert manager.released is None
    coordinator = SimpleNamespace(single_type_managers=[manager])
    scheduler_side.bind_kv_cache_manager(SimpleNamespace(coordinator=coordinator, block_pool=pool))
    manager.allocate_new_blocks("b", 50, 50)
    manager.allocate_new_blocks("c", 20, 20)
    b_blocks = [block.block_id for block in manager.req_to_blocks["b"]]
    assert scheduler_side.build_connector_meta(None) == ReleasedBlocks(())
    manager.pop_blocks_for_free("b")
    assert sorted(scheduler_side.build_connector_meta(None).block_ids) == sorted(b_blocks)
    assert scheduler_side.build_connector_meta(None) == ReleasedBlocks(())  # drained: sent once


def step(tracker: Tracker, rows: list[list[int]], seq_lens: list[int], query_lens: list[int]) -> None:
    tracker.step(
        torch.tensor(seq_lens),
        torch.tensor(query_lens),
        torch.tensor([q > 1 for q in query_lens]),
        torch.tensor(rows),
    )


def test_the_worker_drops_the_finished_requests_state_and_the_running_one_keeps_its_own():
    tracker = Tracker(CONFIG, BLOCK, scale=0.125)
    rows = [[1, 2, 3, 0], [4, 5, 6, 0]]
    step(tracker, rows, [40, 40], [40, 40])  # both prefilled: each keyed by the block of its last entry
    step(tracker, rows, [41, 41], [1, 1])
    running = tracker.states[6]
    assert set(tracker.states) == {3, 6} and running.plan is not None
    connector(KVConnectorRole.WORKER).handle_preemptions(ReleasedBlocks((1, 2, 3)))  # the first finished
    assert set(tracker.states) == {6}
    step(tracker, rows[1:], [42], [1])
    assert tracker.states == {6: running}  # found again, not started afresh


SCRIPT = """
import json, sys
from vllm import SamplingParams
from centroidkv_vllm import workload
from centroidkv_vllm.__main__ import DEFAULT_MODEL
from centroidkv_vllm.tracker import held_side_stores

settings = {"budget": 0.25, "max_new_tokens": 64, "compress_interval": 32, "heads": "whole"}
args = {**workload.engine_args(str(DEFAULT_MODEL), settings, 100 << 20, 2, 1100), "dtype": "float32"}
if sys.argv[1] == "without":
    del args["kv_transfer_config"]
llm = workload.make_llm(args, stock=False)
engine, scheduler = llm.llm_engine, workload.scheduler_of(llm)
for index, (prompt, new) in enumerate(zip(workload.document_prompts(llm.get_tokenizer(), 2, 1000), (8, 64))):
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
steps = []
while engine.has_unfinished_requests():
    engine.step()
    steps.append([len(scheduler.running), held_side_stores()])
print("STEPS " + json.dumps(steps))
"""


@pytest.mark.slow  # two engines, about a minute each
@needs_model
@pytest.mark.parametrize("connector_on", [True, False], ids=["with-connector", "without"])
def test_a_finished_requests_side_store_goes_at_the_next_step(connector_on):
    """heads=whole, two requests of 1000 tokens, one of 8 new tokens and one of 64: once the short
    one has finished, the worker holds one side store with the connector; without it, two, until the
    long one's next block reuses one of the finished request's (vLLM reuses tail blocks first)."""
    mode = "with" if connector_on else "without"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=ENV, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("STEPS ")]
    assert lines, (proc.stdout + proc.stderr)[-3000:]
    steps = json.loads(lines[0].split(" ", 1)[1])
    first_alone = next(i for i, (running, _) in enumerate(steps) if running == 1)
    after = [stores for _, stores in steps[first_alone + 1 : first_alone + 10]]
    assert after == ([1] * 9 if connector_on else [2] * 9), steps
