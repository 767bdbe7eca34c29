"""Job folder names: short readable key=value pairs plus a hash of the whole override string; folders
named the former way (the override string itself) are still found, so their jobs resume."""

from __future__ import annotations

import re

from eval.config import former_job_name, job_name_from_overrides, split_overrides
from eval.sweep import plan

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
    assert [name.rsplit("-", 1)[0] for name in names] == [
        "n_samples=1,benchmark=toy,budget=0.25,model=tiny-llama",  # Hydra's order: by the full key
        "n_samples=1,benchmark=toy,budget=0.5,model=tiny-llama",
    ]
    assert len(set(names)) == 2 and all(job.job_dir.name == job.job for job in jobs)


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
