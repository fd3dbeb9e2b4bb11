#!/usr/bin/env bash
# A list of benchmark suites longer than one device call (each call ends at 10 minutes): the suites run in their own
# process session, which outlives the call that started it while the machine stays held, and each call follows them.
#   bash tools/device_queue.sh start SUITE...   start tools/h200_bench.sh SUITE... in the background, then follow
#   bash tools/device_queue.sh follow           follow the queue a call before started
# Following ends when the queue does or after FOLLOW_S seconds (default 540); then what the queue wrote so far (each
# finished suite's JSON, every step's log, the Triton cache once it ends) is copied under $OUT, with QUEUE.log and,
# once the queue has ended, QUEUE.rc. Make the next call within the machine's idle release (status says, ~30 s):
# a machine given back ends the queue with it. Runs as root there (a process of another user would be ended).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
Q=${DEVICE_QUEUE_DIR:-/tmp/device_queue}  # one queue a machine
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-}" in
  start)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 start SUITE..." >&2; exit 2; }
    if [ -d "$Q" ] && [ ! -f "$Q/rc" ]; then echo "a queue is running: $0 follow" >&2; exit 2; fi
    rm -rf "$Q" && mkdir -p "$Q/out"
    OUT="$Q/out" setsid bash -c 'bash tools/h200_bench.sh "$@" > '"$Q"'/log 2>&1; echo $? > '"$Q"'/rc' _ "$@" \
      < /dev/null > /dev/null 2>&1 &
    ;;
  follow) [ -d "$Q" ] || { echo "no queue started on this machine (a fresh one?)" >&2; exit 2; } ;;
  *) echo "usage: $0 start SUITE... | follow" >&2; exit 2 ;;
esac
deadline=$((SECONDS + ${FOLLOW_S:-540}))
while [ ! -f "$Q/rc" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
cp -r "$Q/out/." "$OUT/" 2>/dev/null
cp "$Q/log" "$OUT/QUEUE.log" 2>/dev/null
if [ -f "$Q/rc" ]; then
  cp "$Q/rc" "$OUT/QUEUE.rc"; echo "queue ended: rc $(cat "$Q/rc")"
else
  echo "queue still running after ${FOLLOW_S:-540} s: call '$0 follow' again within the idle release"
fi
tail -n 40 "$Q/log"
[ -f "$Q/rc" ] && exit "$(cat "$Q/rc")"
exit 0
