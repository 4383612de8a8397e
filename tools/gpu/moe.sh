# The MoE measurements of gpu_check.sh (sourced by it; each mode_NAME is a mode). Every run
# is ferry-bench moe over the NVLink device (or the relay), logged by step; report.sh's tables
# read the logs.

mode_ab() {
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
}

# Phase stamps per kernel (FERRY_NV_TRACE) after the NVLink decode benchmark.
mode_trace() {
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
}

# AllToAllConfig::streaming's choices side by side: nothing streamed, the dispatch, both steps
# (what Streaming::kAuto's choice rests on).
mode_stream() {
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
}

# What the EP2 targets (docs/PERFORMANCE.md) need on two GPUs, with the verdicts last.
mode_targets() {
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
}

# Two ranks of one node on the one GPU as MPS clients beside one rank (see gpu_check.sh).
mode_mps() {
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
}

# NVLink decode and prefill against one scatter per peer (--compare), and what the link
# carries (ferry-bench p2p).
mode_nvlink() {
  # What the link carries (copy engine, SM stores and loads), at a prefill dispatch's size and
  # at 256 MiB.
  for b in 30762496 268435456; do
    step p2p_$b 120 build-gpu/ferry-bench p2p --bytes $b
    cat "$OUT/p2p_$b.log"
  done
  nv=(--nvlink --ranks 2 --hidden 7168 --experts 256 --topk 8 --dtype fp8)
  step nvlink_decode 200 build-gpu/ferry-bench moe "${nv[@]}" --tokens 128 --iters 200 --compare
  step nvlink_decode_push 200 build-gpu/ferry-bench moe "${nv[@]}" --tokens 128 --iters 200 \
    --compare --private 1024
  step nvlink_prefill 300 build-gpu/ferry-bench moe "${nv[@]}" --tokens 4096 --iters 10 --compare
}

mode_relay() {
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
}

mode_hybrid() {
  # EP4 as one node, then as two nodes of two joined by the relay over shm, per rank and with
  # node-once forwarding side by side ("node1" rows). On 4 GPUs this is the relay's cost; on
  # fewer, run it under MPS (MPS=1 MPS_PERCENT=25: each rank its share of the SMs), else
  # processes sharing a GPU are time-sliced and the figures measure the driver's switching
  # (milliseconds), not the protocol.
  ep4=(--nvlink --ranks 4 --hidden 7168 --experts 256 --topk 8 --dtype fp8 --once-per-rank
       --reduce-at-expert-rank)
  step ep4_one_node 200 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 128 --iters 100
  step ep4_two_nodes 200 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 128 --iters 100 \
    --node-ranks 2 --node-once --token-major
  step ep4_two_nodes_prefill 300 build-gpu/ferry-bench moe "${ep4[@]}" --tokens 4096 --iters 10 \
    --node-ranks 2 --node-once
  # The forwarding hop's own cost: node-once's phase stamps of the last replayed epoch.
  FERRY_NV_TRACE=1 step ep4_node_once_trace 200 build-gpu/ferry-bench moe "${ep4[@]}" \
    --tokens 128 --iters 20 --node-ranks 2 --node-once
  echo "== EP4 decode: one node, then two nodes of two (relay over shm): per rank, node-once (node1)"
  grep -h -E '^(\(a\)\+\(b\)|tok\+perm)' "$OUT/ep4_one_node.log" "$OUT/ep4_two_nodes.log" \
    "$OUT/ep4_two_nodes_prefill.log"
  echo "== node-once phases, decode (us, last epoch)"
  grep -h 'node-once trace' "$OUT/ep4_node_once_trace.log"
}

mode_profile() {
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
}

mode_ep() {
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
}

# The host-driven CUDA AllToAll over shm (two processes), decode fp8 and bf16 and prefill.
mode_bench() {
  common=(--device cuda --ranks 2 --hidden 7168 --experts 256 --topk 8 --provider shm)
  step bench_decode_fp8 300 build-gpu/ferry-bench moe "${common[@]}" --tokens 128 --dtype fp8 \
    --iters 50
  step bench_decode_bf16 300 build-gpu/ferry-bench moe "${common[@]}" --tokens 128 \
    --dtype bf16 --iters 50
  step bench_prefill 400 build-gpu/ferry-bench moe "${common[@]}" --tokens 4096 --dtype fp8 \
    --iters 10
}
