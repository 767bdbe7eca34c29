"""Question-answering material of RULER's qa_1 (SQuAD v2) and qa_2 (HotpotQA), from the Hugging Face Hub.

RULER reads the SQuAD v2 dev set and the HotpotQA distractor dev set (NVIDIA/RULER
`scripts/data/synthetic/qa.py`): every distinct paragraph becomes a document, each answerable question
keeps its gold document(s), and SQuAD questions also keep the other paragraphs of the same article as
first-choice distractors. The same splits are read here through `datasets` (validation = dev).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from centroidkv.errors import first_line
from eval.common import quiet_hub

HUB_DATASETS = {
    "squad": ("rajpurkar/squad_v2", None),
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor"),
}


@dataclass
class QAItem:
    query: str
    answers: list[str]
    gold: list[int]  # indices into the document list
    more: list[int] = field(default_factory=list)  # preferred distractors (same SQuAD article)


def _load_hub(dataset: str):
    repo, config = HUB_DATASETS[dataset]
    with quiet_hub():
        try:
            import datasets

            return datasets.load_dataset(repo, config, split="validation")
        except Exception as error:  # network, offline mode, missing repo: all reported the same way
            raise RuntimeError(
                f"RULER {dataset} data needs the Hugging Face Hub dataset {repo!r}, which could not be "
                f"loaded (offline or unreachable): {first_line(error, with_type=True)}"
            ) from None


@cache
def load_qa(dataset: str) -> tuple[list[QAItem], list[str]]:
    """The questions and the sorted distinct documents of "squad" or "hotpotqa" (cached per process)."""
    if dataset not in HUB_DATASETS:
        raise ValueError(f"unknown qa dataset {dataset!r}; choose squad or hotpotqa")
    rows = _load_hub(dataset)
    if dataset == "squad":
        return _squad(rows)
    return _hotpotqa(rows)


def _squad(rows) -> tuple[list[QAItem], list[str]]:
    docs = sorted({row["context"] for row in rows})
    index = {doc: i for i, doc in enumerate(docs)}
    by_title: dict[str, list[int]] = {}
    for row in rows:
        ids = by_title.setdefault(row["title"], [])
        if index[row["context"]] not in ids:
            ids.append(index[row["context"]])
    items = []
    for row in rows:
        answers = list(row["answers"]["text"])
        if not answers:  # unanswerable in SQuAD v2: RULER keeps answerable questions only
            continue
        gold = index[row["context"]]
        more = [i for i in by_title[row["title"]] if i != gold]
        items.append(QAItem(query=row["question"], answers=answers, gold=[gold], more=more))
    return items, docs


def _hotpotqa(rows) -> tuple[list[QAItem], list[str]]:
    def documents(row) -> list[str]:
        ctx = row["context"]
        return [
            f"{title}\n{''.join(sents)}" for title, sents in zip(ctx["title"], ctx["sentences"], strict=True)
        ]

    docs = sorted({doc for row in rows for doc in documents(row)})
    index = {doc: i for i, doc in enumerate(docs)}
    items = [
        QAItem(query=row["question"], answers=[row["answer"]], gold=[index[d] for d in documents(row)])
        for row in rows
    ]
    return items, docs
