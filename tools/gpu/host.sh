# The measurements of gpu_check.sh outside the MoE kernels (sourced by it; each mode_NAME is a
# mode): the KV messenger, the mirrored immediates, the DeepEP / pplx layers, the served model.

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

# The kv benchmarks, 4k and 32k prompts; with PACES ("1.25 1"), each at those paces instead
# (KV_SPIN, KV_WRS, KV_ROUNDS as kv_paces says).
mode_kv() {
  if [ -n "${PACES:-}" ]; then
    kv_paces "$PACES"
    return
  fi
  step kv_4k 300 build-gpu/ferry-bench kv --tokens 4096
  step kv_32k 300 build-gpu/ferry-bench kv --tokens 32768
}

mode_mirror() {
  # A kernel waiting on a mirrored immediate counter (GpuWords) beside a host thread in WaitImm.
  for provider in shm "tcp;ofi_rxm"; do
    step "mirror_${provider%%;*}" 120 build-gpu/ferry-bench mirror --provider "$provider"
    cat "$OUT/mirror_${provider%%;*}.log"
  done
}

# ferry.compat's GPU tests (deep_ep, pplx, pplx_kernels), and what each layer adds per call (GPU and CPU).
mode_compat() {
  PYTHONPATH=$PWD/build-gpu/python:$PWD/python/tests step compat_cuda 240 python3 -m unittest \
    -v test_compat_cuda test_compat_deep_ep_masks
  PYTHONPATH=$PWD/build-gpu/python step bench_compat_cuda 120 python3 \
    tools/bench_compat.py --device cuda --json "$OUT/bench_compat_cuda.json"
  PYTHONPATH=$PWD/build-gpu/python step bench_compat_cpu 120 python3 \
    tools/bench_compat.py --device cpu --json "$OUT/bench_compat_cpu.json"
  for f in "$OUT"/compat_cuda.log "$OUT"/bench_compat_cuda.log \
           "$OUT"/bench_compat_cpu.log; do
    [ -f "$f" ] && { echo "== $(basename "$f" .log)"; tail -8 "$f"; }
  done
}

# The served model (examples/serve) on this host's cores, ferry's host device over shm: its
# end-to-end tests, then tools/bench_serve.py (disaggregated vs colocated decode ITL with long
# prompts arriving, and the KV tail against one layer's raw write), where the polling threads
# have cores of their own (on 2 cores they share one with the compute).
mode_serve() {
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
}
