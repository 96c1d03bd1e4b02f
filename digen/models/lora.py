"""LoRA on a diffusers transformer: add, read, write, switch off.

The adapter is injected in place with ``transformer.add_adapter`` (diffusers' peft
integration), so the transformer keeps its class and call signature; peft freezes every base
weight. Adapter weights start as peft's ``"gaussian"`` init (A random, B zero: the wrapped
model equals the base model exactly) and are float32 whatever the transformer's dtype (``model.lora.dtype`` may make
them bfloat16 or float16), float64 for a float64 one (peft casts activations to the adapter
dtype and back). A is drawn from a fixed seed so every process
that enables LoRA starts from the same adapter.

State dicts use peft's adapter-name-free keys
(``transformer_blocks.0.attn.to_q.lora_A.weight``), the keys a weight sync and a checkpoint
carry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from digen.algos.precision import at_least_float32
from digen.errors import CheckpointError, ConfigError
from digen.lora_targets import FLUX_TARGETS as FLUX_TARGETS  # re-exported: the adapters' defaults
from digen.lora_targets import QWEN_IMAGE_TARGETS as QWEN_IMAGE_TARGETS
from digen.lora_targets import SD3_TARGETS as SD3_TARGETS

ADAPTER = "default"

# The family defaults (``model.lora.target_modules`` unset) live in the torch-free
# digen.lora_targets, which digen.checks also reads (the checkpoint's size).


def add_lora(
    transformer: Any,
    *,
    rank: int,
    alpha: int,
    target_modules: list[str] | tuple[str, ...],
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> None:
    """Inject a LoRA adapter into ``transformer`` in place; only adapter params stay trainable,
    in ``dtype`` (None: float32, float64 for a float64 transformer). The initial values are
    drawn in float32 and cast, so every dtype starts from the same adapter rounded."""
    from peft import LoraConfig

    if rank <= 0:
        raise ConfigError(f"lora rank ({rank}) must be > 0")
    if has_lora(transformer):
        raise ConfigError("LoRA is already enabled on this transformer; enable it once per policy")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        init_lora_weights="gaussian",
        target_modules=list(target_modules),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            transformer.add_adapter(config, adapter_name=ADAPTER)
        except ValueError as e:  # peft: no module matched target_modules
            raise ConfigError(
                f"lora target_modules {list(target_modules)} match no layer of the transformer ({e})"
            ) from e
    for p in transformer.parameters():
        if p.requires_grad:  # float64 adapters for a float64 model
            p.data = at_least_float32(p.data) if dtype is None else p.data.to(dtype)


def has_lora(transformer: torch.nn.Module) -> bool:
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only: detached, CPU, float32, contiguous."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def lora_names(transformer: torch.nn.Module) -> list[str]:
    """The keys of :func:`lora_state_dict`, in its order, without copying a tensor (peft's
    state dict holds the adapter's own tensors, detached)."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(transformer, adapter_name=ADAPTER))


def load_lora_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (keys as :func:`lora_state_dict` gives them) into the adapter.

    Workers load a new version every iteration, so the common case is a direct copy into the
    adapter's parameters (their names minus the adapter name are the state-dict keys); an
    adapter whose keys do not map that way (embedding LoRA, DoRA) goes through peft."""
    params = {
        name.replace(f".{ADAPTER}.", "."): prm
        for name, prm in transformer.named_parameters()
        if f".{ADAPTER}." in name
    }
    if set(params) == set(state):
        _copy_into(params, state, "LoRA weight", "the adapter's")
        return
    from peft import set_peft_model_state_dict

    _check_keys(set(state), set(lora_state_dict_keys(transformer)), "LoRA adapter")
    with torch.no_grad():
        set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER)


def lora_state_dict_keys(transformer: torch.nn.Module) -> list[str]:
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(transformer, adapter_name=ADAPTER))


@contextmanager
def lora_disabled(transformer: Any) -> Iterator[None]:
    """The base model inside the block (adapter layers bypassed), the adapter again after."""
    if not has_lora(transformer):
        raise ConfigError(
            "the reference policy needs LoRA (a full fine-tune keeps no frozen copy of the base "
            "weights); enable LoRA or set the KL coefficient to 0"
        )
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter of ``module``: detached, CPU, float32, contiguous."""
    return {
        name: p.detach().to("cpu", torch.float32).clone().contiguous()  # never alias live params
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def full_names(module: torch.nn.Module) -> list[str]:
    """The keys of :func:`full_state_dict`, in its order, without copying a tensor."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def load_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (keys as :func:`full_state_dict` gives them) into the trainable params,
    cast to each param's dtype and device."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    _check_keys(set(state), set(params), "transformer")
    _copy_into(params, state, "weight", "the transformer's")


def _copy_into(
    params: Mapping[str, torch.Tensor], state: dict[str, torch.Tensor], what: str, whose: str
) -> None:
    """Copy ``state[k]`` into ``params[k]`` in place (cast to its dtype and device), refusing
    a shape mismatch before anything is written."""
    for k, prm in params.items():
        if state[k].shape != prm.shape:
            raise CheckpointError(
                f"{what} {k} has shape {tuple(state[k].shape)}, {whose} is {tuple(prm.shape)}"
            )
    with torch.no_grad():
        for k, prm in params.items():
            prm.copy_(state[k])


def _check_keys(given: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{what} state dict does not match the model: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}; was it saved from the same model "
            "with the same LoRA settings?"
        )
