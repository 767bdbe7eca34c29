"""RULER (NVIDIA/RULER) generated locally: the 13 tasks at any length, in tokens of a given tokenizer.

`generate_samples(task, length, tokenizer, n, seed=0)` returns the samples; `write_jsonl` /
`read_jsonl` store them. qa_1 and qa_2 need SQuAD v2 / HotpotQA from the Hugging Face Hub and fail with
one clear error line when it cannot be reached; the 11 other tasks are fully offline.
"""

from eval.common import read_jsonl, write_jsonl
from eval.ruler.constants import HUB_TASKS, OFFLINE_TASKS, TASK_NAMES, TASKS, max_new_tokens
from eval.ruler.tasks import generate_samples

__all__ = [
    "HUB_TASKS",
    "OFFLINE_TASKS",
    "TASKS",
    "TASK_NAMES",
    "generate_samples",
    "max_new_tokens",
    "read_jsonl",
    "write_jsonl",
]
