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

Text tokens are replicated, never split: every rank computes the whole text stream (Wan's
cross-attention keys/values; HunyuanVideo's and FLUX's text stream, which joins the video or
image tokens in joint attention through this rank's heads only, see
:class:`HunyuanVideoUlyssesProcessor` and :class:`FluxUlyssesProcessor`). Each
rank's gradient on a replicated tensor is then a share too, so a gather whose result the
ranks compute on further (not the loss) has a reduce-scatter backward (:func:`gather_shared`).
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


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of the group's sum of ``x`` (an all-to-all, then a sum in
    rank order, so gloo, which has no reduce-scatter, runs it too)."""
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.sum(0)


class _GatherShared(_Gather):
    """:class:`_Gather`'s forward; the backward sums the ranks' gradients (a shared value's)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def gather_shared(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's slice concatenated along ``dim``, for a result every rank then computes on
    further (replicated text tokens). Unlike :func:`gather_sequence`, whose output feeds the
    one loss every rank computes whole, the gradient arriving here on each rank is only that
    rank's share (the module docstring), so the backward is a reduce-scatter: the sum over
    the group, this rank's slice. A collective."""
    return _GatherShared.apply(x, dim, group)


def reduce_gradients(grads: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """The full gradient from every rank's share: a sum over the group, in place, sorted by
    name so every rank issues the same collectives. A collective."""
    for name in sorted(grads):
        dist.all_reduce(grads[name], op=dist.ReduceOp.SUM, group=group)
    return grads


# --- the attention every family shares ---------------------------------------------------
def _attend(
    seq: list[torch.Tensor],
    text: list[torch.Tensor] | None,
    group,
    *,
    text_first: bool = False,
    rotate: Any = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ulysses attention, the one implementation the families' processors share.

    ``seq``: q, k, v ``[B, S/d, H, D]`` of this rank's share of the split tokens; they go
    through the all-to-all (heads scattered, sequence gathered) to ``[B, S, H/d, D]``.
    ``text``: q, k, v ``[B, L, H, D]`` of the replicated text tokens of joint attention
    (None: self-attention); this rank keeps its H/d heads of them (:func:`_head_slice`).
    ``rotate(seq, text)`` applies the rotary embedding to the q and k of those lists in place,
    at each token's global position. The rank attends over the tokens (text first with
    ``text_first``, as FLUX orders them; else after) with its heads and ``mask``; the split
    tokens' output returns by the inverse all-to-all, the text's is all-gathered over heads
    with a reduce-scatter backward (:func:`gather_shared`). Returns both outputs, heads
    flattened, in q's dtype (the text's None for self-attention)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    seq = [all_to_all(t, 2, 1, group) for t in seq]
    text = None if text is None else [_head_slice(t, group) for t in text]
    if rotate is not None:
        rotate(seq, text)
    n_seq, n_text = seq[0].shape[1], 0 if text is None else text[0].shape[1]
    if text is None:
        q, k, v = seq
    else:
        q, k, v = (torch.cat((t, s) if text_first else (s, t), dim=1) for s, t in zip(seq, text, strict=True))
    out = dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    seq_part, text_part = (
        (out[:, n_text:], out[:, :n_text]) if text_first else (out[:, :n_seq], out[:, n_seq:])
    )
    seq_out = all_to_all(seq_part, 1, 2, group).flatten(2, 3).to(q.dtype)
    if text is None:
        return seq_out, None
    return seq_out, gather_shared(text_part, 2, group).flatten(2, 3).to(q.dtype)


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
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if encoder_hidden_states is not None or attention_mask is not None:
            raise SequenceParallelError("WanUlyssesProcessor is for self-attention (attn1) without a mask")
        check_divisible("attention heads", attn.heads, dist.get_world_size(self.group))
        q, k, v = _get_qkv_projections(attn, hidden_states, None)  # type: ignore[arg-type]
        q, k = attn.norm_q(q), attn.norm_k(k)

        def rotate(seq: list[torch.Tensor], _text: None) -> None:
            if rotary_emb is not None:
                seq[:2] = [_wan_rotary(t, *rotary_emb) for t in seq[:2]]

        seq = [t.unflatten(2, (attn.heads, -1)) for t in (q, k, v)]
        out, _ = _attend(seq, None, self.group, rotate=rotate)
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

    def check_input(args, kwargs):
        temb = args[2] if len(args) > 2 else kwargs.get("temb")
        if temb is not None and temb.ndim == 4:
            raise SequenceParallelError(
                "per-token timesteps (Wan2.2 TI2V, timestep [B, S]) are not split by sequence parallelism"
            )

    return undo + _split_tokens(transformer.blocks[0], transformer.proj_out, group, check_input)


def _split_tokens(first: Any, last: Any, group, check: Any = None) -> list[Any]:
    """Hooks that shard the token sequence (first positional argument, dim 1) entering module
    ``first`` and gather the output of module ``last`` (the per-token output projection);
    ``check(args, kwargs)`` may refuse an input first. Returns the undo callables."""

    def shard_input(_module, args, kwargs):
        if check is not None:
            check(args, kwargs)
        if not args:  # FLUX passes its blocks' inputs by keyword
            return args, {**kwargs, "hidden_states": shard_sequence(kwargs["hidden_states"], 1, group)}
        hidden, *rest = args
        return (shard_sequence(hidden, 1, group), *rest), kwargs

    def gather_output(_module, _args, out):
        return gather_sequence(out, 1, group)

    return [
        first.register_forward_pre_hook(shard_input, with_kwargs=True).remove,
        last.register_forward_hook(gather_output).remove,
    ]


# --- HunyuanVideo -------------------------------------------------------------------------
def _head_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's H/d heads of a replicated ``[B, L, H, D]`` (backward: its slice of the
    gradient, zeros elsewhere, so the ranks' gradients sum to the whole)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[2] // world
    return x.narrow(2, rank * n, n)


def _joint_qkv(attn: Any, x: torch.Tensor, text: bool) -> list[torch.Tensor]:
    """q, k, v ``[B, S, H, D]`` of ``x``, per-head RMS-normalised, as diffusers'
    ``HunyuanVideoAttnProcessor2_0`` and ``FluxAttnProcessor`` project them: the text stream of
    a dual-stream block through the ``add_*`` projections and norms, everything else through
    ``to_*``."""
    added = text and getattr(attn, "add_q_proj", None) is not None
    projections = (
        (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if added else (attn.to_q, attn.to_k, attn.to_v)
    )
    norms = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in projections)
    q, k = (t if norm is None else norm(t) for t, norm in zip((q, k), norms, strict=True))
    return [q, k, v]


class HunyuanVideoUlyssesProcessor:
    """Joint attention of a diffusers ``HunyuanVideoTransformer3DModel`` block over
    [video tokens, text tokens], with this rank holding 1/d of the video tokens and every
    text token.

    The math of diffusers' ``HunyuanVideoAttnProcessor2_0`` (dual-stream blocks: video through
    ``to_*``, text through ``add_*``; single-stream blocks: both through ``to_*``; rotary
    embedding on video tokens only; the transformer's ``[B, 1, 1, S + L]`` mask, true for every
    video token and the prompt's real text tokens), split as DanceGRPO splits its HunyuanVideo
    (XueZeyue/DanceGRPO ``fastvideo/models/hunyuan/modules/attenion.py``
    ``parallel_attention``): video q/k/v go through the all-to-all (heads scattered, sequence
    gathered); text tokens are never split: each rank projects all of them and keeps its own
    H/d heads of text q/k/v; the rank attends over [full video, text] with its heads; the
    video output returns by the inverse all-to-all and the text output is all-gathered over
    heads, so every rank continues with the whole text stream.

    Gradient: the text stream is replicated, so each rank's gradient on it is a share (its
    heads' part); the head all-gather's backward therefore sums the shares over the group and
    keeps this rank's heads (:func:`gather_shared`). DanceGRPO's ``all_gather`` backward keeps
    the rank's own slice instead, which under this module's convention (full gradient = sum
    over ranks) would lose the other ranks' shares of every text-stream gradient.
    """

    def __init__(self, group):
        self.group = group

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:
            raise SequenceParallelError("HunyuanVideoUlyssesProcessor is for joint video + text attention")
        world = dist.get_world_size(self.group)
        check_divisible("attention heads", attn.heads, world)
        n_video, n_text = hidden_states.shape[1] * world, encoder_hidden_states.shape[1]
        if attention_mask is not None and attention_mask.shape[-1] != n_video + n_text:
            raise SequenceParallelError(
                f"attention mask over {attention_mask.shape[-1]} tokens, expected the full video "
                f"({n_video}) + text ({n_text})"
            )

        def rotate(video: list[torch.Tensor], _text: list[torch.Tensor]) -> None:  # video tokens only
            if image_rotary_emb is not None:
                turn: Any = apply_rotary_emb  # annotated as returning a tuple; returns the tensor
                video[:2] = [turn(t, image_rotary_emb, sequence_dim=1) for t in video[:2]]

        video, text = _joint_qkv(attn, hidden_states, False), _joint_qkv(attn, encoder_hidden_states, True)
        video_out, text_out = _attend(video, text, self.group, rotate=rotate, mask=attention_mask)
        assert text_out is not None
        if attn.to_out is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if attn.to_add_out is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out


def _install_hunyuan_video(transformer: Any, group) -> list[Any]:
    """Ulysses processors on every dual- and single-stream block's ``attn``; shard the video
    tokens entering the first block (after the transformer has built the rotary embedding
    and the attention mask for the full sequence), gather the output projection's tokens."""
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoSingleTransformerBlock,
        HunyuanVideoTransformerBlock,
    )

    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    for block in blocks:
        if type(block) not in (HunyuanVideoTransformerBlock, HunyuanVideoSingleTransformerBlock):
            raise SequenceParallelError(
                f"{type(block).__name__} (HunyuanVideo image-to-video token replacement) is not "
                "split by sequence parallelism"
            )
    undo = _set_processors(blocks, HunyuanVideoUlyssesProcessor(group))
    return undo + _split_tokens(blocks[0], transformer.proj_out, group)


def _set_processors(blocks: list[Any], processor: Any) -> list[Any]:
    """``processor`` on every block's ``attn``; returns the callables that put the old ones back."""
    undo: list[Any] = []
    for block in blocks:
        old = block.attn.processor
        block.attn.set_processor(processor)
        undo.append(lambda attn=block.attn, old=old: attn.set_processor(old))
    return undo


# --- FLUX --------------------------------------------------------------------------------
def _rope_rows(
    rope: tuple[torch.Tensor, torch.Tensor], start: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope[0].narrow(0, start, n), rope[1].narrow(0, start, n)


class FluxUlyssesProcessor:
    """Joint attention of a diffusers ``FluxTransformer2DModel`` block over [text tokens,
    image tokens] (FLUX puts text first), this rank holding 1/d of the image tokens and every
    text token: the text-token rule of :class:`HunyuanVideoUlyssesProcessor` (this rank's heads
    of the replicated text q/k/v; the text output all-gathered over heads with a reduce-scatter
    backward) on the math of diffusers' ``FluxAttnProcessor`` (per-head RMS q/k norms; the
    rotary embedding, built by the transformer over ``cat(txt_ids, img_ids)``, applied to
    every token at its global position; no mask).

    Dual-stream blocks pass text and image apart. Single-stream blocks pass one ``[B, L + S/d,
    C]`` sequence, text first; the rotary table covers ``L + S`` tokens, so
    ``S = (rows - local) * d / (d - 1)`` and ``L = rows - S``.
    """

    def __init__(self, group):
        self.group = group

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        from diffusers.models.embeddings import apply_rotary_emb

        world = dist.get_world_size(self.group)
        if attention_mask is not None or image_rotary_emb is None:
            raise SequenceParallelError(
                "FluxUlyssesProcessor needs the rotary embedding and no attention mask"
            )
        check_divisible("attention heads", attn.heads, world)
        single = encoder_hidden_states is None
        if encoder_hidden_states is None:  # single-stream: [text, local image] in one sequence
            local, rows = hidden_states.shape[1], image_rotary_emb[0].shape[0]
            n_text = rows - (rows - local) * world // (world - 1)
            encoder_hidden_states, hidden_states = hidden_states[:, :n_text], hidden_states[:, n_text:]
        n_text, rope_all = encoder_hidden_states.shape[1], image_rotary_emb

        def rotate(image: list[torch.Tensor], text: list[torch.Tensor]) -> None:  # every token, text first
            turn: Any = apply_rotary_emb  # annotated as returning a tuple; returns the tensor
            for part, start in ((text, 0), (image, n_text)):
                rope = _rope_rows(rope_all, start, part[0].shape[1])
                part[:2] = [turn(t, rope, sequence_dim=1) for t in part[:2]]

        image, text = _joint_qkv(attn, hidden_states, False), _joint_qkv(attn, encoder_hidden_states, True)
        image_out, text_out = _attend(image, text, self.group, text_first=True, rotate=rotate)
        assert text_out is not None
        if single:
            return torch.cat([text_out, image_out], dim=1)
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


def _install_flux(transformer: Any, group) -> list[Any]:
    """Ulysses processors on every dual- and single-stream block's ``attn``; shard the image
    tokens entering the first block, gather the output projection's tokens."""
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return _set_processors(blocks, FluxUlyssesProcessor(group)) + _split_tokens(
        blocks[0], transformer.proj_out, group
    )


_INSTALLERS = {"wan": _install_wan, "hunyuan-video": _install_hunyuan_video, "flux": _install_flux}
SP_FAMILIES = tuple(_INSTALLERS)
"""Families :func:`sequence_parallel` can split (the config refuses d > 1 for the others)."""


@contextmanager
def sequence_parallel(policy: Any, group) -> Iterator[Any]:
    """Within the block, ``policy``'s transformer runs Ulysses-parallel over ``group``:
    every rank calls ``policy.velocity`` (or any transformer forward) on the same full
    inputs and gets the same full output, each having computed 1/d of the tokens.
    ``group`` of size 1 changes nothing. Gradients: see :func:`reduce_gradients`.
    Families: ``wan`` (``WanTransformer3DModel``), ``hunyuan-video``
    (``HunyuanVideoTransformer3DModel``) and ``flux`` (``FluxTransformer2DModel``); text
    tokens replicated, never split."""
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
