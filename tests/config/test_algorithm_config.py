"""Config checks of train.algorithm, its options and train.mini_batches: every problem named."""

from __future__ import annotations

import pytest

from digen.config import build_config
from digen.errors import ConfigError
from tests.conftest import required


def problems(**sections) -> list[str]:
    try:
        build_config(required(sections), check_paths=False)
    except ConfigError as exc:
        return exc.problems
    return []


def test_mini_batches_must_divide_the_iteration_s_groups():
    assert problems(rollout={"batch_size": 16, "group_size": 4}, train={"mini_batches": 2}) == []
    assert problems(rollout={"batch_size": 12, "group_size": 4}, train={"mini_batches": 2}) == [
        "train.mini_batches (2) must divide the iteration's prompt groups (rollout.batch_size / "
        "rollout.group_size = 3): each optimizer step takes whole groups; or set train.mini_batch_split=samples"
    ]
    samples = {"mini_batches": 2, "mini_batch_split": "samples"}  # 12 samples: 6 a step
    assert problems(rollout={"batch_size": 12, "group_size": 4}, train=samples) == []
    assert problems(rollout={"batch_size": 12, "group_size": 4}, train={**samples, "mini_batches": 5}) == [
        "train.mini_batches (5) must divide the iteration's samples (rollout.batch_size = 12): with "
        "train.mini_batch_split samples each optimizer step takes an equal share of them, as Flow-GRPO's"
    ]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "digen"])
def test_every_algorithm_and_mini_batches_run_in_every_mode(mode):
    workers = {"local": {"rollout_workers": 1, "trainer_workers": 1}}
    assert problems(schedule={"mode": mode}, cluster=workers, train={"mini_batches": 2}) == []
    for algorithm in ("diffusion-nft", "mix-grpo", "grpo-guard", "flow-dppo", "flow-grpo"):
        assert problems(schedule={"mode": mode}, cluster=workers, train={"algorithm": algorithm}) == []


def test_an_algorithm_with_state_is_not_trained_sharded():
    workers = {"local": {"rollout_workers": 1, "trainer_workers": 2}}
    digen = {"mode": "digen", "tag": False, "rat": False}
    assert problems(schedule=digen, cluster=workers, train={"algorithm": "diffusion-nft", "fsdp": True}) == [
        "train.algorithm (diffusion-nft) keeps state beside the weights, which the FSDP trainer group's "
        "sharded store does not hold; set train.fsdp=false (a replicated trainer group) for diffusion-nft"
    ]
    assert problems(schedule=digen, cluster=workers, train={"mini_batches": 2, "fsdp": True}) == []


def test_each_algorithm_checks_its_own_requirements():
    assert problems(
        train={"algorithm": "grpo-guard"}, rollout={"sde": {"kind": "cps", "noise_level": 0.8}}
    ) == [
        "train.algorithm (grpo-guard) reads Flow-GRPO's Gaussian SDE step (its transition mean and std): it "
        "needs rollout.sde.kind sde, got cps"
    ]
    assert problems(train={"algorithm": "flow-grpo-fast"}) == [
        "train.algorithm (flow-grpo-fast) trains a window of SDE steps; set train.timesteps.strategy=window "
        "(got prefix)"
    ]
    assert problems(train={"algorithm": "cps"}) == [
        "train.algorithm (cps) samples with rollout.sde.kind cps, got sde; set rollout.sde.kind=cps or "
        "choose another algorithm"
    ]
    assert problems(train={"algorithm": "flow-grpo", "timesteps": {"strategy": "window"}}) == [
        "train.algorithm (flow-grpo) trains SDE steps everywhere; train.timesteps.strategy window is "
        "flow-grpo-fast: set train.algorithm=flow-grpo-fast"
    ]


def test_diffusion_nft_needs_lora_no_cfg_and_a_velocity_kl():
    assert problems(
        train={"algorithm": "diffusion-nft", "kl_beta": 1e-4, "kl_target": "mean"},
        rollout={"guidance_scale": 4.5},
        model={"lora": {"enabled": False}},
    ) == [
        "train.kl_beta > 0 needs model.lora.enabled: the reference policy is the base weights",
        "train.algorithm (diffusion-nft) keeps its old weights as a LoRA copy (as its peer); set "
        "model.lora.enabled=true",
        "train.algorithm (diffusion-nft) is CFG-free (its recipes sample and train with guidance 1); "
        "rollout.guidance_scale (4.5) must be 1",
        "train.kl_target (mean): diffusion-nft has no SDE transition mean; its KL is on the velocity (leave "
        "train.kl_target unset or set it to velocity)",
    ]
    assert problems(train={"algorithm": "diffusion-nft", "kl_beta": 1e-4}) == []


def test_diffusion_nft_step_range_must_hold_its_strata():
    nft = {"algorithm": "diffusion-nft", "timesteps": {"fraction": 0.5}}  # 10 steps: 5 strata
    rollout = {"num_steps": 10}
    assert problems(rollout=rollout, train={**nft, "nft": {"step_range": [2, 7]}}) == []
    assert problems(rollout=rollout, train={**nft, "nft": {"step_range": [2, 11]}}) == [
        "train.nft.step_range ([2, 11]) must be [start, end] with 0 <= start < end <= rollout.num_steps (10): "
        "the strata run over schedule steps start .. end - 1"
    ]
    assert problems(rollout=rollout, train={**nft, "nft": {"step_range": [2, 6]}}) == [
        "train.nft.step_range ([2, 6]) holds 4 steps, fewer than the 5 strata of int(rollout.num_steps x "
        "train.timesteps.fraction): a stratum would be empty and train its first step twice; widen the range or "
        "lower the fraction"
    ]


def test_online_dpo_timestep_range_is_an_interval_of_zero_one():
    dpo = {
        "algorithm": "online-dpo",
        "online_dpo": {"timestep_draw": "unshifted", "timestep_range": [0.0, 0.99]},
    }
    assert problems(train=dpo) == []
    dpo["online_dpo"]["timestep_range"] = [0.5, 0.2]
    assert problems(train=dpo) == [
        "train.online_dpo.timestep_range ([0.5, 0.2]) must be [lo, hi] with 0 <= lo < hi <= 1 (fractions of "
        "the way from noise to clean)"
    ]


def test_kl_target_needs_a_kl_weight_and_choices_are_named():
    assert problems(train={"kl_target": "velocity"}) == [
        "train.kl_target (velocity) has no effect with train.kl_beta 0; set train.kl_beta > 0 or leave "
        "train.kl_target unset"
    ]
    assert problems(train={"kl_target": "velocity", "kl_beta": 0.04}) == []
    (bad,) = problems(train={"kl_target": "latent"})
    assert bad.startswith("train.kl_target ('latent'): Input should be 'mean' or 'velocity'")
    (bad,) = problems(train={"mix_grpo": {"schedule": "exp_decay"}})
    assert bad.startswith("train.mix_grpo.schedule ('exp_decay'): Input should be")


def test_algorithm_fields_each_have_a_docstring():
    """Every field of the new sections, and train's new fields, is followed by its docstring."""
    import ast
    import inspect

    import digen.config.schema as config

    tree = ast.parse(inspect.getsource(config))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    wanted = {
        "MixGrpoConfig": None,
        "NftConfig": None,
        "TrainConfig": {"algorithm", "mini_batches", "kl_target"},
    }
    for name, only in wanted.items():
        body = classes[name].body
        fields = [
            (i, s.target.id)
            for i, s in enumerate(body)
            if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and (only is None or s.target.id in only)
        ]
        assert fields and (only is None or {f for _, f in fields} == only), name
        for i, field in fields:
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            )
            assert documented or field in ("mix_grpo", "nft", "flow_dppo"), f"{name}.{field} has no docstring"


def test_a_window_that_does_not_fit_its_range_is_named():
    fast = {"algorithm": "flow-grpo-fast", "timesteps": {"strategy": "window", "window": 3}}
    assert problems(rollout={"num_steps": 6}, train=fast) == []  # [0, 3] holds a window of 3
    assert problems(rollout={"num_steps": 5}, train=fast) == [
        "train.timesteps: window_range=(0, 2) (the default, the first half) is shorter than window=3: "
        "a window needs hi - lo >= window (rollout.num_steps 5); set train.timesteps.window_range"
    ]
    wide = {**fast, "timesteps": {**fast["timesteps"], "window_range": [0, 5]}}
    assert problems(rollout={"num_steps": 5}, train=wide) == []
    past = {**fast, "timesteps": {**fast["timesteps"], "window_range": [2, 9]}}
    assert problems(rollout={"num_steps": 8}, train=past) == [
        "train.timesteps: window_range=(2, 9) must satisfy 0 <= lo < hi <= num_steps=8 "
        "(rollout.num_steps 8); set train.timesteps.window_range"
    ]
