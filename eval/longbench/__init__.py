"""LongBench v1 and LongBench-E (THUDM/LongBench) with the reference prompts, lengths and chat rule.

`load_samples(dataset, tokenizer, data_dir=None, max_length=3500, n=None, e=False)`; scoring is in
`eval.metrics.longbench_score`.
"""

from eval.longbench.constants import (
    ALL_DATASETS,
    E_DATASETS,
    EN_DATASETS,
    MAX_NEW_TOKENS,
    NO_CHAT_TEMPLATE,
    PROMPTS,
)
from eval.longbench.data import load_rows, load_samples, truncate_middle

__all__ = [
    "ALL_DATASETS",
    "EN_DATASETS",
    "E_DATASETS",
    "MAX_NEW_TOKENS",
    "NO_CHAT_TEMPLATE",
    "PROMPTS",
    "load_rows",
    "load_samples",
    "truncate_middle",
]
