"""digen.workers.preload: the version-0 weights a worker hands the controller are the seeded build's
the reference makes, and a CPU worker's loop then takes that same build (no second load)."""

from __future__ import annotations

import torch
from safetensors.torch import load

from digen.assembly import build_policy
from digen.workers import preload


def test_initial_weights_equal_a_seeded_build_and_the_loop_takes_that_build(small_config, monkeypatch):
    cfg = small_config()
    monkeypatch.setattr(preload, "_PRELOADED", {})
    monkeypatch.setattr(preload, "_INITIAL", {})
    torch.manual_seed(12345)  # whatever the worker drew before, the init is the seed's
    got = load(preload.initial_weights(cfg.model_dump(mode="json")))
    torch.manual_seed(cfg.seed)
    want = build_policy(cfg, device="cpu").trainable_state_dict()
    assert got.keys() == want.keys() and len(got) > 0
    for k in want:
        assert torch.equal(got[k], want[k]), k
    kept = preload._PRELOADED[preload._key(cfg, "cpu")]
    assert preload.take_policy(cfg, "cpu") is kept
    again = load(preload.initial_weights(cfg.model_dump(mode="json")))  # no rebuild once taken
    assert preload._key(cfg, "cpu") not in preload._PRELOADED
    assert all(torch.equal(again[k], want[k]) for k in want)
