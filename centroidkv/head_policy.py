"""The head policy: which (layer, KV head) pairs a method treats apart, and how; a wrapper around any
method (`centroidkv.wrapper`), so every compression method takes one (`get_method("snapkv",
heads="whole")`). `heads` is the policy:

  none:   every KV head is compressed by the method to the layer's budget B.
  whole:  the listed heads keep every entry and are never compressed (DuoAttention's retrieval heads,
          CentroidKV's outlier heads); the other heads are compressed to B.
  budget: every head is compressed by the method; the listed heads get `heads_boost` times the
          entries of the others (at most the full length), a two-tier version of AdaKV's per-head
          budgets: the listed heads get more, not everything.

Whatever a policy keeps counts inside the budget: in bytes, B is solved with the listed heads' entries
included (`CompressedCache`), so a policy changes where the bytes go, never how many there are.

The listed heads are the worst `heads_fraction` of all (layer, KV head) pairs by a calibrated score,
read from a head file (`centroidkv.calibrate`). `heads_file` names the score, or a file:

  clustering: (the default) the relative error of each head's attention output on dev essays when
              the head is clustered by CentroidKV's defaults (the paper's outlier heads). Measured with
              one method's compression, but one fixed list applied alike to every method, and on the
              embedded model the only list of the three that helps any method (docs/results.md);
  needle:     the attention mass the question puts on the answer's tokens in dev needle prompts: the
              retrieval heads, a property of the model, independent of any method;
  streaming:  the relative error of each head's attention output, on the same prompts, when it keeps
              only sinks and a recent window: DuoAttention's criterion, also method-independent;
  a path:     a JSON file written by `python -m eval.calibrate`.

A method sets the policy's parameters apart in its class's `wrapper_params` (CentroidKV: heads="whole";
DuoAttention: heads="whole" only, with the "streaming" score; kvpress: heads="none" only), and says
with `compares_calibration` whether a head file's recorded settings are compared with its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from centroidkv.calibrate import HEAD_SCORES
from centroidkv.files import is_file
from centroidkv.params import param
from centroidkv.wrapper import MethodWrapper, innermost, register_wrapper

HEAD_POLICIES = ("none", "whole", "budget")


def check_head_source(policy: str, head_file: str | Path) -> None:
    """One ValueError line for a head file that a policy would read and that is missing or malformed
    (the policy, the score's name or path, the fraction and the boost are rules of `HeadPolicy`'s
    fields)."""
    if policy != "none" and str(head_file) not in HEAD_SCORES:
        from centroidkv.calibrate import read_head_file

        read_head_file(head_file)  # a missing or malformed file fails here, with one line


def favoured_len(budget_len: int, boost: float, full_len: int) -> int:
    """Entries per listed head under the `budget` policy: boost x B, at most the full length."""
    return min(full_len, max(budget_len, math.ceil(boost * budget_len)))


def compressed_fraction(ratio: float, listed_fraction: float, boost: float = math.inf) -> float:
    """The share of its full length each other head keeps when a fraction `listed_fraction` of all KV
    heads is listed and keeps `boost` times as much (inf: everything, the `whole` policy), for a total
    of `ratio` of a full cache. An estimate that ignores per-entry records (used to check
    configurations before a model loads). Raises ValueError when the listed heads alone take the budget.
    """
    if listed_fraction == 0:
        return ratio
    if math.isfinite(boost) and boost * ratio / (1 - listed_fraction + boost * listed_fraction) <= 1:
        return ratio / (1 - listed_fraction + boost * listed_fraction)
    if listed_fraction >= ratio:
        raise ValueError(
            f"its heads kept whole alone take {listed_fraction:.1%} of a full cache's bytes, not less than "
            f"the budget {ratio:g}; raise the budget, keep fewer heads whole (heads_fraction), use "
            "heads=budget or budget_unit=entries"
        )
    return (ratio - listed_fraction) / (1 - listed_fraction)


def model_shape_or_none(model_name: str) -> tuple[int, int] | None:
    """(layers, KV heads) of a named model without loading it; None when unknown (a hub model not in
    the local cache, or a name the config validation reports on its own)."""
    from centroidkv.models.model_specs import model_shape

    try:
        return model_shape(model_name)
    except ValueError:
        return None


@register_wrapper
@dataclass
class HeadPolicy(MethodWrapper):
    """A method under a head policy (module docstring).

    Parameters:
      heads: "none", "whole" (the listed KV heads keep every entry) or "budget" (the listed heads keep
        `heads_boost` times the entries of the others).
      heads_file: which heads are listed: the model's calibration by a score, "clustering" (the
        output error under CentroidKV's clustering: the paper's outlier heads), "needle" (attention
        on the answer's tokens: retrieval heads), "streaming" (the output error of a streaming
        window: DuoAttention's criterion), or a file's path.
      heads_fraction: the worst fraction of all (layer, KV head) pairs that is listed.
      heads_boost: under heads=budget, the listed heads' entries over the others' (> 1).
    Every run records them, heads=none included.
    """

    depth = 20  # outside the storage precision: a calibration compares the settings inside it

    heads: str = param("none", choices=HEAD_POLICIES)
    heads_file: str = param("clustering", reason=f"{' or '.join(HEAD_SCORES)} or a path")
    heads_fraction: float = param(0.04, minimum=0.0, maximum=1.0)
    heads_boost: float = param(4.0, minimum=1, low_open=True)

    def validate(self) -> None:
        """The rules, then the head file a path names (read once: a missing or malformed file is one
        line), then a policy on a method that does not compress."""
        super().validate()
        check_head_source(self.heads, self.heads_file)
        if self.heads != "none" and not self.method.compresses:
            raise ValueError(f"{self.method.name}: a head policy needs a method that compresses (heads=none)")

    @property
    def lists_heads(self) -> bool:
        """Whether the policy lists any head (a policy, a fraction above 0, a method that compresses)."""
        return self.heads != "none" and self.heads_fraction > 0 and self.method.compresses

    @property
    def listed_whole(self) -> bool:
        """Whether the listed heads keep every entry (heads=whole), else `heads_boost` x B (budget)."""
        return self.heads == "whole"

    @property
    def listed_boost(self) -> float:
        """How many times the entries of the other heads a listed head keeps (inf: every entry)."""
        return math.inf if self.listed_whole else self.heads_boost

    def head_file(self, model_name: str) -> Path | None:
        """The head file this policy reads on `model_name`: its path, or for a score the user's
        calibration, else the package's, else the user's file that calibration would write; None when
        no head is listed (heads=none, a fraction of 0, or one that rounds to no head of the model)."""
        if not self.lists_heads:
            return None
        shape = model_shape_or_none(model_name)
        if shape is not None and round(self.heads_fraction * shape[0] * shape[1]) == 0:
            return None
        from centroidkv.calibrate import head_file_for, user_head_file

        if str(self.heads_file) not in HEAD_SCORES:
            return Path(self.heads_file)
        return head_file_for(model_name, self.heads_file) or user_head_file(model_name, self.heads_file)

    def check_model(self, model_name: str) -> None:
        """Raise ValueError when the method cannot run on `model_name` (checked by the runner's config
        validation, before any model loads): the wrapped method's checks, then a head file calibrated
        on another model, or for another shape (layers x KV heads, when known without loading it)."""
        from centroidkv.calibrate import check_head_file, read_head_file

        self.method.check_model(model_name)
        explicit = self.heads != "none" and str(self.heads_file) not in HEAD_SCORES
        path = self.head_file(model_name)
        if path is not None and (explicit or is_file(path)):  # a score without a file: calibrated on load
            check_head_file(path, read_head_file(path), model_name, model_shape_or_none(model_name))

    def check_calibrated(self, model_name: str) -> None:
        """Before `model_name` is installed, converted or loaded: `CalibrationMissing` (one line) when
        the policy needs a head file of it that is not there. A model whose shape is not known without
        loading it (`centroidkv.models.model_specs.model_shape`) is checked when it loads instead."""
        from centroidkv.calibrate import needed_head_file
        from centroidkv.models.model_specs import model_shape

        shape = model_shape(model_name)
        if self.lists_heads and shape is not None:
            needed_head_file(model_name, shape, self.heads_file, self.heads_fraction)

    def identity_fields(self, model_name: str) -> dict[str, Any]:
        """What, beyond its parameters, decides the method's numbers on `model_name` (the wrapped
        method's, and here the head file the policy reads with its content hash, `heads_file_read`: a
        user calibration written later changes what a score reads, so it changes the identity)."""
        fields = self.method.identity_fields(model_name)
        path = self.head_file(model_name)
        if path is None:
            return fields
        from centroidkv.calibrate import head_file_identity

        return {**fields, "heads_file_read": head_file_identity(path)}

    def listed_fraction(self, model_name: str) -> float:
        """The fraction of `model_name`'s KV heads the policy lists, known before the model loads (the
        runner refuses a byte budget these heads alone would exceed). 0 when none is listed, or when
        a score has no file yet: the runner calibrates it when the model loads."""
        path = self.head_file(model_name)
        if path is None or not is_file(path):
            return 0.0
        from centroidkv.calibrate import read_head_file, worst_heads

        data = read_head_file(path)
        listed = sum(len(heads) for heads in worst_heads(data["errors"], self.heads_fraction).values())
        return listed / (data["n_layers"] * data["n_kv_heads"])

    def listed_heads(self, model) -> dict[int, list[int]]:
        """KV heads, per layer index, that the policy lists (kept whole under heads=whole, given more
        entries under heads=budget); called once when a cache first compresses on `model`, so it only
        reads a file, never runs the model (`centroidkv.calibrate.CalibrationMissing`). A method that
        `compares_calibration` has the parameters inside the policy compared with the file's."""
        if not self.lists_heads:
            return {}
        from centroidkv.calibrate import listed_heads_for

        settings = None
        if innermost(self).compares_calibration:  # the run's parameters but the policy's
            settings = {k: v for k, v in self.method.params().items() if k not in self.parameter_names()}
        return listed_heads_for(model, self.heads_file, self.heads_fraction, settings)
