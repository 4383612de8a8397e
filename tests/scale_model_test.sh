#!/usr/bin/env bash
# ferry-bench scale at EP8 on three hidden sizes (every rank's outputs checked by the bench),
# then tools/moe_model_test.py on those runs: the counts at two sizes must predict the third's
# bytes exactly, which the cost model's extrapolation to hidden 7168 rests on.
# Usage: scale_model_test.sh FERRY_BENCH PYTHON
set -eu
bench=$1
python=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for h in 128 256 384; do
  "$bench" scale --ranks 8 --node-ranks 4 --hidden "$h" > "$dir/ep8_h$h.json"
done
FERRY_SCALE_RUNS=$dir "$python" "$(dirname "$0")/../tools/moe_model_test.py" -v
