#!/usr/bin/env bash
# Run the default test suite repeatedly across thread counts (and, optionally, next to a busy CPU)
# to find flaky tests: N repetitions × OMP_NUM_THREADS in THREADS × load in LOADS.
#
#   scripts/stress_suite.sh [N] [--threads "1 2 4"] [--load off|on|both] [--load-procs K]
#                           [--timeout SECONDS] [--report FILE] [-- PYTEST_ARGS...]
#
#   N             repetitions (default 5)
#   --threads     OMP_NUM_THREADS values (default "1 2 4"); tests/conftest.py and the dist harness's
#                 workers use it as their intra-op thread count
#   --load        off (default), on (K busy-loop processes run next to the tests), or both
#   --load-procs  busy loops for --load on (default: the number of CPUs)
#   --timeout     wall-clock limit per pytest run, seconds (default: none); a run that hits it counts
#                 as failed
#   --report      report file (default: $TMPDIR/depthscale-stress-<time>/report.txt, next to each
#                 run's pytest log)
#   PYTEST_ARGS   replace the default selection, e.g. -- tests/dist -k chunked
#
# The suite runs as the README runs it: python -m pytest -q (pyproject's addopts: -m "not slow"),
# with pytest-randomly off if installed. Each run also writes the tolerance log
# (DEPTHSCALE_TOLERANCE_LOG, tests/tolerances.py); the report ends with the checks that came closest
# to their bounds. Exit status: 0 if every run passed, 1 otherwise.
set -uo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

reps=5
threads_list="1 2 4"
load_mode=off
load_procs=$(nproc 2>/dev/null || echo 2)
run_timeout=""
report=""
pytest_args=()

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    reps=$1
    shift
fi
while [[ $# -gt 0 ]]; do
    case $1 in
        --threads) threads_list=$2; shift 2 ;;
        --load) load_mode=$2; shift 2 ;;
        --load-procs) load_procs=$2; shift 2 ;;
        --timeout) run_timeout=$2; shift 2 ;;
        --report) report=$2; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "stress_suite.sh: unknown argument '$1' (pytest arguments go after --)" >&2; exit 2 ;;
    esac
done
case $load_mode in
    off) loads="off" ;;
    on) loads="on" ;;
    both) loads="off on" ;;
    *) echo "stress_suite.sh: --load must be off, on or both, not '$load_mode'" >&2; exit 2 ;;
esac
[[ $reps =~ ^[1-9][0-9]*$ ]] || { echo "stress_suite.sh: N must be a positive integer" >&2; exit 2; }

cd "$(dirname "$0")/.." || exit 2
outdir=${TMPDIR:-/tmp}/depthscale-stress-$(date +%Y%m%d-%H%M%S)-$$
mkdir -p "$outdir"
report=${report:-$outdir/report.txt}
mkdir -p "$(dirname "$report")"

# --- background load: only the processes started here are stopped, by their ids ---------------
load_pids=()
stop_load() {
    local pid
    for pid in "${load_pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${load_pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    load_pids=()
}
start_load() {
    local i
    for ((i = 0; i < load_procs; i++)); do
        python -c 'while True: pass' &
        load_pids+=($!)
    done
}
trap 'stop_load' EXIT
trap 'stop_load; exit 130' INT TERM

plugins=(-p no:cacheprovider)
if python -c 'import pytest_randomly' 2>/dev/null; then
    plugins+=(-p no:randomly)
fi
cmd=(python -m pytest -q "${plugins[@]}" "${pytest_args[@]}")

{
    echo "depthscale stress run $(date -Is)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "cpus: $(nproc 2>/dev/null || echo '?'), repetitions: $reps, threads: $threads_list, load: $loads (busy loops: $load_procs)"
    echo "command: OMP_NUM_THREADS=<threads> ${cmd[*]}"
    echo "logs: $outdir"
    echo
    printf '%-4s %-8s %-5s %7s %7s %8s %4s  %s\n' rep threads load passed failed seconds rc log
} | tee "$report"

any_failed=0
for ((rep = 1; rep <= reps; rep++)); do
    for load in $loads; do
        [[ $load == on ]] && start_load
        for t in $threads_list; do
            log=$outdir/run-$rep-t$t-load$load.log
            start=$(date +%s.%N)
            if [[ -n $run_timeout ]]; then
                OMP_NUM_THREADS=$t DEPTHSCALE_TOLERANCE_LOG=$outdir/tolerances-$rep-t$t-load$load.jsonl \
                    timeout --kill-after=30 "$run_timeout" "${cmd[@]}" >"$log" 2>&1
            else
                OMP_NUM_THREADS=$t DEPTHSCALE_TOLERANCE_LOG=$outdir/tolerances-$rep-t$t-load$load.jsonl \
                    "${cmd[@]}" >"$log" 2>&1
            fi
            rc=$?
            seconds=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.0f", e - s }')
            summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)' "$log" | tail -1)
            passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || true)
            failed=$(grep -oE '[0-9]+ failed' <<<"$summary" | grep -oE '[0-9]+' || true)
            errors=$(grep -oE '[0-9]+ errors?' <<<"$summary" | grep -oE '[0-9]+' || true)
            passed=${passed:-0}
            failed=$((${failed:-0} + ${errors:-0}))
            if [[ $rc -ne 0 && $failed -eq 0 ]]; then
                failed="?"  # no summary: crashed, interrupted or timed out (see rc and the log)
            fi
            [[ $rc -ne 0 || $failed != 0 ]] && any_failed=1
            printf '%-4s %-8s %-5s %7s %7s %8s %4s  %s\n' "$rep" "$t" "$load" "$passed" "$failed" \
                "$seconds" "$rc" "$(basename "$log")" | tee -a "$report"
            grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/       /' | tee -a "$report"
        done
        [[ $load == on ]] && stop_load
    done
done

# The checks that came closest to their bounds, over all runs (tests/tolerances.py `check`).
python - "$outdir" <<'EOF' | tee -a "$report"
import glob, json, sys

worst = {}
for path in glob.glob(f"{sys.argv[1]}/tolerances-*.jsonl"):
    for line in open(path):
        r = json.loads(line)
        key = (r["test"], r["what"])
        if key not in worst or r["ratio"] > worst[key]["ratio"]:
            worst[key] = r
if worst:
    print("\nclosest to their bounds (measured / bound, worst over all runs):")
    for (test, what), r in sorted(worst.items(), key=lambda kv: -kv[1]["ratio"])[:15]:
        print(f"  {r['ratio']:8.4f}  {r['measured']:.3g} / {r['bound']:.3g}  threads={r['threads']}  {test}  [{what}]")
EOF

echo | tee -a "$report"
if [[ $any_failed -ne 0 ]]; then
    echo "FAILED: at least one run failed; report: $report" | tee -a "$report"
    exit 1
fi
echo "all runs passed; report: $report" | tee -a "$report"
exit 0
