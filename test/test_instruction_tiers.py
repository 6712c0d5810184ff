"""Instruction budgets (EngineConfig.instruction_tiers): a static engine keeps a bucket per budget
and runs each query in the smallest that holds its instructions. The padding is masked, so every
budget gives the eager reference's actions; switching budgets must leave nothing behind (the LLM's
streaming cache belongs to one bucket at a time)."""
import dataclasses

import numpy as np
import pytest
import torch

from test_options import window_stream
from vla_node.runtime import EngineConfig, PolicyEngine

SHORT = "put the red cup in the bowl"   # a 28-token chat turn with the tiny tokenizer
LONG = "pick up the red cube with the right arm and hand it over to the left arm"   # 60 tokens


@pytest.fixture(scope="module")
def tiered():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", instruction_tiers=(32, 48)))
    engine.warmup()
    return engine


def test_each_instruction_runs_in_the_smallest_budget_that_holds_it(tiered):
    static, layout = tiered.static, tiered.layout
    assert static.budgets[layout] == (32, 48, 96)
    assert [static.budget_for(layout, [text]) for text in (SHORT, LONG)] == [32, 96]
    assert static.budget_for(layout, [SHORT, LONG]) == 96   # a batch: its longest instruction
    assert {b.length - b.instruction_start for b in static.buckets.values()} == {32, 48, 96}   # all warmed up


def test_every_budget_gives_the_eager_actions_and_a_b_a_repeats_bit_for_bit(tiered):
    eager = PolicyEngine(EngineConfig(seed=0))
    one_budget = PolicyEngine(EngineConfig.for_mode("ctxkv", instruction_tiers=()))
    assert one_budget.static.budgets[one_budget.layout] == (96,)
    obs = eager.dummy_observation()
    noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(3))
    got = {}
    for key, text in (("short", SHORT), ("long", LONG), ("short again", SHORT)):
        query = dataclasses.replace(obs, instruction=text)
        got[key] = tiered.predict(query, noise=noise).normalized
        reference = eager.predict(query, noise=noise).normalized
        assert np.abs(got[key] - reference).max() < 1e-5, key
        assert np.abs(got[key] - one_budget.predict(query, noise=noise).normalized).max() < 1e-5, key
    assert np.array_equal(got["short"], got["short again"])
    assert not np.allclose(got["short"], got["long"])   # the instruction reached the actions


def test_streaming_restarts_with_a_full_prefill_when_the_instruction_changes_budget():
    """The LLM's cache holds the last prefilled bucket's keys: a window whose bucket did not run the
    query before is a full prefill (what a fresh engine gives), even where its bucket's last window
    is the one it slides from, and the stream resumes from there."""
    config = EngineConfig.for_mode("ctxkv", vision_cache=True, streaming_kv=True)
    streamed = PolicyEngine(config)
    short, long = list(window_stream(4)), list(window_stream(4, instruction=LONG))
    streamed.predict(short[0])
    streamed.predict(long[1])   # another bucket: the cache now holds its window
    noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(5))
    back = streamed.predict(short[1], noise=noise).normalized   # slides from short[0], but on long[1]'s cache
    assert streamed.static.stream_steps == 0
    fresh = PolicyEngine(config).predict(short[1], noise=noise).normalized
    assert np.abs(back - fresh).max() < 1e-5
    streamed.predict(short[2])
    assert streamed.static.stream_steps == 1


def test_tile_tiers_make_a_bucket_a_multiple_of_128_tokens_where_it_costs_a_tier_a_few():
    """The tiny prompt's images end at token 129: a 130-token tier makes 259 tokens, three past 2 x 128,
    so it becomes 127 (a 256-token bucket); 60 makes 189, far from a multiple, and stays; the longest
    budget is what check_observation promises and is never trimmed. The actions do not change."""
    tiers = dict(instruction_tiers=(60, 130), max_instruction_tokens=160)
    tiled = PolicyEngine(EngineConfig.for_mode("ctxkv", tile_tiers=True, **tiers))
    full = PolicyEngine(EngineConfig.for_mode("ctxkv", **tiers))
    layout = tiled.layout
    assert tiled.static.budgets[layout] == (60, 127, 160) and full.static.budgets[layout] == (60, 130, 160)
    assert tiled.static.bucket(layout, 1, 127).length == 256
    assert tiled.static.budget_for(layout, ["x " * 40]) == 127   # a 97-token chat turn
    obs = dataclasses.replace(tiled.dummy_observation(), instruction="x " * 40)
    noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(4))
    assert np.abs(tiled.predict(obs, noise=noise).normalized - full.predict(obs, noise=noise).normalized).max() < 1e-5


def test_a_tier_too_short_for_any_instruction_is_refused_at_start():
    with pytest.raises(ValueError, match=r"instruction_tiers: 8 tokens hold no instruction \(the chat turn of a "
                                         r"one-letter one is 18\)"):
        PolicyEngine(EngineConfig.for_mode("ctxkv", instruction_tiers=(8,)))
    with pytest.raises(ValueError, match=r"instruction_tiers must be token counts >= 1, got \[0\]"):
        EngineConfig(instruction_tiers=(0,))
    assert EngineConfig(instruction_tiers=[96, 200]).instruction_budgets == (96,)   # at or above the max: nothing


@pytest.mark.cuda
def test_budgets_under_cuda_graphs_repeat_bit_for_bit_and_stay_within_bf16_noise_of_eager():
    """Each budget's bucket has its own captured graphs: short, long, short again replays the
    short bucket's graphs to the same bits, and each is eager's actions to bf16 noise."""
    gpu = dict(device="cuda", dtype="bfloat16")
    eager, fast = PolicyEngine(EngineConfig(**gpu)), PolicyEngine(EngineConfig.for_mode("fast", **gpu))
    fast.warmup()
    obs = eager.dummy_observation()
    noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(3)).cuda()
    got = {}
    for key, text in (("short", SHORT), ("long", LONG), ("short again", SHORT)):
        query = dataclasses.replace(obs, instruction=text)
        got[key] = fast.predict(query, noise=noise).normalized
        reference = eager.predict(query, noise=noise).normalized
        assert np.linalg.norm(got[key] - reference) / np.linalg.norm(reference) < 1e-2, key
    assert np.array_equal(got["short"], got["short again"])
    assert fast.static.recompiles() == 0
