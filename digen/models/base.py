"""The one interface every model family sits behind.

digen's rollout and training code never touch a diffusers pipeline directly: they see a
:class:`FlowPolicy`, which owns the transformer (the trained part), the frozen text encoders
and VAE, and the scheduler's sigma schedule. Latents live in the model's *step space*: the
tensor the transformer takes and the SDE step updates (SD3: ``[B, C, H, W]``; FLUX and
Qwen-Image: packed ``[B, seq, C*4]``; video: ``[B, C, F, H, W]``). The SDE math is
elementwise with a mean over non-batch dims, so it does not care which.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from digen.algos.precision import at_least_float32
from digen.errors import ConfigError


@dataclass
class PromptEmbeds:
    """Encoded prompts, batch-first tensors keyed by the transformer argument they feed.

    ``tensors`` holds the conditional embeddings (e.g. ``encoder_hidden_states``,
    ``pooled_projections``); ``uncond`` the negative-prompt embeddings used by CFG (empty when
    the model runs without CFG or uses embedded guidance).
    """

    tensors: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def index(self, idx: torch.Tensor | list[int]) -> PromptEmbeds:
        """Rows ``idx`` of every tensor (a new object; tensors are views or copies)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        return PromptEmbeds(
            {k: v.index_select(0, idx_t.to(v.device, non_blocking=True)) for k, v in self.tensors.items()},
            {k: v.index_select(0, idx_t.to(v.device, non_blocking=True)) for k, v in self.uncond.items()},
        )

    def repeat_rows(self, repeats: int) -> PromptEmbeds:
        """Each row repeated ``repeats`` times consecutively ([a, b] -> [a, a, b, b])."""
        return PromptEmbeds(
            {k: v.repeat_interleave(repeats, dim=0) for k, v in self.tensors.items()},
            {k: v.repeat_interleave(repeats, dim=0) for k, v in self.uncond.items()},
        )

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """The rows of ``parts`` one after another (a batched train task's groups, each encoded
        by its own call). A family whose prompt length is the longest prompt of one encoding
        call (Qwen-Image: the states with a padding mask ``<name>_mask``, 0 for padding) gets
        its shorter parts padded at the end to the longest, as its pipeline pads the prompts
        of one call: zeros in the states and in the mask. Any other disagreement of shapes is
        a ValueError naming the tensor."""
        return PromptEmbeds(_cat_rows([p.tensors for p in parts]), _cat_rows([p.uncond for p in parts]))


def _cat_rows(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each tensor of ``parts`` stacked along rows, a padding-masked sequence padded to the
    longest (:meth:`PromptEmbeds.cat`)."""
    out = {}
    for k in parts[0]:
        values = [d[k] for d in parts]
        if len({v.shape[1:] for v in values}) > 1:
            masked = k.endswith("_mask") or f"{k}_mask" in parts[0]
            if not masked or len({v.shape[2:] for v in values}) > 1:
                shapes = sorted({tuple(v.shape[1:]) for v in values})
                raise ValueError(
                    f"prompt embeddings {k!r} of shapes {shapes} cannot stack: only a sequence "
                    f"with a padding mask ({k}_mask) may differ in length"
                )
            n = max(v.shape[1] for v in values)
            values = [
                torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, n - v.shape[1])) for v in values
            ]
        out[k] = torch.cat(values)
    return out


def detach_uncond(uncond: torch.Tensor, cfg_grad: str) -> torch.Tensor:
    """The unconditional CFG branch itself (``cfg_grad`` ``"both"``) or detached (``"cond"``:
    only the conditional branch carries gradient; ``train.cfg_grad`` documents which peer does
    which)."""
    if cfg_grad not in ("cond", "both"):
        raise ConfigError(f"train.cfg_grad ({cfg_grad!r}) must be 'cond' or 'both'")
    return uncond.detach() if cfg_grad == "cond" else uncond


class FlowPolicy:
    """A flow-matching text-to-image/video model as digen's rollout and trainer see it.

    Subclasses (one per family: ``sd3.py``, ``flux.py``, ...) are built by
    :func:`digen.models.load_policy` from a local diffusers pipeline folder.

    :meth:`velocity` is written once, here; a family supplies only what its pipeline does
    differently: :meth:`timesteps` (sigma -> the transformer's timestep),
    :meth:`transformer_kwargs` (embeddings, ids, guidance, masks, shapes),
    :attr:`guidance_embeds` (embedded guidance instead of true CFG), and how the two CFG
    branches run (:attr:`cfg_in_one_forward`) and combine (:meth:`combine_cfg`).

    Attributes:
        family: ``"sd3" | "flux" | "qwen-image" | "wan" | "hunyuan-video"``.
        transformer: the trained module (peft-wrapped when LoRA is on).
        device, dtype: where and in which precision the transformer runs. The velocity, the
            SDE step math and stored latents/log-probs are float32 (float64 for a float64
            model: :mod:`digen.algos.precision`).
        is_video: decode returns frames.
    """

    family: str = ""
    transformer: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    is_video: bool = False
    autocast_dtype: torch.dtype | None = None
    """Every transformer forward runs under ``torch.autocast`` in this dtype (``model.autocast``);
    None: each module computes in its own dtype."""

    def latent_shape(self) -> tuple[int, ...]:
        """One sample's step-space latent shape (no batch dim)."""
        raise NotImplementedError

    def initial_noise(self, generator: torch.Generator) -> torch.Tensor:
        """One sample's starting noise ``[*latent_shape]``, float32, drawn on CPU from
        ``generator`` (so it is the same on every device), returned on ``self.device``."""
        return self.host_noise(generator).to(self.device)

    def host_noise(self, generator: torch.Generator) -> torch.Tensor:
        """:meth:`initial_noise` as drawn, on the host (a caller that moves a batch of them to
        the device at once)."""
        return torch.randn(self.latent_shape(), generator=generator, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's sigmas after ``set_timesteps(num_steps)``: ``[num_steps + 1]``
        float32, decreasing from ~1 to 0 (shift applied as the scheduler config says), on the host:
        the sampling loop reads them as floats, and a copy on the device would cost a round trip
        that waits for the device at every group."""
        raise NotImplementedError

    def encode_prompts(self, prompts: list[str], *, with_uncond: bool) -> PromptEmbeds:
        """Text-encode ``prompts`` (frozen encoders, no grad). ``with_uncond`` adds the
        empty-prompt embeddings CFG needs."""
        raise NotImplementedError

    # --- the velocity: one path for every family ----------------------------------
    cfg_in_one_forward: ClassVar[bool] = True
    """True CFG runs both branches as one ``[uncond; cond]`` forward of ``2B`` rows, as
    ``StableDiffusion3Pipeline`` and Flow-GRPO's ``compute_log_prob`` do (the FLUX, Wan and
    HunyuanVideo pipelines run two forwards: the same values up to round-off); False: two
    forwards, cond then uncond (Qwen-Image: its negative prompt has its own length)."""

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeds,
        guidance_scale: float,
        cfg_grad: str = "both",
    ) -> torch.Tensor:
        """The model's velocity for a batch of (latent, sigma) pairs.

        latents: ``[B, *latent_shape]`` float32; sigmas: ``[B]`` float32 (each row may sit at
        a different timestep: TSP batches timesteps); embeds: ``B`` rows. True CFG (two
        branches combined by :meth:`combine_cfg`, ``uncond + s * (cond - uncond)``) when
        :meth:`uses_true_cfg`; a family with embedded guidance passes ``guidance_scale`` to
        the transformer in :meth:`transformer_kwargs` instead. ``cfg_grad``
        (``train.cfg_grad``): ``"both"`` back-propagates through both CFG branches,
        ``"cond"`` detaches the unconditional one (same value, other gradient).
        Returns ``[B, *latent_shape]`` float32 (float64 for a float64 model, see
        :func:`digen.algos.precision.at_least_float32`); differentiable w.r.t. the trained
        params.
        """
        x = latents.to(self.device, self.dtype)
        t = self.timesteps(sigmas.to(self.device, torch.float32))
        if not self.uses_true_cfg(embeds, guidance_scale):
            return self._forward(x, t, embeds.tensors, guidance_scale)
        if self.cfg_in_one_forward:
            both = {k: torch.cat([embeds.uncond[k], v]) for k, v in embeds.tensors.items()}
            uncond, cond = self._forward(torch.cat([x, x]), torch.cat([t, t]), both, guidance_scale).chunk(2)
        else:
            cond = self._forward(x, t, embeds.tensors, guidance_scale)
            uncond = self._forward(x, t, embeds.uncond, guidance_scale)
        return self.combine_cfg(cond, detach_uncond(uncond, cfg_grad), guidance_scale)

    def _forward(
        self, x: torch.Tensor, t: torch.Tensor, tensors: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        """One transformer forward: ``x [N, *latent_shape]`` (model dtype), ``t [N]``, prompt
        tensors of ``N`` rows -> ``[N, *latent_shape]`` at least float32."""
        with self.autocast():
            out = self.transformer(
                hidden_states=x,
                timestep=t,
                **self.transformer_kwargs(x, tensors, guidance_scale),
                return_dict=False,
            )[0]
        return at_least_float32(out)

    def autocast(self) -> AbstractContextManager[Any]:
        """``torch.autocast`` in :attr:`autocast_dtype` on the policy's device type, or a
        no-op without one. Rollout and training forwards both pass through :meth:`_forward`,
        so they compute alike."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """sigmas ``[B]`` float32 -> the transformer's ``timestep`` ``[B]``: ``1000 * sigma`` in
        float32, the ``scheduler.timesteps`` the SD3, Wan and HunyuanVideo pipelines pass."""
        return sigmas * 1000.0

    def uses_true_cfg(self, embeds: PromptEmbeds, guidance_scale: float) -> bool:
        """Two CFG branches: ``guidance_scale > 1``, ``embeds`` carry ``uncond`` and the
        transformer does not embed the guidance itself (:attr:`guidance_embeds`)."""
        return guidance_scale > 1.0 and bool(embeds.uncond) and not self.guidance_embeds

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes ``guidance_scale`` as an input (FLUX.1-dev,
        HunyuanVideo: guidance-distilled, one pass) instead of true CFG."""
        return False

    def transformer_kwargs(
        self, x: torch.Tensor, tensors: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        """The transformer's keyword arguments besides ``hidden_states`` and ``timestep`` for
        one forward of ``x [N, *latent_shape]``: here the prompt ``tensors`` (``N`` rows)
        on the model's device and dtype; a family adds its ids, guidance, masks, shapes."""
        return {k: v.to(self.device, self.dtype) for k, v in tensors.items()}

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The CFG combination of the branches ``[B, *latent_shape]``:
        ``uncond + s * (cond - uncond)``, as the SD3, FLUX and Wan pipelines do."""
        return uncond + guidance_scale * (cond - uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents ``[B, *latent_shape]`` -> images ``[B, 3, H, W]`` (video:
        ``[B, F, 3, H, W]``), float32 in [0, 1], no grad."""
        raise NotImplementedError

    # --- trained parameters -------------------------------------------------------
    def enable_lora(
        self, rank: int, alpha: int, target_modules: list[str] | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Wrap the transformer with a peft LoRA adapter (``target_modules`` None: the
        family's default, as the peers use it) whose weights are ``dtype`` (None: float32,
        float64 for a float64 model). Only adapter params stay trainable."""
        raise NotImplementedError

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_trainable_parameters()]

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trained parameters keyed exactly as :meth:`trainable_state_dict` keys them (the
        gradients a trainer sends and the weights it publishes share these names). Copies no
        tensor: every train task calls it (a full fine-tune's copy was the whole model)."""
        names = self.trainable_names()
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        if len(names) != len(params):
            raise RuntimeError(f"{len(names)} trainable tensors named but {len(params)} parameters found")
        return list(zip(names, params, strict=True))

    def trainable_names(self) -> list[str]:
        """The keys of :meth:`trainable_state_dict`, in its order, without copying a tensor."""
        return list(self.trainable_state_dict())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight sync moves: the LoRA adapter when LoRA is on, else every
        transformer weight. Detached CPU float32 tensors, keys stable across processes."""
        raise NotImplementedError

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def reference_mode(self):  # -> contextmanager
        """Context manager in which :meth:`velocity` computes the *reference* policy (the
        base weights: LoRA disabled). Raises ``ConfigError`` when there is no LoRA (a full
        fine-tune keeps no frozen copy)."""
        raise NotImplementedError
