#!/usr/bin/env bash
# Issue 14, item 5, on a GPU machine lent through the `device` tool (a bare image with
# torch, no registry): install the carried wheels (.whl: the service's dependencies and
# faiss-gpu-cu12), point faiss at CUDA 13's cuBLAS through the shim in .gpu/lib (see
# cublas12_shim.c), then the GPU benchmark and the unit and API tests on the CUDA paths.
# Usage there: bash benchmarks/gpu/run_on_device.sh [BENCH_S] [UNIT_TESTS_S] [INTEGRATION_S]
set -u
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
CUBLAS13_PATH=$(python3 -c "
import glob, os, site, torch
roots = site.getsitepackages() + [os.path.dirname(os.path.dirname(torch.__file__)), '/usr/local']
hits = [p for r in roots for p in glob.glob(r + '/**/libcublas.so.13*', recursive=True)]
print(sorted(hits, key=len)[0] if hits else '')")
export CUBLAS13_PATH _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
export LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "cuBLAS 13: $CUBLAS13_PATH; CPUs: $(nproc)"
  python3 -c "import torch, faiss, numpy; print('torch', torch.__version__, 'faiss',
faiss.__version__, 'GPUs seen by faiss', faiss.get_num_gpus(), 'numpy', numpy.__version__)"
} 2>&1 | tee "$out/env.txt"
timeout "${1:-240}" python3 benchmarks/gpu_bench.py 2>&1 | tee "$out/gpu_bench.md"
# The unit and API tests, then the integration tests (real uvicorn, crash and kill tests)
# apart, so that a slow second half cannot cost the first its summary. PostgreSQL, Chromium
# and the Fashion-MNIST files are not on that machine: those tests skip there (no CI=true).
export IMGRET_TEST_DEVICE=cuda
tests() {
  timeout "$1" python3 -m pytest "${@:3}" -m "not postgres" -p no:cacheprovider -n 12 \
    --dist loadfile -q --timeout 120 --continue-on-collection-errors \
    --junitxml="$out/junit-$2.xml" > "$out/pytest-$2.log" 2>&1
  echo "pytest $2: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest-$2.log" | tail -40
}
tests "${2:-150}" unit tests/unit tests/api
tests "${3:-200}" integration tests/integration
