# One image for every llmserve service: the container's command picks one
# (`worker`, `scheduler`, `gateway`; `llmserve --help`).
#
#   docker build -t llmserve .                         # CPU (the last stage, `cpu`)
#   docker build -t llmserve:cuda --target cuda .      # NVIDIA GPUs
#
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (the default is the
# public Python image; the tests use one built from Debian packages). TORCH_INDEX_URL: an
# extra index for torch, e.g. PyTorch's CPU-only wheel index for a smaller CPU image.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS runtime-base
# The CPU kernels are compiled on first start for the CPU the container runs on (-march=native,
# see llmserve_kernels/cpu/build.py), so the image carries a C++ compiler. Triton, on CUDA, compiles its
# launchers at run time with the same compiler.
RUN if ! command -v g++ >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv --help >/dev/null

# The dependencies alone, in the virtual environment the image runs.
FROM runtime-base AS deps
ARG TORCH_INDEX_URL=""
WORKDIR /src
RUN python3 -m venv /opt/llmserve
# From pyproject.toml and scripts/install.sh alone, so that a source change does not
# reinstall them. A wheelhouse (deploy/wheelhouse/*.whl) replaces the index.
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY deploy/wheelhouse/ /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; \
    fi \
    && PIP_NO_CACHE_DIR=1 TORCH_INDEX_URL="$TORCH_INDEX_URL" \
        scripts/install.sh /opt/llmserve/bin/python "" --deps-only

# The project as a wheel: the runtime stage installs it without the sources.
FROM deps AS build
COPY llmserve/ llmserve/
COPY scheduler_service/ scheduler_service/
COPY worker_service/ worker_service/
COPY gateway/ gateway/
COPY llmserve_kernels/ llmserve_kernels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; \
    fi \
    && PIP_NO_CACHE_DIR=1 scripts/install.sh /opt/llmserve/bin/python "" --wheel /dist

FROM runtime-base AS runtime
# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER. Written into
# /etc/passwd directly because a minimal base may not ship useradd.
RUN echo "llmserve:x:10001:10001:llmserve:/home/llmserve:/usr/sbin/nologin" >> /etc/passwd \
    && echo "llmserve:x:10001:" >> /etc/group \
    && mkdir -p /home/llmserve /var/cache/llmserve \
    && chown 10001:10001 /home/llmserve /var/cache/llmserve
# Two layers: the dependencies (gigabytes, torch above all), then the project (a few
# megabytes). A source change rebuilds only the second, so a rebuild neither copies nor stores
# the first again; one COPY of the whole built environment would make every rebuild a new
# multi-gigabyte layer.
COPY --from=deps /opt/llmserve /opt/llmserve
COPY --from=build /dist/ /tmp/dist/
COPY scripts/install.sh /tmp/dist/
RUN PIP_NO_INDEX=1 PIP_NO_CACHE_DIR=1 \
        /tmp/dist/install.sh /opt/llmserve/bin/python "" --project-only /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && /opt/llmserve/bin/llmserve worker --check-config
ENV PATH=/opt/llmserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/llmserve \
    HF_HUB_OFFLINE=1 \
    LLMSERVE_KERNEL_CACHE=/var/cache/llmserve/kernels \
    LLMSERVE_HOST=0.0.0.0
# /var/cache/llmserve is writable by the service user: mount a volume there to keep the
# compiled CPU kernels across restarts (no VOLUME line: every container of the gateway and
# the scheduler would leave an anonymous volume behind).
USER 10001:10001
# Which port to probe: each service's compose/k8s definition sets LLMSERVE_PORT; the default
# is the gateway's gRPC port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD llmserve health "127.0.0.1:${LLMSERVE_PORT:-50051}" --timeout 4
ENTRYPOINT ["llmserve"]
CMD ["--help"]

FROM runtime AS cuda
# torch's Linux wheels from the default index bundle the CUDA runtime; the host provides the
# driver through the NVIDIA container toolkit, which reads these.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Last, so that a build without --target gives the CPU image. Built without TORCH_INDEX_URL it
# carries the default index's torch, which runs on CPUs too but is larger.
FROM runtime AS cpu
