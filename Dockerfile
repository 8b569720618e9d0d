# syntax=docker/dockerfile:1
#
# lmserve server image.
#
#   docker build -t lmserve:cpu .                                   # CPU, SmolLM2 baked in
#   docker build -t lmserve:cuda --build-arg VARIANT=cuda .         # CUDA build of torch
#   docker build -t lmserve:slim --build-arg BAKE_MODEL=0 .         # no model: mount one at /models
#   docker run --rm -p 50051:50051 -p 8000:8000 -p 9400:9400 lmserve:cpu       # gRPC, OpenAI HTTP, metrics
#   docker run --rm --gpus all -p 50051:50051 -p 8000:8000 -p 9400:9400 lmserve:cuda
#
# Stages: builder (venv: torch first, then the project) -> models (optional `lmserve pull`)
# -> runtime-<VARIANT> -> runtime (venv + models, non-root, health-checked).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# cpu | cuda. Both use the same Python base: the CUDA torch wheels carry their own CUDA
# runtime libraries, and the NVIDIA container toolkit mounts the driver at run time.
ARG VARIANT=cpu

# ---------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# Empty: the CPU wheel index for VARIANT=cpu, the package index's default (CUDA) wheel for cuda.
ARG TORCH_INDEX_URL=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch before the project, so `pip install .[server]` keeps this build instead of choosing one.
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    index="$TORCH_INDEX_URL"; \
    case "$VARIANT" in \
      cpu)  index="${index:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    if [ -n "$index" ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url "$index" --extra-index-url https://pypi.org/simple; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY model/ model/
COPY server/ server/
COPY client/ client/
# The project from this source tree; its dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[server]" \
    && python -c "import torch, lmserve.server.app, lmserve.model.loader; print('torch', torch.__version__)"

# ---------------------------------------------------------------- models
FROM builder AS models
# 1: pull SmolLM2 (verified by sha256) into /models at build time; 0: leave /models empty.
ARG BAKE_MODEL=1
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p /models \
    && if [ "$BAKE_MODEL" = "1" ]; then lmserve pull smollm2 --models-dir /models --quiet; fi

# ---------------------------------------------------------------- runtime bases
FROM ${PYTHON_IMAGE} AS runtime-cpu
# g++: the CPU attention and elementwise kernels (model/native/csrc/*.cpp, built for the host CPU at first start)
# and torch.compile's C++ code generation for the compiled layers (--compile, model/tuning/compile.py)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

FROM ${PYTHON_IMAGE} AS runtime-cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---------------------------------------------------------------- runtime
# runtime-${VARIANT} is one of the stages above, not a registry image.
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
LABEL org.opencontainers.image.title="lmserve" \
      org.opencontainers.image.description="Text-generation inference over gRPC and an OpenAI-compatible HTTP API, with Prometheus metrics" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 lmserve \
    && useradd --uid 10001 --gid 10001 --home-dir /home/lmserve --create-home --shell /usr/sbin/nologin lmserve
COPY --from=builder /opt/venv /opt/venv
# Owned by the runtime user: the catalog may rewrite a model's .sha256 stamp after re-verifying it.
COPY --from=models --chown=10001:10001 /models /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/lmserve \
    LMSERVE_HOST=0.0.0.0 \
    LMSERVE_MODELS_DIR=/models
WORKDIR /home/lmserve
USER 10001:10001
EXPOSE 50051 8000 9400
# Loading SmolLM2 takes ~10-20 s on CPU: unhealthy results in the start period do not count.
# The check dials the default port in plaintext; with LMSERVE_PORT or TLS, override it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
    CMD ["lmserve", "health", "-t", "127.0.0.1:50051"]
# SIGTERM: health turns NOT_SERVING, new calls get UNAVAILABLE, in-flight streams get
# LMSERVE_GRACE_PERIOD seconds (30 by default) to finish. Give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["lmserve", "serve"]
