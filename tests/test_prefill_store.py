"""Prefills paid once (issue 50, item 2): a prefill kept in the store reads back bit for bit, forks to
the same answers, is keyed by everything that decides it, stays under its limit, is computed again
when its file is torn, and a job run twice with the store gives the same records without a forward."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from test_harness import run_cfg
from test_hybrid_attention import tiny_gemma3, tiny_qwen2

import centroidkv.plan.prefill_store
from centroidkv import get_method, prepare_model
from centroidkv.cache.window_layer import WindowLayer
from centroidkv.needs import Need
from centroidkv.plan.decoding import generate_from, needs_of, prefill
from centroidkv.plan.plan import Prompt, Run, run
from centroidkv.plan.prefill_store import PrefillStore, stored_prefill
from eval.records import read_records
from eval.runner import config_yaml_of, run_job

pytestmark = pytest.mark.usefixtures("one_thread")

FORKED = ("snapkv", "h2o", "centroidkv")
MAX_NEW = 6
# record fields that time this run (or name its job and machine): the others must not change
TIMED = {"ttft", "tpot", "compress_s", "feed_s", "decode_s", "peak_mem", "peak_mem_kind", "load_1min", "job"}


def prompt_ids(n_tokens: int = 300, shift: int = 0) -> torch.Tensor:
    return ((torch.arange(n_tokens) * 7 + shift) % 400 + 10).unsqueeze(0)


def job_needs() -> list[Need]:
    return needs_of([get_method(name) for name in FORKED])


def assert_same_tensor(computed: torch.Tensor | None, stored: torch.Tensor | None, what: str) -> None:
    if computed is None:
        assert stored is None, what
        return
    assert stored.dtype == computed.dtype and stored.device == computed.device, what
    assert stored.shape == computed.shape and stored.stride() == computed.stride(), what
    assert torch.equal(stored, computed), what
    assert stored.untyped_storage().nbytes() == computed.untyped_storage().nbytes(), what


def assert_same_prefill(computed, stored, same_forward: bool = True) -> None:
    """Every layer's keys, values, degrees and records and the first token, bit for bit; the seconds
    too when `stored` is `computed`'s forward kept (`same_forward`)."""
    assert stored.stored and not computed.stored
    assert torch.equal(stored.first_token, computed.first_token)
    assert stored.seconds == computed.seconds or not same_forward
    assert len(stored.cache.layers) == len(computed.cache.layers)
    for index, (fresh, read) in enumerate(zip(computed.cache.layers, stored.cache.layers, strict=True)):
        for slot in ("keys", "values", "log_degree"):
            assert_same_tensor(getattr(fresh.main, slot), getattr(read.main, slot), f"layer {index} {slot}")
        for records in ("extras", "windows"):
            fresh_records, read_records_ = getattr(fresh.main, records), getattr(read.main, records)
            assert sorted(fresh_records) == sorted(read_records_), f"layer {index} {records}"
            for name in fresh_records:
                assert_same_tensor(fresh_records[name], read_records_[name], f"layer {index} {name}")
        for attr in ("n_seen", "prompt_len", "scaling", "query_group", "dtype", "device", "is_initialized"):
            assert getattr(read, attr) == getattr(fresh, attr), f"layer {index} {attr}"


def test_a_stored_prefill_reads_back_bit_for_bit_and_forks_alike(tiny_model, tmp_path):
    store = PrefillStore(tmp_path / "store", 10**9)
    ids, needs = prompt_ids(), job_needs()
    computed = stored_prefill(store, tiny_model, ids, MAX_NEW, needs)
    stored = stored_prefill(store, tiny_model, ids, MAX_NEW, needs)
    assert (store.hits, store.misses) == (1, 1)
    assert_same_prefill(computed, stored)
    for name in FORKED:
        fresh = generate_from(tiny_model, computed, get_method(name), 0.25, MAX_NEW, set())
        again = generate_from(tiny_model, stored, get_method(name), 0.25, MAX_NEW, set())
        assert again.tokens == fresh.tokens, name
        assert again.n_compressions == fresh.n_compressions > 0, name
        for field in ("kv_bytes", "kv_budget_ratio", "kv_allocated_ratio", "kv_len"):
            assert again.measured[field] == fresh.measured[field], (name, field)


@pytest.mark.parametrize("factory", [tiny_gemma3, tiny_qwen2], ids=["gemma3", "qwen2"])
def test_a_hybrid_models_window_layers_read_back_bit_for_bit(factory, tmp_path):
    """Window layers keep their last W - 1 entries in a buffer of W: read back with that storage."""
    torch.manual_seed(0)
    model = prepare_model(factory().eval())
    store, ids = PrefillStore(tmp_path, 10**9), prompt_ids() % 200 + 20
    computed = stored_prefill(store, model, ids, MAX_NEW, job_needs())
    assert any(isinstance(layer, WindowLayer) for layer in computed.cache.layers)
    stored = stored_prefill(store, model, ids, MAX_NEW, job_needs())
    assert_same_prefill(computed, stored)
    fork = (get_method("snapkv"), 0.25, MAX_NEW, set(), None, "entries")  # bytes: the windows take 0.25
    assert generate_from(model, stored, *fork).tokens == generate_from(model, computed, *fork).tokens


def test_a_prefill_that_recorded_more_serves_a_prompt_that_asks_less(tmp_path):
    """SnapKV and H2O's prefill (attention received, a 32-query window) serves H2O alone (no window)
    and a 16-query window: the extra records dropped, the window cut, as a prefill of those needs."""
    model = centroidkv.load_model("tiny-llama")[0]
    store, ids = PrefillStore(tmp_path, 10**9), prompt_ids()
    stored_prefill(store, model, ids, MAX_NEW, [Need("attention_sum"), Need("queries", 32)])
    for needs in ([Need("attention_sum")], [Need("attention_sum"), Need("queries", 16)]):
        fresh = prefill(model, ids, MAX_NEW, needs)
        assert_same_prefill(fresh, stored_prefill(store, model, ids, MAX_NEW, needs), same_forward=False)
    assert (store.hits, store.misses) == (2, 1)
    assert len(store.files()) == 1
    # a prefill without the attention received is computed by another kernel: never served by this one
    stored_prefill(store, model, ids, MAX_NEW, [Need("queries", 16)])
    assert (store.hits, store.misses) == (2, 2)


def test_the_key_changes_with_the_prompt_the_weights_the_dtype_and_the_needs(tmp_path):
    model = centroidkv.load_model("tiny-llama")[0]
    store, ids, needs = PrefillStore(tmp_path, 10**9), prompt_ids(), job_needs()
    key = store.key(model, ids, needs)
    assert store.key(model, ids.clone(), list(needs)) == key  # the same prefill: the same file
    other_prompt = ids.clone()
    other_prompt[0, 100] += 1
    other_weights = copy.deepcopy(model)
    with torch.no_grad():
        next(other_weights.parameters()).view(-1)[0] += 1e-3
    other_dtype = copy.deepcopy(model).to(torch.bfloat16)
    files = {
        "prompt": store.key(model, other_prompt, needs).file_name,
        "weights": store.key(other_weights, ids, needs).file_name,
        "dtype": store.key(other_dtype, ids, needs).file_name,
        "window": store.key(model, ids, [*needs, Need("queries", 64)]).file_name,
        "records": store.key(model, ids, [Need("queries", 32)]).file_name,
    }
    for what, name in files.items():
        assert name != key.file_name, what
    assert len(set(files.values())) == len(files)


def test_the_limit_removes_the_least_recently_used(tmp_path, capsys):
    model = centroidkv.load_model("tiny-llama")[0]
    needs = job_needs()
    one = PrefillStore(tmp_path / "probe", 10**9)
    stored_prefill(one, model, prompt_ids(), MAX_NEW, needs)
    size = one.stored_bytes()
    capsys.readouterr()
    store = PrefillStore(tmp_path / "store", int(2.5 * size))  # two fit, not three
    prompts = [prompt_ids(shift=shift) for shift in range(3)]
    for ids in prompts[:2]:
        stored_prefill(store, model, ids, MAX_NEW, needs)
    first = store.folder / store.key(model, prompts[0], needs).file_name
    os.utime(first, ns=(0, 0))  # used longest ago
    assert stored_prefill(store, model, prompts[1], MAX_NEW, needs).stored  # the second, used again
    stored_prefill(store, model, prompts[2], MAX_NEW, needs)
    assert store.stored_bytes() <= store.max_bytes
    names = {path.name for path in store.files()}
    assert first.name not in names
    assert names == {store.key(model, ids, needs).file_name for ids in prompts[1:]}
    written = [line for line in capsys.readouterr().out.splitlines() if "wrote" in line]
    assert len(written) == 3 and all("MB for a 300-token prompt" in line for line in written)


def test_a_torn_file_is_computed_again_with_one_warning(tmp_path, capsys):
    model = centroidkv.load_model("tiny-llama")[0]
    store, ids, needs = PrefillStore(tmp_path, 10**9), prompt_ids(), job_needs()
    stored_prefill(store, model, ids, MAX_NEW, needs)
    path = store.files()[0]
    whole = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(whole // 2)  # a write cut short outside the store (a full disk, a copy)
    capsys.readouterr()
    again = stored_prefill(store, model, ids, MAX_NEW, needs)
    warnings = capsys.readouterr().err.splitlines()
    assert not again.stored and (store.hits, store.misses) == (0, 2)
    assert (
        len(warnings) == 1
        and "[prefill store] warning" in warnings[0]
        and "computing it again" in warnings[0]
    )
    assert path.stat().st_size == whole
    assert_same_prefill(again, stored_prefill(store, model, ids, MAX_NEW, needs))  # the new file


def test_a_tap_gets_a_forward_of_its_own_when_the_natives_are_stored(tmp_path):
    """TOVA (a kvpress press, compressing inside the prefill) beside SnapKV: the natives' prefill is
    stored, the press's fork never is; both answer as before."""
    pytest.importorskip("kvpress")
    model = centroidkv.load_model("tiny-llama")[0]
    ids = prompt_ids().tolist()[0]
    runs = [Run(get_method("snapkv"), 0.25), Run(get_method("kvpress", press="TOVAPress"), 0.25)]
    store = PrefillStore(tmp_path, 10**9)
    outcomes = [
        run(model, Prompt(ids, [], ids, []), runs, MAX_NEW, set(), prefill_store=store) for _ in range(2)
    ]
    assert (store.hits, store.misses) == (1, 1)
    for first, second in zip(*outcomes, strict=True):
        assert first.generation.tokens == second.generation.tokens
    assert outcomes[1][0].fields.get("prefill_stored") is True
    assert "prefill_stored" not in outcomes[1][1].fields and "prefill_stored" not in outcomes[0][0].fields


def test_a_job_run_twice_reads_its_prefills_and_writes_the_same_records(tmp_path, monkeypatch, capsys):
    forwards = []

    def counted(*args, **kwargs):
        forwards.append(args[1].shape[-1])
        return prefill(*args, **kwargs)

    monkeypatch.setattr(centroidkv.plan.prefill_store, "prefill", counted)
    overrides = [
        "methods=[full,snapkv,h2o,centroidkv]",
        "budgets=[0.25]",
        "benchmark.n_samples=2",
        "benchmark.max_new_tokens=4",
        f"prefill_store.dir={tmp_path / 'store'}",
        "prefill_store.max_gb=1",
    ]
    runs = []
    for results in ("first", "second"):
        cfg, raw = run_cfg(tmp_path / results, overrides)
        run_job(cfg, config_yaml_of(cfg, raw))
        runs.append(read_records(cfg.job_dir / "records.jsonl")[0])
    assert len(forwards) == 2  # the first job's two samples; the second ran no prompt's forward
    first, second = runs
    assert len(first) == len(second) == 8
    for fresh, again in zip(first, second, strict=True):
        assert again.pop("prefill_stored") is True and "prefill_stored" not in fresh
        assert fresh["status"] == "ok"
        assert {k: v for k, v in again.items() if k not in TIMED} == {
            k: v for k, v in fresh.items() if k not in TIMED
        }
    out = capsys.readouterr().out
    assert "[prefill store] 0 read, 2 computed" in out and "[prefill store] 2 read, 0 computed" in out


def test_the_store_is_off_by_default_and_not_in_the_identity(tmp_path, own_cache):
    cfg, _ = run_cfg(tmp_path, ["benchmark.n_samples=1", "benchmark.max_new_tokens=2"])
    stored_cfg, _ = run_cfg(tmp_path, ["benchmark.n_samples=1", "prefill_store.max_gb=2"])
    assert cfg.prefill_store.max_gb == 0 and stored_cfg.prefill_store.max_gb == 2
    assert stored_cfg.identity() == run_cfg(tmp_path, ["benchmark.n_samples=1"])[0].identity()
    run_job(cfg, config_yaml_of(cfg, None))
    assert not (own_cache / "prefills").exists()
    assert all("prefill_stored" not in record for record in read_records(cfg.job_dir / "records.jsonl")[0])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("prefill_store.max_gb=-1", "prefill_store.max_gb: must be a number of gigabytes >= 0"),
        ("prefill_store.max_gb=lots", "prefill_store.max_gb: must be a number"),
        ("+prefill_store.size=3", "prefill_store.size: unknown key"),
    ],
)
def test_a_bad_store_setting_is_one_line(tmp_path, override, fragment):
    from test_harness import config_error_line

    assert fragment in config_error_line(tmp_path, [override])


def test_the_long_study_keeps_its_prefills():
    from test_harness import composed

    for experiment in ("long_study_8k", "long_study_16k", "long_study_32k", "long_study_dev"):
        assert composed([f"experiment={experiment}"]).prefill_store.max_gb > 0, experiment
    assert composed([]).prefill_store.max_gb == 0
    assert Path(centroidkv.plan.prefill_store.default_folder()).name == "prefills"


def test_the_store_settings_do_not_rename_a_job(tmp_path):
    """A job run with and without the store is one job (its folder name hashes the overrides)."""
    from eval.sweep import plan

    base = ["model=tiny-llama", "benchmark=toy", "logger=none", f"results_dir={tmp_path}"]
    store = ["prefill_store.max_gb=2", f"prefill_store.dir={tmp_path / 'store'}"]
    plain, stored = plan(base)[0], plan([*base, *store])[0]
    assert stored.prefill_store.max_gb == 2 and plain.prefill_store.max_gb == 0
    assert stored.job_dir == plain.job_dir
