#!/bin/bash
# A/B: old vs new rdsd, 2 poll threads (unpinned), one task per side (every message crosses).
mkdir -p /tmp/ab
B=${B:-target/release}  # rds-bench
run() { # bin tag round
  local S=/tmp/ab/s-$2-$3.sock; rm -f $S
  $1 --control-socket $S --state-file /tmp/ab/state-$2-$3 --poll-core -2 --poll-core -2 --control-core -2 --log warn >/tmp/ab/log-$2-$3 2>&1 &
  local P=$!
  for _ in $(seq 100); do [[ -S $S ]] && break; sleep 0.1; done
  $B/rds-bench --pair --socket $S --attach-per-task -t ${T:-1} -d 16 -q 64 -a 64 -T 3 --transports rds,unix --mode ${MODE:-blocking} --yield-every 8 -z --json > ${OUT:-/tmp/ab}/$2-$3.json 2>/tmp/ab/$2-$3.err
  kill $P; wait $P 2>/dev/null
}
for r in 1 2 3 4; do run /tmp/rdsd-old old $r; run /tmp/rdsd-new new $r; done
