"""Weights & Biases logging: one run per job, offline unless the user has configured W&B.

`logger=none` gives a logger that does nothing. With `logger=wandb` (default, `mode: auto`) the run
is online only when W&B is configured (WANDB_API_KEY, or `wandb login` credentials in ~/.netrc) and
WANDB_MODE does not say otherwise; it is offline otherwise, so nothing ever needs the network. The
run directory is `<job_dir>/wandb/`; `wandb sync` uploads an offline run later.
"""

from __future__ import annotations

import hashlib
import netrc
import os
from pathlib import Path
from typing import Any

from centroidkv.plan.measurements import table_measurements
from eval.run_config import RunConfig

# The samples table: who and what, then every table measurement (`centroidkv.plan.measurements`).
RECORD_COLUMNS = ("task", "sample_id", "method", "variant", "budget", "status", "score")


def table_columns() -> list[str]:
    return [*RECORD_COLUMNS, *(m.name for m in table_measurements()), "prediction"]


class NullLogger:
    def log_record(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
        pass


def wandb_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str) -> str:
    """offline / online from the logger config, the environment and the user's W&B credentials."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("offline", "online", "disabled"):
        return env
    return "online" if wandb_configured() else "offline"


class WandbLogger:
    """Per-record metrics as steps, a per-sample table and the summary at the end."""

    def __init__(self, cfg: RunConfig, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.step = 0
        directory = Path(cfg.job_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logger.project,
            group=cfg.experiment,
            name=f"{cfg.experiment}/{cfg.job}",
            job_type=cfg.benchmark.name,
            dir=str(directory),
            config=config,
            mode=resolve_mode(cfg.logger.mode),
            # One W&B run per job: a resumed job continues its run (online) instead of starting another.
            id=hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:16],
            resume="allow",
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log_record(self, record: dict[str, Any]) -> None:
        prefix = f"{record['task']}/{record.get('variant') or record['method']}@{record['budget']:g}"
        names = ["score", *(m.name for m in table_measurements())]
        metrics = {f"{prefix}/{k}": record[k] for k in names if record.get(k) is not None}
        metrics["failed"] = int(record["status"] != "ok")
        self.run.log(metrics, step=self.step)
        self.step += 1

    def finish(self, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
        columns = table_columns()
        table = self.wandb.Table(columns=columns)
        for record in records:
            table.add_data(*[_cell(record.get(column)) for column in columns])
        self.run.log({"samples": table}, step=self.step)
        for key, value in summary.items():
            self.run.summary[key] = value
        self.run.finish()


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) or value is None else str(value)


def make_logger(cfg: RunConfig, config: dict[str, Any]) -> NullLogger | WandbLogger:
    if cfg.logger.name == "none":
        return NullLogger()
    return WandbLogger(cfg, config)
