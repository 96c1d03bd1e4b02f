"""Memory you can plan: each worker's predicted peak GPU memory, from the model's shape.

:func:`predict` builds the configured policy on torch's ``meta`` device (shapes, no data, no
GPU, a second or so) and measures, for one training row (one (sample, timestep) pair at the
configured resolution, with CFG when ``rollout.guidance_scale`` > 1), the bytes autograd keeps
for the backward (``torch.autograd.graph.saved_tensors_hooks``: every tensor a forward saves,
counted at its size, so views of one tensor saved twice count twice: an upper bound). Then:

- weights: every parameter and buffer of the policy in its dtype (transformer, text encoders,
  VAE: a worker holds them all);
- optimizer (trainers): the trained tensors' float32 master copy, AdamW's two moments, the
  gradient and the running gradient sum, and the EMA with ``train.ema`` (5 float32 copies of
  the trained tensors, 6 with the EMA; 1/N each with ``train.fsdp`` over N trainers, which also
  shards the transformer's weights);
- activations (trainers): ``train.rows_per_forward`` rows of the measured bytes; with
  ``train.activation_checkpointing`` each block's inputs per row plus one block's saved
  tensors for the rows (the block recomputed in the backward).

A rollout worker holds the weights and the activations of one no-grad step (not counted:
small beside a trainer's). Measured on the eager attention path: CUDA's fused attention keeps
less, so the prediction errs high. ``digen plan`` prints it per worker and refuses a plan whose
trainer does not fit its GPU, naming the key to change (:func:`fit_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    """Predicted peak bytes of one worker of a role."""

    role: str
    weights: int
    optimizer: int
    activations: int
    rows: int
    """Rows per forward the activations are for (0 for a rollout worker)."""

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.activations

    def line(self) -> str:
        parts = f"weights {self.weights / GIB:.2f}"
        if self.role == "trainer":
            parts += f" + optimizer {self.optimizer / GIB:.2f} + activations {self.activations / GIB:.2f} ({self.rows} rows)"
        return f"  {self.role:<7}  ~{self.total / GIB:.2f} GiB ({parts})"


@dataclass(frozen=True)
class RowMeasure:
    """What one training row keeps for the backward: in all, and per transformer block."""

    saved: int
    blocks: int
    block_inputs: int
    """Bytes of one block's input per row (what a checkpointed block keeps)."""


def measure(cfg) -> tuple[int, int, int, RowMeasure]:
    """(weight bytes, the transformer's weight bytes, trained-tensor elements, one row's
    saved bytes) of ``cfg``'s policy, built on ``meta``."""
    import torch

    from digen.assembly import DTYPES
    from digen.models import load_policy
    from digen.parallel.fsdp import block_modules

    m = cfg.model
    policy = load_policy(
        cfg.resolve_path(m.path),
        height=m.resolution,
        width=m.resolution,
        dtype=DTYPES[m.dtype],
        device="meta",
        num_frames=m.num_frames,
        max_sequence_length=m.max_sequence_length,
        text_encoder_dtype=DTYPES[m.text_encoder_dtype or m.dtype],
        vae_dtype=DTYPES[m.vae_dtype],
    )
    if m.lora.enabled:
        from digen.assembly import trained_dtype

        policy.enable_lora(m.lora.rank, m.lora.alpha, m.lora.target_modules, dtype=trained_dtype(cfg))
    else:
        policy.transformer.requires_grad_(True)
    modules = [mod for mod in vars(policy).values() if isinstance(mod, torch.nn.Module)]
    weights = sum(
        t.numel() * t.element_size() for mod in modules for t in [*mod.parameters(), *mod.buffers()]
    )
    trained = sum(p.numel() for _, p in policy.named_trainable_parameters())
    transformer = sum(t.numel() * t.element_size() for t in policy.transformer.parameters())
    blocks = block_modules(policy.transformer)
    block_in: list[int] = []

    def inputs(_m, args, kwargs):
        given = [*args, *kwargs.values()]
        block_in.append(sum(a.numel() * a.element_size() for a in given if isinstance(a, torch.Tensor)))

    hook = blocks[0].register_forward_pre_hook(inputs, with_kwargs=True)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    cfg_scale = cfg.rollout.guidance_scale
    embeds = policy.encode_prompts(["a photo"], with_uncond=cfg_scale > 1.0)
    x = torch.zeros(1, *policy.latent_shape(), device="meta")
    sigma = torch.full((1,), 0.5, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy.velocity(x, sigma, embeds, cfg_scale)
    hook.remove()
    return weights, transformer, trained, RowMeasure(saved[0], len(blocks), block_in[0] if block_in else 0)


def predict(cfg) -> list[Estimate]:
    """Each role's :class:`Estimate` for ``cfg`` (see the module docstring)."""
    weights, transformer, trained, row = measure(cfg)
    t, cl = cfg.train, cfg.cluster.local
    shards = max(1, cl.trainer_workers) if t.fsdp else 1
    copies = 6 if t.ema.enabled else 5  # the EMA: one more float32 copy, sharded alike
    optimizer = copies * 4 * trained // shards
    # FSDP shards the transformer (a full fine-tune's float32 master is in ``optimizer``)
    trainer_weights = weights - transformer + transformer // shards
    rows = t.rows_per_forward
    if t.activation_checkpointing:
        per_block = row.saved // max(1, row.blocks)
        activations = rows * (row.blocks * row.block_inputs + per_block)
    else:
        activations = rows * row.saved
    out = [Estimate("trainer", trainer_weights, optimizer, activations, rows)]
    if cl.rollout_workers:
        out.append(Estimate("rollout", weights, 0, 0, 0))
    return out


def fit_problem(estimates: list[Estimate], placement, gpus) -> str | None:
    """The one-line refusal when the workers ``placement`` puts on one GPU (of ``gpus``, the
    :class:`~digen.cluster.placement.Gpu` list it placed on) are predicted to need more than
    its memory and a trainer is among them, naming the key to change; None when every GPU
    fits, or its memory is unknown (0), or the workers run on CPU."""
    by_role = {e.role: e for e in estimates}
    memory = {g.index: (g.memory_mib, g.type) for g in gpus}
    load: dict[int, list[Estimate]] = {}
    for slot in placement.slots:
        e = by_role.get(slot.role)
        for index in slot.gpus:
            if e is not None:
                load.setdefault(index, []).append(e)
    for index, on in sorted(load.items()):
        mib, kind = memory.get(index, (0, "gpu"))
        trainer = next((e for e in on if e.role == "trainer"), None)
        need = sum(e.total for e in on)
        if trainer is None or mib <= 0 or need <= mib * 2**20:
            continue
        have = mib * 2**20 - (need - trainer.activations)
        per_row = trainer.activations / max(1, trainer.rows)
        fit_rows = int(have // per_row) if per_row > 0 and have > 0 else 0
        fix = (
            f"lower train.rows_per_forward to {fit_rows}, or set train.activation_checkpointing: true"
            if fit_rows >= 1
            else "set train.fsdp: true over more trainers, model.lora.enabled: true, or fewer workers per GPU"
        )
        return (
            f"the workers on GPU {index} ({kind}, {mib / 1024:.1f} GiB) are predicted to need {need / GIB:.1f} GiB "
            f"(a trainer's activations of {trainer.rows} rows: {trainer.activations / GIB:.1f} GiB); {fix}"
        )
    return None
