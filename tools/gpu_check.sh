#!/usr/bin/env bash
# One run on a GPU machine: build the CUDA parts for sm_90, run the GPU tests (and
# compute-sanitizer memcheck/racecheck on small cases), run the chosen measurements. Logs go to
# $OUT (default /tmp/ferry-gpu); a short table is printed last. The modes and switches:
# tools/README.md.
set -u
OUT=${OUT:-/tmp/ferry-gpu}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -x .gpu-deps/prepare.sh ]; then eval "$(.gpu-deps/prepare.sh | grep ^export)"; fi
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
SANITIZER=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
nvidia-smi -L > "$OUT/gpus.txt" 2>&1

# Steps stop at DEADLINE seconds from the start (570; one running then is cut short, later ones
# skipped) so that a run under a 10-minute limit prints its summary and packs its logs (a few
# files come back more easily than many); a TERM or INT packs them too.
deadline=${DEADLINE:-570}
pack_logs() { (cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log); }
trap 'pack_logs; exit 124' TERM INT

step() {  # step NAME SECONDS COMMAND...: runs it, logs it, notes its exit status and time
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS left=$((deadline - SECONDS))
  if [ "$left" -lt 5 ]; then
    printf '%-22s skipped (DEADLINE %ss)\n' "$name" "$deadline" >> "$OUT/summary.txt"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/summary.txt"
  return $rc
}

generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
# The Python bindings where pybind11's headers and CMake package are carried in .pydeps
# (a copy of /usr/include/pybind11 and /usr/lib/cmake/pybind11 under .pydeps/usr; the lent
# machine has Python's headers but no pybind11).
python=()
targets=(moe_cuda_test moe_cuda_faults_test moe_mask_test kv_cuda_test gpu_words_test
         moe_host_test moe_engine_api_test fd_exchange_test ferry-bench)
if [ -d .pydeps/usr/lib/cmake/pybind11 ]; then
  python=(-Dpybind11_DIR="$PWD/.pydeps/usr/lib/cmake/pybind11")
  targets+=(_ferry)
fi
# serve: the bindings alone (the served example runs on the host device, on this host's cores).
[ "${1:-all}" = serve ] && targets=(_ferry)
step configure 120 cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90 "${python[@]}" ||
  { cat "$OUT/configure.log" 2> /dev/null; exit 1; }
step build 400 cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}" ||
  { tail -60 "$OUT/build.log"; exit 1; }

# SASS=1: the machine code of the NVLink kernels whose names contain one of SASS_FUNCS
# ("SendSmall Unpack") into sass.log, and per kernel its instruction count and local-memory
# loads and stores (spills, arrays indexed at run time) -- where the toolkit has cuobjdump.
if [ "${SASS:-0}" != 0 ]; then
  obj=$(find build-gpu -name 'cuda_device_launch.cu.o' | head -1)
  dump=$(dirname "$NVCC")/cuobjdump
  if [ -x "$dump" ] && [ -n "$obj" ]; then
    "$dump" -sass "$obj" 2>&1 | awk -v want="${SASS_FUNCS:-SendSmall Unpack}" '
      /Function :/ { keep = 0; n = split(want, w, " ")
                     for (i = 1; i <= n; ++i) if (index($3, w[i])) keep = 1
                     if (keep) name = $3 }
      keep { print > "/dev/stdout" }
      keep && /\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]\*\// { ins[name]++ }
      keep && /[ \t](STL|LDL)[ .]/ { loc[name]++ }
      END { for (f in ins) printf "sass %-72s %6d instructions %4d local\n", f, ins[f], loc[f] > "/dev/stderr" }
    ' > "$OUT/sass.log"
  else
    echo "SASS=1: no cuobjdump beside $NVCC (has: $(ls "$(dirname "$NVCC")" | tr '\n' ' '))"
  fi
fi

mode=${1:-all}
tests=${TESTS:-1}
case $mode in profile | trace | kvpace | stalls | serve) tests=0 ;; esac  # they build and measure only
if [ "$tests" != 0 ]; then
  step kv_cuda_test 120 build-gpu/kv_cuda_test
  step gpu_words_test 60 build-gpu/gpu_words_test
  step moe_cuda_test 400 build-gpu/moe_cuda_test
  step moe_cuda_faults_test 120 build-gpu/moe_cuda_faults_test
  step moe_mask_test 180 build-gpu/moe_mask_test
  step fd_exchange_test 60 build-gpu/fd_exchange_test
  step moe_engine_api_test 60 build-gpu/moe_engine_api_test
  if [ ${#python[@]} -gt 0 ]; then  # python/tests, test_moe_cuda among them
    PYTHONPATH=$PWD/build-gpu/python step python_tests 200 python3 -m unittest discover -v \
      -s python/tests
  fi
fi
# NVLink cases above SendSmall's bound (tokens x k > 2048): their send half is Route and Pack
# (the graph case replays with device counts that leave token chunks empty).
pack_cases='*n2_t333_h2176_e64_k8_bf16_hot_empty1_nvlink:*n2_t2048_h128_e256_k16_fp8_nvlink:*n2_t700*graph'
# ... and the streamed dispatch: every slot pushed (Pack), and small (SendSmall); the streamed
# combine, summed at the expert rank and copied token-major.
pack_cases="$pack_cases:*n2_t600_h256_e64_k8_bf16_nvlink_streamed:*n2_t7_h128_e8_k2_bf16_nvlink_streamed"
pack_cases="$pack_cases:*n2_t2048_h128_e256_k16_fp8_b_nvlink_allstreamed:*n2_t96*tokmajor_allstreamed"
if [ "$tests" != 0 ] && [ "${SANITIZERS:-1}" != 0 ]; then
  step memcheck 300 "$SANITIZER" --tool memcheck --target-processes all \
    build-gpu/moe_cuda_test \
    --gtest_filter="*n2_t7_h128_e8_k2_bf16*:*n3_t64*:*n4_t96*nodes2:*t96*tokmajor:$pack_cases"
  step racecheck 300 "$SANITIZER" --tool racecheck --target-processes all \
    build-gpu/moe_cuda_test \
    --gtest_filter="*n2_t7_h128_e8_k2_bf16*:*n4_t96*nodes2:*t96*tokmajor:$pack_cases"
fi
# mps mode, or MPS=1 with any mode: what follows runs as clients of an MPS server, so that
# ranks sharing the one GPU run side by side (see the mps mode above; off again at the end).
mps_up=0
if [ "$mode" = mps ] || [ "${MPS:-0}" = 1 ]; then
  # Two ranks of one node sharing the one GPU as clients of an MPS server (its own pipe and log
  # folders, quit at the end; the GPU's settings are not touched): their kernels run side by
  # side, as on two GPUs, but peer memory is the same HBM, not across NVLink. A proxy for what
  # the two-rank protocol costs over one rank (counts rows from a peer, waits on a peer's
  # flags, the ranks' skew), without NVLink's latency or bandwidth. Without MPS two processes
  # on one GPU are time-sliced (milliseconds a step), which is why one GPU measured one rank.
  # MPS_PERCENT (50): each client's share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so
  # that each rank has SMs of its own, as on two GPUs -- sharing them all, the prefill (a)+(b)
  # deadlocked (one rank's resident, spinning receive blocks left no SM for the other's send
  # blocks; MPS does not preempt). One rank runs on the same share.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ferry-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ferry-mps/log
  [ "${MPS_PERCENT:-50}" != 100 ] && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${MPS_PERCENT:-50}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d; then
    mps_up=1
  else
    echo "mps: nvidia-cuda-mps-control missing or would not start" | tee -a "$OUT/summary.txt"
  fi
fi
if [ "$mode" = trace ]; then
  nv=(--nvlink --ranks 2 --hidden 7168 --experts 256 --topk 8 --dtype fp8)
  if [ "${TRACE_COMPARE:-1}" != 0 ]; then
    step nvlink_decode 200 build-gpu/ferry-bench moe "${nv[@]}" --tokens 128 --iters 200 --compare
  fi
  # TRACE_RANKS ("2"; 1 too under MPS, for the same share of SMs alone), TRACE_ARGS (more
  # bench flags, e.g. --token-major).
  for r in ${TRACE_RANKS:-2}; do
    for t in ${TRACE_TOKENS:-128 4096}; do
      name=trace_$t; [ "$r" != 2 ] && name=trace_r${r}_$t
      # shellcheck disable=SC2086  # TRACE_ARGS: flags, split on purpose
      FERRY_NV_TRACE=1 step $name 200 build-gpu/ferry-bench moe "${nv[@]}" --ranks $r \
        --tokens $t --iters 5 --once-per-rank --reduce-at-expert-rank ${TRACE_ARGS:-}
      echo "== $name, (a)+(b) ${TRACE_ARGS:-}: point slowest/mean us since block start" \
        "@ last block's, us from the first DispatchSend block (blocks)"
      grep -h 'trace ' "$OUT/$name.log"
    done
  done
fi
# p50_table LOG...: each log's variant rows as p50 (/ p99) of dispatch and combine and p50 of
# each half, read by position within the bench's |-separated groups (counting fields over a
# whole line miscounts: a variant's name may be one word or two).
p50_table() {
  local f
  printf '%-26s %-14s %11s %11s | %10s %10s | %10s %10s | %5s %5s\n' log variant \
    "disp p50/99" "comb p50/99" "d-send p50" "d-recv p50" "c-send p50" "c-recv p50" "d/fl" "c/fl"
  for f in "$@"; do
    awk -F'|' -v name="$(basename "$f" .log)" '
      NF >= 4 {
        n2 = split($2, d, " "); n3 = split($3, c, " "); n4 = split($4, s, " ")
        if (n2 < 4 || n3 < 4 || n4 < 4 || d[1] !~ /^[0-9.]+$/) next
        if (split($8, fl, " ") < 2) { fl[1] = "-"; fl[2] = "-" }  # p50 over the NVLink floor
        v = $1; gsub(/^ +| +$/, "", v)
        printf "%-26s %-14s %5s/%-5s %5s/%-5s | %10s %10s | %10s %10s | %5s %5s\n", name, v,
               s[1], s[2], s[3], s[4], d[1], d[3], c[1], c[3], fl[1], fl[2]
      }' "$f"
  done
}

# targets_verdict LOG...: each (a)+(b) row of the targets mode's logs against the EP2 targets
# (decode: dispatch p50 <= 15 us, combine <= 20; prefill: each <= 1.3 x the NVLink floor).
targets_verdict() {
  p50_table "$@" | awk '
    NR == 1 || $2 != "(a)+(b)" { next }
    {
      layout = ($3 == "tok") ? "TOK" : "EM"
      n = (layout == "TOK") ? 4 : 3  # the name is one word or two
      split($n, d, "/"); split($(n + 1), c, "/")
      df = $(NF - 1); cf = $NF
      if ($1 ~ /decode/) {
        ok = (d[1] <= 15 && c[1] <= 20) ? "met" : "not met"
        if (df + 0 == 0) ok = ok " (one GPU: not the targets\047 two)"
        printf "%-34s %-3s dispatch %6s combine %6s us: %s\n", $1, layout, d[1], c[1], ok
      } else if (df + 0 > 0) {
        ok = (df <= 1.3 && cf <= 1.3) ? "met" : "not met"
        printf "%-34s %-3s dispatch %5s x floor, combine %5s x floor: %s\n", $1, layout, df, cf, ok
      } else {
        printf "%-34s %-3s no floor (one GPU): not measured\n", $1, layout
      }
    }'
}

if [ "$mode" = ab ]; then
  # The baseline: .baseline.tgz (git archive of an earlier commit, carried) built beside; and
  # each .ab-NAME.tgz carried (another variant, "NAME" in the logs) built beside too. Every
  # pair below runs base, the variants, then new.
  variants=(base)
  for tgz in .ab-*.tgz; do
    [ -e "$tgz" ] && variants+=("$(basename "$tgz" .tgz | sed 's/^\.ab-//')")
  done
  for var in "${variants[@]}"; do
    tgz=.ab-$var.tgz
    [ "$var" = base ] && tgz=.baseline.tgz
    mkdir -p "/tmp/$var" && tar xzf "$tgz" -C "/tmp/$var"
    step "${var}_configure" 120 cmake -S "/tmp/$var" -B "/tmp/$var/build" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90
    step "${var}_build" 400 cmake --build "/tmp/$var/build" -j "$(nproc)" --target ferry-bench
  done
  each_variant() {  # each_variant NAME ARGS...: NAME_VAR for every variant, then NAME_new
    local name=$1 var
    shift
    for var in "${variants[@]}"; do
      step "${name/@/$var}" 300 "/tmp/$var/build/ferry-bench" "$@"
    done
    step "${name/@/new}" 300 build-gpu/ferry-bench "$@"
  }
  decode=(--nvlink --ranks "${AB_RANKS:-2}" --hidden 7168 --experts 256 --topk 8 --dtype fp8
          --tokens 128 --iters 200)
  nv=("${decode[@]}" --once-per-rank --reduce-at-expert-rank --token-major)
  decode_rounds=${AB_DECODE_ROUNDS:-2}
  for round in $(seq "$decode_rounds"); do
    for p in 16 1024; do
      each_variant "nvlink_@_p${p}_$round" moe "${nv[@]}" --private $p
    done
  done
  pf=(--nvlink --ranks "${AB_RANKS:-2}" --hidden 7168 --experts 256 --topk 8 --dtype fp8
      --tokens 4096 --iters 20 --once-per-rank --reduce-at-expert-rank --token-major)
  for p in 16 4096; do  # slots pulled by the receiver, then every slot pushed
    [ "${AB_PREFILL:-1}" = 0 ] && break
    each_variant "nvlink_@_prefill_p$p" moe "${pf[@]}" --private $p
  done
  if [ "$decode_rounds" != 0 ]; then
    step nvlink_compare_new 200 build-gpu/ferry-bench moe "${decode[@]}" --compare --private 1024
    for p in 16 1024; do
      FERRY_NV_TRACE=1 step trace_p$p 200 build-gpu/ferry-bench moe "${nv[@]}" --iters 5 \
        --private $p
      echo "== trace, 128 tokens, (a)+(b), --private $p: point slowest/mean us since block start"
      grep -h 'trace ' "$OUT/trace_p$p.log"
    done
  fi
  if [ "${AB_PREFILL:-1}" != 0 ]; then
    FERRY_NV_TRACE=1 step trace_prefill 200 build-gpu/ferry-bench moe "${pf[@]}" --iters 5
    echo "== trace, 4096 tokens, (a)+(b) token-major: point slowest/mean us"
    grep -h 'trace ' "$OUT/trace_prefill.log"
  fi
  echo "== the pairs in order (us)"
  p50_table $(ls -tr "$OUT"/nvlink_*_p*.log 2>/dev/null | grep -v compare)
fi
# NVLink decode (16 and 1024 private slots) and prefill, (a)+(b) in both layouts: with
# --token-major the bench runs expert-major, token-major, and token-major with the caller's
# permute and un-permute timed in (tok+permute). layout_rounds LOG_PREFIX ROUNDS
tok=(--nvlink --ranks 2 --hidden 7168 --experts 256 --topk 8 --dtype fp8 --once-per-rank
     --reduce-at-expert-rank --token-major)
layout_rounds() {
  local round p
  for round in $(seq "$2"); do
    for p in 16 1024; do
      step "$1_p${p}_$round" 200 build-gpu/ferry-bench moe "${tok[@]}" --tokens 128 --iters 200 \
        --private $p
    done
    step "$1_prefill_$round" 300 build-gpu/ferry-bench moe "${tok[@]}" --tokens 4096 --iters 20
  done
}
# The kv benchmarks, 4k and 32k prompts, at each pace of $1; KV_SPIN=1: each once more with
# engines (and the prefill's layer watcher) that never idle (FERRY_SPIN_US=-1); KV_WRS="A B":
# each once per cap on the engine's outstanding work requests (FERRY_MAX_WRS), in that order;
# KV_ROUNDS: rounds per run (the bench's default, 3; the t/a p50 column is their median).
kv_paces() {
  local t pace spin wrs name label
  for t in 4096 32768; do
    for pace in $1; do
      for spin in 0 ${KV_SPIN:+1}; do
        for wrs in ${KV_WRS:-1024}; do
          name=kv_pace${pace}_$t label=""
          [ "$spin" = 1 ] && name=${name}_spin label=", spinning engines"
          [ -n "${KV_WRS:-}" ] && name=${name}_wrs$wrs label="$label, FERRY_MAX_WRS=$wrs"
          (
            [ "$spin" = 1 ] && export FERRY_SPIN_US=-1
            [ -n "${KV_WRS:-}" ] && export FERRY_MAX_WRS=$wrs
            step "$name" 300 build-gpu/ferry-bench kv --tokens $t --pace $pace \
              ${KV_ROUNDS:+--rounds $KV_ROUNDS}
          )
          echo "== kv, $t tokens, layers $pace x raw apart$label"
          sed -n 3,5p "$OUT/$name.log"
        done
      done
    done
  done
}
if [ "$mode" = layout ]; then
  layout_rounds nvlink_layout 2
  step nvlink_layout_prefill_push 300 build-gpu/ferry-bench moe "${tok[@]}" --tokens 4096 \
    --iters 20 --private 4096
  FERRY_NV_TRACE=1 step trace_prefill_tok 200 build-gpu/ferry-bench moe "${tok[@]}" \
    --tokens 4096 --iters 5
  echo "== trace, 4096 tokens, (a)+(b) token-major (its variants last): point slowest/mean us"
  grep -h 'trace ' "$OUT/trace_prefill_tok.log"
fi
[ "$mode" = kvpace ] && kv_paces "${PACES:-1.25 1}"
if [ "$mode" = stream ]; then
  ranks=${STREAM_RANKS:-2}
  nv=(--nvlink --ranks "$ranks" --hidden 7168 --experts 256 --topk 8 --dtype fp8 --once-per-rank
      --reduce-at-expert-rank)
  for round in $(seq "${STREAM_ROUNDS:-1}"); do
    for s in 0 1 3; do
      step "stream${s}_decode_$round" 200 build-gpu/ferry-bench moe --stream $s "${nv[@]}" \
        --tokens 128 --iters 200 --private 1024
      step "stream${s}_prefill_push_$round" 300 build-gpu/ferry-bench moe --stream $s \
        "${nv[@]}" --tokens 4096 --iters 20 --private 4096 --token-major
      [ "$ranks" = 1 ] && continue  # one rank pulls nothing
      step "stream${s}_prefill_pull_$round" 300 build-gpu/ferry-bench moe --stream $s \
        "${nv[@]}" --tokens 4096 --iters 20 --private 16
    done
  done
  if [ "${STREAM_TRACE:-0}" = 1 ]; then
    FERRY_NV_TRACE=1 step trace_stream_prefill 200 build-gpu/ferry-bench moe --stream 1 \
      "${nv[@]}" --tokens 4096 --iters 5 --private 4096
    echo "== trace, 4096 tokens, (a)+(b), streamed, every slot pushed: point slowest/mean us"
    grep -h 'trace ' "$OUT/trace_stream_prefill.log"
  fi
  for f in "$OUT"/stream*_1.log; do
    echo "== $(basename "$f" .log)"
    grep -h -E '^(variant|\(a\)\+\(b\))' "$f"
  done
fi
if [ "$mode" = targets ]; then
  nv=(--nvlink --ranks "${TARGET_RANKS:-2}" --hidden 7168 --experts 256 --topk 8 --dtype fp8
      --once-per-rank --reduce-at-expert-rank --token-major)
  for round in $(seq "${TARGET_ROUNDS:-2}"); do
    for p in 16 1024; do
      step "target_decode_p${p}_default_$round" 200 build-gpu/ferry-bench moe "${nv[@]}" \
        --tokens 128 --iters 200 --private $p
      step "target_decode_p${p}_stream0_$round" 200 build-gpu/ferry-bench moe --stream 0 \
        "${nv[@]}" --tokens 128 --iters 200 --private $p
    done
  done
  for p in 16 4096; do
    step "target_prefill_p${p}" 300 build-gpu/ferry-bench moe "${nv[@]}" --tokens 4096 \
      --iters 20 --private $p
  done
  # Prefill streamed: the receive half copies each slot as its flag rises, under the pushes
  # (one GPU could not show what that overlap is worth: nothing crosses there).
  for stream in 1 3; do
    step "target_prefill_p4096_stream$stream" 300 \
      build-gpu/ferry-bench moe --stream $stream "${nv[@]}" --tokens 4096 --iters 20 --private 4096
  done
  echo "== the EP2 targets (one node): decode dispatch p50 <= 15 us and combine <= 20 us;"
  echo "   prefill dispatch and combine <= 1.3 x the NVLink floor (d/fl, c/fl)"
  targets_verdict "$OUT"/target_*.log
fi
if [ "$mode" = mps ] && [ "$mps_up" = 1 ]; then
  nv=(--nvlink --hidden 7168 --experts 256 --topk 8 --dtype fp8 --once-per-rank
      --reduce-at-expert-rank --token-major)
  for round in $(seq "${MPS_ROUNDS:-2}"); do
    for r in 1 2; do
      step "mps_decode_r${r}_p16_$round" 200 build-gpu/ferry-bench moe "${nv[@]}" --ranks $r \
        --tokens 128 --iters 200 --private 16
      step "mps_decode_r${r}_p1024_$round" 200 build-gpu/ferry-bench moe "${nv[@]}" \
        --ranks $r --tokens 128 --iters 200 --private 1024
    done
  done
  for r in 1 2; do
    step "mps_prefill_r${r}_p4096" 120 build-gpu/ferry-bench moe "${nv[@]}" --ranks $r \
      --tokens 4096 --iters 20 --private 4096
  done
  echo "== two ranks on one GPU under MPS (r2) beside one rank (r1), p50 us"
  p50_table $(ls -tr "$OUT"/mps_*.log)
fi
if [ "$mode" = caller ]; then
  layout_rounds nvlink_caller "${ROUNDS:-2}"
  kv_paces "${PACES:-1 1.25}"
fi
if [ "$mode" = all ] || [ "$mode" = nvlink ] || [ "$mode" = p2p ]; then
  # What the link carries (copy engine, SM stores and loads), at a prefill dispatch's size and
  # at 256 MiB.
  for b in 30762496 268435456; do
    step p2p_$b 120 build-gpu/ferry-bench p2p --bytes $b
    cat "$OUT/p2p_$b.log"
  done
fi
if [ "$mode" = mirror ]; then
  # A kernel waiting on a mirrored immediate counter (GpuWords) beside a host thread in WaitImm.
  for provider in shm "tcp;ofi_rxm"; do
    step "mirror_${provider%%;*}" 120 build-gpu/ferry-bench mirror --provider "$provider"
    cat "$OUT/mirror_${provider%%;*}.log"
  done
fi
if [ "$mode" = all ] || [ "$mode" = nvlink ] || [ "$mode" = relay ]; then
  nv=(--nvlink --ranks 2 --hidden 7168 --experts 256 --topk 8 --dtype fp8)
  step nvlink_decode 200 build-gpu/ferry-bench moe "${nv[@]}" --tokens 128 --iters 200 --compare
  step nvlink_decode_push 200 build-gpu/ferry-bench moe "${nv[@]}" --tokens 128 --iters 200 \
    --compare --private 1024
  step nvlink_prefill 300 build-gpu/ferry-bench moe "${nv[@]}" --tokens 4096 --iters 10 --compare
fi
if [ "$mode" = all ] || [ "$mode" = relay ]; then
  # Two nodes of one GPU each: every peer through the relay over shm, GPU-timed like the NVLink
  # runs, next to the engine's own scatter of the same bytes (host-timed).
  step relay_decode 200 build-gpu/ferry-bench moe --device cuda --ranks 2 --hidden 7168 \
    --experts 256 --topk 8 --dtype fp8 --tokens 128 --iters 100 --compare
  # The same with engines that never idle (FERRY_SPIN_US=-1: production, pinned cores).
  FERRY_SPIN_US=-1 step relay_decode_spin 200 build-gpu/ferry-bench moe --device cuda --ranks 2 \
    --hidden 7168 --experts 256 --topk 8 --dtype fp8 --tokens 128 --iters 100 --once-per-rank \
    --reduce-at-expert-rank
  step relay_prefill 300 build-gpu/ferry-bench moe --device cuda --ranks 2 --hidden 7168 \
    --experts 256 --topk 8 --dtype fp8 --tokens 4096 --iters 10 --once-per-rank \
    --reduce-at-expert-rank
  echo "== relay (2 nodes x 1 GPU, shm): decode --compare, decode spinning engines, prefill (a)+(b)"
  grep -h -E '^(plain|\(a|\(b)' "$OUT/relay_decode.log" "$OUT/relay_decode_spin.log" \
    "$OUT/relay_prefill.log"
fi
if [ "$mode" = all ] || [ "$mode" = nvlink ] || [ "$mode" = hybrid ]; then
  # EP4 as one node, then as two nodes of two joined by the relay over shm. On 4 GPUs this is
  # the relay's cost; on 2 GPUs two processes share each GPU and the figures measure the
  # driver's time-slicing between their contexts (milliseconds), not the protocol.
  ep4=(--nvlink --ranks 4 --hidden 7168 --experts 256 --topk 8 --dtype fp8 --once-per-rank
       --reduce-at-expert-rank)
  step ep4_one_node 200 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 128 --iters 100
  step ep4_two_nodes 200 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 128 --iters 100 \
    --node-ranks 2
  step ep4_two_nodes_prefill 300 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 4096 --iters 10 \
    --node-ranks 2
  echo "== EP4 decode: one node, then two nodes of two (relay over shm)"
  grep -h '^(a)+(b)' "$OUT/ep4_one_node.log" "$OUT/ep4_two_nodes.log" "$OUT/ep4_two_nodes_prefill.log"
fi
if [ "$mode" = ep ]; then
  # One rank per GPU (issue "EP4 and EP8"): only the sizes the machine's GPUs cover.
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
  for n in ${EP_SIZES:-4 8}; do
    [ "$gpus" -ge "$n" ] || continue
    # EP_STREAM="1 3": one-node decode and prefill again with those --stream masks.
    for s in ${EP_STREAM:-}; do
      step ep${n}_stream${s}_decode 300 build-gpu/ferry-bench moe --stream $s --nvlink \
        --ranks $n --hidden 7168 --experts 256 --topk 8 --dtype fp8 --tokens 128 --iters 200 \
        --once-per-rank --reduce-at-expert-rank
      step ep${n}_stream${s}_prefill 400 build-gpu/ferry-bench moe --stream $s --nvlink \
        --ranks $n --hidden 7168 --experts 256 --topk 8 --dtype fp8 --tokens 4096 --iters 10 \
        --once-per-rank --reduce-at-expert-rank
      echo "== EP$n, --stream $s: decode, prefill (a)+(b)"
      grep -h -E '^(variant|\(a\)\+\(b\)) ' "$OUT"/ep${n}_stream${s}_*.log
    done
    ep=(--nvlink --ranks $n --hidden 7168 --experts 256 --topk 8 --compare)
    step ep${n}_decode_fp8 300 build-gpu/ferry-bench moe "${ep[@]}" --dtype fp8 --tokens 128 \
      --iters 200
    step ep${n}_decode_bf16 300 build-gpu/ferry-bench moe "${ep[@]}" --dtype bf16 --tokens 128 \
      --iters 200
    step ep${n}_prefill 400 build-gpu/ferry-bench moe "${ep[@]}" --dtype fp8 --tokens 4096 \
      --iters 10
    step ep${n}_prefill_ab 400 build-gpu/ferry-bench moe --nvlink \
      --ranks $n --hidden 7168 --experts 256 --topk 8 --dtype fp8 --tokens 4096 --iters 10 \
      --once-per-rank --reduce-at-expert-rank
    step ep${n}_two_nodes_decode 300 build-gpu/ferry-bench moe "${ep[@]}" --dtype fp8 \
      --tokens 128 --iters 100 --node-ranks $((n / 2))
    echo "== EP$n: decode fp8, bf16, prefill (one node), decode as two nodes of $((n / 2))," \
      "prefill (a)+(b)"
    grep -h -E '^(variant|plain|\(a\)\+\(b\)) ' "$OUT"/ep${n}_decode_fp8.log \
      "$OUT"/ep${n}_decode_bf16.log "$OUT"/ep${n}_prefill.log "$OUT"/ep${n}_two_nodes_decode.log \
      "$OUT"/ep${n}_prefill_ab.log
  done
  [ "$gpus" -ge 4 ] || echo "== ep: $gpus GPUs here; EP4 needs 4, EP8 needs 8"
fi
# The served model (examples/serve) on this host's cores, ferry's host device over shm: its
# end-to-end tests, then tools/bench_serve.py (disaggregated vs colocated decode ITL with long
# prompts arriving, and the KV tail against one layer's raw write), where the polling threads
# have cores of their own (on 2 cores they share one with the compute).
if [ "$mode" = engine_api ]; then
  PYTHONPATH=$PWD/build-gpu/python:$PWD/python/tests step engine_api_cuda 240 python3 -m unittest \
    -v test_engine_api_cuda
  PYTHONPATH=$PWD/build-gpu/python step bench_engine_api_cuda 120 python3 \
    tools/bench_engine_api.py --device cuda --json "$OUT/bench_engine_api_cuda.json"
  PYTHONPATH=$PWD/build-gpu/python step bench_engine_api_cpu 120 python3 \
    tools/bench_engine_api.py --device cpu --json "$OUT/bench_engine_api_cpu.json"
  for f in "$OUT"/engine_api_cuda.log "$OUT"/bench_engine_api_cuda.log \
           "$OUT"/bench_engine_api_cpu.log; do
    [ -f "$f" ] && { echo "== $(basename "$f" .log)"; tail -8 "$f"; }
  done
fi
if [ "$mode" = serve ]; then
  PYTHONPATH=$PWD/build-gpu/python step serve_tests 300 python3 -m unittest discover -v \
    -s examples/serve
  PYTHONPATH=$PWD/build-gpu/python step serve_demo_cuda 120 python3 examples/serve/demo.py \
    --device cuda
  if [ "${SERVE_BENCH:-1}" != 0 ]; then
    PYTHONPATH=$PWD/build-gpu/python step bench_serve 240 python3 tools/bench_serve.py \
      --json "$OUT/bench_serve.json" ${SERVE_ARGS:-}
  fi
  for f in "$OUT"/serve_tests.log "$OUT"/serve_demo_cuda.log "$OUT"/bench_serve.log; do
    [ -f "$f" ] && { echo "== $(basename "$f" .log)"; tail -8 "$f"; }
  done
fi
if [ "$mode" = stalls ]; then
  # Where the decode kernels' warps wait, per machine instruction: ncu's sampled warp states
  # (SourceCounters) for STALL_KERNELS on one rank, (a)+(b), T=128, after the warm-up launches;
  # caches and clocks left as they are. stalls_source.csv: one row per instruction (its address,
  # the SASS, samples per stall reason); the details page per kernel in stalls_details.log.
  NCU=${NCU:-/usr/local/cuda/bin/ncu}
  step stalls_profile 300 "$NCU" --target-processes all --clock-control none --cache-control none \
    -k "regex:${STALL_KERNELS:-SendSmall|UnpackKernel}" --launch-skip 40 --launch-count 2 \
    --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \
    -f -o "$OUT/stalls" build-gpu/ferry-bench moe --nvlink --ranks 1 --hidden 7168 \
    --experts 256 --topk 8 --dtype fp8 --tokens 128 --iters 20 --once-per-rank \
    --reduce-at-expert-rank
  "$NCU" -i "$OUT/stalls.ncu-rep" --page details > "$OUT/stalls_details.log" 2>&1
  "$NCU" -i "$OUT/stalls.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/stalls_source.csv" 2> "$OUT/stalls_source.log"
  rm -f "$OUT/stalls.ncu-rep"
  if command -v python3 > /dev/null; then  # the samples summed between trace points
    python3 tools/stall_regions.py "$OUT/stalls_source.csv" > "$OUT/stall_regions.log" 2>&1
  fi
  grep -E 'Warp Cycles Per Issued|Avg. Active Threads|^  [A-Za-z_:]+.*\(' "$OUT/stalls_details.log"
fi
if [ "$mode" = all ] || [ "$mode" = kv ]; then
  step kv_4k 300 build-gpu/ferry-bench kv --tokens 4096
  step kv_32k 300 build-gpu/ferry-bench kv --tokens 32768
fi
if [ "$mode" = all ] || [ "$mode" = nvlink ] || [ "$mode" = profile ]; then
  # Per-kernel GPU time on one rank (ncu serialises kernels, so peers cannot be profiled); the
  # clocks as they are (ncu would otherwise lock them to base for the run).
  NCU=${NCU:-/usr/local/cuda/bin/ncu}
  if [ -x "$NCU" ]; then
    step ncu_decode 300 "$NCU" --target-processes all --clock-control none \
      --metrics gpu__time_duration.sum \
      --print-summary per-kernel build-gpu/ferry-bench moe --nvlink --ranks 1 --hidden 7168 \
      --experts 256 --topk 8 --dtype fp8 --tokens 128 --iters 5 --once-per-rank \
      --reduce-at-expert-rank
    step ncu_prefill 300 "$NCU" --target-processes all --clock-control none \
      --metrics gpu__time_duration.sum \
      --print-summary per-kernel build-gpu/ferry-bench moe --nvlink --ranks 1 --hidden 7168 \
      --experts 256 --topk 8 --dtype fp8 --tokens 4096 --iters 2 --once-per-rank \
      --reduce-at-expert-rank
  fi
fi
if [ "$mode" = all ]; then
  common=(--device cuda --ranks 2 --hidden 7168 --experts 256 --topk 8 --provider shm)
  step bench_decode_fp8 300 build-gpu/ferry-bench moe "${common[@]}" --tokens 128 --dtype fp8 \
    --iters 50
  step bench_decode_bf16 300 build-gpu/ferry-bench moe "${common[@]}" --tokens 128 \
    --dtype bf16 --iters 50
  step bench_prefill 400 build-gpu/ferry-bench moe "${common[@]}" --tokens 4096 --dtype fp8 \
    --iters 10
fi

if [ "$mps_up" = 1 ]; then
  echo quit | nvidia-cuda-mps-control
  cp "$CUDA_MPS_LOG_DIRECTORY"/*.log "$OUT/" 2> /dev/null
fi

for f in "$OUT"/moe_cuda_test.log "$OUT"/moe_cuda_faults_test.log "$OUT"/kv_cuda_test.log \
         "$OUT"/gpu_words_test.log; do
  [ -f "$f" ] && grep -E '^\[  (PASSED|FAILED|SKIPPED) |\[rank|Failure' "$f" | head -20
done
grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT"/memcheck.log "$OUT"/racecheck.log 2> /dev/null
for b in "$OUT"/bench_*.log "$OUT"/nvlink_*.log "$OUT"/relay_*.log; do
  [ -f "$b" ] && { echo "== $(basename "$b" .log)"; grep -E '^(plain|\(a|\(b|tok|variant|NVLink|times in)|in one graph' "$b"; }
done
for f in "$OUT"/kv_[0-9]*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log)"; tail -12 "$f"; }
done
for f in "$OUT"/ncu_*.log; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f" .log) (one rank, (a)+(b)): kernel, gpu time"
  grep -E '^  [A-Za-z_:<>]+.*\(|gpu__time_duration.sum' "$f" | head -30
done
# Every moe benchmark of the call as one compact table (last, where the tool's output tail
# keeps it; ab printed its pairs already).
if [ "$mode" != ab ]; then
  benches=$(grep -l -E '^variant +\|' "$OUT"/*.log 2> /dev/null)
  [ -n "$benches" ] && { echo "== p50 (/ p99) of every moe benchmark, us"; p50_table $benches; }
fi
cat "$OUT/summary.txt"
# The logs travel as one archive (a few files come back more easily than many).
pack_logs
