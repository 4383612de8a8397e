#!/usr/bin/env bash
# One run on a GPU machine: build the CUDA parts for sm_90, run the GPU tests (and
# compute-sanitizer memcheck/racecheck on small cases), run the chosen measurements. Logs go to
# $OUT (default /tmp/ferry-gpu); a short table is printed last. The modes and switches:
# tools/README.md; the measurements themselves are in tools/gpu/ (moe.sh, host.sh), the tables
# in tools/gpu/report.sh.
set -u
mode=${1:-all}
modes="all tests none ab trace stream targets mps nvlink relay hybrid profile ep bench kv mirror
       compat serve"
case " $(echo $modes) " in
  *" $mode "*) ;;
  *) echo "unknown mode $mode (one of: $(echo $modes))"; exit 2 ;;
esac
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
         moe_host_test moe_compat_test fd_exchange_test ferry-bench)
if [ -d .pydeps/usr/lib/cmake/pybind11 ]; then
  python=(-Dpybind11_DIR="$PWD/.pydeps/usr/lib/cmake/pybind11")
  targets+=(_ferry)
fi
# TARGETS: only these (with TESTS=0, a measurement that needs a few binaries builds no more).
if [ -n "${TARGETS:-}" ]; then read -ra targets <<< "$TARGETS"; fi
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

here=$(dirname "$0")
# shellcheck source=gpu/report.sh
. "$here/gpu/report.sh"
# shellcheck source=gpu/moe.sh
. "$here/gpu/moe.sh"
# shellcheck source=gpu/host.sh
. "$here/gpu/host.sh"
tests=${TESTS:-1}
case $mode in profile | trace | serve) tests=0 ;; esac  # they build and measure only
if [ "$tests" != 0 ]; then
  step kv_cuda_test 120 build-gpu/kv_cuda_test
  step gpu_words_test 60 build-gpu/gpu_words_test
  step moe_cuda_test 400 build-gpu/moe_cuda_test
  step moe_cuda_faults_test 120 build-gpu/moe_cuda_faults_test
  step moe_mask_test 180 build-gpu/moe_mask_test
  step fd_exchange_test 60 build-gpu/fd_exchange_test
  step moe_compat_test 60 build-gpu/moe_compat_test
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
# ranks sharing the one GPU run side by side (off again at the end).
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

case $mode in
  all)  # everything that runs on the machine at hand
    mode_nvlink; mode_relay; mode_hybrid; mode_kv; mode_profile; mode_bench ;;
  tests | none) ;;
  mps) [ "$mps_up" = 1 ] && mode_mps ;;
  *) "mode_$mode" ;;
esac

if [ "$mps_up" = 1 ]; then
  echo quit | nvidia-cuda-mps-control
  cp "$CUDA_MPS_LOG_DIRECTORY"/*.log "$OUT/" 2> /dev/null
fi
summarize "$mode"
# The logs travel as one archive (a few files come back more easily than many).
pack_logs
