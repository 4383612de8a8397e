# The tables gpu_check.sh prints (sourced by it): each benchmark log's p50 rows, the EP2
# targets' verdicts, and the closing summary of a run.

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

# summarize MODE: the tests' outcomes, the sanitizers', each benchmark's rows, the kv and ncu
# logs, then every moe benchmark as one compact table (last, where an output tail keeps it).
summarize() {
  local f b benches
  for f in "$OUT"/moe_cuda_test.log "$OUT"/moe_cuda_faults_test.log "$OUT"/kv_cuda_test.log \
           "$OUT"/gpu_words_test.log; do
    [ -f "$f" ] && grep -E '^\[  (PASSED|FAILED|SKIPPED) |\[rank|Failure' "$f" | head -20
  done
  grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT"/memcheck.log "$OUT"/racecheck.log 2> /dev/null
  for b in "$OUT"/bench_*.log "$OUT"/nvlink_*.log "$OUT"/relay_*.log; do
    [ -f "$b" ] || continue
    echo "== $(basename "$b" .log)"
    grep -E '^(plain|\(a|\(b|tok|variant|NVLink|times in)|in one graph' "$b"
  done
  for f in "$OUT"/kv_[0-9]*.log; do
    [ -f "$f" ] && { echo "== $(basename "$f" .log)"; tail -12 "$f"; }
  done
  for f in "$OUT"/ncu_*.log; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f" .log) (one rank, (a)+(b)): kernel, gpu time"
    grep -E '^  [A-Za-z_:<>]+.*\(|gpu__time_duration.sum' "$f" | head -30
  done
  if [ "$1" != ab ]; then  # ab printed its pairs already
    benches=$(grep -l -E '^variant +\|' "$OUT"/*.log 2> /dev/null)
    [ -n "$benches" ] && { echo "== p50 (/ p99) of every moe benchmark, us"; p50_table $benches; }
  fi
  cat "$OUT/summary.txt"
}
