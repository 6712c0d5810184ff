"""Regional torch.compile: every repeated block (ViT block, decoder layer, expert block) shares
one compiled graph, so warm-up compiles a handful of graphs instead of whole unrolled stages.

Module.compile() keeps the module's own parameters and names (no `_orig_mod.` prefixes in
state_dict); `uncompile` returns the modules to eager.
"""
from __future__ import annotations

import torch._dynamo.config as dynamo_config
from torch import nn

from ..model.policy import VLAPolicy

# Graphs one region's code may have: one per bucket shape (every layout x batch size x instruction
# budget and, for an episode's start, each of its shorter windows) and per engine of the process
# with other weights types (an fp8 LLM, say). Dynamo's defaults (8 a region, 256 over all regions)
# and then 64 were hit on the GPU by a process holding the test suite's engines
# (FailOnRecompileLimitHit under fullgraph, test_engine_batch after the instruction tiers doubled
# the buckets). The limit is a runaway guard only: a recompile after warm-up is still counted and
# reported (StaticRunner.recompiles).
RECOMPILE_LIMIT = 1024


def compile_regions(model: VLAPolicy, pad_gemms: bool = True) -> list[nn.Module]:
    """Compile every repeated block in place. With cuBLAS's GEMMs: inductor's max-autotune Triton
    templates were slower in the query where its own timing chose them, and took over 5 minutes of
    warm-up on the H200 (BENCHMARKS.md, the eighteenth session). pad_gemms False: inductor's pad_mm
    pass off (EngineConfig.unpadded_gemms); True leaves its setting as it is."""
    # The names differ between torch versions; the accumulated one caps all regions together.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if getattr(dynamo_config, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
            setattr(dynamo_config, name, RECOMPILE_LIMIT)
    regions: list[nn.Module] = [*model.vision.encoder.blocks, model.vision.pool, model.vision.projector,
                                *model.llm.layers, *model.expert.blocks]
    options = {} if pad_gemms else {"shape_padding": False}
    for module in regions:
        module.compile(fullgraph=True, dynamic=False, options=options)
    return regions


def uncompile(regions: list[nn.Module]) -> None:
    for module in regions:
        module._compiled_call_impl = None  # what nn.Module.compile() set; the eager forward is untouched


def compile_count() -> int:
    """Graphs dynamo has compiled in this process (grows on every recompilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
