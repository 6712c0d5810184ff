"""vla-bench on the tiny preset (CPU): the stage table, and batches of observations against the same
observations alone."""
import json

import pytest

from vla_node.tools.bench import main


def test_bench_times_batches_and_compares_each_entry_with_its_query_alone(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--modes", "eager", "--iters", "2", "--dev-windows", "3",
                 "--batches", "2,4", "--json", str(out)]) == 0
    eager = json.loads(out.read_text())["modes"]["eager"]
    assert sorted(eager["batches"], key=int) == ["1", "2", "4"]
    for n, b in eager["batches"].items():
        assert b["per_observation_ms"] * int(n) == pytest.approx(b["total_ms"])
        assert b["max_abs_dev_vs_alone"] < 1e-5       # fp32: an entry's actions are its own query's
    assert "batches of observations" in capsys.readouterr().out
