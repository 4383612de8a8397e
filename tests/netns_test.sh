#!/usr/bin/env bash
# Hosts as network namespaces: four namespaces joined by veth pairs to a bridge in a fifth,
# addresses 10.77.<n>.1-4/24 assigned inside them (nothing leaves them) and everything removed at
# the end. ferry-bench moe runs one process per rank, each in its own namespace over
# tcp;ofi_rxm, bound to its namespace's address, meeting at rank 0's rendezvous: every rank exits
# 0 and rank 0 prints the figures; ferry-bench fabric and kv likewise, on two of them. Then a
# link goes down and comes back inside one world, which carries on, under MoE cycles and under
# KV requests (every result checked); and a link goes down for longer than the step deadline,
# which ends the world, and a new world forms once it is back (below). Skips (77) where the machine refuses namespaces.
# Last, the multi-process gtest suites given after FERRY_BENCH run their tcp cases with each
# forked rank in a namespace of its own (FERRY_LOCAL_RANK_NETNS, ferry/bootstrap.h).
# Usage: netns_test.sh FERRY_BENCH [GTEST_SUITE...]
set -u
bench=$1
shift
suites=("$@")
tag=f$$  # names unique to this run (interface names stay within 15 characters)
subnet=10.77.$(($$ % 250))
hosts=4
cleanup() {
  for i in $(seq 0 $((hosts - 1))); do ip netns del "${tag}h$i" 2> /dev/null; done
  ip netns del "${tag}br" 2> /dev/null
}
trap cleanup EXIT
if ! ip netns add "${tag}br" 2> /dev/null; then
  echo "SKIP: this machine refuses network namespaces (ip netns add needs root and CONFIG_NET_NS)"
  exit 77
fi
set -e
ip -n "${tag}br" link add br0 type bridge
ip -n "${tag}br" link set br0 up
for i in $(seq 0 $((hosts - 1))); do
  ns=${tag}h$i
  ip netns add "$ns"
  ip link add "${tag}a$i" type veth peer name "${tag}b$i"
  ip link set "${tag}a$i" netns "$ns"
  ip link set "${tag}b$i" netns "${tag}br"
  ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev "${tag}a$i"
  ip -n "$ns" link set "${tag}a$i" up
  ip -n "$ns" link set lo up
  ip -n "${tag}br" link set "${tag}b$i" master br0
  ip -n "${tag}br" link set "${tag}b$i" up
done
set +e
out=$(mktemp -d)
port=29500
run=(moe --provider "tcp;ofi_rxm" --tokens 32 --hidden 256 --experts 12 --topk 2 --iters 5
     --compare --world-size $hosts --rendezvous "$subnet.1:$port")
for i in $(seq $((hosts - 1)) -1 1); do
  FERRY_NODE=$subnet.$((i + 1)) FERRY_RENDEZVOUS_TIMEOUT_MS=60000 \
    ip netns exec "${tag}h$i" "$bench" "${run[@]}" --rank $i > "$out/rank$i.txt" 2>&1 &
  pids[$i]=$!
done
FERRY_NODE=$subnet.1 FERRY_RENDEZVOUS_TIMEOUT_MS=60000 \
  timeout 240 ip netns exec "${tag}h0" "$bench" "${run[@]}" --rank 0 > "$out/rank0.txt" 2>&1
rcs=($?)
for i in $(seq 1 $((hosts - 1))); do wait "${pids[$i]}"; rcs+=($?); done
for i in $(seq 0 $((hosts - 1))); do
  echo "== rank $i (namespace ${tag}h$i, $subnet.$((i + 1)))"
  cat "$out/rank$i.txt"
done
fail=0
for i in $(seq 0 $((hosts - 1))); do
  [ "${rcs[$i]}" -eq 0 ] || { echo "FAIL: rank $i exited ${rcs[$i]}"; fail=1; }
done
for v in "plain" "(a) once/rank" "(b) reduce" "(a)+(b)"; do
  grep -qF "$v " "$out/rank0.txt" || { echo "FAIL: rank 0 printed no '$v' row"; fail=1; }
done

# Two ranks of ferry-bench, rank 1 in the second namespace and rank 0 in the first, met at a
# rendezvous on rank 0's address: two_hosts NAME PORT ARGS... leaves NAME0.txt and NAME1.txt in
# $out and returns 0 when both ranks exited 0.
two_hosts() {
  local name=$1 at=$2
  shift 2
  local args=("$@" --world-size 2 --rendezvous "$subnet.1:$at")
  FERRY_NODE=$subnet.2 timeout 120 ip netns exec "${tag}h1" "$bench" "${args[@]}" --rank 1 \
    > "$out/${name}1.txt" 2>&1 &
  local pid=$!
  FERRY_NODE=$subnet.1 timeout 120 ip netns exec "${tag}h0" "$bench" "${args[@]}" --rank 0 \
    > "$out/${name}0.txt" 2>&1
  local rc0=$?
  wait $pid
  local rc1=$?
  echo "== $name across namespaces (exits $rc0 $rc1)"
  cat "$out/${name}0.txt" "$out/${name}1.txt"
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ]
}

# ferry-bench fabric: rank 0 writes into rank 1, each in its namespace.
two_hosts fab $((port + 4)) fabric --provider "tcp;ofi_rxm" --quick ||
  { echo "FAIL: fabric across namespaces"; fail=1; }
grep -q "imm-rtt" "$out/fab0.txt" || { echo "FAIL: fabric printed no imm-rtt row"; fail=1; }

# ferry-bench kv: the prefill in the first namespace, its decoder in the second.
two_hosts kv $((port + 3)) kv --provider "tcp;ofi_rxm" --tokens 256 --rounds 1 ||
  { echo "FAIL: kv across namespaces"; fail=1; }
grep -q "^deepseek-r1 mla " "$out/kv0.txt" || { echo "FAIL: kv printed no rows"; fail=1; }

# A soak world of RANKS ranks (rank r in host r) whose host DOWN's link goes down for 2 s, 3 s
# into the run, then comes back: soak_through_outage NAME RANKS DOWN PORT SOAK-ARGS... leaves
# rank 0's table in $out/NAME0.txt; fails the test if a rank exited other than 0 or 1 (1: the
# soak's own memory verdict, which is not this test's -- over tcp the first sample precedes the
# sockets' buffers' growth -- so the errors are read from the table).
soak_through_outage() {
  local name=$1 ranks=$2 down=$3 at=$4 i rc
  shift 4
  local args=(soak --provider "tcp;ofi_rxm" "$@" --world-size "$ranks"
              --rendezvous "$subnet.1:$at")
  local ps=()
  for i in $(seq $((ranks - 1)) -1 0); do
    FERRY_NODE=$subnet.$((i + 1)) timeout 120 ip netns exec "${tag}h$i" "$bench" "${args[@]}" \
      --rank $i > "$out/$name$i.txt" 2>&1 &
    ps[$i]=$!
  done
  # The run starts when rank 0 prints its first line: the world has formed.
  for _ in $(seq 100); do grep -q "^ferry-bench soak" "$out/${name}0.txt" && break; sleep 0.1; done
  sleep 3
  ip -n "${tag}br" link set "${tag}b$down" down
  sleep 2
  ip -n "${tag}br" link set "${tag}b$down" up
  for i in $(seq 0 $((ranks - 1))); do
    wait "${ps[$i]}"; rc=$?
    [ $rc -le 1 ] || { echo "FAIL: $name: rank $i exited $rc"; fail=1; }
  done
  cat "$out/${name}0.txt"
}

# ... and the slowest cycle or request of rank R in NAME's table, ms: slowest NAME R.
slowest() { awk -F'|' -v r=" $2 " '$2 == r { print int($7) }' "$out/${1}0.txt"; }

# A link down and up again inside one world: MoE cycles on the host device (ferry-bench soak,
# every cycle's combined output checked bit for bit, each step's deadline 10 s) while rank 2's
# link is down. TCP retransmits what was in flight once the link is back (its backoff: within
# about 3 s of the link going down), so the world carries on: every rank ends its 12 s without
# an error, and rank 2's slowest cycle shows the outage was felt.
echo "== a link down for 2 s and up again inside one world"
soak_through_outage flap $hosts 2 $((port + 5)) --only moe --seconds 12
rows=$(grep -cE "^\| [0-9]+ \| [0-9]+ \| 1 \| 0 \|" "$out/flap0.txt")
[ "$rows" -eq $hosts ] ||
  { echo "FAIL: flap: $rows of $hosts ranks ran their cycles without an error"; fail=1; }
[ "$(slowest flap 2)" -ge 1000 ] ||
  { echo "FAIL: flap: rank 2's slowest cycle $(slowest flap 2) ms: the outage was not felt"
    fail=1; }

# KV requests the same way, every request's pages checked byte for byte: the prefill in the
# first namespace, a decoder that keeps its engine in the second, one that makes a new engine
# every 50 requests in the third; 10 s, the steady decoder's link down. Its requests in flight
# wait for TCP's resend (within the prefill's 5 s transfer timeout); the other decoder's carry
# on meanwhile.
echo "== KV requests across namespaces, a decoder's link down for 2 s and up again"
soak_through_outage kvflap 3 1 $((port + 6)) --only kv --seconds 10 --churn 50
rows=$(grep -cE "^\| [0-9]+ \| [1-9][0-9]* \| [0-9]+ \| 0 \|" "$out/kvflap0.txt")
[ "$rows" -eq 3 ] ||
  { echo "FAIL: kv flap: $rows of 3 processes served requests without an error"; fail=1; }
[ "$(slowest kvflap 1)" -ge 1000 ] ||
  { echo "FAIL: kv flap: decoder 1's slowest request $(slowest kvflap 1) ms: the outage was not"\
         "felt"; fail=1; }

# A link set down mid-run (rank 2's veth, on the bridge's side). Over TCP nothing fails at once:
# writes complete into the senders' socket buffers and TCP retransmits; what ends the run is
# each rank's own step deadline (5 s here, --timeout-ms), at which every process ends with an
# error naming what it waited for, instead of hanging. Then the link comes back and a new world
# over it runs clean.
long=(moe --provider "tcp;ofi_rxm" --tokens 32 --hidden 256 --experts 12 --topk 2
      --iters 100000 --timeout-ms 5000 --world-size $hosts
      --rendezvous "$subnet.1:$((port + 1))")
start=$SECONDS
for i in $(seq $((hosts - 1)) -1 0); do
  FERRY_NODE=$subnet.$((i + 1)) timeout 120 ip netns exec "${tag}h$i" "$bench" "${long[@]}" \
    --rank $i > "$out/down$i.txt" 2>&1 &
  pids[$i]=$!
done
sleep 3
ip -n "${tag}br" link set "${tag}b2" down
down_at=$SECONDS
rcs=()
for i in $(seq 0 $((hosts - 1))); do wait "${pids[$i]}"; rcs+=($?); done
ended=$((SECONDS - down_at))
for i in $(seq 0 $((hosts - 1))); do
  echo "== link down: rank $i"
  cat "$out/down$i.txt"
done
echo "every rank ended ${ended} s after the link went down"
for i in $(seq 0 $((hosts - 1))); do
  [ "${rcs[$i]}" -ne 0 ] && [ "${rcs[$i]}" -ne 124 ] ||
    { echo "FAIL: rank $i exited ${rcs[$i]} (0: it never noticed; 124: it hung)"; fail=1; }
done
[ $ended -le 20 ] || { echo "FAIL: the ranks took ${ended} s to fail (deadline 5 s)"; fail=1; }
grep -qE "DeadlineExceeded|Unavailable" "$out/down0.txt" ||
  { echo "FAIL: rank 0 does not say what it lost"; fail=1; }
ip -n "${tag}br" link set "${tag}b2" up
healed=(moe --provider "tcp;ofi_rxm" --tokens 32 --hidden 256 --experts 12 --topk 2 --iters 5
        --world-size $hosts --rendezvous "$subnet.1:$((port + 2))")
for i in $(seq $((hosts - 1)) -1 0); do
  FERRY_NODE=$subnet.$((i + 1)) timeout 120 ip netns exec "${tag}h$i" "$bench" \
    "${healed[@]}" --rank $i > "$out/up$i.txt" 2>&1 &
  pids[$i]=$!
done
for i in $(seq 0 $((hosts - 1))); do
  wait "${pids[$i]}" ||
    { echo "FAIL: after the link came back, rank $i failed:"; cat "$out/up$i.txt"; fail=1; }
done
grep -q "^plain " "$out/up0.txt" || { echo "FAIL: no figures after the link came back"; fail=1; }
# The multi-process suites' tcp cases, rank r in host r mod 4: their own checks (every byte,
# every fault's outcome) across the bridge instead of loopback. Not the prefill restarted on its
# port: its second process must be a host the first one was, and here it is another.
netns_list=$(seq -s, -f "${tag}h%g" 0 $((hosts - 1)))
node_list=$(seq -s, -f "$subnet.%g" 1 "$hosts")
for suite in "${suites[@]}"; do
  name=$(basename "$suite")
  FERRY_LOCAL_RANK_NETNS=$netns_list FERRY_LOCAL_RANK_NODES=$node_list \
    timeout 300 "$suite" --gtest_filter='*tcp*:*Tcp*-*RestartedOnItsPort*' \
      --gtest_brief=1 > "$out/$name.txt" 2>&1
  rc=$?
  echo "== $name, tcp cases, ranks in namespaces: exit $rc"
  grep -E "^\[  (PASSED|FAILED) |tests? ran" "$out/$name.txt"
  grep -q "^\[  PASSED  \] [1-9]" "$out/$name.txt" && [ $rc -eq 0 ] ||
    { echo "FAIL: $name across namespaces:"; tail -40 "$out/$name.txt"; fail=1; }
done
rm -rf "$out"
[ $fail -eq 0 ] && echo PASS
exit $fail
