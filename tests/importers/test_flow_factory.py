"""``digen import-config flow-factory`` on Flow-Factory's own recipes (tests/data/peers/flow_factory,
X-GenGroup/Flow-Factory a0b2bc5, Apache-2.0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from digen.errors import ConfigError
from digen.importers import import_config
from digen.importers.flow_factory import peer_strata, peer_timesteps

FF = Path(__file__).resolve().parents[1] / "data" / "peers" / "flow_factory" / "examples"


def test_the_sd35_grpo_recipe_imports_with_its_numbers():
    result = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "default.yaml"))
    result.validate()
    c = result.config
    assert (c["rollout"]["batch_size"], c["rollout"]["group_size"], c["train"]["mini_batches"]) == (
        48 * 24,
        24,
        2,
    )
    assert (
        c["rollout"]["sde"] == {"kind": "sde", "noise_level": 0.8} and c["rollout"]["guidance_scale"] == 4.5
    )
    # 2 SDE steps drawn among [1..5]: digen's window of 2 in [1, 6), and the difference said aloud
    assert c["train"]["timesteps"] == {"strategy": "window", "window": 2, "window_range": [1, 6]}
    assert "randperm" in result.dropped["scheduler.sde_steps / num_sde_steps"]
    assert c["train"]["algorithm"] == "flow-grpo-fast" and c["train"]["global_std"] is True
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"]) == (32, 64)
    assert c["reward"] == [{"name": "pickscore", "weight": 1.0}]
    nocfg = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "nocfg.yaml")).config
    assert nocfg["train"]["algorithm"] == "cps" and nocfg["rollout"]["guidance_scale"] == 1.0


@pytest.mark.parametrize(
    "recipe, cause",
    [
        ("grpo/lora/flux2/t2i.yaml", "model.model_type=flux2"),
        ("grpo/lora/wan22/t2v.yaml", "Wan2.2 is not a digen model family"),
    ],
)
def test_what_digen_cannot_train_is_refused_naming_the_key(recipe, cause):
    with pytest.raises(ConfigError, match=cause):
        import_config("flow-factory", str(FF / recipe))


def test_unset_keys_take_flow_factorys_defaults_and_gradient_checkpointing_is_carried(tmp_path):
    """GRPOTrainingArguments (src/flow_factory/hparams/training_args.py l.414-420): global_std
    true, advantage_aggregation 'gdpo' (train.multi_reward: gdpo); a recipe's
    enable_gradient_checkpointing is train.activation_checkpointing."""
    text = (FF / "grpo" / "lora" / "flux1" / "default.yaml").read_text()
    kept = [
        line for line in text.splitlines() if "advantage_aggregation" not in line and "global_std" not in line
    ]
    unset = tmp_path / "unset.yaml"
    unset.write_text(
        "\n".join(kept).replace("enable_gradient_checkpointing: false", "enable_gradient_checkpointing: true")
    )
    result = import_config("flow-factory", str(unset))
    result.validate()
    assert result.config["train"]["global_std"] is True
    assert (
        result.config["train"]["multi_reward"] == "gdpo"
        and "train.advantage_aggregation" not in result.dropped
    )
    assert result.config["train"]["activation_checkpointing"] is True
    assert "train.enable_gradient_checkpointing" not in result.dropped
    plain = import_config("flow-factory", str(FF / "grpo" / "lora" / "flux1" / "default.yaml"))
    assert (
        plain.config["train"]["global_std"] is False
        and "activation_checkpointing" not in plain.config["train"]
    )
    assert plain.config["train"]["multi_reward"] == "gdpo"  # the recipe's own
    sd35 = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "default.yaml")).config
    assert sd35["train"]["multi_reward"] == "sum"


# --- the clean-sample trainers (dgpo, awm, nft, dpo) -------------------------------------------
# Flow-Factory's SD3.5 rollout timesteps, by hand: sigmas = linspace(1, 1/n, n)
# (scheduler/flow_match_euler_discrete.py l.57) through SD3.5's static shift 3, s' = 3s / (1 + 2s).
# At n = 10: s = 1.0, 0.9, ..., 0.1 -> 1000 s' = 1000, 964.3, 923.1, 875, 818.2, 750, 666.7, 562.5,
# 428.6, 250. At n = 14, s = (14 - i) / 14: the last, i = 13, is 1000 * (3/14) / (16/14) = 187.5.


def test_the_peer_s_sd35_schedule_and_strata_as_read_by_hand():
    ts = peer_timesteps("sd3-5", 10)
    assert [round(t, 1) for t in ts] == [
        1000.0,
        964.3,
        923.1,
        875.0,
        818.2,
        750.0,
        666.7,
        562.5,
        428.6,
        250.0,
    ]
    assert peer_timesteps("sd3-5", 14)[-1] == pytest.approx(187.5)
    assert peer_timesteps("flux1", 10) is None  # resolution-dependent shift: not computed here
    # dgpo: timestep_range 0.6 keeps t >= 400: steps 0..8; 4 strata at linspace(0, 8, 5) = 0, 2, 4, 6, 8
    assert peer_strata(ts, (0.0, 0.6), 4, "discrete") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # awm: 0.9 keeps t >= 100: all 14 steps; discrete_wo_init starts at 1: linspace(1, 13, 7)
    ts14 = peer_timesteps("sd3-5", 14)
    assert peer_strata(ts14, (0.0, 0.9), 6, "discrete_wo_init") == [
        (1, 3),
        (3, 5),
        (5, 7),
        (7, 9),
        (9, 11),
        (11, 13),
    ]
    # nft: 0.5 keeps t >= 500, steps 0..10 (545.5 at step 10, 450 at 11): linspace(0, 10, 5).long()
    assert peer_strata(ts14, (0.0, 0.5), 4, "discrete") == [(0, 2), (2, 5), (5, 7), (7, 10)]


@pytest.mark.parametrize("recipe, guidance", [("default.yaml", 4.5), ("nocfg.yaml", 1.0)])
def test_the_sd35_dgpo_recipes_import_with_the_math_of_the_peer_s_code(recipe, guidance):
    result = import_config("flow-factory", str(FF / "dgpo" / "lora" / "sd3_5" / recipe))
    result.validate()
    c = result.config
    assert c["train"]["algorithm"] == "dgpo"
    # trainers/dgpo.py reads each key (l.141-168); the values are the recipe's, read by hand
    assert (
        c["train"]["dgpo"]
        == {
            "solver": "euler",  # scheduler.dynamics_type ODE: Euler on the schedule (flow_match_euler_discrete.py l.329)
            "beta_dpo": 10.0,  # dpo_beta, the sigmoid's scale (dgpo.py l.468)
            "clip_range": 0.05,  # clip_range 5e-2 -> (-0.05, 0.05) (training_args.py l.385-390; dgpo.py l.660-667)
            "clip_dsm": True,  # dgpo.py l.668-669
            "shared_noise": True,  # use_shared_noise (dgpo.py l.566-569)
            "use_ema_ref": False,  # the preference's reference is the base weights (dgpo.py l.612-624)
            "switch_ema_ref": 200,  # sampling with ema_ref once step > 200 (dgpo.py l.200)
            "timesteps": 4,  # num_train_timesteps
            "trunc_steps": 7,  # the strata (0, 2) .. (6, 8) above draw steps 0..7, each with probability 1/2
        }
    )
    assert c["rollout"] == {"batch_size": 24 * 24, "group_size": 24, "num_steps": 10, "eval_steps": 14,
                            "guidance_scale": guidance}  # fmt: skip
    t = c["train"]
    assert (t["mini_batches"], t["global_std"], t["adv_clip"], t["kl_beta"], t["kl_target"]) == (
        1, True, 5.0, 0.001, "velocity",
    )  # fmt: skip
    assert (t["lr"], t["weight_decay"], t["betas"], t["adam_eps"], t["grad_clip"]) == (
        3e-4,
        1e-4,
        [0.9, 0.999],
        1e-8,
        1.0,
    )
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"]) == (64, 128)
    # what digen does otherwise is said aloud
    assert "without replacement" in result.dropped["train.time_sampling_strategy / timestep_range"]
    assert "every trained step" in result.dropped["train.use_shared_noise"]


def _variant(tmp_path, recipe: str, **train) -> str:
    data = yaml.safe_load((FF / recipe).read_text())
    data["train"].update(train)
    path = tmp_path / Path(recipe).name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_sd35_awm_recipe_imports_with_the_math_of_the_peer_s_code():
    result = import_config("flow-factory", str(FF / "awm" / "lora" / "sd3_5" / "default.yaml"))
    result.validate()
    assert result.config["train"]["awm"] == {
        "solver": "euler",
        "advantage_max": None,  # awm.py l.467-469 clamps only: no rescale
        "weighting": "ghuber",  # awm_weighting (awm.py l.322-326)
        "ghuber_power": 0.25,
        "clip_range": 1.0,  # clip_range 1 -> ratio in [0, 2] (awm.py l.497-502)
        "ema_beta": 1.0,  # ema_kl_beta (awm.py l.524-535)
        "ema_decay": 0.3,  # ema_decay, the linear schedule's target
        "ema_ramp": 0.0003,  # 'linear' from 0 over warmup_steps 1000: 0.3 / 1000 per epoch
        "timesteps": 6,  # num_train_timesteps
        "fraction": 0.9286,  # int(14 * 0.9286) = 13: digen's strata linspace(1, 13, 7), the peer's above
    }
    t = result.config["train"]
    assert (t["adv_clip"], t["kl_beta"], t["global_std"], t["lr"]) == (1.0, 1e-4, True, 3e-4)
    assert result.config["rollout"]["batch_size"] == 48 * 16 and result.config["rollout"]["num_steps"] == 14
    assert "(k - 1)" in result.dropped["train.ema_decay_schedule"]  # the peer's first update, said aloud


def test_the_imported_awm_ema_moves_as_flow_factory_s_linear_schedule():
    """Flow-Factory's AWM EMA, restated: ``linear_warmup_decay`` (ema/ema_utils.py l.55-75) and
    ``EMAModuleWrapper.step`` (ema/ema.py l.103-122: ``ema * d + p * (1 - d)`` with
    ``d = decay_fn(step)``), called with ``step = epoch`` after each epoch (trainers/awm.py l.125)."""
    import torch

    from digen.algos.awm import ALGORITHM, ema_decay
    from digen.algos.state import role_weights, with_role
    from digen.config import build_config

    def linear_warmup_decay(decay: float, initial_decay: float, warmup_steps: int):
        delta = decay - initial_decay

        def _decay(step: int) -> float:
            if step >= warmup_steps:
                return decay
            return initial_decay + delta * (step / warmup_steps)

        return _decay

    c = import_config("flow-factory", str(FF / "awm" / "lora" / "sd3_5" / "default.yaml")).config
    train = build_config(c, check_paths=False).train
    peer = linear_warmup_decay(0.3, 0.0, 1000)  # the recipe's ema_decay, initial_decay, warmup_steps
    # the same decay at every step count (0.3 * (k / 1000) and 0.0003 k differ by float64 round-off)
    for k in range(0, 2500):
        assert ema_decay(k, train.awm) == pytest.approx(peer(k), rel=1e-12, abs=1e-15), k
    gen = torch.Generator().manual_seed(0)
    ema = {"w": torch.randn(4, 3, generator=gen)}
    state = with_role(ema, "old")
    for k in (1, 500, 999, 1000, 1700):
        p = torch.randn(4, 3, generator=gen)
        d = peer(k)
        ema["w"] = ema["w"].mul(d).add(p, alpha=1 - d)
        state = ALGORITHM.next_state(state, {"w": p}, train, k)
        torch.testing.assert_close(role_weights(state, "old")["w"], ema["w"], rtol=1e-6, atol=1e-7)


def test_the_sd35_nft_recipe_imports_with_its_strata():
    result = import_config("flow-factory", str(FF / "nft" / "lora" / "sd3_5" / "default.yaml"))
    result.validate()
    t = result.config["train"]
    assert t["algorithm"] == "diffusion-nft"
    assert t["nft"] == {
        "solver": "euler",
        "beta": 1.0,  # nft_beta (nft.py l.409-410)
        "step_range": [0, 10],  # timestep_range 0.5 keeps steps 0..10 of 14 (545.5 at 10, 450 at 11)
        "decay_type": 1,  # off_policy, piecewise_linear 0 / 0.001 / 0.5: DiffusionNFT's type 1
    }
    assert t["timesteps"] == {"fraction": 0.3214}  # int(14 * 0.3214) = 4 = num_train_timesteps
    assert (t["kl_beta"], t["adv_clip"], t["global_std"], t["lr"]) == (0.0, 5.0, False, 1e-4)
    assert "kl_target" not in t  # no KL in the recipe
    assert result.config["rollout"]["batch_size"] == 48 * 16 and result.config["rollout"]["num_steps"] == 14


def test_the_imported_nft_draws_flow_factory_s_discrete_steps():
    """Flow-Factory's ``TimeSampler.discrete`` and ``_stratified_sample`` (utils/noise_schedule.py
    l.185-259 at a0b2bc5; ``include_init=True, force_init=False`` for ``discrete``, nft.py
    l.111-128), restated on its SD3.5 14-step schedule, given the generator digen draws a
    sample's steps from: the same steps."""
    import torch

    from digen.algos.registry import algorithm_for
    from digen.config import build_config
    from digen.seeding import sample_generator

    def stratified_sample(num_samples, start_idx, end_idx, generator):
        boundaries = torch.linspace(start_idx, end_idx, num_samples + 1)
        lower, upper = boundaries[:-1].long(), boundaries[1:].long()
        rand_u = torch.rand(num_samples, generator=generator)
        return lower + (rand_u * (upper - lower)).long()

    def discrete_indices(num_train_timesteps, ts, timestep_range, generator):
        t_min, t_max = 1000.0 * (1.0 - timestep_range), 1000.0
        valid = torch.where((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
        min_idx, max_idx = int(valid.min()), int(valid.max())
        return stratified_sample(num_train_timesteps, min_idx, max_idx, generator).clamp(0, len(ts) - 1)

    # flow_match_euler_discrete.py l.57: sigmas linspace(1, 1/14, 14) through SD3.5's shift 3
    s = torch.linspace(1.0, 1.0 / 14, 14, dtype=torch.float64)
    ts = (1000.0 * 3.0 * s / (1.0 + 2.0 * s)).float()
    c = import_config("flow-factory", str(FF / "nft" / "lora" / "sd3_5" / "default.yaml")).config
    cfg = build_config(c, check_paths=False)
    algo = algorithm_for(cfg)
    seen = set()
    for it in range(3):
        for sample in range(50):
            peer = discrete_indices(4, ts, 0.5, sample_generator(cfg.seed, it, sample, "timesteps"))
            got = algo.trained_steps(cfg, it, sample)
            assert got == sorted(peer.tolist()), (it, sample)
            seen.update(got)
    assert seen == set(range(10))  # steps 0..9, never 10 (the strata's end) nor the last four


def test_the_sd35_dpo_recipe_imports_with_its_unshifted_timesteps():
    result = import_config("flow-factory", str(FF / "dpo" / "lora" / "sd3_5" / "default.yaml"))
    result.validate()
    t = result.config["train"]
    assert t["algorithm"] == "online-dpo"
    assert t["online_dpo"] == {
        "solver": "euler",
        "beta": 100.0,  # beta (dpo.py l.606-610)
        "logit_mean": 0.0,  # logit_mean, logit_std (noise_schedule.py l.112)
        "logit_std": 1.0,
        "timestep_draw": "unshifted",  # weighting_scheme logit_normal at time_shift 1 (unset: TA default 1.0)
        "timestep_range": [0.0, 0.99],  # timestep_range 0.99 -> (0, 0.99) (noise_schedule.py l.70-76)
    }
    # 48 prompts x group 4; 48 pairs on num_processes 8 are 6 a rank, one micro-batch of up to 24 a rank:
    # gradient_accumulation_steps 1 is one optimizer step an epoch
    assert result.config["rollout"]["batch_size"] == 48 * 4 and t["mini_batches"] == 1
    assert (t["kl_beta"], t["lr"], t["global_std"]) == (0.0, 1e-5, False)
    assert "per pair" in result.dropped["train.weighting_scheme"]


def test_the_imported_dpo_noise_level_is_flow_factory_s():
    """``TimeSampler.logit_normal_shifted(stratified=False)`` (utils/noise_schedule.py l.83-154 at
    a0b2bc5) and ``flow_match_sigma`` (l.46-48), as trainers/dpo.py l.443-453, l.565-566 call
    them, restated in float32 on digen's draw of ``N``: the same sigma, over the range's ends."""
    import torch

    from digen.algos.online_dpo import unshifted_sigma

    def peer_sigma(u_standard, logit_mean, logit_std, time_shift, timestep_range):
        u = u_standard * logit_std + logit_mean
        raw = torch.sigmoid(u)
        raw = time_shift * raw / (1 + (time_shift - 1) * raw)
        raw = torch.clamp(raw, min=0.01, max=1.0 - 1e-6)
        frac = timestep_range[0] + raw * (timestep_range[1] - timestep_range[0])
        t = 1000.0 * (1.0 - frac)
        return (t / 1000.0).clamp(0.0, 1.0)

    n = torch.cat([torch.randn(4096, generator=torch.Generator().manual_seed(0)), torch.tensor([-9.0, 9.0])])
    want = {span: peer_sigma(n, 0.0, 1.0, 1.0, span) for span in ((0.0, 0.99), (0.2, 0.9))}
    for span, peer in want.items():
        assert torch.equal(unshifted_sigma(torch.sigmoid(n), span), peer), span
    # by hand: N = -9 is clamped to raw 0.01, sigma 1 - 0.99 * 0.01 = 0.9901; N = 0 is sigma 1 - 0.99 / 2
    assert float(want[(0.0, 0.99)].max()) == pytest.approx(0.9901, abs=1e-6)
    assert float(unshifted_sigma(torch.tensor([0.5]), (0.0, 0.99))) == pytest.approx(0.505)


@pytest.mark.parametrize(
    "recipe, change, key",
    [
        (
            "dpo/lora/sd3_5/default.yaml",
            {"time_shift": 3.0},
            "train.weighting_scheme=logit_normal, time_shift=3.0",
        ),
        ("dpo/lora/sd3_5/default.yaml", {"weighting_scheme": "uniform"}, "train.weighting_scheme=uniform"),
    ],
)
def test_a_clean_sample_recipe_digen_s_math_lacks_is_refused_in_one_line(tmp_path, recipe, change, key):
    with pytest.raises(ConfigError, match=key) as info:
        import_config("flow-factory", _variant(tmp_path, recipe, **change))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "recipe, change, key",
    [
        ("dgpo/lora/sd3_5/default.yaml", {"clip_kl": True}, "train.clip_kl=true"),
        ("dgpo/lora/sd3_5/default.yaml", {"kl_cfg": 4.5}, "train.kl_cfg=4.5"),
        (
            "dgpo/lora/sd3_5/default.yaml",
            {"time_sampling_strategy": "discrete_wo_init"},
            "draws its steps from 0",
        ),
        ("awm/lora/sd3_5/default.yaml", {"guidance_scale": 4.5}, "train.guidance_scale=4.5"),
        ("awm/lora/sd3_5/default.yaml", {"ema_decay_schedule": "power"}, "train.ema_decay_schedule=power"),
        # 0.2 keeps t >= 800, steps 0..6: 8 strata of linspace(0, 6, 9) leave some empty (a step trained twice)
        (
            "nft/lora/sd3_5/default.yaml",
            {"num_train_timesteps": 8, "timestep_range": 0.2},
            "non-empty strata",
        ),
    ],
)
def test_a_key_whose_math_digen_lacks_is_named(tmp_path, recipe, change, key):
    with pytest.raises(ConfigError, match=key):
        import_config("flow-factory", _variant(tmp_path, recipe, **change))


@pytest.mark.slow
def test_the_imported_dgpo_recipe_trains_two_iterations_on_the_tiny_model(tiny_sd3, tmp_path):
    """The import's algorithm section as it is (its beta, clip, 4 of steps 0..7, shared noise,
    the velocity KL, euler rollout with CFG 4.5); only the sizes shrink to the tiny SD3 on CPU."""
    import json
    import math

    from safetensors.torch import load_file

    from digen.config import build_config
    from digen.reference import run_reference

    c = import_config("flow-factory", str(FF / "dgpo" / "lora" / "sd3_5" / "default.yaml")).config
    c["iterations"] = 2
    c["model"] = {"path": str(tiny_sd3), "resolution": 32, "max_sequence_length": 32, "device": "cpu",
                  "lora": {"enabled": True, "rank": 4, "alpha": 8}}  # fmt: skip
    c["prompts"] = {"items": ["a red square", "a blue circle", "a green tree"]}
    c["reward"] = [{"name": "brightness"}]
    c["rollout"].update(batch_size=8, group_size=4)
    c["eval"], c["output"] = {"every": 0}, {"checkpoint_every": 1, "plots": False}
    assert c["train"]["dgpo"]["trunc_steps"] == 7 and c["rollout"]["num_steps"] == 10  # the recipe's
    run_reference(build_config(c), tmp_path / "run")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    for m in metrics:  # 8 samples x the recipe's 4 trained steps
        assert m["samples"] == 8 and m["trained_rows"] == 8 * 4
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    first = load_file(str(tmp_path / "run/checkpoints/iter_0000/weights.safetensors"))
    last = load_file(str(tmp_path / "run/checkpoints/iter_0001/weights.safetensors"))
    assert max(float((first[k] - last[k]).abs().max()) for k in first) > 0


def test_a_key_the_recipe_leaves_unset_takes_flow_factory_s_default(tmp_path):
    data = yaml.safe_load((FF / "grpo" / "lora" / "sd3_5" / "default.yaml").read_text())
    for key in ("global_std", "learning_rate", "gradient_step_per_epoch", "guidance_scale"):
        del data["train"][key]
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    c = import_config("flow-factory", str(path)).config
    # GRPOTrainingArguments l.414 global_std True; TrainingArguments l.190 learning_rate 1e-5,
    # l.141 gradient_step_per_epoch 2, l.178 guidance_scale 3.5
    assert (c["train"]["global_std"], c["train"]["lr"], c["train"]["mini_batches"]) == (True, 1e-5, 2)
    assert c["rollout"]["guidance_scale"] == 3.5


def test_the_strata_bounds_are_flow_factory_s_float32_linspace():
    """The importer cuts strata in plain Python; Flow-Factory with ``torch.linspace(start, end,
    K + 1).long()`` (noise_schedule.py l.256-257, float32): the same integers over the sizes
    recipes use."""
    import torch

    for n in range(2, 41):
        ts = [1000.0 * (1 - i / n) for i in range(n)]  # every step valid at timestep_range 1.0
        for k in range(1, min(n, 12)):
            for strategy, start in (("discrete", 0), ("discrete_wo_init", 1)):
                want = torch.linspace(start, n - 1, k + 1).long().tolist()
                got = peer_strata(ts, (0.0, 1.0), k, strategy)
                assert [a for a, _ in got] + [got[-1][1]] == want, (n, k, strategy)
