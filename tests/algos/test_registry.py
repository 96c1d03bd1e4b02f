"""The algorithm registry: what is registered, how a config names one, what each declares."""

from __future__ import annotations

import pytest

from digen.algos import registry
from digen.algos.registry import RolloutPlan
from digen.config import build_config
from digen.errors import ConfigError
from tests.conftest import required

PEERS = {
    "flow-grpo": "yifan123/flow_grpo @9745241",
    "flow-grpo-fast": "yifan123/flow_grpo @9745241",
    "cps": "yifan123/flow_grpo @9745241",
    "dance-grpo": "XueZeyue/DanceGRPO @15cc71d",
    "mix-grpo": "Tencent-Hunyuan/MixGRPO @e5cdd6a",
    "grpo-guard": "yifan123/flow_grpo @9745241",
    "flow-dppo": "verl-project/verl-omni @a1139ba",
    "diffusion-nft": "NVlabs/DiffusionNFT @24af555",
    "dgpo": "Luo-Yihong/DGPO @01ceb4b",
    "awm": "scxue/advantage_weighted_matching @be51372",
    "online-dpo": "verl-project/verl-omni @a1139ba",
}


def cfg(**train):
    return build_config(required({"train": train}), check_paths=False)


def test_every_algorithm_of_the_issue_is_registered_with_its_peer_and_commit():
    assert registry.available() == list(PEERS)
    for algo in registry.algorithms():
        assert algo.peer.startswith(PEERS[algo.name]), algo.name
        assert algo.title and algo.summary and algo.rollout_needs
        assert {"latents", "log_probs", "sigmas"} <= set(algo.trajectory), algo.name


def test_an_unset_algorithm_is_the_flow_grpo_family_member_the_rollout_names():
    def name(**sections):
        return registry.resolved_name(build_config(required(sections), check_paths=False))

    assert name() == "flow-grpo"
    assert name(rollout={"sde": {"kind": "cps", "noise_level": 0.8}}) == "cps"
    assert name(rollout={"sde": {"kind": "dance", "noise_level": 0.3}}) == "dance-grpo"
    assert name(train={"timesteps": {"strategy": "window"}}) == "flow-grpo-fast"
    assert name(train={"algorithm": "mix-grpo"}) == "mix-grpo"


def test_unknown_algorithm_is_one_config_error_listing_the_names():
    with pytest.raises(ConfigError) as err:
        cfg(algorithm="ppo-diffusion")
    assert err.value.problems == [
        "train.algorithm ('ppo-diffusion') is not a registered algorithm; use one of "
        + ", ".join(PEERS)
        + " (digen algorithms lists them)"
    ]


def test_flow_grpo_family_plans():
    plan = registry.algorithm_for(cfg()).rollout_plan(cfg(), 0)
    assert plan == RolloutPlan(kinds=("sde",) * 8, keep=(0, 8))
    fast = cfg(timesteps={"strategy": "window", "window": 2})
    plan = registry.algorithm_for(fast).rollout_plan(fast, 3)
    window = registry.algorithm_for(fast).trained_steps(fast, 3, sample_id=0)
    assert [i for i, k in enumerate(plan.kinds) if k == "sde"] == window and len(window) == 2
    assert plan.keep == (0, 8)  # Flow-GRPO-Fast keeps every latent, as before the registry
    guard = registry.get("grpo-guard").rollout_plan(cfg(algorithm="grpo-guard"), 0)
    assert guard.means and guard.kinds == ("sde",) * 8
    nft = registry.get("diffusion-nft").rollout_plan(cfg(algorithm="diffusion-nft"), 0)
    assert nft.kinds == ("dpm2",) * 8 and nft.keep == (8, 0)
    euler = cfg(algorithm="diffusion-nft", nft={"solver": "euler"})
    assert registry.algorithm_for(euler).rollout_plan(euler, 0).kinds == ("ode",) * 8


def test_nft_trains_a_seeded_subset_of_all_steps():
    c = cfg(algorithm="diffusion-nft", timesteps={"fraction": 0.5})
    algo = registry.algorithm_for(c)
    steps = [algo.trained_steps(c, 0, s) for s in range(16)]
    assert all(len(s) == 4 and s == sorted(s) and set(s) <= set(range(8)) for s in steps)
    assert 7 in {j for s in steps for j in s}  # unlike DanceGRPO, the last step may train
    assert len({tuple(s) for s in steps}) > 1 and steps == [algo.trained_steps(c, 0, s) for s in range(16)]


def test_a_rollout_plan_that_keeps_steps_it_does_not_take_is_refused():
    with pytest.raises(ConfigError, match="keeps steps 2..4 of 4"):
        RolloutPlan(kinds=("sde",) * 4, keep=(2, 3))
    with pytest.raises(ConfigError, match="4 steps but a schedule of 4 sigmas"):
        RolloutPlan(kinds=("sde",) * 4, keep=(0, 4), schedule=(0, 1, 2, 3))


def test_digen_algorithms_lists_each_with_its_peer_needs_and_trajectory():
    import json

    from typer.testing import CliRunner

    from digen.cli.main import app

    res = CliRunner().invoke(app, ["algorithms", "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.output)
    assert [r["name"] for r in listed] == list(PEERS)
    clean = {"diffusion-nft", "dgpo", "awm"}  # the clean-sample family: state beside the weights
    for r in listed:
        if r["name"] in clean | {"online-dpo"}:
            stateful = "every mode, not train.fsdp" if r["name"] in clean else "every mode"
            assert r["modes"] == stateful, r["name"]
            assert r["trajectory"]["latents"].startswith("[B, 1, *latent]"), r["name"]
        else:
            assert r["modes"] == "every mode", r["name"]
    table = CliRunner().invoke(app, ["algorithms"], env={"COLUMNS": "200"})
    assert table.exit_code == 0
    for r in listed:
        assert r["name"] in table.output and r["peer"].split(":")[0] in table.output
    assert "means [B, T, *latent]" in table.output  # GRPO-Guard's extra trajectory tensor


def test_dgpo_plans_a_cfg_rollout_and_trains_steps_every_sample_shares():
    c = cfg(algorithm="dgpo", dgpo={"timesteps": 3, "trunc_steps": 5})
    algo = registry.algorithm_for(c)
    plan = algo.rollout_plan(c, 0)
    assert plan.kinds == ("dpm2",) * 8 and plan.keep == (8, 0)
    steps = [algo.trained_steps(c, 2, s) for s in range(16)]
    assert all(s == steps[0] for s in steps) and len(steps[0]) == 3 and set(steps[0]) <= set(range(6))
    assert len({tuple(algo.trained_steps(c, i, 0)) for i in range(8)}) > 1  # redrawn each iteration


def test_dgpo_trains_whole_groups_rat_off_unless_asked_and_then_refused():
    digen = {"mode": "digen"}
    c = build_config(required({"train": {"algorithm": "dgpo"}, "schedule": digen}), check_paths=False)
    assert c.schedule.rat is False and c.schedule.resolved().tag is True  # TAG stays on
    assert build_config(required({"schedule": digen}), check_paths=False).schedule.resolved().rat is True
    with pytest.raises(ConfigError) as err:
        build_config(
            required(
                {
                    "train": {"algorithm": "dgpo", "mini_batch_split": "samples", "dgpo": {"trunc_steps": 8}},
                    "schedule": {**digen, "rat": True},
                    "model": {"path": "models/unused", "lora": {"enabled": False}},
                }
            ),
            check_paths=False,
        )
    text = "\n".join(err.value.problems)
    for needle in (
        "lora.enabled=true",
        "trunc_steps (8)",
        "mini_batch_split (samples)",
        "schedule.rat (true)",
    ):
        assert needle in text, needle


def test_awm_trains_one_step_in_each_stratum_after_the_first():
    c = cfg(algorithm="awm", awm={"timesteps": 3, "fraction": 1.0})
    algo = registry.algorithm_for(c)
    assert algo.rollout_plan(c, 0).keep == (8, 0)
    steps = [algo.trained_steps(c, 0, s) for s in range(32)]
    # linspace(1, 8, 4).long() = [1, 3, 5, 8]: one step of [1, 3), [3, 5), [5, 8) each
    assert all(1 <= a < 3 <= b < 5 <= d < 8 for a, b, d in steps)
    assert len({tuple(s) for s in steps}) > 1


def test_online_dpo_pairs_the_first_best_with_the_last_worst():
    from digen.algos.online_dpo import dpo_pair

    assert dpo_pair([0.1, 0.9, 0.9, -0.3, -0.3]) == (1, 4)  # a stable descending sort's ends
    assert dpo_pair([0.0, 0.0, 0.0]) == (0, 2) and dpo_pair([0.5]) is None
    c = cfg(algorithm="online-dpo")
    algo = registry.algorithm_for(c)
    steps = [algo.trained_steps(c, 1, s) for s in range(8)]  # groups of 4
    assert steps[1:4] == [steps[0]] * 3 and steps[5:] == [steps[4]] * 3 and 0 <= steps[0][0] < 1000


def test_dgpo_and_awm_ema_weights_move_as_their_authors():
    """DGPO's ``ema_ref.step(decay=min(0.3, 0.001 * global_step))`` before it counts the step, and
    its switch of the rollout to the EMA weights past ``switch_ema_ref``; AWM's ``ema`` adapter
    ``min(kl_ema_decay, 0.001 * global_step)`` after the epoch's steps."""
    import torch

    from digen.algos.dgpo import SAMPLE_OLD
    from digen.algos.state import role_weights

    c = cfg(algorithm="dgpo", dgpo={"switch_ema_ref": 2})
    dgpo, w0, w1 = registry.get("dgpo"), {"a": torch.zeros(3)}, {"a": torch.ones(3)}
    state = dgpo.initial_state(w0, c.train)
    assert float(state[SAMPLE_OLD][0]) == 0.0 and torch.equal(role_weights(state, "old")["a"], w0["a"])
    after = [dgpo.next_state(state, w1, c.train, steps) for steps in (1, 3, 1000)]
    assert [float(s[SAMPLE_OLD][0]) for s in after] == [0.0, 1.0, 1.0]
    # d = 0 after the first step (old = theta), 0.002 after the third, capped at 0.3
    assert [float(role_weights(s, "old")["a"][0]) for s in after] == pytest.approx([1.0, 0.998, 0.7])
    a = cfg(algorithm="awm")
    awm = registry.get("awm")
    moved = [awm.next_state(awm.initial_state(w0, a.train), w1, a.train, steps) for steps in (1, 100, 1000)]
    assert [float(role_weights(s, "old")["a"][0]) for s in moved] == pytest.approx([0.999, 0.9, 0.7])


def test_online_dpo_refuses_what_splits_a_pair():
    with pytest.raises(ConfigError) as err:
        build_config(
            required(
                {
                    "train": {
                        "algorithm": "online-dpo",
                        "fsdp": True,
                        "kl_beta": 0.1,
                        "zero_advantage": "drop",
                    },
                    "rollout": {"group_size": 1, "batch_size": 4},
                }
            ),
            check_paths=False,
        )
    text = "\n".join(err.value.problems)
    for needle in (
        "train.fsdp (true)",
        "train.kl_beta (0.1)",
        "rollout.group_size (1)",
        "zero_advantage (drop)",
    ):
        assert needle in text, needle
