"""Regional torch.compile: every repeated block (ViT block, decoder layer, expert block) shares
one compiled graph, so warm-up compiles a handful of graphs instead of whole unrolled stages.

Module.compile() keeps the module's own parameters and names (no `_orig_mod.` prefixes in
state_dict); `uncompile` returns the modules to eager.
"""
from __future__ import annotations

from torch import nn

from ..model.policy import VLAPolicy


def compile_regions(model: VLAPolicy) -> list[nn.Module]:
    regions: list[nn.Module] = [*model.vision.encoder.blocks, model.vision.pool, model.vision.projector,
                                *model.llm.layers, *model.expert.blocks]
    for module in regions:
        module.compile(fullgraph=True, dynamic=False)
    return regions


def uncompile(regions: list[nn.Module]) -> None:
    for module in regions:
        module._compiled_call_impl = None  # what nn.Module.compile() set; the eager forward is untouched


def compile_count() -> int:
    """Graphs dynamo has compiled in this process (grows on every recompilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
