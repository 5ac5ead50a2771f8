#!/bin/bash
RUN=/work/main/target/debug/rdsd-run
for b in old new; do
  S=/tmp/epr/$b.sock; rm -f $S
  /tmp/epr/rdsd-$b --control-socket $S --poll-core -2 --control-core -2 --log warn > /dev/null 2>&1 &
  P=$!; sleep 0.5
  # 4 receivers blocked in recv (poll) and 4 in epoll, nothing sent, 5 s
  for k in 1 2 3 4; do RDSD_SOCKET=$S $RUN /tmp/epr/rdsguest recv 127.0.0.1:$((7300+k)) 1 5000 > /dev/null & done
  for k in 1 2 3 4; do RDSD_SOCKET=$S $RUN /tmp/epr/rdsguest recv 127.0.0.1:$((7400+k)) 1 5000 epoll=1 > /dev/null & done
  sleep 0.5; t0=$(awk '{print $14+$15}' /proc/$P/stat); sleep 4; t1=$(awk '{print $14+$15}' /proc/$P/stat)
  wait $(jobs -p | grep -v "^$P$") 2>/dev/null
  echo "$b rdsd cpu ticks over 4 s idle with 8 blocked receivers: $((t1-t0))"
  kill $P; wait $P 2>/dev/null
done
