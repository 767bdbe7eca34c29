"""Job folder names: `<benchmark>-<method or N methods>-<budgets>-<hash of the override string>`
(`job_name`), and a validated run named by its command line's overrides (`named_job`)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from centroidkv.parsing import split_top_level
from eval.run_config import MethodSpec, RunConfig

# Folders named the ways of versions before 2026-12 are not resumed (a new folder starts).
JOB_HASH_CHARS = 6
JOB_PART_CHARS = 40  # a variant's name or the budgets, cut past this (the hash tells them apart)


def split_overrides(override_dirname: str) -> list[str]:
    """Hydra's override_dirname (`a=1,b=[x,y]`) split at its top-level commas into overrides."""
    return split_top_level(override_dirname)


def _safe(text: str) -> str:
    """Filesystem-safe: list brackets and quotes dropped, commas inside a value as +, the rest _."""
    text = re.sub(r"[\[\]{}()'\"\s]", "", text).replace(",", "+")
    return re.sub(r"[^A-Za-z0-9._@+-]", "_", text)


def override_hash(override_dirname: str) -> str:
    """JOB_HASH_CHARS hex digits of the override string: the same overrides, the same hash."""
    return hashlib.sha1(override_dirname.strip().encode()).hexdigest()[:JOB_HASH_CHARS]


def job_name(benchmark: str, methods: tuple[MethodSpec, ...], override_dirname: str) -> str:
    """A job's folder name, short and stable: `<benchmark>-<methods>-<budgets>-<hash>`, e.g.
    `ruler-3methods-0.25+0.5-706c2b` or `toy-snapkv-0.5-1a2b3c`.

    <methods> is the variant's name when the job has one, else the number of variants; <budgets> the
    budgets of the methods that compress, joined by `+` (left out when only the full cache runs);
    <hash> is the hash of the whole override string (`override_hash`), so jobs of other overrides
    never share a name and the same overrides always give the same one. The overrides themselves are
    in the folder's config.yaml (`overrides`).
    """
    variants = list(dict.fromkeys(spec.variant for spec in methods))
    shown = _safe(variants[0])[:JOB_PART_CHARS] if len(variants) == 1 else f"{len(variants)}methods"
    references = _references(methods)
    budgets = sorted({spec.budget for spec in methods if spec.variant not in references})
    parts = [_safe(benchmark)[:JOB_PART_CHARS], shown]
    if budgets:
        parts.append("+".join(f"{budget:g}" for budget in budgets)[:JOB_PART_CHARS].rstrip("+"))
    return "-".join([*parts, override_hash(override_dirname)])


def _references(methods: tuple[MethodSpec, ...]) -> set[str]:
    """The variants that do not compress (the full cache: one reference run at 1.0, whatever the budgets)."""
    from centroidkv.methods import method_class

    return {spec.variant for spec in methods if not method_class(spec.name).compresses}


def named_job(cfg: RunConfig, override_dirname: str) -> RunConfig:
    """`cfg` named by its overrides (`job_name`), in its experiment's folder, with the overrides kept
    (`RunConfig.overrides`, saved in config.yaml)."""
    name = job_name(cfg.benchmark.name, cfg.methods, override_dirname)
    experiment_dir = cfg.job_dir.parent
    return replace(
        cfg,
        job=name,
        job_dir=experiment_dir / name,
        overrides=tuple(split_overrides(override_dirname.strip())),
    )
