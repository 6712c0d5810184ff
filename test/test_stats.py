"""tools/stats.summary: the one percentile summary of every report."""
import numpy as np
import pytest

from vla_node.tools.stats import summary


def test_summary_names_and_values():
    x = [4.0, 1.0, 3.0, 2.0]
    assert summary(x, "n", "min", "max", "mean", "median") == {"n": 4, "min": 1.0, "max": 4.0, "mean": 2.5,
                                                                 "median": 2.5}
    assert summary(x, "p90")["p90"] == pytest.approx(float(np.percentile(x, 90)))
    assert summary(x, "p50", "max", prefix="late_ms_") == {"late_ms_p50": 2.5, "late_ms_max": 4.0}
    assert set(summary(x)) == {"n", "mean", "p50", "p90", "p99", "max"}    # the reports' distribution


def test_empty_samples_and_unknown_names():
    assert summary([]) == {"n": 0} and summary([], "p50", "max") == {}
    with pytest.raises(ValueError, match="unknown statistic 'q5'"):
        summary([1.0], "q5")
