# One image for the service and the worker. The worker target installs a CUDA build of torch
# from the PyTorch index of your choice (TORCH_INDEX); the service target has no torch at all.
FROM python:3.11-slim AS base
WORKDIR /app
# MALLOC_ARENA_MAX=2: glibc's per-thread arenas grew the server's RSS in steps under a fleet's
# calls (bench/results/soak.md: +69 MiB/h by default, flat with 2 arenas; Python's heap flat).
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 MALLOC_ARENA_MAX=2
COPY pyproject.toml README.md ./
COPY vramtune ./vramtune

FROM base AS service
RUN pip install ".[server,postgres]"
EXPOSE 8000
CMD ["vramtune", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install --index-url "$TORCH_INDEX" torch && pip install ".[worker]"
CMD ["vramtune", "worker", "--all-gpus"]
