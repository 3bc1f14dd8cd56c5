# syntax=docker/dockerfile:1
# radixserve images. Every service container runs `radixserve <service>` (ENTRYPOINT radixserve; the
# compose file and the Helm chart pass gateway|tokenizer|worker|detokenizer) and is configured by RS_*
# variables and flags (shared/flags.py). Targets:
#   cpu  (default)  torch CPU build + the project: runs every service, serves the embedded model on CPU
#   cuda            CUDA runtime base, torch CUDA build + triton (+ flashinfer with --build-arg FLASHINFER=1)
#   edge            no torch: the gateway, the tokenizer and the detokenizer (they never import it)
#   docker build -t radixserve:cpu .
#   docker build -t radixserve:cuda --target cuda --build-arg FLASHINFER=1 .
#   docker build -t radixserve:edge --target edge .
# tests/test_deploy_images.py checks what every final stage must have; docs/OPERATIONS.md says how to use them.
ARG PYTHON_VERSION=3.11
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG FLASHINFER=0
ARG UID=10001

# ---- build stages: a virtualenv in /opt/venv and the source in /opt/radixserve ------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS python-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /opt/radixserve
COPY pyproject.toml README.md ./
COPY ops/docker/requirements.py ops/docker/requirements.py

FROM python-build AS edge-build
# The project's dependencies but torch and triton (ops/docker/requirements.py --edge).
RUN python ops/docker/requirements.py --edge > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY services services
COPY shared shared
COPY kernels kernels
COPY proto proto
# --no-deps: torch stays out; the gRPC stubs are generated now, the image's files are read-only later.
RUN pip install --no-deps -e . && python -m services.gateway.protos

FROM python-build AS cpu-build
ARG TORCH_VERSION
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && python ops/docker/requirements.py > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY services services
COPY shared shared
COPY kernels kernels
COPY proto proto
RUN pip install --no-deps -e . && python -m services.gateway.protos

# ---- the runtime base: no compilers, a non-root user, the model directory as a volume ------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG UID
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 RS_HOME=/models HF_HOME=/models/hf \
    RS_HOST=0.0.0.0 RS_METRICS_HOST=0.0.0.0
RUN useradd --uid ${UID} --home-dir /home/radixserve --create-home --shell /usr/sbin/nologin radixserve \
    && mkdir -p /models && chown radixserve:radixserve /models

FROM runtime AS edge
COPY --from=edge-build /opt/venv /opt/venv
COPY --from=edge-build /opt/radixserve /opt/radixserve
USER radixserve
WORKDIR /home/radixserve
VOLUME ["/models"]
EXPOSE 8000 50051 9401 9403
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=6s --start-period=60s --retries=3 CMD ["radixserve", "probe"]
ENTRYPOINT ["radixserve"]
CMD ["gateway"]

# ---- CUDA: torch's CUDA build on the CUDA runtime image ------------------------------------------------
FROM ${CUDA_BASE} AS cuda-build
ARG TORCH_VERSION
ARG TORCH_CUDA
ARG FLASHINFER
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /opt/radixserve
COPY pyproject.toml README.md ./
COPY ops/docker/requirements.py ops/docker/requirements.py
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}" \
    && python ops/docker/requirements.py $([ "${FLASHINFER}" = 1 ] && echo --extra flashinfer) > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && if [ "${FLASHINFER}" = 1 ]; then pip install flashinfer-cubin; fi
COPY services services
COPY shared shared
COPY kernels kernels
COPY proto proto
RUN pip install --no-deps -e . && python -m services.gateway.protos

FROM ${CUDA_BASE} AS cuda
ARG UID
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 RS_HOME=/models HF_HOME=/models/hf \
    RS_HOST=0.0.0.0 RS_METRICS_HOST=0.0.0.0 DEBIAN_FRONTEND=noninteractive
# Triton builds its small CUDA launcher with the system C compiler the first time a kernel runs (and
# keeps it in ~/.triton), so this stage alone carries gcc and the Python headers: the one compiler a
# final stage has, on purpose.
RUN apt-get update && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid ${UID} --home-dir /home/radixserve --create-home --shell /usr/sbin/nologin radixserve \
    && mkdir -p /models && chown radixserve:radixserve /models
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build /opt/radixserve /opt/radixserve
USER radixserve
WORKDIR /home/radixserve
VOLUME ["/models"]
EXPOSE 9402
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=6s --start-period=600s --retries=3 CMD ["radixserve", "probe"]
ENTRYPOINT ["radixserve"]
CMD ["worker"]

# ---- CPU (the default target, last): every service, the embedded model on CPU --------------------------
FROM runtime AS cpu
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/radixserve /opt/radixserve
USER radixserve
WORKDIR /home/radixserve
VOLUME ["/models"]
EXPOSE 8000 50051 9401 9402 9403
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=6s --start-period=300s --retries=3 CMD ["radixserve", "probe"]
ENTRYPOINT ["radixserve"]
CMD ["worker"]
