"""Run a model x compression method(s) x benchmark job (Hydra): `python scripts/run.py [overrides]`.

Examples:
  python scripts/run.py experiment=reproduce_ruler_cpu
  python scripts/run.py -m method=centroidkv,snapkv method.budget=0.25,0.5 benchmark.n_samples=5
  python scripts/run.py model=tiny-llama benchmark=toy logger=none

The composed config is validated into typed objects first; each bad value prints one line on stderr
and the process exits with code 2 before any model loads or any file is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from eval.config import ConfigError, build_run_config, job_name_from_overrides, store_configs  # noqa: E402

store_configs()  # method=<name> for every registered method, from its dataclass defaults


@hydra.main(config_path=str(ROOT / "configs"), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job = job_name_from_overrides(HydraConfig.get().job.override_dirname)
    try:
        run_cfg = build_run_config(cfg, job)
    except ConfigError as error:
        for line in error.lines:
            print(f"config error: {line}", file=sys.stderr)
        sys.exit(2)
    from eval.runner import SetupError, config_yaml_of, run_job

    try:
        summary = run_job(run_cfg, config_yaml_of(run_cfg, cfg))
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    if summary is not None:
        print(f"[done] {run_cfg.job_dir} ({summary['n_records']} records, {summary['n_failed']} failed)")


if __name__ == "__main__":
    main()
