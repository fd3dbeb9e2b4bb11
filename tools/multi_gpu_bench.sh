#!/usr/bin/env bash
# The multi-GPU runs on nvidia-h200-x2 / -x4 / -x8, one device call per part (JSON + logs under $OUT):
#   bash tools/multi_gpu_bench.sh engine|serve|serve-long
# The model: V4-Flash-shaped at full size as shipped (43 layers on its schedule, 256 MXFP4 routed experts, FP8
# linears, the MTP layer; ~160 GB of random weights drawn on the GPUs, shards spilling to /dev/shm past the disk),
# attention tensor-parallel and the MoE expert-parallel over every GPU of the host (TP=N to use fewer).
# - engine (~8 min with the checkpoint): decode steps at batch 1 / 32 / 150, TTFT of 1K and 8K prompts;
# - serve (~9 min): the real Triton server, closed loop at 1 / 8 / 32 / 64 / 150 / 256 users, 1K in / 256 out;
# - serve-long (~9 min): 8K in / 1K out at 1 / 8 / 32 / 64 users.
# serve and serve-long need .cache/h200 carried (bash tools/h200_env.sh pack). The checkpoint lives while the machine
# stays warm; a fresh one draws it again. Per-GPU floors and the projection to compare with: docs/PERF.md
# ("Several GPUs", tools/bench_tp_share.py). PRESET=tiny TP=2 runs the engine part on the CPU (gloo): a smoke test.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # NVLink multicast off (the device notes say why)
OUT=${OUT:-out}; mkdir -p "$OUT"
PRESET=${PRESET:-flash-depth}
if [ "$PRESET" = tiny ]; then
  N=${TP:-2}; DEV=cpu; OVR='{}'; QUANT=bf16; LEN=64; LONG=128
else
  N=${TP:-$(nvidia-smi -L | wc -l)}; DEV=cuda; OVR='{"n_routed_experts":256}'; QUANT=fp8-fp4; LEN=1024; LONG=8192
fi
M=${CK:-/tmp/ckpt}/$PRESET-e256-$QUANT
EA="\"tensor_parallel_size\":$N,\"enable_expert_parallel\":true,\"max_model_len\":10240,\"max_num_seqs\":256,\"block_size\":128"
[ "$DEV" = cuda ] && EA="$EA,\"gpu_memory_utilization\":0.9"
draw() {
  [ -f $M/config.json ] && return 0
  local t0=$SECONDS
  timeout 420 python3 -m tools.make_tiny_checkpoint $M --preset $PRESET --override "$OVR" --quant $QUANT --device $DEV \
    --spill-dir /dev/shm/ckpt 2>&1 | tail -1
  echo "checkpoint drawn in $((SECONDS - t0)) s: $(du -shL $M | cut -f1)"
}
sweep() {  # label, concurrency levels, input len, output len, window s
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  timeout 540 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --engine-args "{$EA}" --driver threads \
    --protocol grpc --concurrency "$2" --input-len "$3" --output-len "$4" --duration "$5" --stop-timeout 30 --out "$OUT" \
    --label "$1" 2>&1 | tee "$OUT/$1.log" | grep -E "c=|rror|weights" | tail -8
}
case "${1:-engine}" in
engine)
  draw
  timeout 420 python3 -m tools.bench_engine --model $M --concurrency 1 --input-len $LEN --output-len 16 \
    --requests-per-user 2 --steady 1,32,150 --label tp$N --engine-args "{$EA}" --json "$OUT/tp${N}_engine.json" 2>&1 \
    | tee "$OUT/tp${N}_engine.log" | grep -E "steady|TTFT|online|rror" | tail -8
  timeout 240 python3 -m tools.bench_engine --model $M --concurrency 1 --input-len $LONG --output-len 16 \
    --requests-per-user 1 --label tp${N}-long --engine-args "{$EA}" --json "$OUT/tp${N}_ttft_long.json" 2>&1 \
    | tee "$OUT/tp${N}_ttft_long.log" | grep -E "TTFT|online|rror" | tail -3 ;;
serve)
  draw; sweep tp$N-triton-1k 1,8,32,64,150,256 1024 256 30 ;;
serve-long)
  draw; sweep tp$N-triton-8k 1,8,32,64 8192 1024 45 ;;
*)
  echo "usage: bash tools/multi_gpu_bench.sh engine|serve|serve-long" >&2; exit 2 ;;
esac
