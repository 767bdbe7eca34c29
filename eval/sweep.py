"""Validate a whole command line (one job or a Hydra sweep) before any job runs.

`plan(argv)` composes every job the command line describes, the way Hydra will (the basic sweeper's
cartesian product of the sweep overrides, the launcher's per-job composition), validates each into a
RunConfig, and checks each job's results folder (writable, room for the records, no records of
another config) and that no two jobs share a folder. Hydra's own errors (an unknown config group, a
key that does not exist, a malformed override) become one line, like every other config error.

A job folder can still be taken by another run after that check, while the sweep is launching. The
submitit launchers (`hydra/launcher=submitit_local`, `submitit_slurm` and configs built on them) run
as `SweepJobs` (below): a job that stops on an error (its folder locked) sends its one line to the
sweep, which prints it as the job ends; the sweep lets its other jobs finish normally (their records
whole, the jobs done: no work lost, no process left running), then exits with the highest exit code
of its jobs (2 for a locked folder).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from centroidkv.errors import first_line
from eval.config import CONFIG_DIR, build_run_config, first_pass_errors, store_configs
from eval.finished_jobs import finished_by_key, plain_config
from eval.job_names import named_job
from eval.job_store import JobStore
from eval.records import JobError, check_results_folder
from eval.run_config import ConfigError, RunConfig
from eval.schema import config_schema

try:  # optional: pip install -e ".[slurm]"
    from hydra_plugins.hydra_submitit_launcher import config as submitit_config
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:
    submitit_config = submitit_launcher = None

INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


def multirun_notice(argv: list[str], n_jobs: int) -> str | None:
    """The first line of a multirun whose jobs differ in their method or budget: each job loads the
    model and prefills every sample again, which one job with `methods=[...] budgets=[...]` shares."""
    swept = [
        arg.split("=", 1)[0].lstrip("+~")
        for arg in argv
        if "=" in arg and "," in arg.split("=", 1)[1] and not arg.split("=", 1)[1].lstrip().startswith("[")
    ]
    by_method = [key for key in swept if key in ("method", "methods", "budgets") or key.startswith("method.")]
    if n_jobs < 2 or not by_method:
        return None
    return (
        f"[multirun] {n_jobs} jobs over {', '.join(by_method)}: each job loads the model and prefills every "
        "sample again; one job with methods=[...] budgets=[...] shares both (README, Running experiments)"
    )


class FinishedJobs(Exception):
    """Every job of the command line is finished under its identity, known before torch is imported
    (`eval.finished_jobs`): `job_dirs`, in Hydra's order."""

    def __init__(self, job_dirs: list[Path]):
        super().__init__(", ".join(map(str, job_dirs)))
        self.job_dirs = job_dirs


def plan(argv: list[str], skip_finished: bool = False) -> list[RunConfig] | None:
    """The validated jobs of a `scripts/run.py` command line, in Hydra's order; None when the command
    line only asks Hydra for information (--help, --cfg, ...). Raises ConfigError (one line each), and
    with `skip_finished` FinishedJobs when every job is known finished before any method is built."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path, get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode

    store_configs()
    use_sweep_launchers()
    args = get_args_parser().parse_args(argv)
    if any(getattr(args, flag, None) for flag in INFO_FLAGS):
        return None
    config_name = args.config_name or "config"
    # --config-path is relative to the script that declares @hydra.main (scripts/run.py), as in Hydra
    config_path = CONFIG_DIR if args.config_path is None else CONFIG_DIR.parent / "scripts" / args.config_path
    search_path = create_config_search_path(str(config_path.resolve()))
    if args.config_dir:
        from hydra.core.config_search_path import SearchPathQuery

        search_path.prepend(
            "command-line", f"file://{os.path.abspath(args.config_dir)}", SearchPathQuery("schema")
        )
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="run", config_search_path=search_path)
    try:
        jobs = _job_overrides(hydra, config_name, args.overrides, args.multirun, RunMode)
        composed = []
        for overrides in jobs:
            cfg = hydra.compose_config(
                config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False
            )
            dirname = cfg.hydra.job.override_dirname
            with open_dict(cfg):
                del cfg["hydra"]  # its interpolations only resolve inside a running job
            composed.append((cfg, dirname))
        if skip_finished:
            _raise_if_finished(composed)
        configs = _validated(jobs, composed)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as error:  # Hydra's own, one line
        line = hydra_error_line(error)
        hint = _key_hint(hydra, config_name, args.overrides, line)
        raise ConfigError([f"{line}; {hint}" if hint else line]) from None
    finally:
        GlobalHydra.instance().clear()
    check_job_folders(configs)
    return configs


def _raise_if_finished(composed: list[tuple[Any, str]]) -> None:
    """FinishedJobs when the key a full check left in each job's folder is this config's."""
    found = [finished_by_key(plain_config(cfg), dirname) for cfg, dirname in composed]
    if found and all(found):
        raise FinishedJobs([job_dir for job_dir in found if job_dir is not None])


def _validated(jobs: list[list[str]], composed: list[tuple[Any, str]]) -> list[RunConfig]:
    """Every composed job validated (its first pass before torch is imported, for all jobs first);
    ConfigError with every line, each naming its job in a multirun."""
    swept = _swept(jobs)

    def where(index: int) -> str:
        return f"job {index} ({','.join(o for o in jobs[index] if o in swept)}): " if len(jobs) > 1 else ""

    schema = config_schema()
    errors = [
        f"{where(index)}{line}"
        for index, (cfg, _) in enumerate(composed)
        for line in first_pass_errors(cfg, schema)
    ]
    if errors:
        raise ConfigError(errors)
    configs = []
    for index, (cfg, dirname) in enumerate(composed):
        try:
            configs.append(named_job(build_run_config(cfg, schema=schema), dirname))
        except ConfigError as error:
            errors.extend(f"{where(index)}{line}" for line in error.lines)
    if errors:
        raise ConfigError(errors)
    return configs


def _job_overrides(
    hydra, config_name: str, overrides: list[str], multirun: bool, run_mode
) -> list[list[str]]:
    """The overrides of each job: the command line itself, or the sweep's jobs (basic sweeper); none
    for a sweeper that picks its jobs as it runs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    mode = hydra.get_mode(config_name=config_name, overrides=overrides)
    if not (multirun or mode == run_mode.MULTIRUN):
        return [list(overrides)]
    master = hydra.compose_config(
        config_name, overrides, run_mode=run_mode.MULTIRUN, with_log_configuration=False
    )
    sweeper = OmegaConf.select(master, "hydra.sweeper._target_") or ""
    if not sweeper.endswith("BasicSweeper"):  # e.g. an optimiser that picks each job's values as it goes
        print(
            f"[sweep] {sweeper} chooses its jobs while it runs: each is validated as it starts",
            file=sys.stderr,
        )
        return []
    params = [
        f"{key}={value}" for key, value in (OmegaConf.select(master, "hydra.sweeper.params") or {}).items()
    ]
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(
        [*params, *master.hydra.overrides.task]
    )
    hydra_overrides = list(master.hydra.overrides.hydra)
    return [[*hydra_overrides, *job] for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _swept(jobs: list[list[str]]) -> set[str]:
    """The overrides that differ between jobs (what names a job of a sweep)."""
    everywhere = set.intersection(*(set(job) for job in jobs)) if jobs else set()
    return {override for job in jobs for override in job} - everywhere


def check_job_folders(configs: list[RunConfig]) -> None:
    """Raise ConfigError unless every job has its own folder, writable, with room, not being run by
    another live run, free of another config's records (an `overwrite` job will set those aside). A
    job a run will skip as finished needs no write: only its identity is checked."""
    errors: list[str] = []
    seen: dict[Path, int] = {}
    for index, cfg in enumerate(configs):
        if cfg.job_dir in seen:
            errors.append(
                f"jobs {seen[cfg.job_dir]} and {index} would both write {cfg.job_dir}: make them differ in a key "
                "that names the job folder (excluded keys such as experiment_name or results_dir do not)"
            )
            continue
        seen[cfg.job_dir] = index
        try:
            if not JobStore(cfg.job_dir).skipped_as_finished(cfg.overwrite):  # finished: no write
                check_results_folder(cfg.job_dir, cfg.needed_bytes)
                JobStore(cfg.job_dir).check_not_running()  # one line per locked job, before any job starts
            if not cfg.overwrite:
                JobStore(cfg.job_dir).check_identity(cfg.identity())
        except JobError as error:
            errors.append(str(error))
    if errors:
        raise ConfigError(errors)


def hydra_error_line(error: BaseException) -> str:
    """One line for a Hydra or OmegaConf error: its first line, with what it names (the options of a
    config group, the key that does not exist)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first, detail = lines[0], None
    heading = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
    cause = error.__cause__ or error.__context__
    if heading is not None:  # an unknown config group option: list the options
        options = lines[heading + 1 :]
        options = options[
            : next((i for i, o in enumerate(options) if o.startswith("Config search path")), None)
        ]
        detail = f"available: {', '.join(options)}"
    elif cause is not None and str(cause).strip():  # e.g. Key 'x' is not in struct
        detail = first_line(cause)
    elif first.startswith("Could not override"):
        detail = "no such key"
    return f"{first} ({detail})" if detail else first


def _key_hint(hydra, config_name: str, overrides: list[str], line: str) -> str:
    """`did you mean ...?` when Hydra refused an override for a key that does not exist: the closest
    keys of the config composed without that override (`eval.schema.suggestion`)."""
    import re

    from hydra.types import RunMode

    from eval.schema import known_keys, missing_param_hint, suggestion

    found = re.match(r"Could not override '([^']+)'", line)
    if found is None:
        return ""
    key = found.group(1)
    given = [o for o in overrides if o.lstrip("+~").partition("=")[0] == key]
    value = given[0].partition("=")[2] if given else None
    rest = [o for o in overrides if o not in given]
    try:
        cfg = hydra.compose_config(config_name, rest, run_mode=RunMode.RUN, with_log_configuration=False)
        root = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # the rest has its own error: no hint
        return ""
    root.pop("hydra", None)
    schema = config_schema()
    return missing_param_hint(key, schema, root) or suggestion(key, value, known_keys(schema, root))


# ------------------------------------------------------------------------------ submitit launchers
@dataclass
class JobExit:
    """What a job of a submitit sweep returns instead of exiting (sys.exit) with an error code: the code
    and the lines the job printed for it (sent to the sweep, which prints them)."""

    code: int
    lines: list[str]


def error_lines(error: BaseException | None) -> list[str]:
    """The lines scripts/run.py prints for the error a job exits on (empty for any other exit)."""
    if isinstance(error, ConfigError):
        return [f"config error: {line}" for line in error.lines]
    if isinstance(error, JobError):
        return [f"error: {error}"]
    return []


class SweepJobs:
    """Mixin for the submitit plugin's launchers: no job of a sweep fails the sweep with a traceback or
    outlives it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one job (in the job's own process); an exit with an error code becomes a JobExit result.
        scripts/run.py exits while it handles the job's JobError or ConfigError, which Python keeps as
        the exit's __context__."""
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as stop:
            if not stop.code:
                raise
            code = stop.code if isinstance(stop.code, int) else 1
            return JobExit(code, error_lines(stop.__context__))

    def launch(self, job_overrides, initial_job_idx: int) -> list[Any]:
        """Submit the jobs as the plugin does, then wait for every one of them, printing the lines of
        each job that stopped with an error as it ends. Exits with the highest code when any did; an
        interrupted wait (Ctrl-C) cancels the unfinished jobs and waits for them to end."""
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobStatus, filter_overrides

        executor = self._executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        submitit_launcher.log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        for i, overrides in enumerate(job_overrides):
            submitit_launcher.log.info(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(overrides))}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        arguments = [
            (list(overrides), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
             Singleton.get_state())
            for i, overrides in enumerate(job_overrides)
        ]  # fmt: skip
        jobs = executor.map_array(self, *zip(*arguments))
        results: dict[int, Any] = {}
        try:
            for job in submitit.helpers.as_completed(jobs, poll_frequency=0.5):
                index = next(i for i, submitted in enumerate(jobs) if submitted is job)
                results[index] = result = _result_of(job)
                if isinstance(result, JobExit):
                    where = (
                        f"job {initial_job_idx + index} ({' '.join(filter_overrides(job_overrides[index]))})"
                    )
                    for line in result.lines or [f"error: {where} exited with code {result.code}"]:
                        print(line, file=sys.stderr, flush=True)
        finally:
            _stop(jobs)  # only an interrupted wait leaves any: they end before the sweep does
        ordered = [results[index] for index in range(len(jobs))]
        codes = [result.code for result in ordered if isinstance(result, JobExit)]
        if codes:
            for index, result in enumerate(ordered):
                if getattr(result, "status", None) == JobStatus.FAILED:  # an exception, not an exit
                    error = result._return_value
                    print(f"error: job {initial_job_idx + index} raised {type(error).__name__}: {error}",
                          file=sys.stderr)  # fmt: skip
                    codes.append(1)
            sys.exit(max(codes))
        return ordered

    def _executor(self):
        """The plugin's executor for this launcher's parameters (as the plugin's own launch builds it)."""
        import submitit

        init_keys = {"max_num_timeout"}
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=self.params["submitit_folder"],
            **{f"{self._EXECUTOR}_{key}": value for key, value in self.params.items() if key in init_keys},
        )
        base_keys = set(OmegaConf.structured(submitit_config.BaseQueueConf).keys())
        executor.update_parameters(
            **{
                key if key in base_keys else f"{self._EXECUTOR}_{key}": value
                for key, value in self.params.items()
                if key not in init_keys | {"submitit_folder"}
            }
        )
        return executor


def _result_of(job) -> Any:
    """A finished job's result: its JobReturn, or a JobExit (also for a job killed before it returned)."""
    from submitit.core.utils import UncompletedJobError

    try:
        return job.results()[0]
    except UncompletedJobError:
        return JobExit(
            1, [f"error: job {job.job_id} ended without a result (killed?); its log: {job.paths.stderr}"]
        )


def _stop(jobs: list) -> None:
    """Cancel the jobs still running and wait until they have ended."""
    unfinished = [job for job in jobs if not job.done()]
    for job in unfinished:
        job.cancel(check=False)
    for job in unfinished:
        job.wait()


# Our launchers (SweepJobs), by the `_target_` Hydra instantiates them from: the module that defines
# them imports this one, and this one names them only (no import back: the layers import downwards).
SWEEP_LAUNCHERS_MODULE = "hydra_plugins.centroidkv_launchers.sweep_launchers"
SWEEP_LAUNCHERS = {"submitit_local": "LocalLauncher", "submitit_slurm": "SlurmLauncher"}


def use_sweep_launchers() -> None:
    """Point the submitit plugin's launcher configs at our launchers (`SWEEP_LAUNCHERS`, SweepJobs;
    Hydra takes launchers only from the hydra_plugins package, hence hydra_plugins/centroidkv_launchers,
    which Hydra imports when it instantiates one). Hydra's plugin scan (once per process) stores the
    plugin's own configs: ours replace them after it."""
    if submitit_launcher is None:
        return
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the plugin scan
    for name, schema in (
        ("submitit_local", submitit_config.LocalQueueConf),
        ("submitit_slurm", submitit_config.SlurmQueueConf),
    ):
        target = f"{SWEEP_LAUNCHERS_MODULE}.{SWEEP_LAUNCHERS[name]}"
        ConfigStore.instance().store(
            group="hydra/launcher", name=name, node=schema(_target_=target), provider="centroidkv"
        )
