"""Summarise Nsight Compute's source page of a Triton kernel (`ncu -i R --page source --csv
--print-source cuda,sass`, as scripts/ncu_flow_kernel.sh writes it): warp-stall samples per
source line and per enclosing function, each with its main stall reasons, so a change to the
kernel shows where its warps wait. Paths in the report are matched to this checkout's files by
their name under vla_node/ (or shown by file name alone).

    python3 scripts/ncu_lines.py flow_b1_source.csv [--top 30]
"""
import argparse
import csv
import os
import re
from collections import Counter, defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def local_path(path: str) -> str:
    """This checkout's copy of a file the report names (the kernel may have run from another)."""
    _, sep, rest = path.partition("/vla_node/")
    return os.path.join(REPO, "vla_node", rest) if sep else path


def functions_of(path: str) -> list[tuple[int, str]]:
    """(first line, name) of every function in a Python file, in order ([] if it is not here)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(n, m.group(1)) for n, line in enumerate(f, 1) if (m := re.match(r"\s*def (\w+)", line))]


def enclosing(functions: list[tuple[int, str]], line: int) -> str:
    name = "?"
    for first, fn in functions:
        if first > line:
            break
        name = fn
    return name


def read(path: str):
    """{(file, line): (samples, Counter(reason: samples), source text)} from the per-line rows."""
    lines, file, header = {}, "?", None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row[:1] == ["File Path"]:
                file = row[1]
            elif SAMPLES in row:
                header = row
                at = header.index(SAMPLES)
                reasons = [(k, name) for k, name in enumerate(header)
                           if name.startswith("stall_") and not name.endswith("(Not Issued)")]
            elif header and row and row[0].isdigit():
                # A source text with quotes in it can split into several fields: count from the end.
                shift = len(row) - len(header)

                def value(k):
                    v = row[k + shift]
                    return float(v.replace(",", "")) if v not in ("", "-") else 0.0
                text = ",".join(row[1:2 + shift])
                lines[(file, int(row[0]))] = (value(at), Counter({name[6:]: value(k) for k, name in reasons}), text)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    lines = read(args.csv)
    if not lines:
        print(f"no per-line '{SAMPLES}' rows in {args.csv}")
        return
    total = sum(s for s, _, _ in lines.values()) or 1.0
    functions = {file: functions_of(local_path(file)) for file, _ in lines}
    per_fn, fn_reasons = Counter(), defaultdict(Counter)
    where = {}
    for (file, line), (samples, reasons, _) in lines.items():
        fn = f"{os.path.basename(file)}:{enclosing(functions[file], line)}"
        where[(file, line)] = fn
        per_fn[fn] += samples
        fn_reasons[fn] += reasons

    def top_reasons(reasons: Counter) -> str:
        n = sum(reasons.values()) or 1.0
        return ", ".join(f"{r} {100 * v / n:.0f}%" for r, v in reasons.most_common(3) if v)

    print(f"{total:.0f} warp-stall samples over {len(lines)} source lines")
    print("per function (share of samples; its main stall reasons):")
    for fn, samples in per_fn.most_common():
        if samples / total >= 0.002:
            print(f"  {100 * samples / total:5.1f} %  {fn:40s} {top_reasons(fn_reasons[fn])}")
    print(f"top {args.top} lines:")
    for key, (samples, reasons, text) in sorted(lines.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {100 * samples / total:5.1f} %  {key[1]:4d} {where[key]:36s} {text.strip()[:60]:60s} "
              f"{top_reasons(reasons)}")


if __name__ == "__main__":
    main()
