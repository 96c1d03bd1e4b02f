"""Ulysses sequence parallelism: d ranks run one sample's transformer forward together.

Each rank of a ``torch.distributed`` group (gloo on CPU, NCCL on GPU) holds 1/d of the
video token sequence between the patch embedding and the output projection. Every
per-token layer (modulation, norms, FFN, projections, cross-attention to text) runs on the
local tokens only; self-attention needs every token, so its q/k/v go through an all-to-all
that scatters heads and gathers the sequence (each rank then attends over the full sequence
with H/d heads) and the output comes back through the inverse all-to-all.

This is the design of DeepSpeed-Ulysses as DanceGRPO uses it (XueZeyue/DanceGRPO
``fastvideo/utils/communications.py`` ``all_to_all_4D`` / ``SeqAllToAll4D``, its
``parallel_states`` group and the video attention processors that call it) and of xDiT's
USP (``yunchang`` ``UlyssesAttention``, whose ``all_to_all_4D`` takes a scatter and a
gather index); digen's own code below follows the same contract: the backward of an
all-to-all is the inverse all-to-all. Pad-free: the sequence length and the head count must
both divide by d (:func:`check_divisible`).

Gradients. Every rank computes the same loss from the same gathered velocity. The gather's
backward keeps the rank's own slice of the output gradient, so each rank's parameter
gradients are its tokens' share; the full gradient is their sum over the group
(:func:`reduce_gradients`). Parameters used only after the gather would be counted d times,
which is why the gather sits right after the per-token output projection, before the
(parameter-free) unpatchify.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from digen.errors import ConfigError


class SequenceParallelError(ConfigError):
    """A shape or setting sequence parallelism cannot split."""


def check_divisible(what: str, value: int, degree: int) -> None:
    """``SequenceParallelError`` unless ``value`` (named ``what``) divides by ``degree``."""
    if value % degree:
        raise SequenceParallelError(
            f"{what} ({value}) must be divisible by the sequence-parallel degree ({degree}); "
            "Ulysses splits it evenly over the group with no padding"
        )


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    check_divisible(f"dim {scatter_dim} of a {tuple(x.shape)} tensor", x.shape[scatter_dim], world)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: rank j's piece of this rank's share of scatter_dim, in rank order along gather_dim
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` over the group and concatenate what every rank sent
    along ``gather_dim`` (rank order). ``all_to_all(all_to_all(x, s, g), g, s) == x``.
    Differentiable: the backward is the inverse all-to-all. A collective."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def shard_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """This rank's contiguous 1/d of ``x`` (replicated on every rank) along ``dim``. Its
    backward puts the gradient into this rank's slice (zeros elsewhere)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible("sequence length", x.shape[dim], world)
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        n = grad.shape[ctx.dim] // dist.get_world_size(ctx.group)
        return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * n, n).contiguous(), None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Every rank's shard concatenated along ``dim`` (the inverse of :func:`shard_sequence`),
    the same on every rank. Backward: this rank's slice of the gradient (every rank computes
    the same loss; see the module docstring). A collective."""
    return _Gather.apply(x, dim, group)


def reduce_gradients(grads: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """The full gradient from every rank's share: a sum over the group, in place, sorted by
    name so every rank issues the same collectives. A collective."""
    for name in sorted(grads):
        dist.all_reduce(grads[name], op=dist.ReduceOp.SUM, group=group)
    return grads


# --- Wan ---------------------------------------------------------------------------------
def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on ``x [B, S, H, D]`` (``cos``/``sin`` ``[1, S, 1, D]``),
    the formula of diffusers' ``WanAttnProcessor``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanUlyssesProcessor:
    """Self-attention (``attn1``) of a diffusers ``WanTransformer3DModel`` block on this rank's
    1/d of the tokens.

    q/k/v are projected and RMS-normalised (Wan normalises across all heads, so before the
    split) on the local tokens, then all-to-all'd to the full sequence with H/d heads; the
    rotary embedding (computed by the transformer for the full sequence, hence the same on
    every rank) is applied there, at each token's global position. Attention, then the
    inverse all-to-all and the output projection on the local tokens. Cross-attention
    (``attn2``) keeps diffusers' processor: its queries are local tokens and its keys/values
    the text tokens, which every rank holds whole (text is replicated, never split).
    """

    def __init__(self, group):
        self.group = group

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if encoder_hidden_states is not None or attention_mask is not None:
            raise SequenceParallelError("WanUlyssesProcessor is for self-attention (attn1) without a mask")
        check_divisible("attention heads", attn.heads, dist.get_world_size(self.group))
        q, k, v = _get_qkv_projections(attn, hidden_states, None)  # type: ignore[arg-type]
        q, k = attn.norm_q(q), attn.norm_k(k)
        # [B, S/d, H, D] -> [B, S, H/d, D]: scatter heads (dim 2), gather the sequence (dim 1)
        q, k, v = (all_to_all(t.unflatten(2, (attn.heads, -1)), 2, 1, self.group) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)
        out = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = all_to_all(out, 1, 2, self.group).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _install_wan(transformer: Any, group) -> list[Any]:
    """Ulysses processors on every block's ``attn1``; shard the tokens entering the first
    block, gather the output projection's tokens. Returns the undo callables."""
    undo: list[Any] = []
    processor = WanUlyssesProcessor(group)
    for block in transformer.blocks:
        old = block.attn1.processor
        block.attn1.set_processor(processor)
        undo.append(lambda attn=block.attn1, old=old: attn.set_processor(old))

    def shard_input(_module, args, kwargs):
        hidden, *rest = args
        temb = rest[1] if len(rest) > 1 else kwargs.get("temb")
        if temb is not None and temb.ndim == 4:
            raise SequenceParallelError(
                "per-token timesteps (Wan2.2 TI2V, timestep [B, S]) are not split by sequence parallelism"
            )
        return (shard_sequence(hidden, 1, group), *rest), kwargs

    def gather_output(_module, _args, out):
        return gather_sequence(out, 1, group)

    undo.append(transformer.blocks[0].register_forward_pre_hook(shard_input, with_kwargs=True).remove)
    undo.append(transformer.proj_out.register_forward_hook(gather_output).remove)
    return undo


_INSTALLERS = {"wan": _install_wan}
SP_FAMILIES = tuple(_INSTALLERS)
"""Families :func:`sequence_parallel` can split (the config refuses d > 1 for the others)."""


@contextmanager
def sequence_parallel(policy: Any, group) -> Iterator[Any]:
    """Within the block, ``policy``'s transformer runs Ulysses-parallel over ``group``:
    every rank calls ``policy.velocity`` (or any transformer forward) on the same full
    inputs and gets the same full output, each having computed 1/d of the tokens.
    ``group`` of size 1 changes nothing. Gradients: see :func:`reduce_gradients`.
    Families: ``wan`` (``WanTransformer3DModel``)."""
    family = getattr(policy, "family", None)
    if family not in _INSTALLERS:
        raise SequenceParallelError(
            f"sequence parallelism supports the {', '.join(_INSTALLERS)} families, not {family!r}"
        )
    if dist.get_world_size(group) == 1:
        yield policy
        return
    undo = _INSTALLERS[family](policy.transformer, group)
    try:
        yield policy
    finally:
        for fn in reversed(undo):
            fn()
