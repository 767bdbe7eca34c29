"""Run a model x compression method(s) x benchmark job (Hydra): `python scripts/run.py [overrides]`.

Examples:
  python scripts/run.py experiment=reproduce_ruler_cpu
  python scripts/run.py -m method=centroidkv,snapkv method.budget=0.25,0.5 benchmark.n_samples=5
  python scripts/run.py model=tiny-llama benchmark=toy logger=none
  python scripts/run.py ... --force      # the same as overwrite=true: start a job folder again

Before any job runs, the whole command line is validated (every job of a sweep, Hydra's own errors
included) and every job folder is checked: each problem prints one line on stderr and the process
exits with code 2, before any model loads or any file is written. A job exits with code 2 when
another run holds its folder, and 1 when it could not load its model or data, could not write its
results, or none of its records succeeded.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from eval.config import build_run_config, store_configs  # noqa: E402
from eval.job_names import named_job  # noqa: E402
from eval.run_config import ConfigError, RunConfig  # noqa: E402

store_configs()  # method=<name> and benchmark=<name> for every registered one, from their dataclasses


@hydra.main(config_path=str(ROOT / "configs"), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    overrides = HydraConfig.get().job.override_dirname
    try:
        run_cfg = named_job(build_run_config(cfg), overrides)
    except ConfigError as error:
        for line in error.lines:
            print(f"config error: {line}", file=sys.stderr)
        sys.exit(2)
    from eval.records import JobError

    try:
        if not skipped_as_finished(run_cfg):
            from eval.runner import config_yaml_of, run_job  # imports torch: only for a job that runs

            summary = run_job(run_cfg, config_yaml_of(run_cfg, cfg))
            if summary is not None:
                dropped = summary.get("n_dropped_lines", 0)
                print(
                    f"[done] {run_cfg.job_dir} ({summary['n_records']} records, {summary['n_failed']} failed"
                    + (f", {dropped} torn or corrupt lines dropped" if dropped else "")
                    + ")"
                )
        remember_if_finished(run_cfg, cfg, overrides)
    except JobError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


def skipped_as_finished(run_cfg: RunConfig) -> bool:
    """A finished job (its done.json) under the same identity is skipped before torch is imported
    (the runner checks again under the job's lock); another identity raises the runner's JobError."""
    from eval.job_store import JobStore
    from eval.records import finished_message

    store = JobStore(run_cfg.job_dir)
    if not store.skipped_as_finished(run_cfg.overwrite):
        return False
    store.check_identity(run_cfg.identity())
    print(finished_message(run_cfg.job_dir))
    return True


def remember_if_finished(run_cfg: RunConfig, cfg: DictConfig, overrides: str) -> None:
    """A job found finished under this config's identity (just run, or skipped) keeps the key that
    lets the same command line skip it before torch is imported (`eval.finished_jobs`)."""
    from eval.finished_jobs import plain_config, remember
    from eval.job_store import JobStore
    from eval.records import JobError

    store = JobStore(run_cfg.job_dir)
    if not store.skipped_as_finished(run_cfg.overwrite):
        return
    try:
        store.check_identity(run_cfg.identity())
    except JobError:
        return
    remember(run_cfg.job_dir, plain_config(cfg), overrides, run_cfg.model.resolved()[0])


def hydra_argv(argv: list[str]) -> list[str]:
    """The command line as Hydra reads it: `--force` is the override `overwrite=true`, and
    `model=<anything but a registered name>` (a folder, a .gguf file, a Hub id, random-*:N) is
    `model.name=<it>`: Hydra's model options are the registered names."""
    from centroidkv.models.model_names import MODEL_NAMES

    def read(arg: str) -> str:
        if arg == "--force":
            return "overwrite=true"
        key, equals, value = arg.partition("=")
        if key in ("model", "+model", "++model") and equals and value not in MODEL_NAMES and "," not in value:
            return f"model.name={value}"
        return arg

    return [read(arg) for arg in argv]


def cli(argv: list[str]) -> None:
    """Validate the whole command line, then hand it to Hydra."""
    from eval.records import finished_message
    from eval.sweep import FinishedJobs, multirun_notice, plan

    argv = hydra_argv(argv)
    try:
        jobs = plan(argv, skip_finished=True)
    except FinishedJobs as finished:  # each job's key says what its full check would (eval.finished_jobs)
        for job_dir in finished.job_dirs:
            print(finished_message(job_dir))
        return
    except ConfigError as error:
        for line in error.lines:
            print(f"config error: {line}", file=sys.stderr)
        sys.exit(2)
    notice = multirun_notice(argv, len(jobs or []))
    if notice:
        print(notice, flush=True)
    sys.argv = [sys.argv[0], *argv]
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
