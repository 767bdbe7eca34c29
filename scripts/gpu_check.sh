#!/usr/bin/env bash
# GPU check: the paper's speed and memory claims on any CUDA GPU with >= 40 GB (an 8B model in bf16
# plus a 64k cache), written into one new folder: summary.md (tables, beside the paper's figures),
# results.json and log.txt. On one H200 it took 223 s (2026-12-04; its tables are in docs/speed.md).
# What it runs: scripts/gpu_check.py (TPOT full vs CentroidKV 0.25 at 16k/32k/64k on random-llama3.1-8b
# in bf16 (seeded random weights of the paper's shape: no Hub access or gated download needed), peak
# GPU memory, compression time per call, CSM vs K-Means at 32k, FlexAttention/flash-attn vs the
# reference, the throughput table).
#
# Install: on a machine with internet, `make setup` (or `pip install -e .` beside a CUDA build of
# torch; `pip install -e ".[gpu]"` adds flash-attn where a wheel matches your torch and CUDA).
#
#   scripts/gpu_check.sh [OUTPUT_DIR]            # default OUTPUT_DIR: $OUT or gpu_check_out; it must be
#                                                # new or empty: earlier results are never replaced
#   scripts/gpu_check.sh --dry-run [OUTPUT_DIR]  # the same code at tiny sizes on a CPU (tests run this)
#   scripts/gpu_check.sh OUTPUT_DIR --only tpot_memory   # some sections alone (gpu_check.py --help)
#
# Before anything runs, the script checks that every module the check imports is importable and exits
# with code 2 and the list of what is missing (and how to bring it) otherwise.
#
# One case: a GPU machine without internet, with its own PyTorch and transformers. Use the project from
# the working tree (PYTHONPATH, not installed) and bring what the machine lacks as wheels:
#   1. on a machine with internet, in the repository root, once:
#        echo /.whl/ >> .git/info/exclude
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#          -d .whl NAME==VERSION
#      e.g. transformers==5.2.0 (pure Python) to run with the version this project pins instead of the
#      machine's; flash-attn (the `gpu` extra) only where a wheel matches the machine's torch and CUDA.
#   2. copy the repository with `.whl` to the GPU machine; this script installs every .whl/*.whl into
#      /tmp/centroidkv-site (--no-index --no-deps) and puts it first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=(--dry-run); shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
if [[ $# -gt 0 ]]; then shift; fi  # what follows goes to gpu_check.py (e.g. --only tpot_memory)
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python && ${#DRY_RUN[@]} -gt 0 ]] && echo .venv/bin/python || echo python3 )}"

# A run never replaces an earlier run's results: the output folder must be new or empty.
if [[ -d "$OUT_DIR" && -n "$(ls -A "$OUT_DIR")" ]]; then
  echo "gpu_check: $OUT_DIR is not empty (an earlier run's results?): give a new or empty folder" >&2
  exit 2
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/centroidkv-site .whl/*.whl
  export PYTHONPATH="/tmp/centroidkv-site:${PYTHONPATH:-}"
fi
# Run from the working tree without an install, the harness's baselines are missing: they are found
# through the project's entry points, which only an installed distribution declares. Install a copy
# (--no-deps) beside the wheels; the working tree stays first on the path.
if ! "$PYTHON" -c "import importlib.metadata as m; m.distribution('centroidkv')" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --upgrade --target /tmp/centroidkv-site .
  export PYTHONPATH="/tmp/centroidkv-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:$PWD/scripts:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

"$PYTHON" - <<'PY' || exit 2
import importlib.util, sys
needed = ["torch", "transformers", "tqdm", "safetensors", "torch.nn.attention.flex_attention"]
missing = [name for name in needed if importlib.util.find_spec(name.split(".")[0]) is None
           or importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)}: bring wheels in .whl/ (see this script's header)")
import torch, transformers
optional = "flash_attn: " + ("yes" if importlib.util.find_spec("flash_attn") else "no (the gpu extra; optional)")
print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, {optional}")
PY

mkdir -p "$OUT_DIR"
"$PYTHON" scripts/gpu_check.py --out "$OUT_DIR" "${DRY_RUN[@]}" "$@" 2>&1 | tee "$OUT_DIR/log.txt"
exit "${PIPESTATUS[0]}"
