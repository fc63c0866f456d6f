#!/usr/bin/env bash
# The GPU benchmark and the CUDA-path tests on a GPU machine (a bare image with torch, no
# package registry): install the carried wheels (.whl: the service's dependencies) and
# faiss-gpu, point faiss at CUDA 13's cuBLAS through the shim in .gpu/lib (see
# cublas12_shim.c), then the GPU benchmark and the unit and API tests on the CUDA paths.
# Usage there: [GPU_BENCH_PARTS=...] [UNIT_TESTS="paths"] bash benchmarks/gpu/run_on_device.sh
#   [BENCH_S] [UNIT_TESTS_S] [INTEGRATION_S] (a stage given 0 seconds is skipped)
set -u
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# faiss-gpu 1.15.1 (the first PyPI wheel with sm_90 code; 135 MB) arrives as an xz tar in
# parts (.faiss*/part.* , over two calls when it exceeds one call's 64 MiB) or in /tmp.
cat /tmp/faiss-part.* .faiss*/part.* 2>/dev/null > /tmp/faiss.tar.xz
python3 -c "import tarfile; tarfile.open('/tmp/faiss.tar.xz').extractall('/tmp/site')" || exit 1
export PYTHONPATH=/tmp/site:/tmp/nv:$PWD
# faiss-gpu dlopens CUDA 12's runtime, cuBLAS and cuRAND from nvidia.<component>/lib (the
# nvidia-*-cu12 wheels): CUDA 12's runtime, the cuBLAS shim and CUDA 13's cuRAND (still
# soname 10) stand in for them.
lib() { python3 -c "
import glob, os, site, torch
roots = site.getsitepackages() + [os.path.dirname(os.path.dirname(torch.__file__)), '/usr/local']
hits = [p for r in roots for p in glob.glob(r + '/**/$1', recursive=True)]
print(sorted(hits, key=len)[0] if hits else '')"; }
CUBLAS13_PATH=$(lib libcublas.so.13)
export CUBLAS13_PATH
for part in cuda_runtime cublas curand; do mkdir -p /tmp/nv/nvidia/$part/lib; done
cp .gpu/lib/libcudart.so.12 /tmp/nv/nvidia/cuda_runtime/lib/
cp .gpu/lib/libcublas*.so.12 /tmp/nv/nvidia/cublas/lib/
ln -sf "$(lib libcurand.so.10)" /tmp/nv/nvidia/curand/lib/libcurand.so.10
export LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "cuBLAS 13: $CUBLAS13_PATH; CPUs: $(nproc)"
  python3 -c "import torch, faiss, numpy; print('torch', torch.__version__, 'faiss',
faiss.__version__, 'GPUs seen by faiss', faiss.get_num_gpus(), 'numpy', numpy.__version__)"
} 2>&1 | tee "$out/env.txt"
timeout "${1:-240}" python3 benchmarks/gpu_bench.py --parts "${GPU_BENCH_PARTS:-embed,search,large_k,metrics}" \
  2>&1 | tee "$out/gpu_bench.md"
# The unit and API tests, then the integration tests (real uvicorn, crash and kill tests)
# apart, so that a slow second half cannot cost the first its summary. PostgreSQL, Chromium
# and the Fashion-MNIST files are not on that machine: those tests skip there (no CI=true).
export IMGRET_TEST_DEVICE=cuda
tests() {  # SECONDS NAME PATHS...; 0 seconds skips the stage
  [ "$1" = 0 ] && return
  timeout -s INT -k 20 "$1" python3 -m pytest "${@:3}" -m "not postgres" -p no:cacheprovider -n 12 \
    --dist loadfile -q --timeout 120 --continue-on-collection-errors \
    --junitxml="$out/junit-$2.xml" > "$out/pytest-$2.log" 2>&1
  echo "pytest $2: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupted" "$out/pytest-$2.log" | tail -40
}
tests "${2:-150}" unit ${UNIT_TESTS:-tests/unit tests/api}
tests "${3:-200}" integration tests/integration
