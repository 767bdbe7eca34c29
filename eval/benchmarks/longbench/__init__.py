"""LongBench v1 (THUDM/LongBench): the 16 English and code datasets; append `_e` for LongBench-E.

Its home: `constants` (prompts, generation lengths, dataset lists, chat-template rule), `data`
(`load_samples(dataset, tokenizer, data_dir=None, max_length=3500, n=None, e=False)`, with the reference
prompts, middle truncation and chat rule), `scoring` (the reference metrics, `longbench_score`), and
here the benchmark, reported the default way (`eval.benchmarks.Report`) under the title "LongBench".

Data from the Hugging Face Hub, or from `data_dir` holding the same jsonl files. The one length is the
truncation length of the prompt in tokens (LongBench's middle truncation); each dataset has its own
generation length, prompt and metric. LongBench is a fixed published test set: it has no dev split
(`split=dev` is refused at validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eval.benchmarks import Benchmark, Report, Sample, register_benchmark
from eval.benchmarks.longbench.constants import E_DATASETS, EN_DATASETS


@register_benchmark
@dataclass(frozen=True)
class LongBench(Benchmark):
    name = "longbench"
    sample_choice = Benchmark.sample_choice | {"data_dir"}  # where the files are read, not what they hold

    tasks: tuple[str, ...] = EN_DATASETS
    lengths: tuple[int, ...] = (31500,)
    n_samples: int = 200  # per dataset (LongBench has at most 200)
    data_dir: str | None = None

    @classmethod
    def report(cls) -> Report:
        return Report(title="LongBench")

    def validate(self) -> list[str]:
        errors = super().validate()
        for task in self.tasks:
            base = task.removesuffix("_e") if isinstance(task, str) else task
            if base not in EN_DATASETS:
                errors.append(
                    f"benchmark.tasks: unknown LongBench dataset {task!r}; choose from {', '.join(EN_DATASETS)}"
                )
            elif task.endswith("_e") and base not in E_DATASETS:
                errors.append(
                    f"benchmark.tasks: {base} is not in LongBench-E; its datasets: {', '.join(E_DATASETS)}"
                )
        if len(self.lengths) > 1:
            errors.append(
                f"benchmark.lengths: LongBench takes one truncation length, got {list(self.lengths)}"
            )
        if self.split == "dev":
            errors.append(
                "benchmark.split: LongBench is a fixed published test set and has no dev split; "
                "use split=test"
            )
        if self.data_dir is not None and not Path(str(self.data_dir)).is_dir():
            errors.append(f"benchmark.data_dir: no such folder {self.data_dir!r}")
        elif self.data_dir is not None and not errors:
            errors.extend(self._data_errors())
        return errors

    def _data_errors(self) -> list[str]:
        """One line per task whose file under `data_dir` is missing or has a row that cannot be a
        sample (the rows the job would read), found before any model loads."""
        from eval.benchmarks.longbench.data import check_rows, load_rows, source_of

        errors = []
        for task in self.tasks:
            dataset, e = task.removesuffix("_e"), task.endswith("_e")
            try:
                check_rows(
                    load_rows(dataset, self.data_dir, e)[: self.n_samples],
                    dataset,
                    source_of(dataset, self.data_dir, e),
                )
            except (OSError, ValueError) as error:
                errors.append(f"benchmark.data_dir: {error}")
        return errors

    @property
    def needs_hub(self) -> bool:
        return self.data_dir is None

    def load(self, tokenizer) -> list[Sample]:
        from eval.benchmarks.longbench.data import load_samples

        max_length = self.lengths[0]
        samples = []
        for dataset in self.tasks:
            rows = load_samples(
                dataset.removesuffix("_e"),
                tokenizer,
                data_dir=self.data_dir,
                max_length=max_length,
                n=self.n_samples,
                e=dataset.endswith("_e"),
            )
            # `length` is the truncation length (the table's context); LongBench's own length field
            # (words, for the LongBench-E buckets) is kept as source_length.
            samples.extend(
                {**row, "task": dataset, "length": max_length, "source_length": row.get("length")}
                for row in rows
            )
        return samples

    def score(self, sample: Sample, prediction: str) -> float:
        from eval.benchmarks.longbench.scoring import longbench_score

        dataset = sample.get("dataset") or sample["task"].removesuffix("_e")
        return float(longbench_score(dataset, prediction, sample["answers"], sample.get("all_classes")))
