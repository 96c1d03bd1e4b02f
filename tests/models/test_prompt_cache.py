"""The prompt-embedding cache: a hit is the fresh encoding's bits, LRU past its cap, counted."""

from __future__ import annotations

import json

import torch

from digen.assembly import build_policy, build_reward
from digen.prompt_cache import EmbedCache, embeds_bytes, encoder_identity
from digen.reference import run_reference
from digen.rollout import generate_group
from digen.task_records import plan_groups


def test_a_cached_embedding_generates_the_bits_of_a_fresh_encoding(small_config):
    cfg = small_config(rollout__guidance_scale=4.5)  # CFG: the unconditional rows are cached too
    policy, reward = build_policy(cfg), build_reward(cfg)
    task = plan_groups(cfg, cfg.prompt_list(), 0, 0)[0]
    cache = EmbedCache.for_config(policy, cfg)
    fresh = generate_group(policy, task, cfg, reward)  # encodes the prompt itself
    first = generate_group(policy, task, cfg, reward, embeds=cache(task.prompt))
    again = generate_group(policy, task, cfg, reward, embeds=cache(task.prompt))
    for got in (first, again):
        for name, t in fresh.tensors().items():
            assert torch.equal(got.tensors()[name], t), name
    assert (cache.hits, cache.misses) == (1, 1)


def test_past_its_cap_the_least_recently_used_prompt_goes_and_the_uncond_rows_are_shared(small_config):
    cfg = small_config(rollout__guidance_scale=4.5)
    policy = build_policy(cfg)
    one = EmbedCache(policy, with_uncond=True)
    a = one("a")
    uncond = embeds_bytes(type(a)({}, a.uncond))
    own = embeds_bytes(a, a)  # the prompt's own rows
    assert uncond > 0 and own > 0
    cache = EmbedCache(policy, with_uncond=True, max_bytes=uncond + 2 * own)
    for prompt in ["a", "b", "c", "a", "c"]:  # c evicts a; a evicts b; c is still there
        cache(prompt)
    assert (cache.hits, cache.misses) == (1, 4)
    assert cache.bytes == uncond + 2 * own  # one copy of the unconditional rows for all
    assert cache("b").uncond["encoder_hidden_states"] is cache("c").uncond["encoder_hidden_states"]
    assert cache.key("a")[-1] == encoder_identity(policy)
    nothing = EmbedCache(policy, with_uncond=True, max_bytes=0)
    nothing("a"), nothing("a")
    assert (nothing.hits, nothing.misses, nothing.bytes) == (0, 2, 0)


def test_the_metrics_count_each_iterations_hits_and_misses(small_config, tmp_path):
    cfg = small_config()
    run_reference(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen: set[str] = set()
    for row in rows:
        groups = plan_groups(cfg, cfg.prompt_list(), row["iteration"], 0)
        new = {g.prompt for g in groups} - seen
        seen |= new
        # each group's prompt is read by its generation and by its train task
        assert row["embed_cache_misses"] == len(new)
        assert row["embed_cache_hits"] == 2 * len(groups) - len(new)
        assert row["embed_cache_hit_rate"] == row["embed_cache_hits"] / (2 * len(groups))
