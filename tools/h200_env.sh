#!/usr/bin/env bash
# The real Triton server on a GPU machine whose Python has numpy 2 (the H200 image: Python 3.12,
# numpy 2.5, torch 2.11): Triton 2.51's python stub corrupts BYTES tensors under numpy 2 (the
# server says ready, then every request fails "Stub process is not healthy"), so the server runs
# from a venv over the image's Python with numpy 1.26.4 in front, torch and the rest from the image.
#
#   bash tools/h200_env.sh pack            # here (internet): wheels + a trimmed Triton into .cache/h200 (~45 MB)
#   bash tools/h200_env.sh setup [VENV]    # there (no internet, .cache/h200 carried): builds VENV (/tmp/tvenv)
#   VENV/bin/python -m backend.serve ...   # then everything that serves or measures runs with that python
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.cache/h200
PY312_WHEEL_FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
                   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# numpy < 2 for the stub; the gRPC client (grpcio and protobuf come from the image) and its JSON;
# the OpenAI front's web stack (the image has anyio, h11, click and jinja2, not these)
WHEELS=(numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25
        fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 uvicorn==0.54.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 orjson==3.13.0)
IMAGE_SITE=${IMAGE_SITE:-/opt/torch/.venv/lib/python3.12/site-packages}

pack() {
    local site
    site=$("${PYTHON:-.venv/bin/python}" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("pytriton")
print(pathlib.Path(list(spec.submodule_search_locations)[0]).parent)
EOF
)
    rm -rf "$PACK" && mkdir -p "$PACK/whl"
    "${PYTHON:-.venv/bin/python}" -m pip download -q "${PY312_WHEEL_FLAGS[@]}" -d "$PACK/whl" "${WHEELS[@]}"
    # pytriton's tritonserver tree and bundled libraries only (the wheel's Python code needs
    # dependencies we never install), without the other Pythons' stubs and libpython 3.13
    tar -C "$site" -cJf "$PACK/tritonserver.tar.xz" \
        --exclude='pytriton/tritonserver/python_backend_stubs/3.[0-9]' \
        --exclude='pytriton/tritonserver/python_backend_stubs/3.1[013]' \
        --exclude='nvidia_pytriton.libs/libpython3*' \
        pytriton/__init__.py pytriton/tritonserver nvidia_pytriton.libs
    du -sh "$PACK"/whl/* "$PACK/tritonserver.tar.xz"
}

setup() {
    local venv=${1:-/tmp/tvenv}
    [[ -d "$PACK/whl" && -f "$PACK/tritonserver.tar.xz" ]] || { echo "error: no $PACK: run 'pack' here and carry it" >&2; exit 1; }
    python3 -m venv --without-pip "$venv"
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$PACK"/whl/*.whl
    tar -C "$site" -xJf "$PACK/tritonserver.tar.xz"
    # torch & co. from the image, behind the venv's own numpy (a .pth appends its path last)
    echo "$IMAGE_SITE" > "$site/zz-image-site.pth"
    # pytriton's metadata, so backend.serve and the doctor find the Triton version
    mkdir -p "$site/nvidia_pytriton-0.7.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: nvidia-pytriton\nVersion: 0.7.0\n' > "$site/nvidia_pytriton-0.7.0.dist-info/METADATA"
    "$venv/bin/python" - <<'EOF'
import numpy, torch, tritonclient.grpc  # noqa: F401
print(f"venv ready: numpy {numpy.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
EOF
}

case "${1:-}" in
    pack) pack ;;
    setup) shift; setup "$@" ;;
    *) echo "usage: $0 pack | setup [VENV]" >&2; exit 2 ;;
esac
