"""LongBench's scorers, equal to the reference: THUDM/LongBench `LongBench/metrics.py` and
`LongBench/eval.py` (first-line rule, max over the ground truths, LongBench-E buckets). The libraries are
the ones the reference uses: `rouge` (not `rouge-score`, whose numbers differ), `fuzzywuzzy` and `jieba`.

Per-sample functions return 0-1 like the reference; `longbench_score` returns 0-100.
"""

from __future__ import annotations

import logging
import math
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import jieba
from rouge import Rouge

with warnings.catch_warnings():  # "Using slow pure-python SequenceMatcher": the reference's own setup
    warnings.simplefilter("ignore")
    from fuzzywuzzy import fuzz

jieba.setLogLevel(logging.WARNING)


def normalize_answer(s: str) -> str:
    """Lower case, drop ASCII punctuation, drop the articles a/an/the, collapse white space."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def normalize_zh_answer(s: str) -> str:
    """Lower case, drop ASCII and Chinese punctuation, remove all white space."""
    punctuation = set(string.punctuation + _ZH_PUNCTUATION)
    return "".join(ch for ch in s.lower() if ch not in punctuation and not ch.isspace())


def _token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """Token F1 of the normalised strings."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """Token F1 over jieba words, each normalised, empty ones dropped."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False)) if w]

    return _token_f1(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F of the `rouge` package; 0 when it raises (e.g. an empty prediction)."""
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_score(
        " ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(ground_truth, cut_all=False))
    )


def classification_score(
    prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_
) -> float:
    """1/len(found) when the gold class is among the class names found in the prediction, else 0.

    Found names contained in the gold name (but not equal to it) are dropped, exactly as the reference
    does it: it removes them from the list it is iterating over, so the name right after a removed one
    is not examined. The reference's difflib fallback is unreachable (`list != 0` is always true).
    """
    if all_classes is None:
        raise ValueError("classification needs the sample's all_classes")
    found = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(found):  # the reference's `for ... in found: found.remove(...)`, step by step
        name = found[i]
        if name in ground_truth and name != ground_truth:
            found.remove(name)
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _number_score(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(1 for n in numbers if n == target) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction equal to the gold paragraph number ("Paragraph N")."""
    return _number_score(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """As `retrieval_score`, gold written "段落N"."""
    return _number_score(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction equal to the gold count."""
    return _number_score(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """fuzzywuzzy's `fuzz.ratio` / 100 between the gold line and the first predicted line (leading newlines
    stripped) that holds none of ` # //; an empty string when there is none."""
    line = next(
        (
            ln
            for ln in prediction.lstrip("\n").split("\n")
            if "`" not in ln and "#" not in ln and "//" not in ln
        ),
        "",
    )
    return fuzz.ratio(line, ground_truth) / 100


DATASET2METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")  # prediction cut at its first line


def _base(dataset: str) -> str:
    name = dataset[:-2] if dataset.endswith("_e") else dataset
    if name not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench dataset {dataset!r}")
    return name


def longbench_score(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score (0-100) of one LongBench prediction: first-line rule, then the best over the ground truths.

    `dataset` may carry LongBench-E's "_e" suffix.
    """
    name = _base(dataset)
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[name]
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return 100.0 * score


def longbench_dataset_score(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """A dataset's score as the reference reports it: the mean over samples, rounded to 2 decimals."""
    scores = [longbench_score(dataset, p, a, all_classes) for p, a in zip(predictions, answers, strict=True)]
    return round(sum(scores) / len(scores), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of a sample, from the dataset's `length` field (words; characters in Chinese)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def longbench_e_scores(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """Per-bucket means (0-100, 2 decimals) as LongBench's `scorer_e`; an empty bucket gives nan."""
    buckets: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for p, a, n in zip(predictions, answers, lengths, strict=True):
        buckets[length_bucket(n)].append(longbench_score(dataset, p, a, all_classes))
    return {b: round(sum(v) / len(v), 2) if v else math.nan for b, v in buckets.items()}
