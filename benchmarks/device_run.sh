# Sourced by the benchmarks/run_*.sh device scripts: run NAME SECONDS CMD... runs CMD with a
# time limit, logs to $OUT/NAME.log and prints its exit status and tail (RUN_TAIL: tail's
# options, default "-n 40").
run() {
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  # shellcheck disable=SC2086  # RUN_TAIL holds tail's options
  echo "=== $name exit $? ($(date +%T))"; tail ${RUN_TAIL:--n 40} "$OUT/$name.log"
}

# The SM clock, power, temperature and throttle reasons every 500 ms into $OUT/clocks.csv
# for the whole call (timed rows carry a wall-clock "at" to line up with it): whether a
# workload timed after a long one runs slower because the clock dropped. pack_out stops it.
log_clocks() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,nounits -lms 500 > "$OUT/clocks.csv" 2>/dev/null &
  CLOCK_LOGGER=$!
  trap 'kill "$CLOCK_LOGGER" 2>/dev/null' EXIT  # also on an early exit: the call must end
}

# The device hands back at most 8 files from $OUT: past that, pack them all into one
# results.tgz (unpack it here with tar xzf) and list what it holds.
pack_out() {
  [[ -n ${CLOCK_LOGGER:-} ]] && kill "$CLOCK_LOGGER" 2>/dev/null
  ls -la "$OUT"
  local n
  n=$(find "$OUT" -type f | wc -l)
  if (( n > 8 )); then
    tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/"
    echo "packed $n files into \$OUT/results.tgz"
  fi
}
