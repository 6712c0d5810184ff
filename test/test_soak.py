"""vla-soak end to end, briefly (the soak itself is a benchmark: BENCHMARKS.md). A short run
through the node leaves no process and no shared memory behind; the engine soak counts
recompiles after warm-up (on the GPU, through the compiled fast mode: none)."""
import json

import pytest

from vla_node.tools.soak import main

pytestmark = pytest.mark.timeout(300)


def test_a_short_node_soak_leaves_no_process_or_shared_memory_behind(tmp_path):
    main(["node", "--queries", "30", "--warmup", "10", "--sample-every", "10", "--json", str(tmp_path / "soak.json")])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["queries"] >= 30 and report["node_exit_code"] == 0
    assert report["processes_left"] == [] and report["dds_shm_leaked"] == []
    assert report["engine"]["final_queries"] >= 30 and report["node"]["rss_mib"][1] > 0


def test_engine_soak_counts_recompiles_on_the_cpu(tmp_path):
    main(["engine", "--queries", "6", "--warmup", "3", "--sample-every", "3", "--json", str(tmp_path / "soak.json")])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["queries"] == 6 and report["recompiles"] == 0 and len(report["samples"]) == 3


@pytest.mark.cuda
def test_engine_soak_on_the_gpu_has_no_recompiles_after_warmup(tmp_path):
    main(["engine", "--device", "cuda", "--mode", "fast", "--queries", "200", "--warmup", "20", "--sample-every", "50",
          "--json", str(tmp_path / "soak.json")])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["queries"] == 200 and report["recompiles"] == 0
