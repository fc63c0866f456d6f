# syntax=docker/dockerfile:1
# Two stages: wheels are built with the compilers in `build`; the final image has none.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY imgret imgret
ARG EXTRAS=postgres
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir ".[${EXTRAS}]"
# The gpu profile swaps faiss-cpu for faiss-gpu (both ship the module `faiss`) and onnxruntime
# for onnxruntime-gpu (both ship `onnxruntime`; the GPU wheel has the CUDA and TensorRT
# providers). 1.15.1 is the faiss version run on an H200 (docs/gpu_bench.md); faiss-gpu-cu12
# 1.14.1 has no Hopper (sm_90) code.
ARG GPU=0
RUN if [ "$GPU" = "1" ]; then /opt/venv/bin/pip uninstall -y faiss-cpu onnxruntime \
    && /opt/venv/bin/pip install --no-cache-dir "faiss-gpu>=1.15.1" onnxruntime-gpu; fi

FROM python:${PYTHON}-slim AS runtime
RUN useradd --create-home --uid 10001 imgret && mkdir -p /data && chown imgret /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src/alembic.ini /app/alembic.ini
COPY --from=build /src/imgret/migrations /app/imgret/migrations
# MALLOC_ARENA_MAX: glibc gives each thread its own heap arena, and a decode or forward pass
# in many threads keeps each arena's peak; two arenas keep the process near its decode bound.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    IMGRET_DATA_DIR=/data
WORKDIR /app
USER imgret
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
# `imgret serve` upgrades the schema (Alembic) before it starts listening.
CMD ["imgret", "serve", "--host", "0.0.0.0", "--port", "8000"]
