# syntax=docker/dockerfile:1
# DeepSeek-V4 on NVIDIA Triton Inference Server for GPU hosts, one CUDA (12.9) throughout.
# docs/DOCKER.md: building, running with a real checkpoint, shm/memlock, what the doctor checks.
#
#   docker build -t deepseek-v4-triton .                                    # native engine
#   docker build --build-arg ENGINE=vllm -t deepseek-v4-triton:vllm .       # + vLLM (cu129 wheel)
#   docker run --gpus all --init --shm-size 16g --ulimit memlock=-1 \
#       -v /data/DeepSeek-V4-Flash:/models/DeepSeek-V4-Flash:ro -p 8000-8002:8000-8002 -p 9000:9000 deepseek-v4-triton
#
# What goes wrong in vendor images, and what stops it here: a CUDA 13 library slipping into a
# CUDA 12.9 image (the seed's torchcodec NEEDed libnvrtc.so.13 beside torch 2.9.1+cu129). Every
# torch-family wheel comes from https://download.pytorch.org/whl/cu129 through --index-url (never
# --extra-index-url, which lets PyPI's build for another CUDA win), docker/constraints-cu129.txt
# pins their +cu129 builds on top of the project's constraints.txt, and `python3 -m tools.doctor`
# fails the build when any installed library NEEDs another CUDA major than torch's.

ARG ENGINE=native

# Base: Triton 25.06. NVIDIA's release notes: "Release 25.06 is based on CUDA 12.9.1" (25.04 is
# 12.9.0; 25.08 moved to CUDA 13.0), so its system CUDA matches torch's +cu129 wheels. Its Python
# (3.12, Ubuntu 24.04, as in every 24.12+ release) was not checked on a pulled image: no registry
# access from where this was written. The tag is pinned; pin the digest too once you have pulled it.
FROM nvcr.io/nvidia/tritonserver:25.06-py3 AS base

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The system Python is this image's environment (PEP 668 would refuse pip without the flag).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
# The user the server runs as (numeric below, so Kubernetes' runAsNonRoot can verify it).
RUN useradd --create-home --uid 10001 --user-group deepseek

WORKDIR /opt/deepseek
COPY constraints.txt ./
COPY docker/constraints-cu129.txt docker/constraints-vllm.txt docker/

# 1. torch and torchvision, the CUDA 12.9 builds, from the PyTorch index alone. --no-deps: that index
#    need not carry constraints.txt's exact versions of torch's own dependencies; step 2 takes them
#    (nvidia-*-cu12 libraries, triton, ...) from PyPI, and the +cu129 pins keep this torch in place.
RUN python3 -m pip install --no-deps --index-url https://download.pytorch.org/whl/cu129 \
        -c constraints.txt -c docker/constraints-cu129.txt \
        torch==2.13.0+cu129 torchvision==0.28.0+cu129

# 2. The project (importable from anywhere: Triton's python stub imports `backend`) and everything it
#    needs, under the same two constraint files.
COPY pyproject.toml ./
COPY backend/ backend/
COPY engine/ engine/
COPY kernels/ kernels/
COPY client/ client/
COPY loadtest/ loadtest/
COPY tools/ tools/
RUN python3 -m pip install -c constraints.txt -c docker/constraints-cu129.txt .

# 3. Triton's side: the python-based backend where Triton looks for backends (model.py at
#    backends/deepseek/model.py), the model repository, and the entrypoint.
COPY backend/ /opt/tritonserver/backends/deepseek/
COPY model_repository/ model_repository/
COPY model_repository_vllm/ model_repository_vllm/
COPY --chmod=755 docker/entrypoint.sh /usr/local/bin/deepseek-entrypoint

# 4. Refuse to build a mixed environment: torch family from one release and CUDA variant, no library
#    NEEDing another CUDA major, numpy right for this Triton's stub, tritonserver runs.
RUN python3 -m tools.doctor

ENV HOME=/home/deepseek \
    MODEL_DIR=/models/DeepSeek-V4-Flash \
    ENGINE=native
# HTTP, gRPC, metrics; the OpenAI API (OPENAI_PORT; OPENAI_HOST=127.0.0.1 keeps it inside)
EXPOSE 8000 8001 8002 9000
# Start period: loading a full checkpoint onto the GPUs takes minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; port = os.environ.get('HTTP_PORT', '8000'); sys.exit(urllib.request.urlopen(f'http://localhost:{port}/v2/models/deepseek_v4/ready', timeout=4).status != 200)"]
USER 10001:10001
# NVIDIA's entrypoint first: it sets up CUDA forward compatibility for older drivers, then runs ours.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/usr/local/bin/deepseek-entrypoint"]
CMD ["serve"]


FROM base AS engine-native


# vLLM for CUDA 12.9. Its PyPI wheels are CUDA 13 builds (they require nvidia-cutlass-dsl[cu13]);
# each release also ships a +cu129 wheel on GitHub, used here. vLLM 0.29.0 pins torch==2.13.0,
# torchvision==0.28.0, torchaudio==2.11.0 and torchcodec>=0.14. Not verified from here: that the
# wheel URL below and torchaudio/torchcodec +cu129 builds on the PyTorch index exist (no access).
FROM base AS engine-vllm
ARG VLLM_VERSION=0.29.0
ARG VLLM_WHEEL=https://github.com/vllm-project/vllm/releases/download/v${VLLM_VERSION}/vllm-${VLLM_VERSION}%2Bcu129-cp38-abi3-manylinux_2_28_x86_64.whl
USER 0:0
# torchaudio and torchcodec first, CUDA 12.9 builds from the PyTorch index alone: PyPI's torchcodec
# is the seed's CUDA 13 library.
RUN python3 -m pip install --no-deps --index-url https://download.pytorch.org/whl/cu129 \
        -c constraints.txt -c docker/constraints-cu129.txt \
        torchaudio==2.11.0+cu129 torchcodec==0.15.0+cu129
# constraints.txt less numpy (vLLM needs numpy 2: docker/constraints-vllm.txt says why), the same +cu129 pins.
RUN sed '/^numpy==/d' constraints.txt > /tmp/constraints-vllm-base.txt \
    && python3 -m pip install -c /tmp/constraints-vllm-base.txt -c docker/constraints-cu129.txt \
        -c docker/constraints-vllm.txt "vllm @ ${VLLM_WHEEL}" \
    && rm /tmp/constraints-vllm-base.txt
RUN python3 -m tools.doctor
ENV ENGINE=vllm
USER 10001:10001


# The stage the ENGINE build argument names (BuildKit builds only that one).
# hadolint ignore=DL3006
FROM engine-${ENGINE}
