"""The RULER task builders and `generate_samples`.

Each task is built by a pure function of (sample seed, haystack size): the random content of a sample
(keys, values, depths, chains, word lists) is drawn from `random.Random(sample seed)` before anything
that depends on the size, so the size can be searched without changing the sample, and the same seed
always gives the same bytes. The size is the largest one whose prompt (input and answer prefix) plus
the task's max new tokens fits the target length, as RULER counts it (NVIDIA/RULER
`scripts/data/synthetic/*.py`: `length = tokens(input) + tokens_to_generate <= max_seq_length`).

A sample's seed starts with its split (`dev` or `test`), and its needle values and keys, vt's names
and values, its essays and its qa question come from the split's half (`eval.benchmarks.split_index`),
so that no dev sample shares a seed, a needle value or a key with a test sample.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from eval.benchmarks import check_split, split_index, split_items, split_seed
from eval.benchmarks.ruler.constants import DEPTHS, NEEDLE, TASKS, TEMPLATES, max_new_tokens
from eval.benchmarks.ruler.needles import common_words, random_coded_word, random_upper_name, random_value
from eval.benchmarks.ruler.qa import load_qa
from eval.common import Tokenizer, count_tokens, largest_fitting, resolve_tokenizer
from eval.text import NOISE, essay_text, insert_at_depths, split_sentences

MIN_LENGTH = 1024  # below this the few-shot examples alone (vt, cwe) leave no room for a haystack


@dataclass
class Built:
    """A task instance before templating: the haystack with its needles, the query and the answers."""

    haystack: str
    query: str
    answers: list[str]
    fields: dict[str, Any] = field(default_factory=dict)  # extra template fields (type_needle_v, num_v)
    prefix: str = ""  # few-shot text put before the task template (vt, cwe)
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the sample (depths, needles)
    single: bool = False  # niah with one answer: RULER turns the plural template into the singular


@dataclass
class Rendered:
    context: str
    question: str
    answer_prefix: str

    @property
    def input(self) -> str:
        return self.context + self.question


def _singular(text: str) -> str:
    """RULER's rewrite of the niah template when a single value is asked."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def render(kind: str, built: Built) -> Rendered:
    """Fill the task template; `context` ends where the haystack ends and `question` is the rest."""
    spec = TEMPLATES[kind]
    template, prefix = spec["template"], spec["answer_prefix"]
    if built.single:
        template, prefix = _singular(template), _singular(prefix)
    fields = {"query": built.query, **built.fields}
    head, tail = template.split("{context}")
    return Rendered(
        context=built.prefix + head.format(**fields) + built.haystack,
        question=tail.format(**fields),
        answer_prefix=prefix.format(**fields),
    )


# ---------------------------------------------------------------------------------------------- niah


def _niah_builder(cfg: dict[str, Any], seed: str, split: str) -> Callable[[int], Built]:
    """NVIDIA/RULER `niah.py`: needles "One of the special magic ... for {key} is: {value}." at depths
    drawn from a 40-point grid; haystack of noise sentences, essay words or distractor needles.

    The reference uses the depth grid for the essay haystack only and uniform line positions for the
    other two; the grid is used for all three here, so that every needle has a stated depth.
    """
    rng = random.Random(seed)
    kind_k, kind_v = cfg["type_needle_k"], cfg["type_needle_v"]
    num_k = max(cfg["num_needle_k"], cfg["num_needle_q"])
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_value(kind_k, rng, split))
        values.append([random_value(kind_v, rng, split) for _ in range(cfg["num_needle_v"])])
        needles += [NEEDLE.format(type_needle_v=kind_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(num_k), cfg["num_needle_q"])
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    single = cfg["num_needle_q"] * cfg["num_needle_v"] == 1
    fields = {"type_needle_v": kind_v[:-1] if single else kind_v}
    extra = {"needles": needles, "depths": depths}
    haystack_kind = cfg["type_haystack"]
    distractors: list[str] = []
    distractor_rng = random.Random(seed + ":distractors")

    def build(size: int) -> Built:
        if haystack_kind == "essay":
            units = split_sentences(essay_text(size, split))
            text = " ".join(insert_at_depths(units, needles, depths))
        else:
            if haystack_kind == "noise":
                units = [NOISE] * size
            else:  # distractor needles, drawn once in a fixed order so that size n is a prefix of n + 1
                while len(distractors) < size:
                    distractors.append(
                        NEEDLE.format(
                            type_needle_v=kind_v,
                            key=random_value(kind_k, distractor_rng, split),
                            value=random_value(kind_v, distractor_rng, split),
                        )
                    )
                units = distractors[:size]
            text = "\n".join(insert_at_depths(units, needles, depths))
        return Built(text, query, answers, fields=fields, extra=extra, single=single)

    return build


# ------------------------------------------------------------------------------------ variable tracking


def _chain(rng: random.Random, num_chains: int, num_hops: int, name_len: int, value: str | None, split: str):
    """Variable names (all distinct) and the assignment statements of each chain (RULER's format);
    names and values from the split's half."""
    names: list[str] = []
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append(random_upper_name(rng, name_len, split))
    names = list(dict.fromkeys(names))
    chains, groups = [], []
    for c in range(num_chains):
        group = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        first = value if value is not None else _chain_value(rng, split)
        statements = [f"VAR {group[0]} = {first}"]
        statements += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        chains.append(statements)
        groups.append(group)
    return groups, chains


def _chain_value(rng: random.Random, split: str) -> str:
    """A chain's 5-digit value (np.random.randint(10000, 99999) in RULER), from the split's half."""
    return str(10000 + split_index(rng, 89999, split))


def _vt_haystack(rng: random.Random, chains: list[list[str]], size: int) -> str:
    sentences = [NOISE] * size
    for statements in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(statements)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, statements[j])
    return "\n".join(sentences).replace(". \n", ".\n")


def _vt_builder(cfg: dict[str, Any], seed: str, icl: str, split: str) -> Callable[[int], Built]:
    """NVIDIA/RULER `variable_tracking.py`: one chain of 4 hops hidden in noise, after a short worked
    example (3-letter names) that shows the answer format."""
    rng = random.Random(seed)
    groups, chains = _chain(rng, cfg["num_chains"], cfg["num_hops"], 5, None, split)
    value = chains[0][0].split("=")[-1].strip()
    fields = {"num_v": cfg["num_hops"] + 1}

    def build(size: int) -> Built:
        return Built(
            _vt_haystack(random.Random(seed + f":{size}"), chains, size),
            value,
            groups[0],
            fields=fields,
            prefix=icl,
            extra={"chain": chains[0]},
        )

    return build


def _vt_example(seed: str, num_hops: int, size: int, split: str) -> str:
    """The worked example of vt (3-letter names), with its answer prefix and answer appended."""
    rng = random.Random(seed + ":icl")
    groups, chains = _chain(rng, 1, num_hops, 3, _chain_value(rng, split), split)
    built = Built(
        _vt_haystack(random.Random(seed + f":icl:{size}"), chains, size),
        chains[0][0].split("=")[-1].strip(),
        groups[0],
        fields={"num_v": num_hops + 1},
    )
    r = render("variable_tracking", built)
    # RULER appends " " + answer after the prefix, then "\n", then "\n" before the task.
    return r.input + r.answer_prefix + " " + " ".join(groups[0]) + "\n\n"


_VT_EXAMPLE_SIZES: dict[tuple[int, int], tuple[Tokenizer, int]] = {}


def _vt_example_size(tokenizer: Tokenizer, num_hops: int) -> int:
    """Noise size of the worked example: RULER fits it to 500 tokens, once per tokenizer."""
    key = (id(tokenizer), num_hops)
    if key not in _VT_EXAMPLE_SIZES:
        size = largest_fitting(
            # the probe only measures the example's size: any split's draws will do
            lambda s: count_tokens(tokenizer, _vt_example("ruler:vt:probe", num_hops, s, "test")),
            500,
            guess=15,
            minimum=num_hops + 1,
        )
        _VT_EXAMPLE_SIZES[key] = (tokenizer, size)  # the tokenizer is kept so that its id stays unique
    return _VT_EXAMPLE_SIZES[key][1]


# ---------------------------------------------------------------------------- common words extraction


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(rng: random.Random, chosen: list[str], common_reps: int, uncommon_reps: int, num_cw: int):
    """Numbered list of `chosen` words: the first `num_cw` repeated `common_reps` times, the rest
    `uncommon_reps` times, shuffled; and the common words (the answer)."""
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    words = common * common_reps + uncommon * uncommon_reps
    rng.shuffle(words)
    return _numbered(words), common


def _cwe_builder(cfg: dict[str, Any], seed: str, length: int) -> Callable[[int], Built]:
    """NVIDIA/RULER `common_words_extraction.py`: a numbered word list in which 10 words appear 30 times
    and the others 3 times (6 and 1 below 4k), after one worked example (40 words: 10 and 3 times;
    20 words: 3 and 1 times below 4k). The words come from one fixed draw, so that a longer list only
    adds uncommon words."""
    rng = random.Random(seed)
    vocab = common_words()
    short = length < 4096
    num_cw = cfg["num_cw"]
    examples = []
    for _ in range(cfg["num_fewshot"]):
        if short:
            ctx, ans = _cwe_list(rng, rng.sample(vocab, 20), 3, 1, num_cw)
        else:
            ctx, ans = _cwe_list(rng, rng.sample(vocab, 40), 10, 3, num_cw)
        r = render("common_words_extraction", Built(ctx, "", ans))
        examples.append(r.input + r.answer_prefix + " " + _numbered(ans))
    prefix = "\n".join(examples) + "\n"
    reps = (6, 1) if short else (cfg["freq_cw"], cfg["freq_ucw"])
    order = rng.sample(vocab, len(vocab))

    def build(size: int) -> Built:
        ctx, answers = _cwe_list(random.Random(seed + f":{size}"), order[:size], reps[0], reps[1], num_cw)
        return Built(ctx, "", answers, prefix=prefix)

    return build


# ------------------------------------------------------------------------------ frequent words extraction


def _zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (pi^2/6 at 2); Euler-Maclaurin tail after 1000 terms elsewhere."""
    if alpha == 2.0:
        return math.pi**2 / 6
    n = 1000
    head = sum(k**-alpha for k in range(1, n))
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


def _fwe_builder(cfg: dict[str, Any], seed: str, length: int) -> Callable[[int], Built]:
    """NVIDIA/RULER `freq_words_extraction.py`: coded words with Zipf counts int(N k^-a / zeta(a)) over a
    vocabulary of length // 50 words; the most frequent one is the noise "..."; the answer is ranks 2-4."""
    rng = random.Random(seed)
    vocab_size = length // 50
    wordlen, alpha = cfg["coded_wordlen"], cfg["alpha"]
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add(random_coded_word(rng, wordlen))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the top-ranked word is noise
    z = _zeta(alpha)

    def build(size: int) -> Built:
        counts = [int(size * (k**-alpha) / z) for k in range(1, len(ranked) + 1)]
        words = [w for w, c in zip(ranked, counts, strict=True) for _ in range(c)]
        random.Random(seed + f":{size}").shuffle(words)
        return Built(" ".join(words), "", ranked[1:4])

    return build


# ------------------------------------------------------------------------------------------------ qa


def _qa_builder(cfg: dict[str, Any], seed: str, index: int, split: str) -> tuple[Callable[[int], Built], int]:
    """NVIDIA/RULER `qa.py`: the gold document(s) of the split's question `index` (the splits take
    alternate questions of the dataset), then distractors (same SQuAD article first, then any),
    shuffled and numbered "Document i:"."""
    items, docs = load_qa(cfg["dataset"])
    questions = split_items(len(items), split)
    item = items[questions[index % len(questions)]]
    rng = random.Random(seed)
    more = list(item.more)
    rng.shuffle(more)
    taken = set(item.gold) | set(more)
    others = [i for i in range(len(docs)) if i not in taken]
    rng.shuffle(others)
    order = item.gold + more + others  # size n keeps the first n of these

    def build(size: int) -> Built:
        chosen = [docs[i] for i in order[: max(size, len(item.gold))]]
        random.Random(seed + f":{size}").shuffle(chosen)
        text = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
        return Built(text, item.query, list(item.answers))

    return build, len(docs)


# ------------------------------------------------------------------------------------------ samples

# rough tokens per haystack unit, only to start the search near the answer
_UNIT_TOKENS = {"noise": 24, "essay": 1.3, "needle": 30, "cwe": 14, "fwe": 3, "qa": 150, "vt": 24}


def check_arguments(task: str, length: int, n: int, split: str = "test") -> None:
    """Raise ValueError (one line) for an unknown task, a too short length, a bad sample count or an
    unknown split."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose one of: {', '.join(TASKS)}")
    if not isinstance(length, int) or length < MIN_LENGTH:
        raise ValueError(f"length must be an integer >= {MIN_LENGTH} tokens, got {length!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    check_split(split)


def _builder(
    cfg: dict[str, Any], sample_seed: int, index: int, split: str, length: int, tok: Tokenizer
) -> tuple[Callable[[int], Any], str, int, int | None]:
    """The haystack builder of one sample of a task (size -> built sample), its unit for the first
    size guess, and the smallest and largest size it takes (None: no largest)."""
    kind = cfg["task"]
    if kind == "niah":
        return _niah_builder(cfg, sample_seed, split), cfg["type_haystack"], 0, None
    if kind == "variable_tracking":
        icl = _vt_example(sample_seed, cfg["num_hops"], _vt_example_size(tok, cfg["num_hops"]), split)
        return _vt_builder(cfg, sample_seed, icl, split), "vt", cfg["num_hops"] + 1, None
    if kind == "common_words_extraction":
        return _cwe_builder(cfg, sample_seed, length), "cwe", cfg["num_cw"], len(common_words())
    if kind == "freq_words_extraction":
        return _fwe_builder(cfg, sample_seed, length), "fwe", 0, None
    build, maximum = _qa_builder(cfg, sample_seed, index, split)
    return build, "qa", 0, maximum


def _largest_fitting_sample(
    kind: str,
    build: Callable[[int], Any],
    tok: Tokenizer,
    budget: int,
    start: int,
    minimum: int,
    maximum: int | None,
) -> tuple[int, Any, Any, int]:
    """The largest haystack size whose prompt (input + answer prefix) fits `budget` tokens, searched
    from `start`: the size, the built sample, its rendering and its prompt's tokens."""

    def measure(size: int) -> int:
        r = render(kind, build(size))
        return count_tokens(tok, r.input + r.answer_prefix)

    size = largest_fitting(measure, budget, guess=start, minimum=minimum, maximum=maximum)
    built = build(size)
    r = render(kind, built)
    return size, built, r, count_tokens(tok, r.input + r.answer_prefix)


def generate_samples(
    task: str,
    length: int,
    tokenizer: Tokenizer | str,
    n: int,
    seed: int = 0,
    progress: bool = False,
    split: str = "test",
) -> list[dict[str, Any]]:
    """`n` RULER samples of `task` of `split` ("dev" or "test") whose prompt fits `length` tokens of
    `tokenizer`. Each sample: task, index, input (= context + question, the user message), context, question,
    answer_prefix (appended after the assistant turn starts), answers, max_new_tokens, length (tokens of
    input), ruler_length (tokens of input + answer prefix, plus max_new_tokens: RULER's own `length`,
    <= target_length), target_length, seed, split, use_chat_template, haystack_size, and per task: needles and
    depths (niah), chain (vt). `tokenizer` is a tokenizer or a `centroidkv` model name.
    """
    check_arguments(task, length, n, split)
    cfg = TASKS[task]
    kind = cfg["task"]
    if kind == "qa":
        load_qa(cfg["dataset"])  # fail early, with one line, when the hub cannot be reached
    tok = resolve_tokenizer(tokenizer)
    new_tokens = max_new_tokens(task)
    budget = length - new_tokens
    guess: int | None = None
    samples = []
    for index in tqdm(range(n), desc=f"{task} @ {length}", disable=not progress):
        sample_seed = split_seed(split, "ruler", task, seed, index)
        build, unit, minimum, maximum = _builder(cfg, sample_seed, index, split, length, tok)

        start = guess or max(minimum + 1, int(budget / _UNIT_TOKENS[unit]))
        size, built, r, prompt_tokens = _largest_fitting_sample(
            kind, build, tok, budget, start, minimum, maximum
        )
        if prompt_tokens > budget:
            raise ValueError(
                f"{task}: even the smallest haystack needs {prompt_tokens + new_tokens} > {length} tokens"
            )
        guess = size
        samples.append(
            {
                "task": task,
                "index": index,
                "input": r.input,
                "context": r.context,
                "question": r.question,
                "answer_prefix": r.answer_prefix,
                "answers": built.answers,
                "max_new_tokens": new_tokens,
                "length": count_tokens(tok, r.input),
                "ruler_length": prompt_tokens + new_tokens,
                "target_length": length,
                "seed": seed,
                "split": split,
                "use_chat_template": True,
                "haystack_size": size,
                **built.extra,
            }
        )
    return samples
