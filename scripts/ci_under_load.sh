#!/usr/bin/env bash
# CI as it runs on a busy machine: RUNS consecutive clean clones of this repository's HEAD, each
# running `bash .ci/run` (the README's test command, with a fresh .venv) beside N_LOOPS busy loops
# (`while True: pass`) that start before its clone and end with it. One line per run and the
# exit status of the last failing one (issue 18's must-show: 2 runs, 3 loops, both passing).
#
#   scripts/ci_under_load.sh [RUNS=2] [N_LOOPS=3]        # logs: ${CI_LOAD_DIR:-/tmp/ci_under_load}/runN.log
set -uo pipefail
runs=${1:-2} loops=${2:-3}
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${CI_LOAD_DIR:-/tmp/ci_under_load}
mkdir -p "$dir"
. "$repo/scripts/busy_loops.sh"
status=0
for run in $(seq "$runs"); do
    start_load "$loops"
    clone="$dir/clone"
    rm -rf "$clone" && git clone -q "$repo" "$clone"
    start=$SECONDS
    (cd "$clone" && CI=true bash .ci/run) > "$dir/run$run.log" 2>&1
    rc=$?
    end_load
    [ "$rc" -eq 0 ] || status=$rc
    echo "ci_under_load: run $run/$runs at $(git -C "$clone" rev-parse --short HEAD): rc $rc in $((SECONDS - start)) s" \
         "with $loops busy loops; $(grep -E '[0-9]+ (passed|failed)' "$dir/run$run.log" | tail -1)"
done
exit "$status"
