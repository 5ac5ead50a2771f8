#!/bin/bash
# Local RTT on an rdsd whose poll thread also holds an idle kernel-TCP connection (8 paths), vs none.
# usage: ep.sh RDSD_BIN TAG CONNECT(0|1)
set -u
BIN=/work/main/target/release
R=$1; TAG=$2; CONN=$3
A=epa$$; B=epb$$
cleanup() { kill $PA $PB 2>/dev/null; wait $PA $PB 2>/dev/null; ip netns del $A; ip netns del $B; }
ip netns add $A; ip netns add $B
ip link add eth0 netns $A type veth peer name eth0 netns $B
for n in $A $B; do ip -n $n link set lo up; ip -n $n link set eth0 up; done
ip -n $A addr add 10.78.0.1/24 dev eth0; ip -n $B addr add 10.78.0.2/24 dev eth0
ip netns exec $A $R --control-socket /tmp/$A.sock --state-file /tmp/$A.st --poll-core 1 --control-core 0 --idle spin --local-addr 10.78.0.1/32 --local-addr 127.0.0.0/8 --paths 8 --log warn &
PA=$!
ip netns exec $B $R --control-socket /tmp/$B.sock --state-file /tmp/$B.st --poll-core -2 --control-core -2 --local-addr 10.78.0.2/32 --paths 8 --log warn &
PB=$!
trap cleanup EXIT
for i in $(seq 100); do [[ -S /tmp/$A.sock && -S /tmp/$B.sock ]] && break; sleep 0.1; done
if [ $CONN = 1 ]; then
  for i in $(seq 60); do ip netns exec $A $BIN/rdsctl -s /tmp/$A.sock ping 10.78.0.2 -I 10.78.0.1 -c 1 -W 1 >/dev/null 2>&1 && break; sleep 0.5; done
  sleep 1
  echo "paths up: $($BIN/rdsctl -s /tmp/$A.sock stats | grep '^tcp_path_up ')"
fi
$BIN/rds-bench rtt --socket /tmp/$A.sock --app-core 0 --count 200000 2>&1 | tail -25
