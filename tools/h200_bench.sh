#!/usr/bin/env bash
# The benchmark suites on a GPU machine, one device call for one or a few suites:
#   bash tools/h200_bench.sh SUITE...        (python -m benchmarks list names them)
# Each suite writes $OUT/SUITE.json (python -m benchmarks report|compare reads it) and a log per step.
# Suites that serve through Triton need .cache/h200 carried (bash tools/h200_env.sh pack): the image's
# numpy 2 breaks Triton 2.51's stub, so they run from the venv tools/h200_env.sh builds.
# PRESET=NAME replaces the suites' model preset; checkpoints are drawn on the GPU into CKPT (/tmp/ckpt) and reused.
# Triton's compiled kernels (cubins, their metadata, the launchers) persist between fresh machines: a carried
# .cache/triton-jit.tar.xz is unpacked into the cache before the suites and the cache goes back packed as
# $OUT/triton-jit.tar.xz (copy it to .cache/ for the next call). A fresh machine otherwise spends ~2 minutes
# compiling the engine's kernels at V4-Flash depth before its first step. The cache lives at one fixed path
# because Triton's cache groups name their files by absolute path.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
[ $# -gt 0 ] || { python3 -m benchmarks list; exit 2; }
if [ -d .cache/h200 ]; then
  [ -x /tmp/tvenv/bin/python ] || bash tools/h200_env.sh setup /tmp/tvenv > "$OUT/env.log" 2>&1 \
    || { tail "$OUT/env.log"; exit 1; }
  export BENCH_TRITON_PYTHON=/tmp/tvenv/bin/python
fi
export TRITON_CACHE_DIR=/tmp/triton-jit
[ -f .cache/triton-jit.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ] && tar -xJf .cache/triton-jit.tar.xz -C /tmp
rc=0
for suite in "$@"; do
  python3 -m benchmarks run "$suite" ${PRESET:+--preset "$PRESET"} --out "$OUT/$suite.json" --ckpt "${CKPT:-/tmp/ckpt}" || rc=1
done
if [ -d "$TRITON_CACHE_DIR" ]; then  # what a hit needs: metadata, groups, cubins, launchers (not the IRs)
  (cd /tmp && find triton-jit -type f \( -name '*.json' -o -name '*.cubin' -o -name '*.so' \) -print0 \
    | XZ_OPT=-T0 tar --null -cJf "$OUT/triton-jit.tar.xz" -T -) || rm -f "$OUT/triton-jit.tar.xz"
fi
exit $rc
