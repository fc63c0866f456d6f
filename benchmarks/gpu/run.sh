#!/usr/bin/env bash
# The GPU benchmark and the CUDA paths of the tests, on any CUDA host that reaches the package
# registries: a virtual environment with the gpu extra (faiss-gpu; pick the wheel that matches
# the host's CUDA, as a production image does), then benchmarks/gpu_bench.py, then the unit,
# API and integration tests with IMGRET_TEST_DEVICE=cuda. Results go to $OUT (default
# /tmp/gpu-out). PostgreSQL, Chromium and the Fashion-MNIST files may be missing there: those
# tests skip (CI=true is not set).
# Usage: bash benchmarks/gpu/run.sh [BENCH_S] [UNIT_TESTS_S] [INTEGRATION_S]   (0 skips a stage)
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
venv=${GPU_VENV:-.venv-gpu}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[dev,gpu,onnx]' || exit 1
py="$venv/bin/python"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "CPUs: $(nproc)"
  "$py" -c "import torch, faiss, numpy; print('torch', torch.__version__, 'faiss',
faiss.__version__, 'GPUs seen by faiss', faiss.get_num_gpus(), 'numpy', numpy.__version__)"
} 2>&1 | tee "$out/env.txt"
[ "${1:-600}" = 0 ] || timeout "${1:-600}" "$py" benchmarks/gpu_bench.py \
  --parts "${GPU_BENCH_PARTS:-embed,search,large_k,metrics}" 2>&1 | tee "$out/gpu_bench.md"
export IMGRET_TEST_DEVICE=cuda
tests() {  # SECONDS NAME PATHS...; 0 seconds skips the stage
  [ "$1" = 0 ] && return
  timeout -s INT -k 20 "$1" "$py" -m pytest "${@:3}" -m "not postgres" -p no:cacheprovider \
    -n "$(nproc)" --dist loadfile -q --junitxml="$out/junit-$2.xml" > "$out/pytest-$2.log" 2>&1
  echo "pytest $2: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupted" "$out/pytest-$2.log" | tail -40
}
tests "${2:-600}" unit tests/unit tests/api
tests "${3:-900}" integration tests/integration
