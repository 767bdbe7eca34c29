"""Job folder names: `<benchmark>-<methods>-<budgets>-<hash of the override string>`, the overrides in
the folder's config.yaml; folders named the former ways (short key=value pairs plus the hash, or the
override string itself) are still found, so their jobs resume."""

from __future__ import annotations

import dataclasses
import re

import pytest
from omegaconf import OmegaConf

from eval.config import former_job_name, job_name_from_overrides, split_overrides
from eval.records import DONE, RECORDS
from eval.runner import config_yaml_of, run_job
from eval.sweep import plan

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false"]
SAFE = re.compile(r"^[A-Za-z0-9=,._@+-]+$")


def test_names_are_short_readable_safe_and_unique():
    assert job_name_from_overrides("") == "default"
    name = job_name_from_overrides("method.budget=0.25,method.params.schedule=linear")
    assert re.fullmatch(r"budget=0\.25,schedule=linear-[0-9a-f]{6}", name)
    assert name == job_name_from_overrides(
        "method.budget=0.25,method.params.schedule=linear"
    )  # deterministic

    long = (
        "benchmark.lengths=[4096,8192],methods=[full,{name:centroidkv,variant:centroidkv_r02,"
        "params:{r_init:0.2}}],+method.params.press_params.press=SnapKVPress,method.params.r_min=0.05"
    )
    name = job_name_from_overrides(long)
    assert SAFE.match(name) and len(name) <= 90 and name.startswith("lengths=4096+8192,methods=full")
    assert job_name_from_overrides(long.replace("0.05", "0.06")) != name  # cut off, told apart by the hash

    # two keys that would read the same keep their prefixes
    assert job_name_from_overrides("benchmark.seed=1,method.params.seed=2").startswith(
        "benchmark.seed=1,method.params.seed=2-"
    )
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
    assert job.job == f"toy-3methods-0.5+0.75-{job_name_from_overrides(dirname).rsplit('-', 1)[1]}"
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


def test_a_job_folder_of_the_key_value_name_is_resumed_there(tmp_path):
    """A job stopped under the name of the previous version keeps its folder and name: the rerun
    adds only the missing record, and no folder of the new name appears."""
    argv = [*THREE_METHODS, f"results_dir={tmp_path}"]
    (new,) = plan(argv)
    old_name = job_name_from_overrides(_override_dirname(argv))
    old = dataclasses.replace(new, job=old_name, job_dir=new.job_dir.parent / old_name)
    run_job(old, config_yaml_of(old, None))  # the job as the previous version ran it
    records = (old.job_dir / RECORDS).read_text().splitlines(keepends=True)
    assert len(records) == 5
    (old.job_dir / RECORDS).write_text("".join(records[:-1]))  # stopped before its last record
    (old.job_dir / DONE).unlink()

    (resumed,) = plan(argv)
    assert (resumed.job, resumed.job_dir) == (old_name, old.job_dir)
    assert run_job(resumed, config_yaml_of(resumed, None))["n_records"] == 5
    assert (old.job_dir / RECORDS).read_text().splitlines(keepends=True)[:4] == records[:4]
    assert (old.job_dir / DONE).is_file() and not new.job_dir.exists()


def test_a_folder_named_the_former_way_is_resumed(tmp_path):
    argv = [*TINY, f"results_dir={tmp_path}", "method.budget=0.25", "benchmark.n_samples=1"]
    (job,) = plan(argv)
    assert job.job_dir.name == job.job and "-" in job.job  # the new name when no folder exists yet
    former = tmp_path / job.experiment / former_job_name(_override_dirname(argv))
    former.mkdir(parents=True)
    (resumed,) = plan(argv)
    assert resumed.job_dir == former.resolve() and resumed.job == former.name
    job.job_dir.mkdir(parents=True)  # once the new folder exists, it is the one used
    (again,) = plan(argv)
    assert again.job_dir == job.job_dir


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
