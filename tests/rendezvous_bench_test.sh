#!/usr/bin/env bash
# ferry-bench moe, kv and fabric as one process per rank, started apart and met at a TCP
# rendezvous on loopback (as a cluster's launcher starts them): every rank exits 0, rank 0 prints
# the figures and each other rank its own line. Then ranks that disagree on the world size both
# fail, saying so. Usage: rendezvous_bench_test.sh FERRY_BENCH
set -u
bench=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
small=(moe --tokens 16 --hidden 256 --experts 12 --topk 2 --iters 5)
# A loopback port: the first of a few that rank 0 can bind (another test may hold one).
for try in 0 1 2 3 4; do
  port=$((20000 + ($$ * 7 + try * 331) % 40000))
  for r in 2 1; do  # the others first: they wait for rank 0
    FERRY_RENDEZVOUS_TIMEOUT_MS=30000 "$bench" "${small[@]}" --world-size 3 --rank $r \
      --rendezvous 127.0.0.1:$port > "$out/rank$r.txt" 2>&1 &
    pids[$r]=$!
  done
  sleep 0.3
  "$bench" "${small[@]}" --world-size 3 --rank 0 --rendezvous 127.0.0.1:$port \
    > "$out/rank0.txt" 2>&1
  rc0=$?
  if [ $rc0 -ne 0 ] && grep -q "Address already in use" "$out/rank0.txt"; then
    kill "${pids[1]}" "${pids[2]}" 2> /dev/null; wait; continue
  fi
  break
done
fail=0
wait "${pids[1]}"; rc1=$?
wait "${pids[2]}"; rc2=$?
for r in 0 1 2; do echo "== rank $r"; cat "$out/rank$r.txt"; done
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] || { echo "FAIL: exits $rc0 $rc1 $rc2"; fail=1; }
grep -q "ranks=3" "$out/rank0.txt" && grep -q "^plain " "$out/rank0.txt" ||
  { echo "FAIL: rank 0 printed no figures"; fail=1; }
for r in 1 2; do
  grep -q "\[rank $r of 3\] plain: done" "$out/rank$r.txt" ||
    { echo "FAIL: rank $r did not report"; fail=1; }
done

# pair NAME ARGS...: a world of two started apart -- rank 1 in the background first, then rank
# 0; their output in $out/NAME0.txt and NAME1.txt, their exits in rc0 and rc1.
pair() {
  local name=$1 pid
  shift
  "$bench" "$@" --rank 1 > "$out/${name}1.txt" 2>&1 &
  pid=$!
  sleep 0.3
  "$bench" "$@" --rank 0 > "$out/${name}0.txt" 2>&1
  rc0=$?
  wait $pid
  rc1=$?
  cat "$out/${name}0.txt" "$out/${name}1.txt"
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { echo "FAIL: $name exits $rc0 $rc1"; fail=1; }
}

# ferry-bench kv the same way: the prefill is rank 0, its one decoder rank 1.
pair kv kv --tokens 256 --rounds 1 --world-size 2 --rendezvous 127.0.0.1:$((port + 2))
grep -q "^deepseek-r1 mla " "$out/kv0.txt" || { echo "FAIL: kv rank 0 printed no rows"; fail=1; }
grep -q "\[rank 1 of 2\] deepseek-r1 mla: done" "$out/kv1.txt" ||
  { echo "FAIL: kv rank 1 did not report"; fail=1; }

# ferry-bench fabric: its two ranks started apart.
pair fb fabric --quick --max-bytes 65536 --world-size 2 --rendezvous 127.0.0.1:$((port + 3))
grep -q "2 rendezvous ranks" "$out/fb0.txt" && grep -q "^paged " "$out/fb0.txt" ||
  { echo "FAIL: fabric rank 0 printed no rows"; fail=1; }
grep -q "\[rank 1 of 2\]: done" "$out/fb1.txt" || { echo "FAIL: fabric rank 1"; fail=1; }

# World sizes that disagree: both fail within their timeout, naming the sizes.
port=$((port + 1))
FERRY_RENDEZVOUS_TIMEOUT_MS=20000 "$bench" "${small[@]}" --world-size 3 --rank 1 \
  --rendezvous 127.0.0.1:$port > "$out/bad1.txt" 2>&1 &
bad=$!
sleep 0.3
FERRY_RENDEZVOUS_TIMEOUT_MS=20000 "$bench" "${small[@]}" --world-size 2 --rank 0 \
  --rendezvous 127.0.0.1:$port > "$out/bad0.txt" 2>&1
rcb0=$?
wait $bad; rcb1=$?
cat "$out/bad0.txt" "$out/bad1.txt"
[ $rcb0 -ne 0 ] && [ $rcb1 -ne 0 ] || { echo "FAIL: a world of mixed sizes started"; fail=1; }
for f in bad0 bad1; do
  grep -q "rank 1 says the world size is 3, rank 0 says 2" "$out/$f.txt" ||
    { echo "FAIL: $f does not say why"; fail=1; }
done
[ $fail -eq 0 ] && echo PASS
exit $fail
