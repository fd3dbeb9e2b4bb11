#!/usr/bin/env bash
# Serve the checkpoint mounted at $MODEL_DIR on every interface, admin APIs behind a key.
#
#   docker run --gpus all -v /data/DeepSeek-V4-Flash:/models/DeepSeek-V4-Flash:ro IMAGE
#   docker run ... IMAGE serve --engine-args '{"max_model_len": 32768}'   # extra backend.serve flags
#   docker run ... IMAGE python3 -m tools.doctor                          # anything else runs as given
#
# Environment: MODEL_DIR (a checkpoint directory, or "tiny" for the built-in test model), ENGINE
# (native | vllm; the image's default), ENGINE_ARGS (JSON merged into model.json), HTTP_PORT,
# GRPC_PORT, METRICS_PORT, OPENAI_PORT (the OpenAI API, 9000; empty: none), OPENAI_HOST (0.0.0.0:
# reachable through -p; 127.0.0.1: inside the container only), DSV4_OPENAI_API_KEY (the OpenAI API's
# Bearer key; unset: open), ADMIN_KEY or the file /run/secrets/admin_key (else backend.serve picks a
# random key and writes it to $SERVE_WORKDIR/admin_key, 0600), SERVE_WORKDIR (generated backends/,
# model_repository/, logs; default /tmp/deepseek-triton).
set -euo pipefail

if [[ $# -gt 0 && "$1" != serve && "$1" != -* ]]; then
    exec "$@"
fi
[[ "${1:-}" == serve ]] && shift

MODEL_DIR="${MODEL_DIR:-/models/DeepSeek-V4-Flash}"
if [[ "$MODEL_DIR" != tiny && ! -f "$MODEL_DIR/config.json" ]]; then
    echo "error: no checkpoint at MODEL_DIR=$MODEL_DIR (no config.json)." >&2
    echo "Mount one read-only, e.g. -v /data/DeepSeek-V4-Flash:$MODEL_DIR:ro, or set MODEL_DIR=tiny." >&2
    exit 2
fi

# ENGINE picks the engine unless ENGINE_ARGS names one itself.
ENGINE_ARGS="$(python3 -c '
import json, os, sys
args = json.loads(os.environ.get("ENGINE_ARGS") or "{}")
if not isinstance(args, dict):
    sys.exit("error: ENGINE_ARGS must be a JSON object")
args.setdefault("engine", os.environ.get("ENGINE", "native"))
print(json.dumps(args))
')"

# The admin key by the environment or a file, never on a command line (/proc/<pid>/cmdline is
# world-readable). backend.serve still has to hand it to tritonserver's own command line: see
# docs/RELIABILITY.md.
admin=()
if [[ -n "${ADMIN_KEY:-}" ]]; then
    export DSV4_ADMIN_KEY="$ADMIN_KEY"
elif [[ -r /run/secrets/admin_key ]]; then
    admin=(--admin-key-file /run/secrets/admin_key)
fi

# The OpenAI API beside Triton, on every interface unless OPENAI_HOST says otherwise.
openai=()
if [[ -n "${OPENAI_PORT-9000}" ]]; then
    openai=(--openai-port "${OPENAI_PORT-9000}" --openai-host "${OPENAI_HOST:-0.0.0.0}")
fi

# exec: backend.serve replaces this shell, so `docker stop`'s SIGTERM reaches it (it lets Triton
# drain in-flight requests, then stops it). Run with --init so an init process reaps zombies.
exec python3 -m backend.serve \
    --model "$MODEL_DIR" \
    --engine-args "$ENGINE_ARGS" \
    --host 0.0.0.0 \
    --http-port "${HTTP_PORT:-8000}" \
    --grpc-port "${GRPC_PORT:-8001}" \
    --metrics-port "${METRICS_PORT:-8002}" \
    --model-repository "/opt/deepseek/${MODEL_REPOSITORY:-$([[ "${ENGINE:-native}" == vllm ]] && echo model_repository_vllm || echo model_repository)}" \
    --workdir "${SERVE_WORKDIR:-/tmp/deepseek-triton}" \
    "${admin[@]}" \
    "${openai[@]}" \
    "$@"
