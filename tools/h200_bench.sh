#!/usr/bin/env bash
# Every GPU measurement in docs/PERF.md, one device call per part:
#   bash tools/h200_bench.sh check-defaults|fp8-bf16|kernels|quant|fused|compress|fused-fp8|recheck|depth|v41|v41-fp8|v41-serve|ratio-depth|largest|profile-depth|profile-prefill|profile-v4|prefill|depth-s10|check-s10|attention-s11|depth-s11|profile-spec|serve-depth|final|spec|mixed|engine|quick|sync|agentic|ttft|peer|profile|numpy2|serving|tp-share|structured  (JSON + logs under $OUT)
# numpy2, serving, largest, v41-serve, ratio-depth and depth-s10 need .cache/h200 carried (bash tools/h200_env.sh pack).
# Checkpoints, drawn on the GPU: flash-depth (V4-Flash depth: 43 layers, 16 experts; mixed, engine, depth) and
# flash-shaped (its per-layer shapes, 4 layers: quick and the rest).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
CK=/tmp/ckpt
EA='"max_model_len":8192,"max_num_seqs":256,"block_size":128,"gpu_memory_utilization":0.6'
bench() { python3 -m tools.bench_engine --preset flash-shaped --cache-dir $CK "$@"; }
case "${1:-all}" in
kernels)
  timeout 200 python3 -m tools.bench_kernels --batches 1,8,32,128,256 --no-compile --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -32
  timeout 240 python3 -m tools.bench_kernels --batches 32 --json "$OUT/kernels_compile.json" > "$OUT/kernels_compile.log" 2>&1
  tail -8 "$OUT/kernels_compile.log" ;;
quant)  # FP8 GEMM + MXFP4 / FP8 MoE: checked vs the torch references (non-zero exit on a mismatch), a config sweep per shape timed vs floors
  timeout 280 python3 -m tools.bench_quant --budget 220 --json "$OUT/quant.json" 2>&1 | tee "$OUT/quant.log" | tail -40 ;;
fused)  # issue 20's fused kernels: checked vs the torch references (non-zero exit on a mismatch), timed vs floor and the old path
  timeout 300 python3 -m tools.bench_fused --json "$OUT/fused.json" 2>&1 | tee "$OUT/fused.log" | tail -40 ;;
compress)  # the compressors' multi-row step: the fused kernels' check (with the others'), then fused vs torch ops (~2 min)
  timeout 240 python3 -m tools.bench_fused --only compress --json "$OUT/compress.json" 2>&1 | tee "$OUT/compress.log" | tail -24 ;;
fused-fp8)  # the same check, then only the FP8 linear rows (W_CVT per shape, the gemv at 1 row, the stacked pairs)
  timeout 240 python3 -m tools.bench_fused --only fp8 --json "$OUT/fused_fp8.json" 2>&1 | tee "$OUT/fused_fp8.log" | tail -80 ;;
depth)  # decode at V4-Flash depth (43 layers, its schedule, 16 experts): as shipped (FP8 + MXFP4) vs bf16, each vs its floor
  for q in ${DEPTH_QUANTS:-fp8-fp4 bf16}; do
    timeout 270 python3 -m tools.bench_engine --preset flash-depth --quant "$q" --cache-dir $CK --concurrency 1,32,150 \
      --input-len 512 --output-len 32 --requests-per-user 1 --floor --steady 1,32,150 --label "depth-$q" \
      --engine-args '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
      --json "$OUT/depth_$q.json" 2>&1 | tee "$OUT/depth_$q.log" | grep -E "floor|steady|online|Error|error" | tail -12
    rm -rf "$CK"/flash-depth*  # 46 GB in bf16: one at a time on the 64 GB disk
  done ;;
v41)  # DeepSeek-V4.1-Flash-shaped (released 40-layer schedule and per-layer shapes, 8 experts; FP8 32x32 tiles +
  # FP4 experts as shipped, both kept as stored: the FP8 kernels read the 32x32 tiles): TTFT 1K/8K/32K with
  # decoder-side bounded replay off/on,
  # the prefill eager and through the engine's own mixed-step CUDA graphs at max_num_seqs 64 (replay on: a front
  # graph per token count + a tail graph per kept-row bucket; replay off: graphs captured for it at the same
  # max_num_seqs); decode at batch 1/32 with CUDA graphs and eagerly vs the floor; graphed greedy tokens vs padded
  # eager / eager for decode and for mixed steps (~5 min: the 16 GB checkpoint ~45 s, the captures, the 32K
  # prompts ~60 s, batch-32 prefills)
  timeout 560 python3 -m tools.bench_v41 --cache-dir $CK --reps 1 --eager-steps 4 --json "$OUT/v41.json" 2>&1 \
    | tee "$OUT/v41.log" | grep -v "^  TTFT" | tail -16
  rm -rf "$CK"/v41-* ;;
v41-fp8)  # issue 25, V4.1's FP8 32x32 linears kept as stored: the V4.1-Flash-shaped engine's fused kernels (the FP8
  # GEMVs and MMA reading 32x32 tiles, on every linear) against the torch references through prefill, mixed and decode
  # steps, then the FP8 linear kernels alone at V4.1-Flash's shapes (check, then a sweep of tiles; ~6 min with the
  # checkpoint write). Decode vs its floor (which now counts the FP8 bytes): the v41 mode.
  M=$CK/v41-flash-shaped-fp8-fp4
  [ -f $M/config.json ] || timeout 120 python3 -m tools.make_tiny_checkpoint $M --preset v41-flash-shaped --quant fp8-fp4 \
    --device cuda 2>&1 | tail -1
  timeout 150 python3 -m tools.bench_engine --model $M --concurrency '' --check-kernels \
    --engine-args '{"max_model_len":4096,"max_num_seqs":32,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/check_v41.json" 2>&1 | tee "$OUT/check_v41.log" | grep -E "default vs|rror|FP8 linears" | tail -4
  rm -rf "$CK"/v41-*
  timeout 170 python3 -m tools.bench_quant --v41 --quick --budget 130 --json "$OUT/quant_v41.json" 2>&1 \
    | tee "$OUT/quant_v41.log" | tail -32 ;;
fp8-bf16)  # does keeping FP8 linears as stored pay? The engine's FP8 dispatch per V4.1 / V4 linear vs cuBLAS on the
  # same weight in bf16 at 1 / 32 / 2048 rows (~30 s; session 9: V4.1's 32x32 MMA 7-12x slower at 2048 rows)
  timeout 170 python3 -m tools.bench_fp8_vs_bf16 --rows 1,32,2048 --json "$OUT/fp8_vs_bf16.json" 2>&1 | tail -45 ;;
v41-serve)  # V4.1-Flash-shaped through the real Triton server (engine core process), closed loop at 1/32/150 users,
  # 512 in / 64 out (~5 min; needs .cache/h200 carried: bash tools/h200_env.sh pack)
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  M=$CK/v41-flash-shaped-fp8-fp4
  [ -f $M/config.json ] || timeout 120 python3 -m tools.make_tiny_checkpoint $M --preset v41-flash-shaped --quant fp8-fp4 \
    --device cuda 2>&1 | tail -1
  timeout 400 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --driver threads --protocol grpc \
    --engine-args '{"max_model_len":4096,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
    --concurrency 1,32,150 --input-len 512 --output-len 64 --duration 30 --stop-timeout 20 --out "$OUT" \
    --label v41-triton 2>&1 | tee "$OUT/v41_sweep.log" | grep -E "c=|rror|weights" | tail -6
  rm -rf "$CK"/v41-* ;;
recheck)  # after session 6's split-order fix: do graph steps now equal their eager twins (issues 20 and 21)? One
  # checkpoint: the mixed-step check + diagnosis at budget 512 (8/8 against padded eager means FULL graphs can be
  # the default again), then speculative decoding at batch 1 and 8 (forced acceptance near 1 means the verify
  # graph reproduces the run it replays); about 6 minutes with the checkpoint write
  timeout 300 python3 -m tools.bench_mixed --preset flash-depth --quant fp8-fp4 --cache-dir $CK --check-only \
    --step-budgets 512 --budgets 512 --users 8 --engine-args '{"max_model_len":8192,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/mixed_check.json" 2>&1 | tee "$OUT/mixed_check.log" | grep -E "check:|diag:|diag \(sizes" | tail -6
  timeout 240 python3 -m tools.bench_spec --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batches 1,8 \
    --input-len 512 --output-len 48 \
    --engine-args '{"max_model_len":4096,"block_size":128,"gpu_memory_utilization":0.9,"cudagraph_mode":"FULL_DECODE_ONLY"}' \
    --json "$OUT/spec.json" 2>&1 | tee "$OUT/spec.log" | grep -vE "^(INFO|WARNING)" | tail -8 ;;
mixed)  # issue 20 at V4-Flash depth as shipped (FP8 + MXFP4), one engine: mixed-step graphs vs eager (tokens, then ms
  # per step of 64 decodes + a prefill chunk at budgets 512 / 2048), then the budget sweep: 64 users, 1024-token
  # prompts, 128 output tokens, closed loop, per budget TTFT / ITL / out tok/s (about 5-7 minutes with the checkpoint)
  timeout 570 python3 -m tools.bench_mixed --preset flash-depth --quant fp8-fp4 --cache-dir $CK \
    --budgets ${BUDGETS:-256,512,1024,2048} --step-budgets 512,2048 --users 64 --requests-per-user ${RPU:-2} \
    --input-len 1024 --output-len 128 --engine-args '{"max_model_len":8192,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/mixed.json" 2>&1 | tee "$OUT/mixed.log" | grep -vE "^\s*$|INFO" | tail -24 ;;
engine)  # the headline: V4-Flash depth as shipped (FP8 + MXFP4); per-layer time vs the per-layer floor
  timeout 560 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1,32,64 --input-len 1024 \
    --output-len 64 --requests-per-user 1 --floor --steady 1,32,64,150 \
    --engine-args '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/engine_depth.json" 2>&1 | tee "$OUT/engine_depth.log" | grep -E "floor|steady|layer|online|Error|error" | tail -16 ;;
quick)  # the 4-layer flash-shaped preset: optimized (graphs checked vs eager and the references) and baseline
  bench --concurrency 1,8,32,64,150 --input-len 512 --output-len 64 --requests-per-user 1 --floor --check-graphs --steady 1,32,150 \
    --engine-args "{$EA}" --json "$OUT/engine_opt.json" 2>&1 | tee "$OUT/engine_opt.log" | tail -14
  bench --concurrency 1,32,150 --input-len 512 --output-len 64 --requests-per-user 1 --baseline \
    --engine-args "{$EA}" --json "$OUT/engine_base.json" 2>&1 | tee "$OUT/engine_base.log" | tail -6 ;;
sync)  # the optimized engine with async scheduling off: what overlapping host and GPU buys
  bench --concurrency 1,32,150 --input-len 512 --output-len 64 --requests-per-user 1 --label sync --steady 1,32,150 \
    --engine-args "{$EA,\"async_scheduling\":false}" --json "$OUT/engine_sync.json" 2>&1 | tee "$OUT/engine_sync.log" | tail -5 ;;
ttft)  # TTFT of a 1024-token prompt at batch 1, our engine alone (peer adds transformers)
  bench --concurrency 1 --input-len 1024 --output-len 32 --requests-per-user 3 \
    --engine-args "{$EA}" --json "$OUT/ttft_1024.json" 2>&1 | tee "$OUT/ttft_1024.log" | tail -3 ;;
largest)  # the largest V4-Flash-shaped model one H200 holds as shipped (43 layers, 128 MXFP4 experts, ~85 GB;
  # shards spill to /dev/shm past the 64 GB disk): it loads, decode steps vs floor, it serves through Triton
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  M=$CK/flash-depth-e128-fp8-fp4; LA='{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
  [ -f $M/config.json ] || { t0=$SECONDS; timeout 300 python3 -m tools.make_tiny_checkpoint $M \
    --preset flash-depth --override '{"n_routed_experts":128}' --quant fp8-fp4 --device cuda --spill-dir /dev/shm/ckpt 2>&1 | tail -2; echo "written in $((SECONDS - t0)) s"; }
  du -shL $M | tee "$OUT/largest_size.txt"
  timeout 240 python3 -m tools.bench_engine --model $M --concurrency '' --steady 1,32,150 --floor --label largest --engine-args "$LA" \
    --json "$OUT/largest.json" 2>&1 | tee "$OUT/largest.log" | grep -E "floor|steady|holds|shard 4[34]/|rror" | tail -9
  timeout 240 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --engine-args "$LA" --driver threads --protocol grpc \
    --concurrency 1,32 --input-len 512 --output-len 64 --duration 15 --stop-timeout 20 --out "$OUT" --label largest-triton 2>&1 \
    | tee "$OUT/largest_sweep.log" | grep -E "c=|rror|weights" | tail -5 ;;
spec)  # issue 21: MTP speculative decoding at V4-Flash depth (FP8 + MXFP4): plain, draft and verify (graph and eager) step
  # times at batch 1, 8, 32, the modelled speed-up by acceptance rate, end to end with the random MTP (~0 accepted) and with
  # drafts forced to agree (that run's outputs replayed); about 4 minutes with the checkpoint write
  timeout 270 python3 -m tools.bench_spec --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batches 1,8,32 \
    --input-len 512 --output-len 48 \
    --engine-args '{"max_model_len":4096,"block_size":128,"gpu_memory_utilization":0.9,"cudagraph_mode":"FULL_DECODE_ONLY"}' \
    --json "$OUT/spec.json" 2>&1 | tee "$OUT/spec.log" | grep -vE "^(INFO|WARNING)" | tail -30 ;;
check-defaults)  # first after CPU-only work: the default paths changed since the last GPU run, checked before anything
  # is timed (~5 min): V4.1's FP8 dispatch against cuBLAS (its 32x32 linears' prefill now unpacked to bf16), then
  # V4.1-Flash-shaped against the torch references (the unpacked prefill; the router and pooling weights held in fp32).
  # The checkpoint stays for a `v41` call right after. (4-layer V4's check: session 8's last call, unchanged since.)
  timeout 120 python3 -m tools.bench_fp8_vs_bf16 --rows 1,32,2048 --only v41 --json "$OUT/fp8_vs_bf16.json" 2>&1 | tail -4
  M=$CK/v41-flash-shaped-fp8-fp4
  [ -f $M/config.json ] || timeout 120 python3 -m tools.make_tiny_checkpoint $M --preset v41-flash-shaped --quant fp8-fp4 \
    --device cuda 2>&1 | tail -1
  timeout 200 python3 -m tools.bench_engine --model $M --concurrency '' --check-kernels \
    --engine-args '{"max_model_len":4096,"max_num_seqs":32,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/check_v41.json" 2>&1 | tee "$OUT/check_v41.log" | grep -E "default vs|rror|FP8 linears" | tail -4 ;;
final)  # session 7's last call, most important first: the fused kernels against the torch references on the GPU (4-layer
  # V4 as shipped: chunked prefill, mixed and decode steps), speculative decoding at V4-Flash depth at batch 1 and 8,
  # then V4.1-Flash-shaped: its kernels against the references, TTFT / decode / mixed graphs; the compressors'
  # multi-row kernels timed last (~9.5 min)
  timeout 180 python3 -m tools.bench_engine --preset flash-shaped --cache-dir $CK --quant fp8-fp4 --concurrency '' \
    --check-kernels --engine-args "{$EA}" --json "$OUT/check_v4.json" 2>&1 | tee "$OUT/check_v4.log" \
    | grep -E "default vs|rror" | tail -3
  timeout 170 python3 -m tools.bench_spec --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batches 1,8 \
    --input-len 512 --output-len 48 \
    --engine-args '{"max_model_len":4096,"block_size":128,"gpu_memory_utilization":0.9,"cudagraph_mode":"FULL_DECODE_ONLY"}' \
    --json "$OUT/spec.json" 2>&1 | tee "$OUT/spec.log" | grep -vE "^(INFO|WARNING)" | tail -22
  rm -rf "$CK"/flash-depth-*
  M=$CK/v41-flash-shaped-fp8-fp4
  timeout 120 python3 -m tools.make_tiny_checkpoint $M --preset v41-flash-shaped --quant fp8-fp4 --device cuda 2>&1 | tail -1
  timeout 130 python3 -m tools.bench_engine --model $M --concurrency '' --check-kernels \
    --engine-args '{"max_model_len":4096,"max_num_seqs":32,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/check_v41.json" 2>&1 | tee "$OUT/check_v41.log" | grep -E "default vs|rror" | tail -3
  timeout 230 python3 -m tools.bench_v41 --cache-dir $CK --reps 1 --eager-steps 4 --lengths 1024,8192 \
    --json "$OUT/v41.json" 2>&1 | tee "$OUT/v41.log" | grep -v "^  TTFT" | tail -16
  rm -rf "$CK"/v41-*
  timeout 60 python3 -m tools.bench_fused --only compress --json "$OUT/compress.json" > "$OUT/compress.log" 2>&1
  tail -12 "$OUT/compress.log" ;;
profile-spec)  # issues 21 and 25: where a speculative step's time goes at V4-Flash depth as shipped (batch 1, k = 3: the
  # host under cProfile, then the GPU's kernels), and a V4.1-Flash-shaped decode step's kernels at batch 1 (~5 min)
  SPEC='{"speculative_config":{"method":"mtp","num_speculative_tokens":3},"cudagraph_mode":"FULL_DECODE_ONLY"}'
  timeout 200 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 1 --steps 48 \
    --rows 45 --host --engine-args "$SPEC" > "$OUT/profile_spec_host.txt" 2>&1; tail -1 "$OUT/profile_spec_host.txt"
  timeout 120 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 1 --steps 48 \
    --rows 45 --engine-args "$SPEC" > "$OUT/profile_spec_gpu.txt" 2>&1; tail -1 "$OUT/profile_spec_gpu.txt"
  M=$CK/v41-flash-shaped-fp8-fp4
  timeout 120 python3 -m tools.make_tiny_checkpoint $M --preset v41-flash-shaped --quant fp8-fp4 --device cuda 2>&1 | tail -1
  timeout 150 python3 -m tools.profile_decode --model $M --batch 1 --steps 48 --rows 45 > "$OUT/profile_v41_b1.txt" 2>&1
  tail -1 "$OUT/profile_v41_b1.txt"; rm -rf "$CK"/v41-* ;;
profile-depth)  # where a depth-43 decode step goes as shipped (FP8 + MXFP4): kernels by CUDA time at batch 1 and 150
  df -h / /tmp /dev/shm > "$OUT/disk.txt" 2>&1; cat "$OUT/disk.txt"
  for b in 1 150; do
    timeout 160 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch $b --steps 48 \
      --rows 45 > "$OUT/profile_depth_b$b.txt" 2>&1; tail -1 "$OUT/profile_depth_b$b.txt"
  done ;;
check-s10)  # session 10's last changes: the fused kernels' check on the GPU (wo_a through cuBLAS per group in place, hc_pre's
  # decode token tiles, with the rest), then at V4-Flash depth as shipped TTFT of 1024 tokens and decode at 1 / 32 (~6 min)
  timeout 170 python3 -m tools.bench_fused --only align --json "$OUT/fused_check.json" 2>&1 | tee "$OUT/fused_check.log" \
    | grep -E "check:|MISMATCH" | head -12
  timeout 230 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1 --input-len 1024 \
    --output-len 8 --requests-per-user 3 --floor --steady 1,32 \
    --engine-args '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/engine_depth.json" 2>&1 | tee "$OUT/engine_depth.log" | grep -E "TTFT of|batch [0-9]+: step|rror" | tail -4 ;;
attention-s11)  # session 11: the attention kernel's tiles swept on a 2048-token chunk, the default dispatch at 2048 / 1 /
  # 32 / 150 tokens, against the three-loop kernel it replaced when tools/_old_attention.py is carried (git show 3f023ce~1:kernels/fused_attention.py), then the 4-layer engine as
  # shipped against the references (~6 min)
  AG=; [ -f tools/_old_attention.py ] && AG="--against tools._old_attention"
  timeout 330 python3 -m tools.bench_attention_prefill $AG --json "$OUT/attention_prefill.json" 2>&1 \
    | tee "$OUT/attention.log" | grep -E "best|MISMATCH|reference|T=" | tail -12
  timeout 200 python3 -m tools.bench_engine --preset flash-shaped --cache-dir $CK --quant fp8-fp4 --concurrency '' \
    --check-kernels --engine-args "{$EA}" --json "$OUT/check_v4.json" 2>&1 | tee "$OUT/check_v4.log" \
    | grep -E "default vs|rror" | tail -3 ;;
depth-s11)  # session 11's end: the fused kernels' check (the stacked pair through cuBLAS as two GEMMs among them), at
  # V4-Flash depth as shipped TTFT of 1024 tokens and decode steps at 1 / 32 / 150 vs their floors, the attention
  # kernel at chunk and decode sizes (against the three-loop kernel when tools/_old_attention.py is carried), then where
  # a 4 x 1024-token prefill goes, kernels and the torch ops that launched them (~9 min with the checkpoint write)
  timeout 120 python3 -m tools.bench_fused --only align --json "$OUT/fused_check.json" 2>&1 | tee "$OUT/fused_check.log" \
    | grep -E "check:|MISMATCH" | head -6
  M=$CK/flash-depth-fp8-fp4; DA='{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
  timeout 260 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1 --input-len 1024 \
    --output-len 8 --requests-per-user 3 --floor --steady 1,32,150 --engine-args "$DA" \
    --json "$OUT/engine_depth.json" 2>&1 | tee "$OUT/engine_depth.log" | grep -E "TTFT of|batch [0-9]+: step|rror" | tail -6
  AG=; [ -f tools/_old_attention.py ] && AG="--against tools._old_attention"
  timeout 120 python3 -m tools.bench_attention_prefill $AG --json "$OUT/attention_prefill.json" 2>&1 \
    | tee "$OUT/attention.log" | grep -E "best|MISMATCH|T=" | tail -24
  timeout 100 python3 -m tools.profile_decode --model $M --batch 4 --steps 1 --prompt-len 1024 --rows 40 --ops \
    > "$OUT/profile_prefill_v4.txt" 2>&1; tail -1 "$OUT/profile_prefill_v4.txt" ;;
depth-s10)  # issue 20 after session 10's prefill paths, at V4-Flash depth as shipped: TTFT of 1024 tokens and decode steps
  # vs their floors, where a 4 x 1024-token prefill goes, then 64 users through the real Triton server, 1024 in / 128
  # out, 60 s (~9 min; needs .cache/h200 carried)
  bash tools/h200_env.sh setup /tmp/tvenv > /tmp/env.log 2>&1 || { tail /tmp/env.log; exit 1; }
  M=$CK/flash-depth-fp8-fp4; DA='{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
  timeout 240 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1 --input-len 1024 \
    --output-len 8 --requests-per-user 3 --floor --steady 1,64,150 --engine-args "$DA" \
    --json "$OUT/engine_depth.json" 2>&1 | tee "$OUT/engine_depth.log" | grep -E "TTFT of|batch [0-9]+: step|rror" | tail -5
  timeout 120 python3 -m tools.profile_decode --model $M --batch 4 --steps 1 --prompt-len 1024 --rows 30 \
    > "$OUT/profile_prefill_v4.txt" 2>&1; tail -1 "$OUT/profile_prefill_v4.txt"
  timeout 200 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --engine-args "$DA" --driver threads --protocol grpc \
    --concurrency 64 --input-len 1024 --output-len 128 --duration 60 --stop-timeout 30 --out "$OUT" --label depth-triton-64 \
    2>&1 | tee /tmp/depth_sweep.log | grep -E "c=|rror|weights" | tail -4 ;;
prefill)  # issue 20, session 10's prefill paths: V4's FP8 linears through cuBLAS's blockwise FP8 GEMM (checked vs the
  # act-quant reference, timed vs the "mma" kernel it replaces), the MoE through unpacked experts + grouped GEMM
  # (checked, timed vs the fused kernels), the default engine vs the references (4-layer, as shipped), then at V4-Flash
  # depth the one-user TTFT of 1024 tokens and where a 4 x 1024-token prefill goes; the attention tiles swept last (~10 min)
  timeout 100 python3 -m tools.bench_fp8_vs_bf16 --rows 128,256,512,1024,2048 --only v4 --json "$OUT/fp8_cublas.json" 2>&1 \
    | tail -22
  timeout 120 python3 -m tools.bench_moe_prefill --experts 16 --fmt mxfp4 --json "$OUT/moe_prefill.json" 2>&1 | tail -7
  timeout 150 python3 -m tools.bench_engine --preset flash-shaped --cache-dir $CK --quant fp8-fp4 --concurrency '' \
    --check-kernels --engine-args "{$EA}" --json "$OUT/check_v4.json" 2>&1 | tee "$OUT/check_v4.log" \
    | grep -E "default vs|rror" | tail -3
  timeout 150 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1 --input-len 1024 \
    --output-len 8 --requests-per-user 3 --floor \
    --engine-args '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/engine_ttft.json" 2>&1 | tee "$OUT/engine_ttft.log" | grep -E "TTFT of|rror" | tail -3
  timeout 150 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 4 --steps 1 \
    --prompt-len 1024 --rows 40 > "$OUT/profile_prefill_v4.txt" 2>&1; tail -1 "$OUT/profile_prefill_v4.txt"
  timeout 200 python3 -m tools.bench_attention_prefill --json "$OUT/attention_prefill.json" 2>&1 | tee "$OUT/attention.log" \
    | grep -E "best|MISMATCH|reference|rror" ;;
profile-v4)  # issue 20 at V4-Flash depth as shipped, one checkpoint: where a 1024-token prefill goes (4 prompts, kernels by
  # CUDA time), where a batch-1 decode step goes, the one-user TTFT of 1024 tokens vs its FLOP floor, then V4's FP8
  # linears against cuBLAS bf16 and cuBLAS's blockwise FP8 GEMM (~8 min with the checkpoint write)
  timeout 200 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 4 --steps 1 \
    --prompt-len 1024 --rows 60 > "$OUT/profile_prefill_v4.txt" 2>&1; tail -1 "$OUT/profile_prefill_v4.txt"
  timeout 120 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 1 --steps 48 \
    --rows 60 > "$OUT/profile_depth_b1.txt" 2>&1; tail -1 "$OUT/profile_depth_b1.txt"
  timeout 150 python3 -m tools.bench_engine --preset flash-depth --quant fp8-fp4 --cache-dir $CK --concurrency 1 --input-len 1024 \
    --output-len 8 --requests-per-user 3 --floor --steady 1 \
    --engine-args '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}' \
    --json "$OUT/engine_ttft.json" 2>&1 | tee "$OUT/engine_ttft.log" | grep -E "floor|steady|layer|online|rror" | tail -8
  timeout 120 python3 -m tools.bench_fp8_vs_bf16 --rows 1,32,1024,2048 --only v4 --json "$OUT/fp8_vs_bf16.json" 2>&1 | tail -24 ;;
profile-prefill)  # issues 20 and 25: where a 1024-token prefill's time goes (kernels by CUDA time, 4 prompts in one
  # step each, one output token): V4-Flash depth as shipped, then V4.1-Flash-shaped (~5 min with both checkpoints)
  timeout 200 python3 -m tools.profile_decode --preset flash-depth --quant fp8-fp4 --cache-dir $CK --batch 4 --steps 1 \
    --prompt-len 1024 --rows 45 > "$OUT/profile_prefill_v4.txt" 2>&1; tail -1 "$OUT/profile_prefill_v4.txt"
  rm -rf "$CK"/flash-depth-*
  timeout 200 python3 -m tools.profile_decode --preset v41-flash-shaped --quant fp8-fp4 --cache-dir $CK --batch 4 \
    --steps 1 --prompt-len 1024 --rows 45 > "$OUT/profile_prefill_v41.txt" 2>&1; tail -1 "$OUT/profile_prefill_v41.txt" ;;
profile)
  python3 -m tools.profile_decode --batch 1 --steps 200 --rows 40 > "$OUT/profile_b1.txt" 2>&1; tail -1 "$OUT/profile_b1.txt"
  python3 -m tools.profile_decode --batch 1 --steps 200 --rows 30 --host > "$OUT/host_b1.txt" 2>&1; tail -1 "$OUT/host_b1.txt" ;;
agentic)
  for mode in none snapshot replay; do
    case $mode in none) pc=false; rp=true;; snapshot) pc=true; rp=false;; replay) pc=true; rp=true;; esac
    bench --workload agentic --concurrency 4 --turns 4 --input-len 2048 --turn-len 256 --output-len 16 \
      --engine-args "{$EA,\"enable_prefix_caching\":$pc,\"swa_bounded_replay\":$rp}" --label $mode \
      --json "$OUT/agentic_$mode.json" 2>&1 | tee "$OUT/agentic_$mode.log" | tail -4
  done ;;
numpy2)  # the image's numpy 2 beside Triton 2.51's stub: the launcher refuses; forced past it, the model's self-check refuses
  bash tools/h200_env.sh setup /tmp/tvenv2 > "$OUT/env2.log" 2>&1 || { tail "$OUT/env2.log"; exit 1; }
  rm -rf /tmp/tvenv2/lib/python3.12/site-packages/numpy /tmp/tvenv2/lib/python3.12/site-packages/numpy-*  # the image's 2.x shows through
  timeout 240 /tmp/tvenv2/bin/python - <<'EOF' 2>&1 | tee "$OUT/numpy2.log" | tail -6
import numpy
from backend import serve
print("numpy", numpy.__version__)
try:
    serve.TritonServer(http_port=0, grpc_port=0, metrics_port=0).start()
    print("launcher: STARTED (wrong)")
except serve.ServerError as e:
    print("launcher refused:", str(e)[:200])
serve.stub_numpy_problem = lambda install, version: None  # what a launcher without the check would do
try:
    serve.TritonServer(http_port=0, grpc_port=0, metrics_port=0, startup_timeout_s=200).start().stop()
    print("model: LOADED (wrong)")
except serve.ServerError as e:
    print("model refused:", [line for line in str(e).splitlines() if "BYTES" in line][:1])
EOF
  ;;
serve-depth)  # issue 20's serving target at V4-Flash depth as shipped (43 layers, 16 experts, FP8 + MXFP4, cudagraph_mode FULL):
  # the pure-decode step at batch 64, then 64 users through the real Triton server (engine core process), 1024-token
  # prompts, 128 output tokens, closed loop for 90 s: ITL p50 against that step, TTFT p90 against p50 (~6 min)
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  M=$CK/flash-depth-fp8-fp4; DA='{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
  [ -f $M/config.json ] || timeout 150 python3 -m tools.make_tiny_checkpoint $M --preset flash-depth --quant fp8-fp4 \
    --device cuda 2>&1 | tail -1
  timeout 150 python3 -m tools.bench_engine --model $M --concurrency '' --steady 64 --input-len 1024 --engine-args "$DA" \
    --json "$OUT/depth_steady64.json" 2>&1 | tee "$OUT/depth_steady64.log" | grep -E "steady|rror" | tail -2
  timeout 300 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --engine-args "$DA" --driver threads --protocol grpc \
    --concurrency 64 --input-len 1024 --output-len 128 --duration 90 --stop-timeout 30 --out "$OUT" --label depth-triton-64 \
    2>&1 | tee "$OUT/depth_sweep.log" | grep -E "c=|rror|weights" | tail -4 ;;
ratio-depth)  # issue 20's last target at V4-Flash depth as shipped: output tok/s per GPU at 150 tok/s per user (or the
  # baseline's best), optimized vs the engine's own baseline (tools/bench_engine.py BASELINE), both through the real
  # Triton server, 1024 in / 128 out, 20 s per level (~9 min: two server starts; needs .cache/h200 carried)
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  M=$CK/flash-depth-fp8-fp4; DA='"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9'
  [ -f $M/config.json ] || timeout 150 python3 -m tools.make_tiny_checkpoint $M --preset flash-depth --quant fp8-fp4 \
    --device cuda 2>&1 | tail -1
  SW="/tmp/tvenv/bin/python -m loadtest.sweep --serve --model $M --driver threads --protocol grpc --input-len 1024
    --output-len 128 --duration 20 --stop-timeout 20 --out $OUT"
  timeout 250 $SW --engine-args "{$DA}" --concurrency 1,32,64,150 --label depth-optimized 2>&1 | grep -E "c=|rror" | tail -5
  # the baseline's step at this depth is ~0.76 s (session 9): one 128-token request takes ~100 s, so one user,
  # a window it fits in, and the wait for it (at 32 users nothing finished in 190 s)
  timeout 300 $SW --engine-args "{$DA,\"kernels\":\"ref\",\"enforce_eager\":true,\"enable_prefix_caching\":false,\"async_scheduling\":false}" \
    --concurrency 1 --duration 40 --stop-timeout 150 --label depth-baseline 2>&1 | grep -E "c=|rror" | tail -4
  python3 -m loadtest.interactivity "$OUT/depth-optimized.json" "$OUT/depth-baseline.json" --at 150 \
    --json "$OUT/ratio_depth.json" | tail -1 ;;
serving)  # issue 16: one closed-loop workload through Triton (engine core process) and through the engine's async API
  bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
  bench --concurrency 1 --input-len 16 --output-len 4 --requests-per-user 1 --engine-args "{$EA}" > "$OUT/ckpt.log" 2>&1  # writes $CK/flash-shaped
  timeout 280 /tmp/tvenv/bin/python -m loadtest.sweep --serve --model $CK/flash-shaped --engine-args "{$EA}" --driver threads \
    --protocol grpc --concurrency 1,32,150 --input-len 512 --output-len 64 --duration 20 --stop-timeout 20 \
    --out "$OUT" --label triton 2>&1 | tee "$OUT/sweep.log" | grep -E "c=|error" | tail -4
  timeout 200 python3 -m tools.bench_engine --model $CK/flash-shaped --core-process --concurrency 1,32,150 --input-len 512 \
    --output-len 64 --requests-per-user 4 --engine-args "{$EA}" --json "$OUT/engine_direct.json" 2>&1 | tee "$OUT/direct.log" | tail -5 ;;
tp-share)  # issue 18: rank 0's share of V4-Flash as shipped at tensor_parallel_size 8 (43 layers, 8/64 heads, 32/256 MXFP4 experts), collectives skipped
  timeout 420 python3 -m tools.bench_tp_share --world ${TP_WORLD:-8} --batches 1,32,150 --input-len 512 --chunk 2048 \
    --json "$OUT/tp_share.json" 2>&1 | tee "$OUT/tp_share.log" | grep -vE "^\s*$|INFO" | tail -12 ;;
structured)  # issue 23: structured outputs' decode step time at batch 1/32/150 with 0/50/100% JSON-schema-constrained rows
  timeout 200 python3 -m tools.bench_structured --preset flash-shaped --cache-dir $CK --steps 30 \
    --json "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | grep -E "batch|compile|GPU|Error|error" | tail -12 ;;
peer)
  bench --concurrency 1 --input-len 1024 --output-len 32 --requests-per-user 2 --hf-peer 1,8 \
    --engine-args "{$EA}" --json "$OUT/peer_1024.json" 2>&1 | tee "$OUT/peer_1024.log" | tail -6
  bench --concurrency 32 --input-len 512 --output-len 32 --requests-per-user 1 --hf-peer 32 \
    --engine-args "{$EA}" --json "$OUT/peer_512.json" 2>&1 | tee "$OUT/peer_512.log" | tail -6 ;;
esac
