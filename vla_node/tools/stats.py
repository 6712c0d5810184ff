"""One percentile summary for every report (vla-bench, vla-replay, vla-soak, vla-node-bench, vla-sim
eval): the same statistics under the same names, computed once.

    summary([3.0, 1.0, 2.0], "p50", "max")       -> {"p50": 2.0, "max": 3.0}
    summary(x, "p50", "p99", prefix="late_ms_")   -> {"late_ms_p50": ..., "late_ms_p99": ...}

Names: "n", "mean", "std", "min", "max", "median" (= p50) and "pNN" for any percentile NN.
Empty samples give {"n": 0} when "n" is asked for, else {} (nothing to summarise).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

DISTRIBUTION = ("n", "mean", "p50", "p90", "p99", "max")   # the reports' full summary


def summary(samples: Sequence[float] | np.ndarray, *names: str, prefix: str = "") -> dict:
    names = names or DISTRIBUTION
    a = np.asarray(samples, np.float64).ravel()
    if a.size == 0:
        return {f"{prefix}n": 0} if "n" in names else {}
    out = {}
    for name in names:
        if name == "n":
            value = int(a.size)
        elif name in ("mean", "std", "min", "max"):
            value = float(getattr(a, name)())
        elif name == "median":
            value = float(np.percentile(a, 50))
        elif name.startswith("p") and name[1:].replace(".", "", 1).isdigit():
            value = float(np.percentile(a, float(name[1:])))
        else:
            raise ValueError(f"unknown statistic {name!r}: n, mean, std, min, max, median or pNN")
        out[prefix + name] = value
    return out
