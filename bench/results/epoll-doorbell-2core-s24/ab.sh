#!/bin/bash
# A/B: receiver doorbell sendtos per 5000-message transfer, old vs new rdsd, under 2 CPU hogs
RUN=/work/main/target/debug/rdsd-run
one() { # $1 = binary tag
  S=/tmp/epr/$1.sock; rm -f $S
  /tmp/epr/rdsd-$1 --control-socket $S --poll-core -2 --control-core -2 --log warn > /tmp/epr/$1.log 2>&1 &
  P=$!; sleep 0.5
  RDSD_SOCKET=$S RDS_RECV_SPIN_US=0 timeout 60 strace -f -c -o /tmp/epr/recv.c $RUN /tmp/epr/rdsguest recv 127.0.0.1:7150 5000 30000 epoll=1 nsock=3 > /tmp/epr/recv.out &
  R=$!; sleep 0.3
  RDSD_SOCKET=$S timeout 60 strace -f -c -o /tmp/epr/send.c $RUN /tmp/epr/rdsguest send 127.0.0.1:7250 127.0.0.1:7150 5000 64 linger=0 > /tmp/epr/send.out
  wait $R
  kill $P; wait $P 2>/dev/null
  n=$(awk '$NF=="sendto"{print $4}' /tmp/epr/recv.c); echo "$1 sendto=${n:-0} $(grep -o 'done got=[0-9]*' /tmp/epr/recv.out)"
}
timeout 600 yes > /dev/null & Y1=$!
timeout 600 yes > /dev/null & Y2=$!
for i in $(seq 1 ${N:-10}); do one old; one new; done
kill $Y1 $Y2
