"""LoRA on both families: starts equal to the base, trains only the adapter, syncs small
state dicts, and switches off for the reference policy."""

from __future__ import annotations

import pytest
import torch

from digen.errors import CheckpointError, ConfigError
from digen.models import FlowPolicy, load_policy
from digen.models.lora import SD3_TARGETS

from ._helpers import RES, noise


def _inputs(policy: FlowPolicy):
    embeds = policy.encode_prompts(["a photo of a cat", "a dog"], with_uncond=True)
    return noise(policy, 2), torch.tensor([0.9, 0.4]), embeds


def _randomise(policy: FlowPolicy, seed: int = 0) -> dict[str, torch.Tensor]:
    """Load random adapter weights (B != 0, so LoRA changes the output); returns them."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in policy.trainable_state_dict().items()}
    policy.load_trainable_state_dict(state)
    return state


def test_initial_lora_policy_equals_base(policy):
    x, sigmas, embeds = _inputs(policy)
    with torch.no_grad():
        base = policy.velocity(x, sigmas, embeds, 4.5)
        policy.enable_lora(rank=4, alpha=8)
        assert torch.equal(policy.velocity(x, sigmas, embeds, 4.5), base)


def test_only_adapter_params_train_and_get_gradients(policy):
    policy.enable_lora(rank=4, alpha=8)
    trainable = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    x, sigmas, embeds = _inputs(policy)
    policy.velocity(x, sigmas, embeds, 4.5).square().mean().backward()
    grads = {n: p.grad for n, p in policy.transformer.named_parameters() if p.grad is not None}
    assert set(grads) == set(trainable)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)


def test_trainable_state_dict_is_the_small_adapter(policy):
    full_bytes = sum(v.numel() * 4 for v in policy.trainable_state_dict().values())
    assert full_bytes == sum(p.numel() * 4 for p in policy.transformer.parameters())
    policy.enable_lora(rank=2, alpha=4)
    state = policy.trainable_state_dict()
    assert state and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state)
    assert all(
        v.dtype == torch.float32 and v.device.type == "cpu" and v.is_contiguous() for v in state.values()
    )
    assert sum(v.numel() * 4 for v in state.values()) < 0.2 * full_bytes


def test_state_dict_round_trip_between_processes(policy, tiny_paths):
    """A second policy (another worker) loading the first one's adapter computes the same velocity."""
    policy.enable_lora(rank=4, alpha=8)
    state = _randomise(policy)
    other = load_policy(tiny_paths[policy.family], height=RES, width=RES)
    other.enable_lora(rank=4, alpha=8)
    other.load_trainable_state_dict(state)
    x, sigmas, embeds = _inputs(policy)
    with torch.no_grad():
        torch.testing.assert_close(
            other.velocity(x, sigmas, embeds, 4.5), policy.velocity(x, sigmas, embeds, 4.5)
        )
    bad = dict(state)
    bad.pop(next(iter(bad)))
    with pytest.raises(CheckpointError, match="1 missing keys"):
        other.load_trainable_state_dict(bad)


def test_reference_mode_gives_the_base_policy(policy):
    x, sigmas, embeds = _inputs(policy)
    with torch.no_grad():
        base = policy.velocity(x, sigmas, embeds, 4.5)
    policy.enable_lora(rank=4, alpha=8)
    _randomise(policy)
    with torch.no_grad():
        tuned = policy.velocity(x, sigmas, embeds, 4.5)
        assert (tuned - base).abs().max() > 1e-3
        with policy.reference_mode():
            assert torch.equal(policy.velocity(x, sigmas, embeds, 4.5), base)
        assert torch.equal(policy.velocity(x, sigmas, embeds, 4.5), tuned)
    assert all(p.requires_grad for n, p in policy.transformer.named_parameters() if ".lora_" in n)


def test_full_fine_tune_state_round_trip_and_no_reference(sd3_policy, tiny_paths):
    state = sd3_policy.trainable_state_dict()
    assert set(state) == {n for n, _ in sd3_policy.transformer.named_parameters()}
    state["proj_out.bias"] = state["proj_out.bias"] + 1.0
    other = load_policy(tiny_paths["sd3"], height=RES, width=RES)
    other.load_trainable_state_dict(state)
    assert torch.equal(other.transformer.proj_out.bias, state["proj_out.bias"])
    with pytest.raises(ConfigError, match="reference policy needs LoRA"):
        with sd3_policy.reference_mode():
            pass


def test_default_and_custom_targets(sd3_policy):
    sd3_policy.enable_lora(rank=2, alpha=2, target_modules=["attn.to_q"])
    keys = sd3_policy.trainable_state_dict()
    assert keys and all(".attn.to_q.lora_" in k for k in keys)
    assert "attn.to_add_out" in SD3_TARGETS
    with pytest.raises(ConfigError, match="already enabled"):
        sd3_policy.enable_lora(rank=2, alpha=2)


def test_lora_init_is_the_same_in_every_process(tiny_paths):
    a = load_policy(tiny_paths["flux"], height=RES, width=RES)
    b = load_policy(tiny_paths["flux"], height=RES, width=RES)
    torch.manual_seed(123)  # a different global RNG state must not matter
    a.enable_lora(rank=4, alpha=8)
    b.enable_lora(rank=4, alpha=8)
    sa, sb = a.trainable_state_dict(), b.trainable_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(v.abs().sum() > 0 for k, v in sa.items() if "lora_A" in k)


def test_save_pretrained_transformer_merges_lora(sd3_policy, tmp_path):
    from diffusers import SD3Transformer2DModel

    sd3_policy.enable_lora(rank=4, alpha=8)
    _randomise(sd3_policy)
    sd3_policy.save_pretrained_transformer(tmp_path / "transformer")
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    x, sigmas, embeds = _inputs(sd3_policy)
    sd3_policy.transformer, tuned = merged, sd3_policy.transformer
    with torch.no_grad():
        merged_v = sd3_policy.velocity(x, sigmas, embeds, 1.0)
        sd3_policy.transformer = tuned
        torch.testing.assert_close(
            merged_v, sd3_policy.velocity(x, sigmas, embeds, 1.0), atol=1e-5, rtol=1e-5
        )


def test_direct_adapter_copy_equals_peft_loading(policy, tiny_paths):
    """Workers load an adapter every iteration by copying into its parameters; peft's own
    loader gives the same adapter, and a wrong shape is refused."""
    from peft import set_peft_model_state_dict

    from digen.models.lora import ADAPTER

    policy.enable_lora(rank=4, alpha=8)
    state = _randomise(policy, seed=3)
    other = load_policy(tiny_paths[policy.family], height=RES, width=RES)
    other.enable_lora(rank=4, alpha=8)
    with torch.no_grad():
        set_peft_model_state_dict(other.transformer, state, adapter_name=ADAPTER)
    mine, theirs = policy.trainable_state_dict(), other.trainable_state_dict()
    assert set(mine) == set(state) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(mine[k], state[k]) for k in state)
    k0 = next(iter(state))
    with pytest.raises(CheckpointError, match="shape"):
        policy.load_trainable_state_dict({**state, k0: torch.zeros(3, 3)})


@pytest.mark.parametrize("arch", ["sd3", "flux", "qwen-image", "wan", "hunyuan-video"])
def test_every_default_target_names_a_layer_of_the_family(tiny_models, arch):
    """The family's default targets (the peers' lists) each match a linear layer of its tiny
    model, as peft matches them (the module's name ends with the target), so a default that
    names a feed-forward digen's tiny model lacks cannot pass unnoticed; FLUX and Qwen-Image
    adapt their feed-forwards, as Flow-GRPO's train_flux.py and train_qwenimage.py do."""
    from digen.models.registry import FAMILIES

    policy = load_policy(tiny_models(arch, RES), height=RES, width=RES)
    targets = type(policy).default_lora_targets
    linear = [n for n, m in policy.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if arch == "wan":  # add_k/v_proj exist on the image-conditioned Wan only (wan.py)
        unmatched = [t for t in unmatched if t not in ("add_k_proj", "add_v_proj")]
    assert unmatched == [], (FAMILIES[arch], unmatched)
    if arch in ("flux", "qwen-image"):
        assert len(targets) == 12 and sum("net." in t for t in targets) == 4
    policy.enable_lora(rank=2, alpha=2)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A." in n}
    assert all(any(n.endswith(t) for t in targets) for n in adapted) and adapted


@pytest.mark.parametrize("arch", ["sd3", "flux", "qwen-image", "wan", "hunyuan-video"])
def test_the_disk_check_counts_the_adapter_the_family_injects(tiny_models, tmp_path, arch):
    """digen.checks sizes a checkpoint from the transformer's safetensors header without torch:
    with ``model.lora.target_modules`` unset it counts the family's default targets
    (digen.lora_targets, the table the adapters inject), so its count is the adapter's own
    parameter count (it used to count only attention modules, missing FLUX's and Qwen-Image's
    feed-forwards), and with the config's targets it counts those."""
    from digen.checks import checkpoint_estimate
    from digen.config import build_config
    from digen.lora_targets import DEFAULT_TARGETS
    from digen.models.pipeline_policy import read_model_index
    from tests.conftest import small_config_data

    path = tiny_models(arch, RES)
    policy = load_policy(path, height=RES, width=RES)
    assert type(policy).default_lora_targets == DEFAULT_TARGETS[read_model_index(path)["_class_name"]]
    for targets in (None, ["to_q", "to_v"]):
        fresh = load_policy(path, height=RES, width=RES)
        fresh.enable_lora(rank=4, alpha=8, target_modules=targets)
        adapter = sum(v.numel() for v in fresh.trainable_state_dict().values())
        lora = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": targets}
        cfg = build_config(small_config_data(path, model__lora=lora, train__ema={"enabled": False}))
        copies = 3 + int(cfg.schedule.resolved().max_staleness or 0)  # weights, AdamW's two moments
        assert checkpoint_estimate(cfg, tmp_path, resume=False) == 4 * adapter * copies, (arch, targets)
