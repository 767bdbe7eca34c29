"""Job folder names: `<benchmark>-<methods>-<budgets>-<hash of the override string>`, the overrides in
the folder's config.yaml."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from eval.job_names import override_hash, split_overrides
from eval.runner import config_yaml_of, run_job
from eval.sweep import plan

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false"]
SAFE = re.compile(r"^[A-Za-z0-9=,._@+-]+$")


def test_overrides_split_at_top_level_commas_only():
    assert split_overrides("a=[1,2],b={c:3,d:4},e='x,y'") == ["a=[1,2]", "b={c:3,d:4}", "e='x,y'"]


def test_a_sweep_names_its_jobs_readably(tmp_path):
    jobs = plan(["-m", *TINY, f"results_dir={tmp_path}", "method.budget=0.25,0.5", "benchmark.n_samples=1"])
    names = [job.job for job in jobs]
    assert [name.rsplit("-", 1)[0] for name in names] == ["toy-centroidkv-0.25", "toy-centroidkv-0.5"]
    assert len(set(names)) == 2 and all(job.job_dir.name == job.job for job in jobs)


THREE_METHODS = [*TINY, "methods=[full,centroidkv,snapkv]", "budgets=[0.5,0.75]", "benchmark.n_samples=1",
                 "benchmark.max_new_tokens=2"]  # fmt: skip


def test_a_job_is_named_by_benchmark_methods_and_budgets_and_keeps_its_overrides(tmp_path):
    """Before: `n_samples=1,benchmark=toy,budgets=0.25+0.5,methods=full+centroidkv+snapkv,...-<hash>`."""
    argv = [*THREE_METHODS, f"results_dir={tmp_path}"]
    (job,) = plan(argv)
    dirname = _override_dirname(argv)
    assert job.job == f"toy-3methods-0.5+0.75-{override_hash(dirname)}"
    assert job.job_dir == tmp_path.resolve() / "default" / job.job
    (again,) = plan(list(reversed(argv)))  # stable: the same overrides in another order, the same name
    assert again.job == job.job
    (other,) = plan([*argv, "benchmark.seed=1"])  # other overrides: another hash
    assert other.job.startswith("toy-3methods-0.5+0.75-") and other.job != job.job
    (full_only,) = plan([*TINY, f"results_dir={tmp_path}", "methods=[full]"])
    assert re.fullmatch(r"toy-full-[0-9a-f]{6}", full_only.job)  # the full cache has no budget

    run_job(job, config_yaml_of(job, None))
    saved = OmegaConf.to_container(OmegaConf.load(job.job_dir / "config.yaml"))
    assert (
        saved["overrides"] == split_overrides(dirname)
        and "methods=[full,centroidkv,snapkv]" in saved["overrides"]
    )


def _override_dirname(argv: list[str]) -> str:
    """Hydra's override_dirname of a command line, as configs/config.yaml sets it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.config import CONFIG_DIR, store_configs

    store_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=argv, return_hydra_config=True)
    GlobalHydra.instance().clear()
    return cfg.hydra.job.override_dirname
