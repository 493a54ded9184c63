# syntax=docker/dockerfile:1
# specserve on CPU:  docker compose up --build   (or: docker build -t specserve . && docker run -p 8000:8000 specserve)
FROM python:3.11-slim

# torch is installed first and pinned, as `make install` does, so nothing resolves an unpinned torch
# later. The default source is the PyTorch CPU wheel index (no CUDA wheels in a CPU image); build
# with --build-arg TORCH_INDEX_URL= to take torch from PyPI / your pip configuration instead.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECSERVE_CACHE_DIR=/models

WORKDIR /app

RUN pip install "${TORCH_SPEC}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}

# A C++ compiler builds the CPU kernels (engine/kernels) once, below; without one the engine
# falls back to slower pure-PyTorch products.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# Runtime dependencies from pyproject.toml (this layer is rebuilt only when pyproject.toml changes;
# torch is already satisfied by the pinned install above).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# An unprivileged user that owns the model cache.
RUN useradd --create-home --uid 1000 specserve \
    && mkdir -p /models \
    && chown specserve:specserve /models

# Pull the default model at build time into /models ($SPECSERVE_CACHE_DIR). pull.py needs only the
# standard library plus the dependencies above, so this layer survives code changes elsewhere.
COPY --chown=specserve:specserve engine/models/pull.py /tmp/specserve_pull.py
USER 1000
RUN python /tmp/specserve_pull.py && rm /tmp/specserve_pull.py
USER 0

# The project itself.
COPY README.md ./
COPY engine ./engine
COPY server ./server
COPY configs ./configs
RUN pip install --no-deps .

# Compile the kernels into the model cache now, so the first start does not wait for them.
USER 1000
RUN python -m engine.kernels.build
USER 0

COPY docker/entrypoint.sh /usr/local/bin/specserve-entrypoint
RUN chmod 755 /usr/local/bin/specserve-entrypoint

USER 1000
EXPOSE 8000
# The model cache (the default model pulled above, compiled kernels, autotune results): mount a
# volume here to keep what a run pulls or tunes.
VOLUME ["/models"]
# 200 once the engine can serve (503 while it loads or restarts).
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["specserve-entrypoint"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
