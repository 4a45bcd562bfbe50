# cy-llm: the worker (Python) and the sidecar (Rust) in one image.
#
#   CPU, the native engine and the embedded model (the defaults):
#     docker build -t cy-llm --label org.opencontainers.image.revision="$(git rev-parse HEAD)" .
#   NVIDIA GPUs, vLLM, models mounted at run time:
#     docker build -t cy-llm:cuda --build-arg BASE_IMAGE=docker.io/nvidia/cuda:12.9.1-runtime-ubuntu24.04 \
#       --build-arg ENGINE=vllm --build-arg HARDWARE=nvidia-hopper --build-arg EMBEDDED_MODEL= .
#   Only the sidecar (a small image): docker build --target sidecar -t cy-llm-sidecar .
#
# The image runs the worker (`cy-llm serve`); the same image runs the sidecar with the command
# `cy-llm-sidecar`. Both run as uid 10001 and meet at the socket in /run/cy-llm.

ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
ARG RUST_IMAGE=docker.io/library/rust:1.95-slim-bookworm

# --- the sidecar, built with cargo ---
FROM ${RUST_IMAGE} AS sidecar-build
# Behind a TLS-intercepting proxy: its CA bundle, mounted into the build (podman build -v CA:/run/ca.crt:ro
# --build-arg CARGO_HTTP_CAINFO=/run/ca.crt --build-arg PIP_CERT=/run/ca.crt). Unset: the image's CAs.
ARG CARGO_HTTP_CAINFO
WORKDIR /src
COPY proto proto
COPY sidecar sidecar
# Cache mounts keep crates and compiled dependencies between builds; the binary leaves through /out.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/sidecar/target \
    cargo build --release --locked --manifest-path sidecar/Cargo.toml \
 && install -D -m 0755 sidecar/target/release/cy-llm-sidecar /out/cy-llm-sidecar

# --- what both roles share: tini as PID 1 (forwards SIGTERM, reaps), the user, the socket folder ---
FROM ${BASE_IMAGE} AS base
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tini ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 cyllm \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/cy-llm --create-home --shell /usr/sbin/nologin cyllm \
 && install -d -o 10001 -g 10001 -m 0750 /run/cy-llm \
 && install -d -o 10001 -g 10001 -m 0755 /var/cache/cy-llm
# Per-build labels (org.opencontainers.image.revision, .created) are given at build time with
# --label: buildah reuses a cached LABEL layer even when a build argument in it changed.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="cy-llm" \
      org.opencontainers.image.description="LLM inference worker (StreamPredict over a Unix socket) and its gateway-facing sidecar" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/cy-llm/cy-llm"
VOLUME ["/run/cy-llm"]
ENV CYLLM_SIDECAR_WORKERS=unix:///run/cy-llm/worker.sock
EXPOSE 50051 8080 9090
ENTRYPOINT ["/usr/bin/tini", "--"]

# --- the sidecar alone ---
FROM base AS sidecar
COPY --from=sidecar-build /out/cy-llm-sidecar /usr/local/bin/cy-llm-sidecar
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["cy-llm-sidecar", "--probe", "/readyz"]
CMD ["cy-llm-sidecar"]

# --- pip's find-links folder, empty unless the build names one (--build-context wheels=DIR) ---
FROM scratch AS wheels

# --- the worker, its engine stack and the embedded model (the default target) ---
FROM base AS worker
ARG ENGINE=native
ARG HARDWARE=cpu
ARG EMBEDDED_MODEL=smollm2-135m-instruct
# Package sources for the build only: a private index, a local wheel folder (mounted at /wheels), the
# proxy CA bundle as for cargo above.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
# On CPUs the native engine compiles its C++ kernels on first start for the CPU it runs on
# (engine.kernel_dir, below), so the CPU image carries a C++ compiler.
RUN compiler="" && case "$HARDWARE" in cpu*) compiler=g++ ;; esac \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ${compiler:+"$compiler"} \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/cy-llm/venv \
    PATH=/opt/cy-llm/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_PROGRESS_BAR=off
COPY pyproject.toml setup.py README.md /src/
COPY proto /src/proto
COPY deploy /src/deploy
COPY worker /src/worker
# `cy-llm setup` resolves the registry's pinned set for HARDWARE and ENGINE and installs it;
# the lock it writes stays in the image for `cy-llm doctor`.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=wheels,target=/wheels \
    python3 -m venv "$VIRTUAL_ENV" \
 && pip install /src \
 && cy-llm setup --engine "$ENGINE" --hardware "$HARDWARE" --lock /opt/cy-llm/requirements.lock --yes \
 && rm -rf /src
# The embedded model, converted once at build time: the container needs no network to serve it.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=wheels,target=/wheels \
    if [ -n "$EMBEDDED_MODEL" ]; then \
      cy-llm models prepare "$EMBEDDED_MODEL" --cache-dir /opt/cy-llm/models \
      && rm -rf /opt/cy-llm/models/downloads; \
    fi
COPY --from=sidecar-build /out/cy-llm-sidecar /usr/local/bin/cy-llm-sidecar
USER 10001:10001
ENV HF_HUB_OFFLINE=1 \
    CYLLM_ENGINE=${ENGINE} \
    CYLLM_MODEL=${EMBEDDED_MODEL} \
    CYLLM_CACHE_DIR=/opt/cy-llm/models \
    CYLLM_SOCKET=/run/cy-llm/worker.sock \
    CYLLM_ADAPTERS__KB_DIR=/var/cache/cy-llm/kb \
    CYLLM_ENGINE__KERNEL_DIR=/var/cache/cy-llm/kernels
# Ready: the model is loaded and the worker is making progress (grpc.health.v1 over its socket).
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 CMD ["cy-llm", "health", "--ready"]
CMD ["cy-llm", "serve"]
