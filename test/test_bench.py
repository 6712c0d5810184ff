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


def test_a_mode_that_fails_costs_its_own_row_only(tmp_path, capsys, monkeypatch):
    """A mode whose engine fails (a kernel that does not build on that machine) is reported with its
    error; the modes after it still run, and the exit code says one failed."""
    from vla_node.tools import bench

    real = bench.run_mode

    def run_mode(spec, *args, **kwargs):
        if spec == "static":
            raise RuntimeError("the kernel did not build")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--modes", "static,eager", "--iters", "1", "--dev-windows", "1",
                 "--json", str(out)]) == 1
    results = json.loads(out.read_text())
    assert list(results["modes"]) == ["eager"]
    assert results["failed"] == {"static": "RuntimeError: the kernel did not build"}
    assert "static    failed: RuntimeError: the kernel did not build" in capsys.readouterr().out


def test_one_instruction_budget_pads_more_and_keeps_the_actions(tmp_path, monkeypatch):
    """onebudget: the static buckets of max_instruction_tokens only (no instruction_tiers), as before
    the tiers. The padding is masked, so both give eager's actions within fp32 rounding. The results
    say which cuBLAS workspaces every mode ran with: torch's on the CPU, where no mode takes the
    graphs rung's workspace-free GEMMs (on a GPU the process's GEMMs all run without)."""
    from vla_node.runtime import EngineConfig
    from vla_node.runtime.graphs import NO_GEMM_WORKSPACE
    from vla_node.tools.bench import mode_config

    for name in NO_GEMM_WORKSPACE:   # as a user who set neither: restored after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)

    assert mode_config("static+onebudget", EngineConfig(preset="tiny")).instruction_budgets == (96,)
    assert mode_config("static", EngineConfig(preset="tiny")).instruction_budgets == (48, 96)
    assert mode_config("static+tier47", EngineConfig(preset="tiny")).instruction_budgets == (47, 96)
    for unknown in ("static+tier0", "static+tier", "static+tierx"):
        with pytest.raises(ValueError, match="unknown mode"):
            mode_config(unknown, EngineConfig(preset="tiny"))
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--modes", "eager,static,static+onebudget", "--iters", "1",
                 "--dev-windows", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert all(results["modes"][m]["max_abs_dev"] < 1e-5 for m in ("static", "static+onebudget"))
    assert results["gemm_workspace"] == "torch's default"
