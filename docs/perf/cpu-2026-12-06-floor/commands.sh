# The teacher-forced check's noise floor at growing depth on the tiny preset (CPU, 2 cores; ~20-30 s each).
# Run from the repository root: bash docs/perf/cpu-2026-12-06-floor/commands.sh
set -e
mkdir -p /tmp/floordepth
for L in 4 16 32; do
  R=$(python3 -c "L=$L; print([0] + [4,16]*((L-2)//2) + [4] + [0])")
  python -m tools.make_tiny_checkpoint /tmp/floordepth/tiny-L$L --preset tiny \
    --override "{\"num_hidden_layers\": $L, \"compress_ratios\": $R}"
  python -m tools.check_teacher_forced --model /tmp/floordepth/tiny-L$L --reference rounded --floor --prompts 4 \
    --prompt-len 16 --steps 32 --probes 1 --json /tmp/floordepth/L$L.json > /tmp/floordepth/L$L.log 2>&1 || true
done
