"""Record equivalence of two versions of the harness: run a fixed set of jobs, then compare their records.

A refactor must not change what a job records. This script runs the equivalence set (tiny random
Llama and Mistral models x every native method x the toy, RULER, NIAH and LongBench-fixture
benchmarks, plus the embedded SmolLM2 on one RULER sample per task and on one sample of kvpress's zoo,
with the presses' prefill shared and with a prefill of their own), and writes every record with
its measurements of time and memory removed, sorted, to one file. Run it on the old and the new
code, then compare:

    python scripts/equivalence.py run /tmp/eq-new                       # this checkout
    PYTHONPATH=/tmp/old python /tmp/old/scripts/equivalence.py run /tmp/eq-old   # an older worktree
    python scripts/equivalence.py compare /tmp/eq-old/records.jsonl /tmp/eq-new/records.jsonl

`--quick` leaves out the embedded model (about 1 minute instead of about 10 on 2 cores).
`compare` prints one line per record that differs (and the fields that differ) and exits 1 if any
does; `--ignore FIELD` leaves a field out of the comparison (e.g. one a newer version added).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Measurements that change from run to run (time, memory of the process): never compared.
MEASURED_FIELDS = (
    "ttft",
    "tpot",
    "prefill_s",
    "compress_s",
    "feed_s",
    "decode_s",
    "peak_mem",
    "peak_mem_kind",
    "traceback",
    "load_1min",  # the machine's load while the record was made
    "n_cores",
)
NATIVE_METHODS = "[full,centroidkv,streaming_llm,h2o,snapkv,pyramidkv,kmeans,cam]"
POLICY_METHODS = (
    "[{name:centroidkv,variant:ckv-none,params:{heads:none}},{name:centroidkv,variant:ckv-budget,"
    "params:{heads:budget}},{name:kmeans,variant:kmeans-whole,params:{heads:whole}},"
    "{name:h2o,variant:h2o-budget,params:{heads:budget}},{name:snapkv,variant:snapkv-whole,params:{heads:whole}},"
    "{name:centroidkv,variant:ckv-int4,params:{kv_precision:int4}},"
    "{name:h2o,variant:h2o-int8-budget,params:{kv_precision:int8,heads:budget}},"
    "{name:snapkv,variant:snapkv-int4-whole,params:{kv_precision:int4,heads:whole}}]"
)
LONGBENCH_FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "longbench"

# (job name, overrides): small enough to run in minutes on 2 cores.
TINY_BENCHMARKS = {
    "toy": ["benchmark=toy"],
    "ruler": [
        "benchmark=ruler",
        "benchmark.tasks=[niah_single_1,niah_multikey_1,vt,cwe,qa_1]",
        "benchmark.lengths=[1024]",
        "benchmark.n_samples=1",
        "benchmark.max_new_tokens=8",
    ],
    "niah": ["benchmark=niah", "benchmark.lengths=[1024]", "benchmark.depths=[0,50]"],
    "longbench": [
        "benchmark=longbench",
        f"benchmark.data_dir={LONGBENCH_FIXTURES}",
        "benchmark.tasks=[hotpotqa,trec,lcc]",
        "benchmark.lengths=[512]",
        "benchmark.n_samples=1",
    ],
}


def jobs(quick: bool) -> list[tuple[str, list[str]]]:
    common = ["logger=none", "warmup=false", f"methods={NATIVE_METHODS}", "budgets=[0.25,0.5]"]
    found = [
        (f"{model}-{bench}", [f"model={model}", *common, *overrides])
        for model in ("tiny-llama", "tiny-mistral")
        for bench, overrides in TINY_BENCHMARKS.items()
    ]
    # head policies and storage precisions, on the tiny Llama's RULER set
    found.append(("tiny-llama-policies", ["model=tiny-llama", *common[:2], f"methods={POLICY_METHODS}",
                                          "budgets=[0.25,0.5]", *TINY_BENCHMARKS["ruler"]]))  # fmt: skip
    if not quick:
        found.append(
            (
                "smollm2-ruler",
                [
                    "experiment=reproduce_ruler_cpu",
                    "logger=none",
                    "warmup=false",
                    "benchmark.n_samples=1",
                ],
            )
        )
        zoo = [
            "experiment=kvpress_zoo",
            "logger=none",
            "warmup=false",
            "benchmark.n_samples=1",
            "benchmark.tasks=[niah_single_1]",
            "benchmark.lengths=[1024]",
            "benchmark.max_new_tokens=16",
        ]
        found.append(("smollm2-zoo-shared", zoo))
        found.append(("smollm2-zoo-own", [*zoo, "share_prefill=false"]))
    return found


def run(out: Path, quick: bool, only: str = "") -> int:
    out.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).resolve().parent / "run.py"
    for name, overrides in jobs(quick):
        if not name.startswith(only):
            continue
        print(f"[equivalence] {name}", flush=True)
        command = [sys.executable, str(script), *overrides, f"results_dir={out / name}"]
        if subprocess.run(command).returncode != 0:
            print(f"[equivalence] {name} failed: {' '.join(command)}", file=sys.stderr)
            return 1
    records = []
    for path in sorted(out.glob("*/**/records.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records.append({k: v for k, v in record.items() if k not in MEASURED_FIELDS})
    records.sort(key=record_key)
    (out / "records.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    print(f"[equivalence] {len(records)} records -> {out / 'records.jsonl'}")
    return 0


def record_key(record: dict) -> tuple:
    return (
        str(record.get("model")),
        str(record.get("benchmark")),
        str(record.get("sample_id")),
        str(record.get("variant")),
        float(record.get("budget") or 0),
    )


def compare(old_path: Path, new_path: Path, ignore: list[str]) -> int:
    def load(path: Path) -> dict[tuple, dict]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {record_key(r): {k: v for k, v in r.items() if k not in ignore} for r in rows}

    old, new = load(old_path), load(new_path)
    differing = 0
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            differing += 1
            print(f"only in {'new' if key in new else 'old'}: {key}")
            continue
        fields = sorted(f for f in set(old[key]) | set(new[key]) if old[key].get(f) != new[key].get(f))
        if fields:
            differing += 1
            print(f"differs: {key}: {', '.join(fields)}")
    print(f"{len(old)} old records, {len(new)} new records, {differing} differ")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run the equivalence set into a folder")
    run_parser.add_argument("out", type=Path)
    run_parser.add_argument("--quick", action="store_true", help="tiny models only")
    run_parser.add_argument("--only", default="", help="only the jobs whose name starts with this")
    compare_parser = sub.add_parser("compare", help="compare two records.jsonl written by `run`")
    compare_parser.add_argument("old", type=Path)
    compare_parser.add_argument("new", type=Path)
    compare_parser.add_argument("--ignore", action="append", default=[], help="a field not to compare")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.out, args.quick, args.only)
    return compare(args.old, args.new, args.ignore)


if __name__ == "__main__":
    raise SystemExit(main())
