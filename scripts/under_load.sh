#!/usr/bin/env bash
# pytest with busy loops beside it, the way a loaded 2-core CI machine runs the suite: N_LOOPS
# processes spinning `while True: pass`, started before the first run and ended when this script
# ends, whatever the result (or Ctrl-C). The suite must pass like this every time (issue 18).
#
#   scripts/under_load.sh N_LOOPS REPEATS PYTEST_ARGS...
#   scripts/under_load.sh 3 5 test/test_node_malformed.py       # 5 runs of one file, 3 busy loops
#   make test-under-load LOAD=3                                 # the whole suite once (make test)
#
# One line per run (result, wall time) and a summary; the exit status is non-zero if a run failed.
set -uo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 N_LOOPS REPEATS PYTEST_ARGS..." >&2
    exit 2
fi
loops=$1 repeats=$2
shift 2
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export ROS_LOG_DIR=${ROS_LOG_DIR:-$PWD/out/ros_log}

. scripts/busy_loops.sh
start_load "$loops"

failed=0
for run in $(seq "$repeats"); do
    start=$SECONDS
    if "$PY" -m pytest "$@"; then
        result=passed
    else
        result=FAILED
        failed=$((failed + 1))
    fi
    echo "under_load: run $run/$repeats $result in $((SECONDS - start)) s with $loops busy loops"
done
echo "under_load: $((repeats - failed))/$repeats runs passed with $loops busy loops"
[ "$failed" -eq 0 ]
