"""Full fine-tuning of a policy that does not fit one device: FSDP2 across the trainer group.

Every trainer rank holds 1/N of the transformer's weights, gradients and AdamW state
(``torch.distributed.fsdp.fully_shard``: parameters become ``DTensor`` shards on a 1-D device
mesh). A forward all-gathers one transformer block at a time; a backward reduce-scatters each
block's gradient, so every rank ends with its shard of the gradient summed over all ranks'
rows. Optional activation checkpointing recomputes each block in the backward instead of
keeping its activations (``torch.distributed._composable.checkpoint``: parameter names do not
change, so state dicts keep :meth:`FlowPolicy.trainable_state_dict`'s keys).

Gradient semantics are digen's (:mod:`digen.training`, :class:`digen.optim.ParameterStore`):
the update is AdamW on ``(sum over every trained row of every task of d loss) / total_rows``,
its norm clipped to ``train.grad_clip``. FSDP's reduce-scatter averages over ranks by default;
:func:`shard_transformer` makes it an exact sum (divide factor 1, SUM-only collectives), and
:meth:`ShardedTrainer.step` divides by the global row count, so the sharded update equals the
unsharded one however rows are spread over ranks.

How the runtime uses it (``train.fsdp: true``)
---------------------------------------------
The trainer workers of a job (fixed at job start, sorted by name) form one process group
(``gloo`` on CPU, ``nccl`` on GPU) and act as ONE logical trainer that owns the optimizer
(the rank loop: :mod:`digen.workers.fsdp_loop`; the controller's side: :mod:`digen.runtime.fsdp_group`;
the Redis keys: :mod:`digen.controlplane.fsdp_keys`):

1. rendezvous through Redis: rank 0 publishes a formation, and the ranks meet in a store in
   the job's Redis (:mod:`digen.parallel.store`); every rank loads the start version's weights from Redis and calls
   ``ShardedTrainer(policy, cfg.train, activation_checkpointing=...)`` (which shards it); on
   ``--resume`` rank 0 reads the checkpoint's ``optimizer.safetensors`` and
   :meth:`ShardedTrainer.load_optimizer_state` scatters each rank's shard;
2. rank 0 leases train tasks and step commands from Redis and broadcasts each as JSON
   (:mod:`digen.parallel.comm`, never pickle). For a train task every rank reads the group's
   trajectories itself and calls :meth:`ShardedTrainer.accumulate` *together* on its share of
   the rows (:func:`shard_rows`); a rank with fewer forwards pads with zero-weight ones, so
   uneven shares cannot deadlock. The gradient stays in the sharded ``.grad``: rank 0
   acknowledges with the stats summed over ranks and every rank's timeline event only;
3. the controller queues a step command once every train task of the iteration is in; every
   rank calls :meth:`ShardedTrainer.step` (the row total is checked against the controller's);
4. :meth:`ShardedTrainer.full_state_dict` gathers the weights on rank 0, which publishes
   version v+1 to Redis for the rollout workers; on a checkpointing step
   :meth:`ShardedTrainer.optimizer_state` gathers AdamW's moments and rank 0 writes them in
   :meth:`digen.optim.ParameterStore.save`'s format, so checkpoints resume in either mode.

``train.ema`` is sharded like the weights: each rank keeps the EMA of its own shards
(:attr:`ShardedTrainer.ema`, ``DTensor`` shards placed as the parameters) and updates it in
:meth:`ShardedTrainer.step` at the replicated store's cadence with its rule
(:func:`digen.optim.ema_update`: elementwise, so the shards of the replicated EMA for the same
weights, bit for bit). A checkpoint gathers it whole (:meth:`ShardedTrainer.ema_state`,
``ema/<name>`` in ``optimizer.safetensors``, as the replicated store writes it; ``digen export
--ema`` reads it there), a resumed group scatters it back (:meth:`ShardedTrainer.load_ema`),
and a version evaluated with the EMA (``train.ema.eval``) is served with each rank's shard of
it beside its shard of the weights. Only rank 0 ever holds the whole EMA: in host memory,
while it writes a checkpoint (gathered one tensor at a time, as the weights and moments are).

The trainer ranks neither run TAG generation nor take train tasks independently (the config
turns TAG and RAT off), and the scheduler sees them as trainers whose tasks all finish on rank 0.
The group is not elastic: a rank that dies fails the job (the others hit a collective error or
timeout; rerun with ``--resume``), and a trainer that joins mid-job idles until the next job.
Checkpoints need a run directory that rank 0 and the controller share (a shared filesystem
across machines).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from digen.config import Config, TrainConfig
from digen.errors import ConfigError
from digen.models import lora
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.optim import ema_after_step, ema_before_step
from digen.task_records import TrainStats
from digen.training import TrainRows, chunk_loss, forward_chunks

MeshOrGroup = DeviceMesh | dist.ProcessGroup | None


# --- sharding ------------------------------------------------------------------------
def block_modules(module: nn.Module, block_types: list[str] | None = None) -> list[nn.Module]:
    """The transformer blocks to shard one by one: modules whose class name is in
    ``block_types`` (default: the diffusers model's ``_no_split_modules``, e.g. SD3's
    ``JointTransformerBlock``), else every member of the module's ``nn.ModuleList``s."""
    names = set(block_types or getattr(module, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in module.modules() if m is not module and type(m).__name__ in names]
    else:
        blocks = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    if not blocks:
        raise ConfigError(
            f"{type(module).__name__} has no transformer blocks to shard (looked for "
            f"{sorted(names) or 'nn.ModuleList members'}); pass block_types with its block class names"
        )
    return blocks


def checkpoint_blocks(module: nn.Module, block_types: list[str] | None = None) -> nn.Module:
    """Activation checkpointing of every transformer block of ``module`` (see
    :func:`block_modules`), in place: each block's forward keeps only its inputs and recomputes
    the rest in the backward (``torch.distributed._composable.checkpoint``: parameter names and
    state dicts do not change). For an unsharded policy, a replicated trainer's; FSDP applies
    the same per block in :func:`shard_transformer`. Returns ``module``."""
    from torch.distributed._composable import checkpoint

    for block in block_modules(module, block_types):
        checkpoint(block)
    return module


def device_mesh(mesh_or_group: MeshOrGroup, device_type: str) -> DeviceMesh:
    """A 1-D mesh over ``mesh_or_group`` (None: the default process group)."""
    if isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    if not dist.is_initialized():
        raise ConfigError(
            "sharded training needs a torch.distributed process group; call "
            "torch.distributed.init_process_group (gloo on CPU, nccl on GPU) on every trainer first"
        )
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    assert group is not None  # initialized above
    return DeviceMesh.from_group(group, device_type)


def shard_transformer(
    module: nn.Module,
    *,
    mesh_or_group: MeshOrGroup = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    block_types: list[str] | None = None,
) -> nn.Module:
    """Shard ``module`` in place with FSDP2: each block (see :func:`block_modules`), then the
    root (the embedders and output layers). Returns ``module`` (now also an ``FSDPModule``).

    activation_checkpointing: recompute each block's forward in the backward.
    reshard_after_forward: free the gathered weights after each block's forward (gather
        again in the backward): least memory; False keeps them until the backward.
    param_dtype: compute dtype of the gathered weights (e.g. bfloat16 with float32 shards,
        the master weights); gradients are reduced in float32. None: the parameters' dtype.

    Gradients are reduced as an exact SUM over ranks (FSDP's default is the mean), the sum
    :class:`ShardedTrainer` and digen's optimizer semantics expect. Every rank must call this
    with the same module structure; the module must already be on the rank's device.
    """
    device_type = next(module.parameters()).device.type
    mesh = device_mesh(mesh_or_group, device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

    for block in block_modules(module, block_types):
        if activation_checkpointing:
            checkpoint(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
    return module


def shard_rows(rows: TrainRows, rank: int, world_size: int) -> TrainRows:
    """Rank ``rank``'s contiguous share of ``rows`` (sizes differ by at most one row; a rank
    may get none when there are fewer rows than ranks)."""
    n = len(rows)
    start, end = n * rank // world_size, n * (rank + 1) // world_size
    return rows.take(torch.arange(start, end, dtype=torch.long))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def trainable_tensors(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    """The trained tensors as the sharded policy holds them (``DTensor`` shards of the
    parameters, detached, sharing their storage), keyed like
    :meth:`FlowPolicy.trainable_state_dict`: the LoRA adapter when LoRA is on, else every
    trainable transformer weight."""
    if lora.has_lora(policy.transformer):
        from peft import get_peft_model_state_dict

        named = get_peft_model_state_dict(policy.transformer, adapter_name=lora.ADAPTER).items()
    else:
        named = ((k, p) for k, p in policy.transformer.named_parameters() if p.requires_grad)
    return {name: t.detach() for name, t in named}


def gather_trainable_state(policy: FlowPolicy, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
    """The policy's trained tensors, whole, keyed like :meth:`FlowPolicy.trainable_state_dict`:
    the LoRA adapter when LoRA is on, else every trainable transformer weight. Detached CPU
    float32. A collective: every rank calls it; ranks other than ``to_rank`` get ``{}`` (None:
    every rank gets the dict). Gathers one tensor at a time (peak extra memory: one weight)."""
    return gather_whole(trainable_tensors(policy), to_rank=to_rank)


def gather_whole(tensors: dict[str, torch.Tensor], *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
    """``tensors`` (``DTensor`` shards, or whole tensors) whole, detached CPU float32. A
    collective: every rank calls it; ranks other than ``to_rank`` get ``{}`` (None: every
    rank gets the dict). Gathers one tensor at a time (peak extra memory: one tensor)."""
    keep = to_rank is None or dist.get_rank() == to_rank
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        whole = _full(t.detach())
        if keep:
            out[name] = whole.to("cpu", torch.float32).contiguous()
    return out


def local_trainable_shards(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    """This rank's shard of each trained tensor, keyed like :meth:`FlowPolicy.trainable_state_dict`:
    FSDP2 shards dim 0 in rank order (``torch.chunk``'s split), so the ranks' shards
    concatenated along dim 0 are the whole tensor. No collective; detached views."""
    return local_shards(trainable_tensors(policy))


def local_shards(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shard of each of ``tensors`` (``DTensor.to_local``; a whole tensor as it is).
    No collective; detached views."""
    return {name: (t.to_local() if isinstance(t, DTensor) else t).detach() for name, t in tensors.items()}


def shard_of(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of a whole ``tensor``, as FSDP2 cuts it (``torch.chunk``;
    a rank past the last chunk holds an empty one): what :func:`local_trainable_shards`
    returns for a tensor the group holds."""
    chunks = torch.chunk(tensor, world, dim=0)
    return chunks[rank].contiguous() if rank < len(chunks) else tensor[:0].contiguous()


# --- training ------------------------------------------------------------------------
class ShardedTrainer:
    """One per trainer rank: the FSDP-sharded policy and an AdamW over its shards.

    Call order, on every rank of the group together: ``accumulate`` once per train task (any
    number of tasks), ``step`` once per optimizer step, ``full_state_dict`` to publish.
    """

    def __init__(
        self,
        policy: FlowPolicy,
        train: TrainConfig,
        *,
        mesh_or_group: MeshOrGroup = None,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        version: int = 0,
    ):
        self.policy = policy
        self.train = train
        self.version = version
        # float32 shards (the master weights, as ParameterStore keeps them), gathered in the
        # policy's compute dtype; a LoRA run keeps its frozen base in the compute dtype
        low_precision = policy.dtype != torch.float32
        if low_precision and not lora.has_lora(policy.transformer):
            policy.transformer.float()
        shard_transformer(
            policy.transformer,
            mesh_or_group=mesh_or_group,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
            param_dtype=policy.dtype if low_precision else None,
        )
        self.mesh = next(p for p in policy.transformer.parameters() if isinstance(p, DTensor)).device_mesh
        self.group = self.mesh.get_group()
        self.params = [p for p in policy.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=train.lr, betas=train.betas, eps=train.adam_eps, weight_decay=train.weight_decay
        )
        self.local_rows = 0
        self.ema: dict[str, torch.Tensor] | None = (
            {k: t.float().clone() for k, t in trainable_tensors(policy).items()}
            if train.ema.enabled
            else None
        )
        """``train.ema``: the EMA of this rank's shards (``DTensor`` shards placed as the
        parameters), float32, keyed like :meth:`FlowPolicy.trainable_state_dict`; None without."""

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _agree(self, value: int, op: Any) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.mesh.device_type)
        dist.all_reduce(t, op=op, group=self.group)
        return int(t.item())

    def accumulate(
        self,
        rows: TrainRows,
        embeds: PromptEmbeds,
        cfg: Config,
        *,
        tsp: bool,
        sigma_max: float,
    ) -> TrainStats:
        """Add this rank's rows' summed loss gradient to the sharded ``.grad`` (a collective).

        rows: this rank's share of one train task (may be empty); embeds: one row per sample of
        the task (``rows.sample`` indexes it); as :func:`digen.training.task_gradient`, whose
        chunking (TSP packs ``train.rows_per_forward`` rows; else one forward per step) and
        loss (:func:`digen.training.chunk_loss`) this shares. Ranks agree on the number of forwards; one with fewer runs
        zero-weight forwards so every rank issues the same gathers and reduce-scatters.
        Returns this rank's stats (sums over its rows).
        """
        chunks = forward_chunks(rows, tsp, cfg.train.rows_per_forward) if len(rows) else []
        forwards = self._agree(len(chunks), dist.ReduceOp.MAX)
        stats, sizes, sums = TrainStats(), [], []
        for i in range(forwards):
            if i < len(chunks):
                chunk = rows.take(chunks[i])
                loss, terms, kl = chunk_loss(self.policy, chunk, embeds, cfg, sigma_max)
                loss.sum().backward()
                sizes.append(len(chunk))
                sums.append(TrainStats.chunk_sums(loss, terms, kl))
            else:
                self._padding_backward(rows, embeds, cfg)
        stats.add_chunks(sizes, sums)
        stats.forwards = forwards  # padding forwards gather too
        self.local_rows += stats.rows
        return stats

    def _padding_backward(self, rows: TrainRows, embeds: PromptEmbeds, cfg: Config) -> None:
        """A forward/backward with zero gradient: the collectives of a real chunk (one row of
        zeros; the reference forward too when the KL term has one)."""
        policy, r = self.policy, cfg.rollout
        x = torch.zeros((1, *rows.x.shape[1:]), dtype=torch.float32, device=policy.device)
        sigma = torch.full((1,), 0.5, device=policy.device)
        e = embeds.index([0])
        v = policy.velocity(x, sigma, e, r.guidance_scale)
        if cfg.train.kl_beta > 0:
            with torch.no_grad(), policy.reference_mode():
                policy.velocity(x, sigma, e, r.guidance_scale)
        (v.sum() * 0.0).backward()

    def step(self, total_rows: int | None = None, *, last_of_iteration: bool = True) -> dict[str, float]:
        """One AdamW step on ``grad / total_rows`` after clipping its (global) norm to
        ``train.grad_clip``, as :meth:`digen.optim.ParameterStore.step`, and the EMA's updates
        at its cadence (each rank its own shards: the update is elementwise, so the shards of
        the replicated store's EMA, bit for bit, given the same weights). A collective.
        total_rows: the rows trained since the last step on ALL ranks (None: summed here).
        last_of_iteration: the step ends the iteration (``train.ema.update: iteration``)."""
        rows = self._agree(self.local_rows, dist.ReduceOp.SUM) if total_rows is None else total_rows
        if rows <= 0:
            raise ValueError(f"an optimizer step needs trained rows, got {rows}")
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:  # ParameterStore steps every tensor, zero gradient or not
                    p.grad = torch.zeros_like(p)
                p.grad.div_(rows)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.train.grad_clip)
        if self.ema is not None:
            ema_before_step(self.train.ema, self.ema, trainable_tensors(self.policy), self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.local_rows = 0
        self.version += 1
        if self.ema is not None:
            ema_after_step(
                self.train.ema, self.ema, trainable_tensors(self.policy), self.version, last_of_iteration
            )
        return {"grad_norm": float(_full(norm))}

    # --- the EMA (train.ema) -------------------------------------------------------------
    def ema_state(self, *, to_rank: int = 0) -> dict[str, torch.Tensor]:
        """The EMA, whole (``{name: tensor}`` CPU float32, as a checkpoint keeps it under
        ``ema/<name>``), on ``to_rank``; ``{}`` elsewhere and without ``train.ema``. A collective."""
        return {} if self.ema is None else gather_whole(self.ema, to_rank=to_rank)

    def load_ema(self, tensors: dict[str, torch.Tensor] | None, *, src_rank: int = 0) -> bool:
        """Restore the EMA from whole tensors (a checkpoint's ``ema/<name>``, of a sharded or
        an unsharded run, prefix stripped): rank ``src_rank`` passes them, the others None;
        each rank receives its shard. A checkpoint without them (its run kept no EMA) leaves
        the EMA where it starts, at the weights. Returns whether it was restored. A collective."""
        if self.ema is None:
            return False
        from torch.distributed.tensor import distribute_tensor

        is_src = self.rank == src_rank
        present = is_src and tensors is not None and set(self.ema) <= set(tensors)
        if not self._agree(int(present), dist.ReduceOp.MAX):
            return False
        for name, t in self.ema.items():
            if is_src:
                assert tensors is not None
                whole = tensors[name].to(t.device, torch.float32)
            else:
                whole = torch.empty(t.shape, dtype=torch.float32, device=t.device)
            if isinstance(t, DTensor):
                self.ema[name] = distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=src_rank)
            else:
                dist.broadcast(whole, src=dist.get_global_rank(self.group, src_rank), group=self.group)
                self.ema[name] = whole
        return True

    def full_state_dict(self, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
        """The current version's whole trained weights for publishing (see
        :func:`gather_trainable_state`; a collective, ``{}`` on ranks other than ``to_rank``)."""
        return gather_trainable_state(self.policy, to_rank=to_rank)

    # --- optimizer state (checkpoints) ---------------------------------------------------
    def optimizer_state(
        self, names: list[str], *, to_rank: int = 0
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """AdamW's moments, whole, keyed as :meth:`digen.optim.ParameterStore.save` writes
        ``optimizer.safetensors`` (``exp_avg/<name>``, ``exp_avg_sq/<name>``), and the AdamW
        step count per name (``state.json``'s ``adam_steps``). ``names``: the trained tensors'
        names in ``self.params`` order (:meth:`FlowPolicy.named_trainable_parameters`, taken
        before sharding). A collective gathering one tensor at a time; ``({}, {})`` on ranks
        other than ``to_rank``."""
        if len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} trained parameters")
        keep = self.rank == to_rank
        tensors: dict[str, torch.Tensor] = {}
        steps: dict[str, float] = {}
        for name, p in zip(names, self.params, strict=True):
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    whole = _full(st[key])
                    if keep:
                        tensors[f"{key}/{name}"] = whole.to("cpu", torch.float32).contiguous()
            if "step" in st and keep:
                steps[name] = float(st["step"])
        return tensors, steps

    def load_optimizer_state(
        self,
        names: list[str],
        tensors: dict[str, torch.Tensor] | None,
        steps: dict[str, float],
        *,
        src_rank: int = 0,
    ) -> None:
        """Restore AdamW from whole tensors in :meth:`optimizer_state`'s format (a checkpoint
        of a sharded or an unsharded run): rank ``src_rank`` passes them (read from
        ``optimizer.safetensors``), the others None; each rank receives its shard
        (``distribute_tensor`` scatters from ``src_rank``). ``steps``: every rank's copy of
        the step counts; a name without one has no state yet. A collective."""
        if len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} trained parameters")
        from torch.distributed.tensor import distribute_tensor

        is_src = self.rank == src_rank
        for name, p in zip(names, self.params, strict=True):
            if name not in steps:
                continue
            state: dict[str, torch.Tensor] = {"step": torch.tensor(float(steps[name]))}
            for key in ("exp_avg", "exp_avg_sq"):
                if is_src:
                    assert tensors is not None
                    if f"{key}/{name}" not in tensors:
                        raise ValueError(f"optimizer state lacks {key}/{name}")
                    whole = tensors[f"{key}/{name}"].to(p.device, p.dtype)
                else:
                    whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                state[key] = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=src_rank)
            self.optimizer.state[p] = state
