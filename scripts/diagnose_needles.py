"""Where the needle goes, and how much of CentroidKV's loss is the proxy model's tokenizer.

For RULER single-needle prompts (essay haystack, `niah_single_2`, seeded as the harness seeds them),
one shared prefill per prompt, then per (configuration, budget):

1. **Needle fate per layer**: a diagnostic record (`needle`, one more `centroidkv.needs` recorder,
   registered here: 1 for the needle value's tokens, 0 elsewhere, summed when entries merge) follows
   the entries through compression; per layer and head the needle's tokens are *intact* (an entry of
   degree 1), *merged with needle tokens only*, *merged with haystack tokens*, or *evicted* (their mark
   is gone). Heads kept whole count as intact.
2. **Value tokenisation** (the proxy question): SmolLM2 splits a 7-digit number into 7 single-digit
   tokens, Llama-3's tokenizer into 3 tokens of up to 3 digits. The same prompts are rebuilt with
   values of 7-digit numbers (RULER's), 3-digit numbers (3 tokens, Llama-3's count for 7 digits) and
   RULER's word values (multi-character tokens), and each is scored (greedy answer contains the value).

    python scripts/diagnose_needles.py --samples 8 --compared "similarity=post_rope,heads=none"

The two CentroidKV columns: "default" (the library's defaults unless --default gives parameters) and
"compared" (by default the paper's matching on the cached, post-RoPE keys with every head merged: the
configuration the plugin serves with heads=none).

Prints Markdown tables (docs/results.md, "Why the essay haystack failed", summarises them).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from centroidkv import get_method, load_model  # noqa: E402
from centroidkv.cache.budget import check_budget  # noqa: E402
from centroidkv.errors import refused_in_one_line  # noqa: E402
from centroidkv.models.loading import EMBEDDED_MODEL  # noqa: E402
from centroidkv.needs import RECORDERS, Need, Recorder  # noqa: E402
from centroidkv.plan.decoding import generate_from, needs_of, prefill  # noqa: E402
from eval.benchmarks.ruler import needles  # noqa: E402
from eval.benchmarks.ruler.constants import TASKS  # noqa: E402
from eval.benchmarks.ruler.scoring import string_match_all  # noqa: E402
from eval.benchmarks.ruler.tasks import MIN_LENGTH, generate_samples  # noqa: E402
from eval.samples import encode_prompt  # noqa: E402

NEEDLE = Need("needle")
VALUE_KINDS = ("7-digit numbers", "3-digit numbers", "words")


class NeedleMark(Recorder):
    """1 for the entries at `positions` (the needle value's tokens), 0 elsewhere; merged by sum."""

    merge = "sum"

    def __init__(self) -> None:
        self.positions: torch.Tensor = torch.empty(0, dtype=torch.long)

    def initial(self, first_position, shape, device):
        positions = torch.arange(first_position, first_position + shape[-1], device=device)
        marked = torch.isin(positions, self.positions.to(device)).float()
        return marked.expand(shape).contiguous()


MARK = NeedleMark()
RECORDERS[NEEDLE.name] = MARK


@contextlib.contextmanager
def value_kind(kind: str):
    """Build niah_single_2 samples whose values are `kind` (RULER's words, or n-digit numbers)."""
    task = "niah_single_2"
    original_cfg, original_number = dict(TASKS[task]), needles.random_number
    if kind == "words":
        TASKS[task] = {**original_cfg, "type_needle_v": "words"}
    elif kind == "3-digit numbers":
        needles.random_number = lambda rng, split, digits=3: original_number(rng, split, digits)
    try:
        yield task
    finally:
        TASKS[task], needles.random_number = original_cfg, original_number


def value_positions(ids: list[int], value: str, tokenizer) -> list[int]:
    """Token positions of the needle value inside the prompt (its last occurrence before the question)."""
    for text in (" " + value, value):
        pattern = tokenizer(text, add_special_tokens=False).input_ids
        starts = [i for i in range(len(ids) - len(pattern) + 1) if ids[i : i + len(pattern)] == pattern]
        if starts:
            return list(range(starts[0], starts[0] + len(pattern)))
    raise ValueError(f"value {value!r} not found in the prompt tokens")


def needle_fate(cache, n_marked: int) -> torch.Tensor:
    """[n_layers, 4]: shares of the needle tokens intact / merged with needle only / merged with
    haystack / evicted, over all KV heads."""
    rows = []
    for layer in cache.layers:
        mark = layer.main.extras[NEEDLE.name]  # [B, H_c, T]
        degree = layer.main.degrees_or_zeros().exp()
        n_heads = len(layer.head_lengths())
        single = degree < 1.5
        intact = (mark * single).sum()
        pure = (mark * (~single) * (mark > degree - 0.5)).sum()
        mixed = (mark * (~single) * (mark <= degree - 0.5)).sum()
        whole = (n_heads - mark.shape[1]) * n_marked  # heads kept whole keep the needle intact
        total = n_heads * n_marked
        evicted = total - whole - mark.sum()
        rows.append(torch.stack([intact + whole, pure, mixed, evicted]) / total)
    return torch.stack(rows)


def parse_params(text: str) -> dict:
    params = {}
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"a parameter is key=value, got {item!r}")
        for cast in (int, float):
            with contextlib.suppress(ValueError):
                value = cast(value)
                break
        params[key] = value
    return params


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--default", default="", help="CentroidKV params of 'default' (k=v,...)")
    parser.add_argument(
        "--compared",
        default="similarity=post_rope,heads=none",
        help="CentroidKV params of 'compared' (k=v,...; default: post-RoPE matching, every head merged)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    return parser, parser.parse_args()


Key = tuple[str, str, float]  # (value kind, configuration, budget)


@dataclass
class Findings:
    """What the prompts showed: needle fate per layer (7-digit values), scores, value token counts."""

    fate: dict[Key, torch.Tensor] = field(default_factory=dict)
    scores: dict[Key, list[float]] = field(default_factory=dict)
    n_tokens: dict[str, list[int]] = field(default_factory=dict)


def run_prompts(args: argparse.Namespace, configs: dict, budgets: list[float]) -> Findings:
    """One shared prefill per prompt and value kind; every configuration and budget from it."""
    model, tokenizer = load_model(EMBEDDED_MODEL)
    needs = [*needs_of(configs.values()), NEEDLE]
    found = Findings()
    for kind in VALUE_KINDS:
        with value_kind(kind) as task:
            samples = generate_samples(task, args.length, tokenizer, args.samples, seed=0)
        for sample in tqdm(samples, desc=kind, unit="prompt"):
            head, _ = encode_prompt(sample, tokenizer, context_only=False)
            positions = value_positions(head, sample["answers"][0], tokenizer)
            found.n_tokens.setdefault(kind, []).append(len(positions))
            MARK.positions = torch.tensor(positions)
            pre = prefill(model, torch.tensor([head]), args.max_new_tokens, needs=needs)
            for name, method in configs.items():
                for budget in budgets if method.compresses else [1.0]:
                    key = (kind, name, budget)
                    if kind == VALUE_KINDS[0] and method.compresses:
                        cache = pre.cache.fork(method, budget, needs=[NEEDLE])
                        share = needle_fate(cache, len(positions)) / len(samples)
                        found.fate[key] = found.fate.get(key, 0) + share
                        del cache
                    result = generate_from(model, pre, method, budget, args.max_new_tokens)
                    text = tokenizer.decode(result.tokens[0], skip_special_tokens=True)
                    found.scores.setdefault(key, []).append(100 * string_match_all(text, sample["answers"]))
            del pre
    return found


def print_fate(found: Findings, configs: dict, budgets: list[float]) -> None:
    print(
        "\n## Needle fate per layer (7-digit values, essay haystack): intact / merged-needle / merged-haystack / evicted"
    )
    compressed = [name for name in configs if name != "full"]
    for budget in budgets:
        print(f"\nbudget {budget}\n\n| layer | " + " | ".join(compressed) + " |")
        print("|---|" + "---|" * len(compressed))
        n_layers = next(iter(found.fate.values())).shape[0]
        for layer in [*range(0, n_layers, 3), n_layers - 1]:
            cells = [found.fate[(VALUE_KINDS[0], name, budget)][layer] for name in compressed]
            print(
                f"| {layer} | "
                + " | ".join(" / ".join(f"{100 * float(s):.0f}" for s in c) for c in cells)
                + " |"
            )
        means = [found.fate[(VALUE_KINDS[0], name, budget)].mean(0) for name in compressed]
        print("| mean | " + " | ".join(" / ".join(f"{100 * float(s):.0f}" for s in m) for m in means) + " |")


def print_scores(found: Findings, configs: dict, budgets: list[float]) -> None:
    print("\n## Score by needle value type (niah_single_2, % of prompts whose answer contains the value)\n")
    columns = [(name, budget) for name in configs for budget in (budgets if name != "full" else [1.0])]
    print("| value (tokens) | " + " | ".join(f"{name} {budget}" for name, budget in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for kind in VALUE_KINDS:
        tokens = found.n_tokens[kind]
        cells = [statistics.fmean(found.scores[(kind, name, budget)]) for name, budget in columns]
        print(f"| {kind} ({min(tokens)}-{max(tokens)}) | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


def checked_configs(args: argparse.Namespace) -> tuple[dict, list[float]]:
    """The configurations and budgets of the command line; ValueError (one line) for bad ones."""
    budgets = [check_budget(float(b)) for b in args.budgets.split(",")]
    if args.samples < 1 or args.length < MIN_LENGTH or args.threads < 1:
        raise ValueError(f"--samples and --threads must be >= 1 and --length >= {MIN_LENGTH}")
    configs = {
        "full": get_method("full"),
        "default": get_method("centroidkv", **parse_params(args.default)),
        "compared": get_method("centroidkv", **parse_params(args.compared)),
        "streaming_llm": get_method("streaming_llm"),
    }
    return configs, budgets


def main() -> None:
    parser, args = parse_args()
    with refused_in_one_line(parser):  # everything is checked before a model loads
        configs, budgets = checked_configs(args)
    torch.set_num_threads(args.threads)
    found = run_prompts(args, configs, budgets)
    print_fate(found, configs, budgets)
    print_scores(found, configs, budgets)
    print(
        f"\n{args.samples} prompts per value type, {args.length} tokens, seed 0; default={configs['default']}"
    )
    print(f"compared={configs['compared']}")


if __name__ == "__main__":
    random.seed(0)
    main()
