"""The library behind the report command lines (`scripts/tables.py`, `scripts/figures.py`,
...): tables, figures, rankings and captions from records."""
