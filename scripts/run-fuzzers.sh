#!/usr/bin/env bash
# Runs every libFuzzer harness built in BUILD_DIR for SECONDS each, one after the other, from
# its seed corpus (tests/fuzz/corpus/<harness>, read only) and what earlier runs found
# (BUILD_DIR/corpus/<harness>). Prints one line per harness; exits 1 if any found a crash, a
# leak or a timeout (the input is left in BUILD_DIR as crash-*, leak-* or timeout-*, and the
# harness's log as BUILD_DIR/<harness>.log).
set -uo pipefail
build=${1:?usage: run-fuzzers.sh BUILD_DIR SECONDS}
seconds=${2:?usage: run-fuzzers.sh BUILD_DIR SECONDS}
root=$(cd "$(dirname "$0")/.." && pwd)
failed=0
for harness in "$build"/*_fuzz; do
  name=$(basename "$harness")
  found="$build/corpus/$name"
  mkdir -p "$found"
  log="$build/$name.log"
  # -rss_limit_mb: inputs that make ferry allocate without bound fail the run; -timeout: so do
  # inputs that take over 10 s.
  if "$harness" "$found" "$root/tests/fuzz/corpus/$name" -max_total_time="$seconds" \
      -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix="$build/" \
      >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
    echo "fuzz: $name clean, ${runs:-?} inputs in ${seconds} s"
  else
    echo "fuzz: $name FAILED (log: $log)"
    tail -n 30 "$log"
    failed=1
  fi
done
exit $failed
