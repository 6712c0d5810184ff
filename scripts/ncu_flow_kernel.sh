#!/usr/bin/env bash
# Where the persistent flow loop's warps stall, line by line (issue 22): Nsight Compute's PC
# sampling (SourceCounters) of one flow_kernel launch at each batch size (full size, 891 context
# tokens, 10 flow steps), exported per source line and SASS instruction (flow_bB_source.csv), with
# the launch's summary sections (flow_bB.txt). scripts/ncu_lines.py summarises a CSV (the script
# prints its summary too).
#
#   OUT=dir bash scripts/ncu_flow_kernel.sh [1 4]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
reports=$(mktemp -d)
[ $# -gt 0 ] || set -- 1 4
for B in "$@"; do
    timeout 250 "$NCU" --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source yes \
        -k regex:flow_kernel -c 1 -f -o "$reports/flow_b$B" \
        python3 scripts/check_fused_batches.py --entries "$B" --steps 10 > "$OUT/flow_b$B.txt" 2>&1
    "$NCU" -i "$reports/flow_b$B.ncu-rep" --page details >> "$OUT/flow_b$B.txt" 2>&1
    "$NCU" -i "$reports/flow_b$B.ncu-rep" --page source --csv --print-source cuda,sass > "$OUT/flow_b${B}_source.csv" 2>&1
    echo "== B=$B: $(grep -c . "$OUT/flow_b${B}_source.csv") source rows"; grep -E "Duration|Warp Cycles Per Issued" "$OUT/flow_b$B.txt"
    python3 scripts/ncu_lines.py "$OUT/flow_b${B}_source.csv" --top 30
done
