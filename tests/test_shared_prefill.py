"""One prefill for every kvpress press of a job (`share_prefill`), and forks decoded as one batch
(`decode_batch`): both must change the cost only, never what a run keeps or predicts.

- Every press of the zoo that shares the prefill keeps exactly the keys and values (and masks) it keeps
  in a prefill of its own, on a tiny model; on the embedded model for SnapKV, TOVA, Knorm, Compactor
  and ExpectedAttention, with the same greedy answer.
- A job of full + TOVA + Knorm gives the same predictions with and without sharing, and its press
  records say `prefill_shared` accordingly.
- Forks decoded together give the tokens they give alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from centroidkv import get_method, load_model
from centroidkv.plan.decoding import Prefill, decode_forks, needs_of, prefill, start_fork
from eval.benchmarks.toy import Toy

pytestmark = pytest.mark.usefixtures("one_thread")

kvpress = pytest.importorskip("kvpress")

from baselines.kvpress_press import OWN_PREFILL, build_press, own_prefill_reason, press_names  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 0.25


def zoo_presses() -> list[dict]:
    """The kvpress entries of `make zoo` (configs/experiment/kvpress_zoo.yaml), as method params."""
    config = yaml.safe_load((ROOT / "configs" / "experiment" / "kvpress_zoo.yaml").read_text())
    return [
        entry["params"]
        for entry in config["methods"]
        if isinstance(entry, dict) and entry["name"] == "kvpress"
    ]


def tap_of(method, model, ids: torch.Tensor, max_new: int):
    """The press's run on a shared prefill, or None when it needs a prefill of its own."""
    run = method.prefill_run(model, BUDGET, ids.shape[1], max_new, share_prefill=True)
    return run if run.shares_prefill else None


def own_prefill(model, method, ids: torch.Tensor, max_new: int):
    """The press's run with a prefill of its own, and that prefill (its cache compressed)."""
    run = method.prefill_run(model, BUDGET, ids.shape[1], max_new, share_prefill=False)
    with run.prefill_hooks(model):
        return run, prefill(model, ids, max_new)


def own_and_shared(model, params_list: list[dict], ids: torch.Tensor, max_new: int):
    """For each press: the cache of its own prefill, and the fork it compressed in one shared prefill."""
    methods = [get_method("kvpress", **params) for params in params_list]
    taps = {i: tap_of(m, model, ids, max_new) for i, m in enumerate(methods)}
    shared = prefill(model, ids, max_new, taps={i: tap for i, tap in taps.items() if tap is not None})
    own = [
        own_prefill(model, method, ids, max_new) if taps[i] is not None else None
        for i, method in enumerate(methods)
    ]
    return methods, taps, shared, own


def assert_same_layers(own_cache, shared_cache, what: str) -> None:
    assert len(own_cache.layers) == len(shared_cache.layers), what
    for index, (a, b) in enumerate(zip(own_cache.layers, shared_cache.layers, strict=True)):
        assert a.keys.shape == b.keys.shape, f"{what}, layer {index}: {a.keys.shape} vs {b.keys.shape}"
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"{what}, layer {index}"


def test_every_press_that_cannot_share_says_why():
    """A press class with its own `__call__` does more than hook one forward: it must be listed."""
    base_call = kvpress.BasePress.__call__
    for name in press_names():
        cls = getattr(kvpress, name)
        if cls.__call__ is not base_call:
            assert name in OWN_PREFILL, f"{name} has its own __call__ but is not in OWN_PREFILL"


def test_every_zoo_press_keeps_the_same_entries_from_a_shared_prefill():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 500, (1, 384), generator=torch.Generator().manual_seed(0))
    params_list = zoo_presses()
    methods, taps, shared, own = own_and_shared(model, params_list, ids, 8)
    shared_ones = [i for i, tap in taps.items() if tap is not None]
    assert len(shared_ones) >= 20, "most of the zoo shares the prefill"
    for i in range(len(methods)):
        name = params_list[i]["press"]
        if taps[i] is None:  # listed, with a reason
            assert own_prefill_reason(build_press(name, params_list[i].get("press_params", {}), 0.5)), name
            continue
        tapped = shared.tapped[i]
        assert tapped.error is None, f"{name}: {tapped.error!r}"
        own_run, own_prefilled = own[i]
        assert_same_layers(own_prefilled.cache, tapped.cache, name)
        assert taps[i].record_fields() == own_run.record_fields(), name  # masks: the test below
    # the shared prefill's own cache is untouched by the taps: it equals a plain prefill's
    plain = prefill(model, ids, 8)
    assert_same_layers(plain.cache, shared.cache, "the shared cache")
    assert torch.equal(plain.first_token, shared.first_token)


def _attention(model):
    from centroidkv.attention import attention_modules

    return attention_modules(model)


def test_masking_presses_keep_the_same_masks():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 500, (1, 384), generator=torch.Generator().manual_seed(1))
    for params in (
        {"press": "AdaKVPress", "press_params": {"press": "SnapKVPress"}},
        {"press": "CriticalAdaKVPress", "press_params": {"press": "SnapKVPress"}},
    ):
        method = get_method("kvpress", **params)
        tap = tap_of(method, model, ids, 8)
        prefill(model, ids, 8, taps={"press": tap})
        own_prefill(model, method, ids, 8)
        own_masks = {m.layer_idx: m.masked_key_indices for m in _attention(model)}
        assert tap.decodes_alone and set(tap.masks) == set(own_masks), params["press"]
        for layer, mask in own_masks.items():
            assert all(torch.equal(a, b) for a, b in zip(mask, tap.masks[layer], strict=True)), layer
        for module in _attention(model):
            module.masked_key_indices = None


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = load_model("smollm2-135m")
    return model, tokenizer


EMBEDDED_PRESSES = ("SnapKVPress", "TOVAPress", "KnormPress", "CompactorPress", "ExpectedAttentionPress")


@pytest.mark.slow  # 45 s; the tiny-model job test below runs the same path in make test
def test_embedded_model_shared_prefill_equals_own(embedded):
    """On the embedded model, one shared prefill against a prefill per press: the same kept entries in
    every layer, and the same greedy answer to the question fed afterwards (the runner's path is the
    tiny-model job test below)."""
    model, tokenizer = embedded
    sample = Toy(lengths=(512,), n_samples=1, context_only=True).load(tokenizer)[0]
    from eval.samples import encode_prompt

    head, tail = encode_prompt(sample, tokenizer, True)
    ids, question = torch.tensor([head]), torch.tensor([tail])
    params_list = [{"press": press} for press in EMBEDDED_PRESSES]
    _, _, shared, own = own_and_shared(model, params_list, ids, 8)
    for i, press in enumerate(EMBEDDED_PRESSES):
        own_prefilled = own[i][1]
        assert_same_layers(own_prefilled.cache, shared.tapped[i].cache, press)
        answers = [
            decode_forks(model, [start_fork(model, source, "full", 1.0, 8, question)], 8)[0].tokens
            for source in (own_prefilled, Prefill(shared.tapped[i].cache, shared.first_token, 0.0))
        ]
        assert answers[0] == answers[1], press


def test_a_job_gives_the_same_predictions_with_and_without_sharing(tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.config import CONFIG_DIR, build_run_config, store_configs
    from eval.runner import config_yaml_of, run_job

    predictions = {}
    for share in ("true", "false"):
        overrides = [
            "model=tiny-llama",
            "benchmark=toy",
            "benchmark.n_samples=2",
            "benchmark.context_only=true",
            "logger=none",
            "warmup=false",
            f"results_dir={tmp_path / share}",
            f"share_prefill={share}",
            "budgets=[0.5]",
            "methods=[full,{name:kvpress,variant:a,params:{press:TOVAPress}},"
            "{name:kvpress,variant:b,params:{press:KnormPress}}]",
        ]
        store_configs()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
        cfg = build_run_config(raw, "job")
        run_job(cfg, config_yaml_of(cfg, raw))
        records = _records(tmp_path / share)
        assert records and all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
        for r in records:
            if r["method"] == "kvpress":
                assert r["prefill_shared"] is (share == "true"), r["variant"]
        predictions[share] = {(r["sample_id"], r["variant"]): r["prediction"] for r in records}
    assert predictions["true"] == predictions["false"]
    assert len(predictions["true"]) == 6


def _records(folder: Path) -> list[dict]:
    import json

    return [
        json.loads(line) for path in folder.rglob("records.jsonl") for line in path.read_text().splitlines()
    ]


def test_forks_decoded_together_give_the_tokens_they_give_alone():
    model, _ = load_model("tiny-mistral")
    ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(2))
    names = ["full", "centroidkv", "streaming_llm", "h2o", "snapkv", "pyramidkv", "kmeans", "cam"]
    methods = [get_method(n, n_sink=4, n_recent=32, compress_interval=4) for n in names]
    prefilled = prefill(model, ids, 24, needs=needs_of(methods))
    question = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(3))

    def forks():
        return [start_fork(model, prefilled, m, b, 24, question) for m in methods for b in (0.3, 0.6)]

    alone = [decode_forks(model, [fork], 24, set())[0] for fork in forks()]
    together = decode_forks(model, forks(), 24, set())
    for a, b in zip(alone, together, strict=True):
        assert (
            a.tokens == b.tokens and a.n_compressions == b.n_compressions and a.seq_lengths == b.seq_lengths
        )
    assert any(g.n_compressions > 1 for g in together), "re-compressions happen while decoding together"
    assert all(g.tpot is not None for g in alone) and all(g.tpot is None for g in together)
