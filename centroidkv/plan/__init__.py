"""Running prompts: one plan per prompt (`plan`: `run`, `warm_up`), prefill and decoding (`decoding`),
their timing, the measurements every run records, the prefill store, and the options that configure
them. Importing this package imports nothing heavy."""
