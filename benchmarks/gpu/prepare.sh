#!/usr/bin/env bash
# Prepare, on this (CPU) machine, what run_on_device.sh needs on a GPU machine whose
# image has torch but no registry: .whl (the service's pure dependencies for its Python
# 3.12), .gpu/lib (CUDA 12's runtime and the cuBLAS 12 -> 13 shim) and .faissA/part.aa
# (faiss-gpu 1.15.1 as an xz tar, 58.5 MB: too large to travel with the rest in one call).
# Add /.whl/, /.gpu/ and /.faissA/ to .git/info/exclude first. Then copy the checkout and
#   .faissA to the GPU machine and move .faissA/part.aa to /tmp/faiss-part.aa there; copy
#   .whl and .gpu next (a separate transfer when uploads are capped) and run
#   "bash benchmarks/gpu/run_on_device.sh".
set -eu
cd "$(dirname "$0")/../.."
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$@"
}
mkdir -p .whl .gpu/lib .faissA
# The versions this project's venv resolved; fastapi 0.165 imports opentelemetry.
get .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 \
  fastapi==0.165.0 starlette==1.10.0 python-multipart==0.0.34 uvicorn==0.54.0 optuna==5.0.0 \
  colorlog==6.12.0 pytorch-metric-learning==2.9.0 opentelemetry-api==1.45.2
tmp=$(mktemp -d)
get "$tmp" nvidia-cuda-runtime-cu12==12.9.79 faiss-gpu==1.15.1
unzip -j -o -q "$tmp"/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' \
  -d .gpu/lib
gcc -O2 -Wall -fPIC -shared -Wl,-soname,libcublas.so.12 \
  -Wl,--version-script=benchmarks/gpu/cublas12.map -o .gpu/lib/libcublas.so.12 \
  benchmarks/gpu/cublas12_shim.c -ldl
# FAISS lists libcublasLt.so.12 as needed without calling it: an empty library will do.
echo 'int imgret_cublaslt12_placeholder;' > "$tmp/lt.c"
gcc -shared -fPIC -Wl,-soname,libcublasLt.so.12 -o .gpu/lib/libcublasLt.so.12 "$tmp/lt.c"
mkdir "$tmp/faiss" && (cd "$tmp/faiss" && unzip -q "$tmp"/faiss_gpu-1.15.1-*.whl)
(cd "$tmp/faiss" && XZ_OPT="-9e -T2" tar cJf "$OLDPWD/.faissA/part.aa" .)
rm -rf "$tmp"
du -sh .whl .gpu .faissA
