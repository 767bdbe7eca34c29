"""Results you can trust after a crash, a second run or a typo (one test per case of issue 10).

Subprocess tests run scripts/run.py on `tiny-llama` with the `toy` benchmark; the others call the
harness in-process.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eval.job_store import JobStore
from eval.records import read_records, record_key
from eval.run_config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(ROOT / "scripts" / "run.py")]
TINY = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false"]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def run(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, env=env(), timeout=timeout, **kwargs)


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.strip()]


def wait_for_records(results: Path, pattern: str, n: int, proc: subprocess.Popen, limit: float = 240) -> Path:
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        found = list(results.glob(pattern))
        if found and len(found[0].read_text().splitlines()) >= n:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no {n} records appeared (exit code {proc.poll()})")


# ------------------------------------------------------------------ 1. resuming with another config
def test_a_killed_job_resumes_only_with_its_own_config(tmp_path):
    """Killed at a few records (kill -9). Rerun after its experiment file changed max_new_tokens (a
    key that does not name the folder): refused, naming the key, nothing touched. Rerun with the
    config it was started with: it completes, every record exactly once, nothing written before the
    kill lost or redone."""
    configs, results = tmp_path / "configs", tmp_path / "results"
    (configs / "experiment").mkdir(parents=True)
    experiment = configs / "experiment" / "mix.yaml"
    experiment.write_text("# @package _global_\nexperiment_name: mix\nbenchmark:\n  max_new_tokens: 6\n")
    args = ["-cd", str(configs), "experiment=mix", *TINY, f"results_dir={results}", "methods=[full,streaming_llm]",
            "budgets=[0.5]", "benchmark.n_samples=15"]  # fmt: skip
    first = subprocess.Popen([*RUN, *args], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        records_path = wait_for_records(results, "mix/*/records.jsonl", 5, first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    before = records_path.read_bytes()
    assert 5 <= len(before.splitlines()) < 30 and not (records_path.parent / "done.json").exists()

    experiment.write_text(experiment.read_text().replace("max_new_tokens: 6", "max_new_tokens: 3"))
    refused = run(args, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = error_lines(refused)
    assert (
        line.startswith("config error: ")
        and "benchmark.max_new_tokens: 6 -> 3" in line
        and "overwrite" in line
    )
    assert records_path.read_bytes() == before  # nothing touched

    experiment.write_text(experiment.read_text().replace("max_new_tokens: 3", "max_new_tokens: 6"))
    resumed = run(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = records_path.read_text().splitlines()
    keys = [record_key(json.loads(line)) for line in lines]
    assert len(keys) == len(set(keys)) == 30  # every sample x method exactly once
    after = {record_key(r): r for r in map(json.loads, lines)}
    for record in map(json.loads, before.decode().splitlines()[:-1]):  # the last line may be torn
        assert after[record_key(record)] == record


def test_overwrite_sets_the_old_records_aside_and_starts_again(tmp_path):
    from test_harness import run_cfg

    from eval.records import JobMismatch
    from eval.runner import config_yaml_of, run_job
    from scripts.run import hydra_argv

    cfg, raw = run_cfg(tmp_path, ["method=full", "benchmark.n_samples=2", "benchmark.max_new_tokens=6"])
    run_job(cfg, config_yaml_of(cfg, raw))
    old = (cfg.job_dir / "records.jsonl").read_text()
    changed, raw = run_cfg(tmp_path, ["method=full", "benchmark.n_samples=2", "benchmark.max_new_tokens=3"])
    assert changed.job_dir == cfg.job_dir
    with pytest.raises(JobMismatch, match="benchmark.max_new_tokens: 6 -> 3"):
        run_job(changed, config_yaml_of(changed, raw))
    assert hydra_argv(["-m", "a=1", "--force"]) == ["-m", "a=1", "overwrite=true"]
    forced, raw = run_cfg(tmp_path, ["method=full", "benchmark.n_samples=2", "benchmark.max_new_tokens=3",
                                     "overwrite=true"])  # fmt: skip
    run_job(forced, config_yaml_of(forced, raw))
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert len(records) == 2 and all(r["n_generated"] <= 3 for r in records)
    (kept,) = cfg.job_dir.glob("records.jsonl.replaced-*")
    assert kept.read_text() == old and JobStore(cfg.job_dir).finished


def test_identity_names_model_dtype_device_benchmark_and_each_variant(tmp_path):
    from test_harness import run_cfg

    cfg, _ = run_cfg(
        tmp_path, ["methods=[full,{name:snapkv,variant:w16,params:{window_size:16}}]", "budgets=[0.5]"]
    )
    identity = cfg.identity()
    assert identity["model.name"] == "tiny-llama" and identity["model.dtype"] == "float32"
    assert identity["model.device"] == "cpu" and identity["benchmark.max_new_tokens"] == 8
    assert identity["benchmark.seed"] == 0 and identity["methods.w16.params.window_size"] == 16
    assert identity["methods.w16.method"] == "snapkv" and identity["methods.w16.budgets"] == [0.5]
    # dtype null on CPU is float32: the same job; bfloat16 is another one
    same, _ = run_cfg(tmp_path, ["methods=[full,{name:snapkv,variant:w16,params:{window_size:16}}]", "budgets=[0.5]",
                                 "model.dtype=float32"])  # fmt: skip
    other, _ = run_cfg(tmp_path, ["methods=[full,{name:snapkv,variant:w16,params:{window_size:16}}]", "budgets=[0.5]",
                                  "model.dtype=bfloat16"])  # fmt: skip
    assert same.identity() == identity and other.identity()["model.dtype"] == "bfloat16"


# ----------------------------------------------------------------------- 2. two runs of the same job
def test_a_second_run_of_a_running_job_exits_2_naming_the_holder(tmp_path):
    results = tmp_path / "results"
    args = [*TINY, f"results_dir={results}", "method=full", "benchmark.n_samples=400", "benchmark.ignore_eos=true",
            "experiment_name=twice"]  # fmt: skip
    first = subprocess.Popen([*RUN, *args], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        records_path = wait_for_records(results, "twice/*/records.jsonl", 1, first)
        # Stopped, the first run holds its lock until it is killed: left running, it could finish its
        # samples (~10 s) and release the lock before the second run or the kill came (the flaky race).
        first.send_signal(signal.SIGSTOP)
        second = run(args)  # the default 300 s: under a loaded machine its startup alone took over 120 s
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL, "the first run ended before it was killed"
    assert not (records_path.parent / "done.json").exists()
    assert second.returncode == 2, second.stderr[-2000:]
    (line,) = error_lines(second)
    assert f"is being run by pid {first.pid} on host {socket.gethostname()}" in line
    records, _ = read_records(records_path)
    keys = [record_key(json.loads(x)) for x in records_path.read_text().splitlines() if x.endswith("}")]
    assert len(keys) == len(set(keys)) == len(records)  # only the first run wrote
    # The first run died holding the lock: the next run detects the stale lock and takes it over.
    store = JobStore(records_path.parent)
    assert store.lock().startswith(f"pid {first.pid} on host {socket.gethostname()} (since ")
    store.unlock()


# --------------------------------------------------------------------------- 3. results folders
def _read_only(path: Path) -> list[str] | None:
    """A command prefix under which `path` is read-only, or None where that cannot be arranged."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return []
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {path} {path} && mount -o remount,ro,bind {path}"],
        capture_output=True,
    )
    if probe.returncode != 0:
        return None
    script = f'mount --bind "{path}" "{path}" && mount -o remount,ro,bind "{path}" && exec "$0" "$@"'
    return ["unshare", "-m", "sh", "-c", script]


def test_read_only_results_folder_is_one_line_before_the_model_loads(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    prefix = _read_only(results)
    if prefix is None:
        pytest.skip("cannot make a folder read-only here (root without unshare/mount)")
    out = subprocess.run(
        [*prefix, *RUN, *TINY, f"results_dir={results}", "method=full", "benchmark.n_samples=1"],
        capture_output=True, text=True, env=env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = error_lines(out)
    assert line.startswith(f"config error: results folder {results}/") and "cannot be written" in line
    assert list(results.iterdir()) == []


def test_results_folder_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    from test_harness import run_cfg

    import centroidkv
    from eval.records import ResultsFolderError
    from eval.runner import config_yaml_of, run_job

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(centroidkv, "load_model", no_model)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg, raw = run_cfg(blocker / "results", ["benchmark.n_samples=1"])
    with pytest.raises(ResultsFolderError, match="is not a folder"):
        run_job(cfg, config_yaml_of(cfg, raw))
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )
    cfg, raw = run_cfg(tmp_path / "results", ["benchmark.n_samples=1"])
    with pytest.raises(ResultsFolderError, match="MB free, the job's records need about"):
        run_job(cfg, config_yaml_of(cfg, raw))
    assert not (tmp_path / "results").exists()


def test_a_full_disk_mid_job_is_one_line_and_keeps_every_whole_record(tmp_path):
    """RLIMIT_FSIZE makes records.jsonl unable to grow past 12 kB, as a full disk would: the job stops
    with one line, every record written before is whole, no torn line is left."""
    results = tmp_path / "results"
    limit = 12_000

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = subprocess.run(
        [*RUN, *TINY, f"results_dir={results}", "methods=[full,streaming_llm]", "budgets=[0.5]",
         "benchmark.n_samples=40", "experiment_name=full_disk"],
        capture_output=True, text=True, env=env(), timeout=300, preexec_fn=small_files,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [line for line in error_lines(out) if not line.startswith(("full_disk/", "[failed]"))]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write ") and "File too large" in lines[0], (
        lines
    )
    (records_path,) = results.glob("full_disk/*/records.jsonl")
    text = records_path.read_text()
    assert text.endswith("\n") and len(text) <= limit
    assert all(json.loads(line)["status"] == "ok" for line in text.splitlines())
    assert not (records_path.parent / "done.json").exists()


# ----------------------------------------------------------------------------- 4. validation
@pytest.mark.parametrize(
    "override, fragment",
    [
        ("+benchmark.n_sample=1", "benchmark.n_sample: toy has no such parameter"),
        ("+method.budgett=0.5", "method.budgett: unknown key"),
        ("+bogus=1", "bogus: unknown key"),
        ("+model.dtpye=float32", "model.dtpye: unknown key"),
    ],
)
def test_keys_no_schema_knows_are_errors(tmp_path, override, fragment):
    from test_harness import config_error_line

    assert fragment in config_error_line(tmp_path, [override])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["+benchmark.n_sample=1"], "benchmark.n_sample: toy has no such parameter"),
        (
            ["benchmark.n_sample=1"],
            "Could not override 'benchmark.n_sample'. (Key 'n_sample' is not in struct)",
        ),
        # the list is not compared: test_benchmark_home drops a benchmark into the tree while it runs
        (["benchmark=nope"], "Could not find 'benchmark/nope' (available: "),
        (["method.budget=[0.5"], "no viable alternative at input"),
        (["-m", "method.budget=0.5,2"], "job 1 (method.budget=2): budgets: budget must be a fraction"),
        (["-m", "warmup=true,false"], "jobs 0 and 1 would both write"),
    ],
)
def test_the_whole_command_line_is_validated_first(tmp_path, args, fragment):
    from eval.sweep import plan

    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    with pytest.raises(ConfigError) as error:
        plan([*flags, *TINY, f"results_dir={tmp_path}", *overrides])
    assert len(error.value.lines) == 1 and fragment in error.value.lines[0], error.value.lines
    assert list(tmp_path.iterdir()) == []


def test_a_bad_job_in_a_sweep_stops_the_sweep_before_any_job_runs(tmp_path):
    out = run(["-m", *TINY, f"results_dir={tmp_path / 'results'}", "method.budget=0.5,2", "benchmark.n_samples=1"],
              timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert error_lines(out) == [
        "config error: job 1 (method.budget=2): budgets: budget must be a fraction in (0, 1], got 2"
    ]
    assert not (tmp_path / "results").exists()


def test_a_job_whose_every_record_failed_is_not_done(tmp_path):
    from test_harness import run_cfg

    from eval.runner import config_yaml_of, run_job

    # centroidkv at 0.001 keeps no entry of a ~300-token toy prompt
    cfg, raw = run_cfg(tmp_path, ["method=centroidkv", "method.budget=0.001", "benchmark.n_samples=2"])
    with pytest.raises(RuntimeError, match="none of the 2 records succeeded") as error:
        run_job(cfg, config_yaml_of(cfg, raw))
    assert error.value.exit_code == 1 and "no room for any token" in str(error.value)  # the CLI exits 1
    assert not JobStore(cfg.job_dir).finished
    with pytest.raises(RuntimeError, match="none of the 2 records succeeded"):  # not skipped: tried again
        run_job(cfg, config_yaml_of(cfg, raw))


# ------------------------------------------------------------------- 5. protected windows vs budget
def test_a_budget_too_small_for_the_protected_windows_shrinks_them_and_one_of_no_entry_fails_first():
    """50-token prompt, 100 new tokens. Budget 0.5: B = 75 < 81 protected tokens of centroidkv; the
    prompt fits, the first compression comes during decoding and keeps n_recent 75 - 16 - 1 = 58
    (`centroidkv.cache.budget.fit_protected`). Budget 0.005: B = 0, refused before any decoding step."""
    from centroidkv import load_model
    from centroidkv.plan.decoding import generate_from, prefill

    model, _ = load_model("tiny-llama")
    prefilled = prefill(model, torch.arange(1, 51).unsqueeze(0), 100)
    shrunk = generate_from(
        model, prefilled, "centroidkv", 0.5, 100, eos_token_ids=set(), budget_unit="entries"
    )
    assert len(shrunk.tokens[0]) == 100 and shrunk.n_compressions >= 1
    assert (shrunk.n_sink_used, shrunk.n_recent_used) == (16, 58)
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="keeps 0 entries: no room for any token"):
            generate_from(model, prefilled, "centroidkv", 0.005, 100, budget_unit="entries")
    finally:
        hook.remove()
    assert not forwards  # no token was generated
    # 50 new tokens: B = 50 holds the prompt, and 99 entries stay under B + g - 1 = 113: never compresses
    result = generate_from(
        model, prefilled, "centroidkv", 0.5, 50, eos_token_ids=set(), budget_unit="entries"
    )
    assert len(result.tokens[0]) == 50


def test_a_budget_of_no_entry_is_a_config_error_and_one_short_of_the_protected_windows_is_not(tmp_path):
    from test_harness import composed

    from eval.config import build_run_config

    overrides = ["benchmark=ruler", "benchmark.lengths=[1024,2048]", "methods=[full,centroidkv,snapkv]"]
    # 0.05: centroidkv keeps 5 entries of a 1024-token sample in bytes (its outlier heads take most of
    # the budget), fewer than its 81 protected: it runs with shorter windows (fit_protected)
    build_run_config(composed([*overrides, "budgets=[0.05,0.5]"]), "job")
    with pytest.raises(ConfigError) as error:
        build_run_config(
            composed([*overrides[:2], "methods=[full,streaming_llm]", "budgets=[0.0005,0.5]"]), "job"
        )
    assert error.value.lines == [  # (SnapKV's query window alone exceeds such a budget: its own line)
        "budgets: streaming_llm@0.0005 on a 1024-token ruler sample (budget_unit=bytes) keeps 0 entries: no "
        "room for any token; raise the budget"
    ]


# -------------------------------------------------------------------------------- 6. small ones
def test_max_new_tokens_zero_generates_nothing():
    from centroidkv import load_model
    from centroidkv.plan.decoding import generate_from, prefill

    model, _ = load_model("tiny-llama")
    prefilled = prefill(model, torch.arange(1, 41).unsqueeze(0), 0)
    assert generate_from(model, prefilled, "full", 1.0, 0).tokens == [[]]
    assert generate_from(model, prefilled, "full", 1.0, 2).tokens[0].__len__() == 2
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate_from(model, prefilled, "full", 1.0, -1)


def test_an_empty_prompt_is_one_clear_error():
    from centroidkv import load_model
    from centroidkv.plan.decoding import prefill

    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="empty prompt"):
        prefill(model, torch.zeros(1, 0, dtype=torch.long), 8)


def test_a_hub_model_without_the_hub_fails_at_once_with_one_line(tmp_path):
    try:  # the Hub endpoint answers: the model would download
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        reachable = True
    except OSError:
        reachable = False
    if reachable:
        pytest.skip("the Hugging Face Hub is reachable here: the model would download")
    clean = {
        k: v
        for k, v in env().items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    out = subprocess.run(
        [*RUN, "model=qwen2-7b", "benchmark=toy", "logger=none", f"results_dir={tmp_path}", "method=full"],
        capture_output=True, text=True, env=clean, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = error_lines(out)  # no retry warnings before it
    assert line.startswith("error: ") and "Qwen/Qwen2-7B-Instruct" in line and "Hugging Face Hub" in line


def test_torn_and_corrupt_lines_are_counted_in_the_summary(tmp_path):
    from test_harness import run_cfg

    from eval.runner import config_yaml_of, run_job

    cfg, raw = run_cfg(tmp_path, ["method=full", "benchmark.n_samples=3"])
    run_job(cfg, config_yaml_of(cfg, raw))
    path = cfg.job_dir / "records.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(
        lines[0] + "{not json\n" + "".join(lines[1:]) + '{"benchmark": "toy", "ta'
    )  # corrupt + torn
    (cfg.job_dir / "done.json").unlink()
    summary = run_job(cfg, config_yaml_of(cfg, raw))
    assert summary["n_dropped_lines"] == 2 and summary["n_records"] == 3
    assert path.read_text() == "".join(lines)  # cleaned, nothing redone
