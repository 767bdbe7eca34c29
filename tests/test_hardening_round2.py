"""Hardening, second round (issue 29, S1 and D1-D13): no record field becomes a path, a bad record or
a broken model cache is one line, nothing already written is lost.

Each test names its case. Jobs run in-process on `tiny-llama` with the `toy` benchmark (as
tests/test_hardening.py does), one in a subprocess (Ctrl-C); the embedded model is never loaded (its
tokenizer is, and the conversion is tested with stand-ins for the GGUF loaders).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_harness import config_error_line, run_cfg
from test_job_safety import RUN, TINY, env, wait_for_records

import centroidkv.models
from centroidkv.wheel_models import WHEEL_MODELS
from eval.records import JobMismatch, ResultsFolderError, check_results_folder, read_records
from eval.run_config import ConfigError
from eval.runner import config_yaml_of, run_job
from scripts import figures, table_files, tables
from scripts.generate import main as generate_main

pytestmark = pytest.mark.usefixtures("one_thread")

TWO_METHODS = [
    "methods=[full,snapkv]",
    "budgets=[0.5]",
    "benchmark.n_samples=2",
    "benchmark.max_new_tokens=2",
]


def finished_job(tmp_path: Path, overrides: list[str] = TWO_METHODS):
    """A finished tiny job: (its config, the composed Hydra config, its records.jsonl)."""
    cfg, raw = run_cfg(tmp_path, overrides)
    run_job(cfg, config_yaml_of(cfg, raw))
    return cfg, raw, cfg.job_dir / "records.jsonl"


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def toy_records(experiment: str, benchmark: str = "toy") -> list[dict[str, Any]]:
    """Full cache and SnapKV at 0.5 on two samples, naming `experiment` and `benchmark` themselves."""
    return [
        {
            "benchmark": benchmark,
            "task": "toy",
            "length": 256,
            "sample_id": f"toy-{i}",
            "method": method,
            "variant": method,
            "params": {},
            "budget": budget,
            "status": "ok",
            "score": score,
            "model": "tiny-llama",
            "experiment": experiment,
        }  # fmt: skip
        for i in range(2)
        for method, budget, score in (("full", 1.0, 100.0), ("snapkv", 0.5, 50.0))
    ]


def write_job(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder.parent


# ------------------------------------------------------------- S1. record fields never become paths
ESCAPE = "../../../../escape/PWNED"


def test_a_record_naming_its_experiment_with_dot_dots_writes_nothing_outside_out(tmp_path):
    """Before: figures.py wrote escape/PWNED_toy_*.png/.pdf outside --out, and tables.py (two
    experiments) escape/PWNED_toy_*.md/.tex (exit 0). Now the names are reduced to safe ones."""
    out = tmp_path / "out" / "a" / "b" / "c"
    escape = tmp_path / "out" / "escape"  # where out/a/b/c/<folder>/../../../../escape lands
    escape.mkdir(parents=True)
    bad = write_job(tmp_path / "results" / "bad" / "job", toy_records(ESCAPE))
    good = write_job(tmp_path / "results" / "good" / "job", toy_records("other"))
    assert figures.main([str(bad), "--out", str(out / "figures")]) == 0
    assert tables.main([str(bad), str(good), "--out", str(out / "tables")]) == 0
    assert list(escape.iterdir()) == []
    written = [p for p in files_under(tmp_path) if not p.is_relative_to(tmp_path / "results")]
    assert written and all(p.is_relative_to(out) for p in written)
    prefix = table_files.safe_name(ESCAPE)
    assert prefix.startswith("escape_PWNED-") and "/" not in prefix and not prefix.startswith(".")
    assert (out / "figures" / f"{prefix}_toy_accuracy_vs_budget.png").is_file()
    assert (out / "tables" / f"{prefix}_toy_budget0.5.md").is_file()
    assert (out / "tables" / "other_toy_budget0.5.md").is_file()  # a plain name is kept as it is


def test_a_record_naming_its_benchmark_with_dot_dots_writes_nothing_outside_out(tmp_path):
    experiment = write_job(tmp_path / "results" / "exp" / "job", toy_records("exp", benchmark="../../b/X"))
    out = tmp_path / "out"
    assert figures.main([str(experiment), "--out", str(out / "figures")]) == 0
    assert tables.main([str(experiment), "--out", str(out / "tables")]) == 0
    name = table_files.safe_name("../../b/X")
    assert (out / "figures" / f"exp_{name}_accuracy_vs_budget.png").is_file()
    assert (out / "tables" / f"{name}_budget0.5.md").is_file()
    written = [p for p in files_under(tmp_path) if not p.is_relative_to(tmp_path / "results")]
    assert all(p.parent in (out / "figures", out / "tables") for p in written)


def test_safe_names_are_plain_and_never_collide_and_output_paths_stay_in_their_folder(tmp_path):
    assert table_files.safe_name("reproduce_ruler_cpu") == "reproduce_ruler_cpu"
    names = [table_files.safe_name(text) for text in ("..", ".", "a/b", "a_b/", "/etc/passwd", "x" * 300, "")]
    assert all(table_files.PLAIN_NAME.fullmatch(name) for name in names)
    assert len(set(names)) == len(names)  # "a/b" and "a_b/" reduce to different names
    with pytest.raises(table_files.OutputError, match="not a plain file name"):
        table_files.output_path(tmp_path, "../x.md")


# ----------------------------------------------------------------- D1. a linked output folder
def test_a_tables_or_figures_folder_that_is_a_link_is_refused(tmp_path, capsys):
    """Before: `ln -s /elsewhere <exp>/tables` made tables.py write into /elsewhere (exit 0)."""
    experiment = write_job(tmp_path / "results" / "exp" / "job", toy_records("exp"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (experiment / "tables").symlink_to(elsewhere, target_is_directory=True)
    assert tables.main([str(experiment)]) == 2
    assert figures.main([str(experiment), "--out", str(experiment / "tables")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {experiment / 'tables'} is a symbolic link; not writing through it "
                     "(remove it or give another --out)"] * 2  # fmt: skip
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------ D2. a record field of the wrong type
def test_records_with_a_wrong_type_are_dropped_kept_aside_and_the_job_finishes(tmp_path):
    """Before: resume crashed in summarize (ValueError: Unknown format code 'g' / TypeError), exit 1,
    and done.json was never written, so every rerun crashed again."""
    cfg, raw, path = finished_job(tmp_path)
    good = path.read_text()
    first = json.loads(good.splitlines()[0])
    bad = [{**first, "sample_id": "x1", "budget": "abc"}, {**first, "sample_id": "x2", "score": "high"}]
    bad_lines = "".join(json.dumps(r) + "\n" for r in bad)
    path.write_text(good + bad_lines)
    (cfg.job_dir / "done.json").unlink()
    summary = run_job(cfg, config_yaml_of(cfg, raw))
    assert summary["n_records"] == 4 and summary["n_dropped_lines"] == 2 and summary["n_failed"] == 0
    assert path.read_text() == good and (cfg.job_dir / "done.json").is_file()
    (kept,) = cfg.job_dir.glob("records.jsonl.dropped-*")
    assert kept.read_text() == bad_lines  # nothing written is lost


# ------------------------------------------------------------------ D3. records of another job
def test_records_copied_from_another_job_are_refused_on_resume_and_skipped_by_tables(tmp_path, capsys):
    """Before: a record of smollm2-135m / someone-elses-job replaced a genuine one on resume, and the
    tables pooled it (SnapKV 0.0 -> 50.0 here, caption "smollm2-135m, tiny-llama")."""
    cfg, raw, path = finished_job(tmp_path)
    genuine = [r for r in map(json.loads, path.read_text().splitlines()) if r["method"] == "snapkv"]
    foreign = {**genuine[0], "model": "smollm2-135m", "job": "someone-elses-job", "score": 100.0}
    with path.open("a") as handle:
        handle.write(json.dumps(foreign) + "\n")
    before = path.read_text()
    (cfg.job_dir / "done.json").unlink()
    with pytest.raises(JobMismatch) as error:
        run_job(cfg, config_yaml_of(cfg, raw))
    assert str(error.value) == (
        f"{path} holds 1 record(s) of another job (model smollm2-135m, job someone-elses-job); move them "
        "out of the file, or pass overwrite=true (--force) to start the job again"
    )
    assert error.value.exit_code == 2 and path.read_text() == before
    df = tables.load([cfg.job_dir.parent])
    assert set(df["model"]) == {"tiny-llama"} and len(df) == 4
    assert sorted(df.loc[df["method"] == "snapkv", "score"]) == sorted(r["score"] for r in genuine)
    assert (
        "1 record(s) of another job skipped (model smollm2-135m, job someone-elses-job)"
        in capsys.readouterr().err
    )


# ------------------------------------------------------- D4, D5, D9. generate: one line, before loading
def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_generate_with_a_model_that_cannot_be_loaded_is_one_line(monkeypatch, capsys):
    """Before: `--model llama3.1-8b` offline was a RuntimeError traceback (exit 1)."""

    def unreachable(*args, **kwargs):
        raise RuntimeError("cannot load 'meta-llama/Llama-3.1-8B-Instruct' from the Hugging Face Hub")

    monkeypatch.setattr(centroidkv.models, "load_tokenizer", unreachable)
    monkeypatch.setattr(centroidkv.models, "load_model", unreachable)
    assert generate_main(["--prompt", "hi", "--model", "llama3.1-8b", "--methods", "full"]) == 1
    assert one_error_line(capsys) == (
        "error: cannot load the tokenizer of llama3.1-8b: cannot load 'meta-llama/Llama-3.1-8B-Instruct' "
        "from the Hugging Face Hub"
    )
    monkeypatch.setattr(centroidkv.models, "load_tokenizer", lambda name: None)  # the model itself fails
    monkeypatch.setattr(centroidkv.models, "max_positions", lambda name: None)
    assert generate_main(["--prompt", "hi", "--model", "llama3.1-8b", "--methods", "full"]) == 1
    assert one_error_line(capsys).startswith("error: cannot load llama3.1-8b: cannot load 'meta-llama/")


def test_generate_max_new_tokens_beyond_the_models_positions_is_refused_before_loading(
    no_model_loading, capsys
):
    """Before: the model loaded, then a traceback trying to allocate 768 GB."""
    assert generate_main(["--prompt", "hi", "--max-new-tokens", "1000000000", "--methods", "full"]) == 2
    assert one_error_line(capsys) == (
        "error: --max-new-tokens must be at least 1 and below smollm2-135m's 8192 positions, got 1000000000"
    )


LONG_CONTEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(900))


def test_generate_a_context_beyond_the_models_positions_is_refused_before_loading(
    tmp_path, no_model_loading, capsys
):
    """Before: an 11k-token context on the embedded model (8,192 positions) ran for 5 minutes and
    answered nothing, without a warning."""
    (tmp_path / "context.txt").write_text(LONG_CONTEXT)
    argv = ["--context", str(tmp_path / "context.txt"), "--question", "What jumps?", "--methods", "full"]
    assert generate_main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: the prompt (") and "more than smollm2-135m's 8192" in line
    assert line.endswith("or pass --truncate to cut the middle of the context")


def test_truncate_cuts_the_middle_of_the_context_to_fit():
    from centroidkv.prompt_fit import prompt_length, truncate_context

    tokenizer = centroidkv.models.load_tokenizer()
    cut = truncate_context(tokenizer, LONG_CONTEXT, "What jumps?", "full_prompt", 64, 2048)
    assert 2048 - 64 - 8 <= prompt_length(tokenizer, cut, "What jumps?", "full_prompt") <= 2048 - 64
    assert cut.startswith("Line 0: the quick") and cut.endswith(
        "Line 899: the quick brown fox jumps over the lazy dog."
    )
    assert truncate_context(tokenizer, "short", "q", "full_prompt", 64, 2048) == "short"


def test_generate_refuses_a_prompt_beyond_the_positions_before_any_prefill():
    """The Python API too: tiny-llama has 4096 positions."""
    from centroidkv.generate import generate

    model, _ = centroidkv.models.load_model("tiny-llama")
    tokenizer = centroidkv.models.load_tokenizer()
    with pytest.raises(ValueError, match=r"need \d+ positions, more than the model's 4096"):
        generate(model, tokenizer, LONG_CONTEXT, "What jumps?", ["full"], max_new_tokens=4, warm=False)


# --------------------------------------------------------- D6. a LongBench row without its answers
def test_a_longbench_file_whose_rows_lack_answers_is_one_line_naming_file_and_field(tmp_path):
    """Before: `KeyError: 'answers'` traceback when the samples loaded (after the model)."""
    from eval.benchmarks import build_benchmark
    from eval.benchmarks.longbench.data import load_samples

    rows = [{"input": "Who?", "context": "Ada wrote it.", "length": 3, "_id": str(i)} for i in range(2)]
    (tmp_path / "qasper.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = f"{tmp_path / 'qasper.jsonl'}: row 1: no field 'answers' (a row of qasper has context, input, answers)"
    params = {
        "name": "longbench",
        "tasks": ["qasper"],
        "data_dir": str(tmp_path),
        "lengths": [500],
        "n_samples": 2,
    }
    _, errors = build_benchmark(params)
    assert errors == [f"benchmark.data_dir: {message}"]  # refused with the config, before any model
    with pytest.raises(ValueError) as error:
        load_samples("qasper", None, data_dir=tmp_path)
    assert str(error.value) == message


# ----------------------------------------------------------- D7, D8. the converted-model cache
class FakeGguf:
    """Stands in for transformers' GGUF loaders: `from_pretrained` gives an object whose
    `save_pretrained` writes a small checkpoint slowly (a real conversion takes ~20 s)."""

    calls = 0

    def __init__(self, files: tuple[str, ...]):
        self.files = files
        self.hf_quantizer = object()
        self.config = type("Config", (), {})()

    @classmethod
    def model(cls, *args, **kwargs) -> FakeGguf:
        cls.calls += 1
        return cls(("model.safetensors", "config.json"))

    @classmethod
    def tokenizer(cls, *args, **kwargs) -> FakeGguf:
        return cls(("tokenizer.json", "tokenizer_config.json"))

    def save_pretrained(self, folder) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            if name.endswith(".safetensors"):
                save_file({"weight": torch.arange(1000, dtype=torch.float32)}, str(folder / name))
            elif name == "config.json":  # the shape the wheel model declares (checked on each load)
                (folder / name).write_text(json.dumps(WHEEL_MODELS["smollm2-135m"].declared_config))
            else:
                (folder / name).write_text("{}")
            time.sleep(0.2)


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """An empty model cache under tmp_path, converted by FakeGguf."""
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(FakeGguf, "calls", 0)
    monkeypatch.setattr(
        centroidkv.models, "AutoModelForCausalLM", type("M", (), {"from_pretrained": FakeGguf.model})
    )
    monkeypatch.setattr(
        centroidkv.models, "AutoTokenizer", type("T", (), {"from_pretrained": FakeGguf.tokenizer})
    )
    return tmp_path / "cache" / "smollm2-135m"


def whole(folder: Path) -> bool:
    """Whether a (fake) converted checkpoint has every file and weights that read back."""
    from safetensors.torch import load_file

    names = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    if not all((folder / name).is_file() for name in names):
        return False
    try:
        return torch.equal(load_file(folder / "model.safetensors")["weight"], torch.arange(1000.0))
    except Exception:  # truncated: SafetensorError
        return False


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_deleted_converted_model_is_converted_again(fake_conversion, damage, capsys):
    """Before: a conversion counted as complete once config.json and tokenizer_config.json existed, so
    a truncated or deleted model.safetensors was a SafetensorError / OSError traceback on every run."""
    from centroidkv.models import _embedded_dir

    folder = _embedded_dir()
    weights = folder / "model.safetensors"
    assert folder == fake_conversion and whole(folder) and FakeGguf.calls == 1
    if damage == "truncate":
        with weights.open("r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    else:
        weights.unlink()
    assert not whole(folder)
    assert _embedded_dir() == folder and FakeGguf.calls == 2 and whole(folder)
    assert "converting smollm2-135m again" in capsys.readouterr().err
    assert sorted(p.name for p in folder.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


def test_a_conversion_without_manifest_is_checked_by_its_safetensors_header(fake_conversion):
    """A cache converted by an earlier version (no conversion.json) is used when whole, converted
    again when its safetensors file is shorter than its header says."""
    from centroidkv.models import _embedded_dir

    folder = _embedded_dir()
    (folder / "conversion.json").unlink()
    assert _embedded_dir() == folder and FakeGguf.calls == 1  # whole: not converted again
    weights = folder / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size - 100)
    assert _embedded_dir() == folder and FakeGguf.calls == 2 and whole(folder)
    assert (folder / "conversion.json").is_file()


def test_two_conversions_at_once_both_succeed(fake_conversion):
    """Before: both converted into one shared smollm2-135m.tmp, which the other deleted: one died with
    `SafetensorError ... No such file or directory` (or left a checkpoint missing files)."""
    from centroidkv.models import _embedded_dir

    start = threading.Barrier(2)
    results: list[Any] = []

    def convert() -> None:
        start.wait(timeout=10)  # both ask for the model at the same moment
        try:
            results.append(_embedded_dir())
        except Exception as error:  # what the test reports
            results.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [fake_conversion, fake_conversion] and FakeGguf.calls == 1  # one converted
    assert whole(fake_conversion)
    assert sorted(p.name for p in fake_conversion.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


# ------------------------------------------------- D10, D12. a folder where the runner keeps a file
@pytest.mark.parametrize("name", [".lock", "records.jsonl"])
def test_a_folder_named_like_a_job_file_is_one_line_before_any_work(tmp_path, name):
    """Before: a `.lock` folder was an IsADirectoryError traceback from check_not_running; a
    `records.jsonl` folder was refused as holding "results without a saved identity"."""
    from eval.sweep import plan

    args = [
        *TINY,
        "method=full",
        "benchmark.n_samples=1",
        "benchmark.max_new_tokens=2",
        f"results_dir={tmp_path}",
    ]
    (job_dir,) = [cfg.job_dir for cfg in plan(args)]
    (job_dir / name).mkdir(parents=True)
    with pytest.raises(ConfigError) as error:
        plan(args)
    assert error.value.lines == [f"{job_dir / name} is a folder, where the runner keeps a file; remove it"]
    assert [p.name for p in job_dir.iterdir()] == [name]


# ------------------------------------------------------------------------- D11. Ctrl-C during a job
N_SAMPLES = 300


def _default_sigint() -> None:
    """In the job's process: Ctrl-C's default handling, even when this test runs in the background,
    where the shell starts it with SIGINT ignored (and Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_the_job_resumes(tmp_path):
    """Before: a KeyboardInterrupt traceback. Now one line with the records kept, exit 130, and the
    rerun completes the job from them."""
    from eval.sweep import plan

    results = tmp_path / "results"
    # enough samples that the job (~50 samples/s on a tiny model) cannot end before the interrupt
    args = [*TINY, f"results_dir={results}", "methods=[full,streaming_llm]", "budgets=[0.5]",
            f"benchmark.n_samples={N_SAMPLES}", "benchmark.max_new_tokens=6"]  # fmt: skip
    job = subprocess.Popen(
        [*RUN, *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        records_path = wait_for_records(results, "*/*/records.jsonl", 4, job)
    finally:
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and "sample/s" not in line]
    kept = read_records(records_path)[0]
    assert job.returncode == 130, err[-3000:]
    assert lines == [
        f"error: {records_path.parent}: interrupted after {len(kept)} record(s), all kept in records.jsonl; "
        "rerun the same command to resume"
    ]
    (cfg,) = plan(args)  # the same job, resumed in this process
    assert cfg.job_dir == records_path.parent
    assert run_job(cfg, config_yaml_of(cfg, None))["n_records"] == 2 * N_SAMPLES
    after = {json.dumps(r, sort_keys=True) for r in read_records(records_path)[0]}
    assert len(after) == 2 * N_SAMPLES and {json.dumps(r, sort_keys=True) for r in kept} <= after


# ------------------------------------------------------------ D13. an experiment name too long
def test_an_experiment_name_too_long_for_the_file_system_is_one_line_and_creates_nothing(tmp_path):
    """Before: refused by the lock's mkdir ("File name too long"), after the results folder was made."""
    results = tmp_path / "results"
    line = config_error_line(results, ["method=full", "experiment_name=" + "a" * 300])
    assert line == "experiment_name: 300 characters, more than a folder name may have (255)"
    with pytest.raises(ResultsFolderError, match="more than a file system allows"):
        check_results_folder(results / ("b" * 300) / "job")
    assert not results.exists()
