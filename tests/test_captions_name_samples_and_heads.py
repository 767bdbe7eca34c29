"""Captions are written by the code (issue 54, item 6): every table that `make published` writes
names, in its Markdown and its LaTeX, the model, the context length, the samples behind each cell and
each method's head policy; the figure titles name the head policy too."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.compact_records import expand, main
from scripts.reports.figures import _subtitle
from scripts.reports.tables import load

ROOT = Path(__file__).resolve().parent.parent
HEADS = ROOT / "results" / "heads.jsonl.gz"  # the head-policy factorial: every policy in one experiment


def test_every_generated_table_caption_names_model_length_samples_and_head_policy(tmp_path):
    """The wrong-answer counts of multikey tasks too (the heads factorial and the 8k study have them)."""
    for compact, model in ((HEADS, "smollm2-135m"), (ROOT / "results" / "tiny_example.jsonl.gz", "tiny-llama"),
                           (ROOT / "results" / "long_study_8k.jsonl.gz", "qwen2.5-0.5b")):  # fmt: skip
        out = tmp_path / compact.name
        assert main(["tables", str(compact), "--out", str(out), "--no-figures"]) == 0
        tables = sorted(out.glob("*.md"))
        assert tables
        if model != "tiny-llama":  # multikey tasks: their wrong-answer counts are a table too
            assert out / "wrong_answers.md" in tables
        for table in tables:
            caption = table.read_text().splitlines()[0]
            latex = re.search(r"\\caption\{(.*)\}", table.with_suffix(".tex").read_text()).group(1)
            for text in (caption, latex):
                assert re.search(r"\d+ samples? per (task )?cell", text), (table.name, text)
                assert "head policy: " in text and "context " in text, (table.name, text)
                assert model in text, (table.name, text)


def test_the_head_policy_words_name_each_policy_with_its_methods(tmp_path):
    df = load(expand(HEADS, tmp_path))
    budget = df[(df["budget"] == 0.125) | (df["method"] == "full")]
    title = _subtitle(budget)
    assert "smollm2-135m, context 4k tokens, 5 samples per task cell, 25 per average" in title, title
    policies = " ".join(title.splitlines()[1:])
    assert policies.startswith("head policy: whole for centroidkv-whole, kmeans-whole"), policies
    assert "budget for centroidkv-budget" in policies and policies.endswith("none for the others")
