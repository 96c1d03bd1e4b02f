"""State an algorithm keeps beside the weights (DiffusionNFT's old copy): in the optimizer
store, in every version dict as ``algo/<role>/<name>``, in checkpoints, through --resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from digen.algos.diffusion_nft import nft_decay
from digen.algos.state import (
    load_version,
    policy_state,
    role_weights,
    split_version,
    state_name,
    swapped_weights,
    with_role,
)
from digen.assembly import build_policy
from digen.errors import AlgorithmError
from digen.optim import ParameterStore
from digen.reference import run_reference
from digen.rollout import generate_group
from digen.task_records import plan_groups

NFT = {"train__algorithm": "diffusion-nft", "train__nft": {"decay_type": 1}}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.lora_A.weight": torch.randn(2, 3, generator=gen),
        "a.lora_B.weight": torch.randn(3, 2, generator=gen),
    }


def test_state_tensors_are_named_algo_role_parameter():
    w = weights()
    state = with_role(w, "old")
    assert sorted(state) == ["algo/old/a.lora_A.weight", "algo/old/a.lora_B.weight"]
    assert state_name("old", "a.lora_A.weight") == "algo/old/a.lora_A.weight"
    trained, extra = split_version({**w, **state})
    assert trained.keys() == w.keys() and extra.keys() == state.keys()
    assert all(torch.equal(role_weights(extra, "old")[k], w[k]) for k in w)


def test_the_store_keeps_nft_state_in_every_version_and_moves_it_after_the_iteration(small_config):
    train = small_config(**NFT).train
    w = weights()
    store = ParameterStore(w, train)
    version = store.weights()
    assert sorted(version) == sorted([*w, *with_role(w, "old")])  # version 0: old = the weights
    grad = {k: torch.ones_like(v) for k, v in w.items()}
    store.step(grad, rows=1, last_of_iteration=False)  # mini-batch 0 of 2: the state waits
    assert all(torch.equal(role_weights(store.state, "old")[k], w[k]) for k in w)
    store.step(grad, rows=1)  # the iteration's last step: old <- d old + (1 - d) theta, d(2 steps)
    d = nft_decay(2, 1)
    for k in w:
        expected = w[k] * d + store.trained()[k] * (1 - d)
        assert torch.allclose(role_weights(store.state, "old")[k], expected, atol=1e-7, rtol=0)
    assert ParameterStore(w, small_config().train).weights().keys() == w.keys()  # Flow-GRPO: nothing extra


def test_checkpoints_keep_the_state_out_of_the_exported_weights(small_config, tmp_path):
    train = small_config(**NFT).train
    store = ParameterStore(weights(), train)
    store.step({k: torch.ones_like(v) for k, v in weights().items()}, rows=2)
    store.save(tmp_path / "ckpt", {"iteration": 0})
    assert load_file(str(tmp_path / "ckpt/weights.safetensors")).keys() == weights().keys()
    opt = load_file(str(tmp_path / "ckpt/optimizer.safetensors"))
    assert {k for k in opt if k.startswith("algo/")} == set(with_role(weights(), "old"))
    back, _ = ParameterStore.load(tmp_path / "ckpt", train)
    assert back.weights().keys() == store.weights().keys()
    assert all(torch.equal(back.weights()[k], v) for k, v in store.weights().items())


def test_load_version_and_swapped_weights_round_trip_exactly(small_config):
    cfg = small_config(**NFT)
    policy = build_policy(cfg)
    base = policy.trainable_state_dict()
    other = {k: v + 0.5 for k, v in base.items()}
    load_version(policy, {**base, **with_role(other, "old")})
    assert role_weights(policy_state(policy), "old").keys() == base.keys()
    params = dict(policy.named_trainable_parameters())
    with swapped_weights(policy, other):
        assert all(torch.equal(params[k].detach(), other[k]) for k in base)
    assert all(torch.equal(params[k].detach(), base[k]) for k in base)
    policy.load_trainable_state_dict(base)  # a version loaded another way leaves the table alone
    load_version(policy, base)
    assert policy_state(policy) == {}


def test_nft_rollouts_sample_with_the_old_weights(small_config):
    cfg = small_config(**NFT)
    policy = build_policy(cfg)
    base = policy.trainable_state_dict()
    task = plan_groups(cfg, cfg.prompt_list(), 0, 0)[0]

    def sample(old):
        load_version(policy, {**base, **with_role(old, "old")})
        return generate_group(policy, task, cfg, None).latents

    same = sample(base)
    assert same.shape[1] == 1  # the final latent only
    moved = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in base.items()
    }
    assert not torch.equal(sample(moved), same)
    assert torch.equal(sample(base), same)
    policy.load_trainable_state_dict(base)
    load_version(policy, base)  # no algo/old tensors
    with pytest.raises(AlgorithmError, match="load each version with digen.algos.state.load_version"):
        generate_group(policy, task, cfg, None)


def test_nft_resume_equals_no_resume(small_config, tmp_path):
    """The old weights are restored on --resume, so the run continues as if never stopped."""
    run_reference(small_config(iterations=3, **NFT), tmp_path / "straight")
    run_reference(small_config(iterations=1, **NFT), tmp_path / "resumed")
    run_reference(small_config(iterations=3, **NFT), tmp_path / "resumed", resume=True)

    def rows(run):
        return [
            {k: r[k] for k in ("rewards", "loss", "grad_norm")}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        ]

    assert rows(tmp_path / "straight") == rows(tmp_path / "resumed")
    for name in ("weights", "optimizer"):
        a = load_file(str(tmp_path / f"straight/checkpoints/iter_0002/{name}.safetensors"))
        b = load_file(str(tmp_path / f"resumed/checkpoints/iter_0002/{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
