"""Several questions about one context (`Prompt.follow_ups`): each run compresses the context once
and answers every question from that compressed cache. The answers, and everything measured apart
from times and batching, must be those of one call per question; only the compressions are fewer.
"""

from __future__ import annotations

import pytest
import torch

from centroidkv import get_method
from centroidkv.methods import method_class
from centroidkv.plan.plan import CONTEXT_ONLY, Prompt, Run, run

pytestmark = pytest.mark.usefixtures("one_thread")

# Times and batching change with the number of questions; nothing else may.
NOT_COMPARED = {"ttft", "tpot", "prefill_s", "compress_s", "feed_s", "decode_s", "peak_mem", "peak_mem_kind"}
MAX_NEW = 24  # past compress_interval=8: decoding re-compresses each fork too


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def native_runs() -> list[Run]:
    """A merging method, one with per-entry records (H2O) and one with a query window (SnapKV, with
    packed int4 storage), each at a budget that compresses."""
    return [
        Run(get_method("centroidkv", heads="none", compress_interval=8), 0.4),
        Run(get_method("h2o", compress_interval=8), 0.4),
        Run(get_method("snapkv", kv_precision="int4", kv_group=16, kv_residual=16), 0.4),
    ]


def compare(together, alone_per_question, n_questions: int) -> None:
    for i in range(len(alone_per_question[0])):
        for q in range(n_questions):
            joint, alone = together[i * n_questions + q], alone_per_question[q][i]
            assert joint.error is None and alone.error is None, (joint.error, alone.error)
            assert joint.question == q
            assert joint.answer_ids == alone.answer_ids and joint.answer_ids
            measured = {k: v for k, v in joint.generation.measured.items() if k not in NOT_COMPARED}
            assert measured == {k: alone.generation.measured[k] for k in measured}


def test_each_question_gets_the_answer_and_measurements_of_its_own_call(tiny_model):
    vocab = tiny_model.config.vocab_size
    context = random_ids(160, vocab, 0)
    questions = [random_ids(n, vocab, seed) for seed, n in ((1, 5), (2, 9), (3, 2))]
    runs = native_runs()
    joint_prompt = Prompt(context, questions[0], context, questions[0], CONTEXT_ONLY, tuple(questions[1:]))
    together = run(tiny_model, joint_prompt, runs, MAX_NEW, eos_token_ids=set(), decode_batch=2)
    alone = [
        run(tiny_model, Prompt(context, q, context, q, CONTEXT_ONLY), runs, MAX_NEW, eos_token_ids=set())
        for q in questions
    ]
    compare(together, alone, len(questions))
    assert len({tuple(o.answer_ids) for o in together[:3]}) > 1  # the questions do change the answer


def test_the_context_is_compressed_once_per_run(tiny_model, monkeypatch):
    vocab = tiny_model.config.vocab_size
    context, first, second = random_ids(160, vocab, 4), random_ids(6, vocab, 5), random_ids(4, vocab, 6)
    method = get_method("centroidkv", heads="none")  # compress_interval 64: no re-compression in 4 steps
    calls = []
    compressing = method_class("centroidkv")  # the class whose compress the wrapped method runs
    original = compressing.compress

    def counting(self, kv, target_len, stats):
        calls.append(stats.layer_idx)
        return original(self, kv, target_len, stats)

    monkeypatch.setattr(compressing, "compress", counting)
    prompt = Prompt(context, first, context, first, CONTEXT_ONLY, (second,))
    outcomes = run(tiny_model, prompt, [Run(method, 0.4)], 4, eos_token_ids=set())
    assert [o.question for o in outcomes] == [0, 1] and all(o.generation for o in outcomes)
    assert sorted(calls) == list(range(tiny_model.config.num_hidden_layers))  # once per layer


def test_a_kvpress_press_answers_every_question_from_its_compressed_context(tiny_model):
    pytest.importorskip("kvpress")
    vocab = tiny_model.config.vocab_size
    context = random_ids(160, vocab, 7)
    questions = [random_ids(5, vocab, 8), random_ids(7, vocab, 9)]
    runs = [Run(get_method("kvpress", press="SnapKVPress"), 0.4)]
    for share_prefill in (True, False):  # a tap on the shared prefill, and a prefill of its own
        joint_prompt = Prompt(context, questions[0], context, questions[0], CONTEXT_ONLY, (questions[1],))
        together = run(tiny_model, joint_prompt, runs, 6, eos_token_ids=set(), share_prefill=share_prefill)
        alone = [
            run(
                tiny_model,
                Prompt(context, q, context, q, CONTEXT_ONLY),
                runs,
                6,
                eos_token_ids=set(),
                share_prefill=share_prefill,
            )
            for q in questions
        ]
        compare(together, alone, len(questions))


def test_follow_up_questions_need_the_context_only_protocol(tiny_model):
    ids = random_ids(40, tiny_model.config.vocab_size, 10)
    with pytest.raises(ValueError, match="context-only"):
        run(tiny_model, Prompt(ids, [], ids, [], follow_ups=([11, 12],)), native_runs()[:1], 2)
