"""The peers as simulator modes: VeRL-Omni, GenRL and Flow-GRPO, each a phase-serial SPMD
iteration restated from its code.

The three peers run one synchronous program on every GPU: each phase (generate, score,
recompute, train, sync) starts on all GPUs together and ends at a collective, so an iteration
is the sum of its phases, each as long as its slowest GPU (a heterogeneous testbed gives every
GPU the same share). Nothing is pulled or overlapped across phases, so the peers need no
Scheduler: :func:`simulate_peer` lays each replica's phases on the timeline and returns a
:class:`~digen.sim.driver.SimResult` measured on the same window as digen's modes.

A :class:`PeerRecipe` (``configs/sim/catalog.yaml`` ``peers:``, every field cited there to
file and commit of the peer) says what each phase does:

- generation in the peer's engine (``engine``: vLLM-Omni compiled, diffusers eager) at its
  generation batch, on the training model when it samples there (FSDP gathers per step);
- the reward model on the same GPUs (``reward_wake``: its engine is woken and put to sleep
  each iteration, as VeRL-Omni's colocated reward engine);
- rollout sleep/wake and FSDP actor onload/offload over PCIe;
- an old-log-prob forward at ``logprob_batch`` (None: the rollout's log-probs are reused) and
  a reference forward per trained timestep when the recipe has a KL term;
- training at ``train_micro_batch`` with ``optimizer_steps`` optimizer steps per rollout
  (each one gradient all-reduce of the adapter);
- the LoRA weight sync into the rollout engine and the trajectories through one driver.

Efficiency depends on the tokens of a pass (:func:`digen.sim.costmodel.pass_efficiency`), so
micro-batching shows. No phase carries a fitted factor: every term is the peer's code or a
published measurement, or an assumption named in ``docs/cost-model.md``; a recipe names the
commit it restates (``commit``), and a peer that changed (VeRL-Omni batched its generation at
9401c4b0) is one recipe per commit compared with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from digen.core.events import Role
from digen.core.timeline import TimelineRow
from digen.errors import ConfigError
from digen.sim.costmodel import (
    GPUS_PER_NODE,
    REFERENCE_TFLOPS,
    CostModel,
    GpuType,
    PaperInputs,
    _pass_s,
    needs_fsdp,
    pass_efficiency,
)
from digen.sim.dataplane import GB
from digen.sim.measure import SimResult, measure_rows


@dataclass(frozen=True)
class PeerRecipe:
    """One peer's iteration (``configs/sim/catalog.yaml`` ``peers:``)."""

    name: str
    commit: str
    """Where the recipe is read: the peer's repository at a commit (or a dated document)."""
    engine: str
    """Rollout engine: a key of the catalog's ``engines`` (speedup over eager)."""
    gen_batch: int
    """Samples per generation pass."""
    gen_on_trainer: bool
    """Samples with the training model (FSDP-sharded when training shards: a gather per step)."""
    fsdp: bool
    """The actor is FSDP-sharded over all GPUs even where the weights fit (the peer's config)."""
    logprob_batch: int | None
    """Old-log-prob recompute micro-batch (None: reuses the rollout's log-probs)."""
    reference_forward: bool
    """A reference-model forward per trained timestep (KL to the reference)."""
    train_micro_batch: int
    optimizer_steps: int
    """Optimizer steps per rollout batch."""
    rollout_sleep_wake: bool
    """The rollout engine's weights go to host after generation and come back at the sync."""
    actor_offload: bool
    """FSDP parameter and optimizer offload: the actor's shard comes on before training and
    goes off after."""
    reward_wake: bool
    """The reward model's engine is woken on the same GPUs before scoring and put to sleep."""
    reward_tp: int = 1
    """Tensor parallelism of the reward engine (its weights split over this many GPUs)."""
    weight_sync: bool = False
    """The trained weights are copied into a separate rollout engine after each step."""
    driver_gbps: float | None = None
    """One driver process relays every sample's trajectory (None: no central driver)."""
    async_sync: Literal["abort", "drain"] | None = None
    """An asynchronous peer (:func:`simulate_async_peer`): standalone rollout GPUs; at a weight
    sync the rollout ``abort`` s its in-flight generations (VeRL-Omni ``separate_async``) or
    ``drain`` s them first, scoring each as it is reaped (UniRL's ``AsyncDiffusionTrainer``).
    None: the synchronous colocated iteration."""
    async_staleness: int = 1
    """Weight syncs a generation may cross (UniRL's ``buffer_max_staleness``; VeRL-Omni's
    separate_async runs one batch ahead: 1). 1: the next batch generates while this one
    trains; 0: nothing is launched past a sync, so generation and training alternate."""


@dataclass(frozen=True)
class Phase:
    name: str
    kind: str
    """Timeline kind: gen, decode, reward, train, sync."""
    seconds: float


def peer_phases(
    recipe: PeerRecipe, inputs: PaperInputs, gpu: GpuType, degree: int, share: int, group: int | None = None
) -> list[Phase]:
    """The phases of one iteration on one replica of ``degree`` GPUs of type ``gpu`` that holds
    ``share`` of the iteration's samples, in the peer's order; ``group``: the GPUs the actor
    is sharded and its gradient reduced over (default: every GPU of the testbed)."""
    w, mdl, curve = inputs.workload, inputs.workload.model, inputs.curve
    speed = degree * gpu.tflops * mdl.sp_eff(degree)
    tokens = mdl.tokens
    engine = inputs.engines.get(recipe.engine)
    if engine is None:
        raise ConfigError(f"peer {recipe.name}: engine {recipe.engine} is not in the catalog's engines")
    fsdp = recipe.fsdp or needs_fsdp(mdl, gpu, degree)
    # FSDP shards over every GPU of the job: past one node its all-gathers cross the network
    nodes = math.ceil((group or inputs.gpus) / GPUS_PER_NODE)
    link = gpu.intra_gbps if nodes <= 1 else min(gpu.intra_gbps, inputs.net_gbps)
    gather = mdl.weights_gb / link if fsdp else 0.0
    k = w.trained_timesteps
    tcfg = mdl.train_cfg or mdl.cfg
    out: list[Phase] = []

    def fwd(batch: int, passes: int) -> float:
        """One forward of ``batch`` samples x ``passes`` CFG passes, at its pass efficiency."""
        return batch * passes * mdl.tflop_per_step / (speed * pass_efficiency(curve, batch * tokens))

    def gen_fwd(batch: int) -> float:
        """One denoising step of ``batch`` samples in the rollout engine: one sample's pass at
        its tokens' efficiency, the batch at the measured batch gain (:class:`BatchGain`)."""
        one = mdl.cfg * mdl.tflop_per_step / (speed * pass_efficiency(curve, tokens))
        return batch * one / (engine * inputs.batch_gain(batch, tokens))

    def batched(total: int, size: int, one) -> float:
        full, rest = divmod(total, size)
        return full * one(size) + (one(rest) if rest else 0.0)

    # generation: steps x CFG passes per batch, in the rollout engine (or on the actor)
    gen_gather = gather if recipe.gen_on_trainer else 0.0
    gen = batched(share, recipe.gen_batch, lambda b: w.steps * _pass_s(gen_fwd(b), gen_gather, mdl.layers))
    out.append(Phase("generate", "gen", gen))
    out.append(Phase("decode", "decode", share * mdl.decode_s_ref * REFERENCE_TFLOPS / gpu.tflops))
    if recipe.rollout_sleep_wake:
        out.append(Phase("rollout sleep", "sync", mdl.weights_gb / gpu.host_gbps))
    if recipe.reward_wake:
        out.append(Phase("reward wake", "sync", inputs.reward_weights_gb / recipe.reward_tp / gpu.host_gbps))
    out.append(Phase("reward", "reward", share * mdl.reward_tflop / gpu.tflops))
    if recipe.reward_wake:
        out.append(Phase("reward sleep", "sync", inputs.reward_weights_gb / recipe.reward_tp / gpu.host_gbps))
    n = group or inputs.gpus
    trained_gb = mdl.adapter_gb if mdl.adapter_gb is not None else mdl.weights_gb
    # param and optimizer offload: the actor's shard of the bf16 weights and of AdamW's float32
    # master weights and two moments (12 B per trained parameter = 6 x its bf16 GB)
    actor_gb = (mdl.weights_gb + 6 * trained_gb) / n
    if recipe.actor_offload:
        out.append(Phase("actor onload", "sync", actor_gb / gpu.host_gbps))
    if recipe.logprob_batch:
        lp = batched(share, recipe.logprob_batch, lambda b: k * _pass_s(fwd(b, tcfg), gather, mdl.layers))
        out.append(Phase("old log-prob", "train", lp))
    if recipe.reference_forward:
        ref = batched(
            share, recipe.train_micro_batch, lambda b: k * _pass_s(fwd(b, tcfg), gather, mdl.layers)
        )
        out.append(Phase("reference forward", "train", ref))
    train = batched(
        share,
        recipe.train_micro_batch,
        lambda b: k * _pass_s(fwd(b, tcfg) * mdl.train_flops_factor, 2 * gather, mdl.layers),
    )
    out.append(Phase("train", "train", train))
    # each optimizer step all-reduces the float32 gradient of what is trained (ring: 2 (N-1)/N)
    reduce = 2 * (n - 1) / n * 2 * trained_gb / link if n > 1 else 0.0
    out.append(Phase("optimizer steps", "sync", recipe.optimizer_steps * reduce))
    if recipe.actor_offload:
        out.append(Phase("actor offload", "sync", actor_gb / gpu.host_gbps))
    if recipe.weight_sync:
        out.append(Phase("weight sync", "sync", 2 * trained_gb / gpu.host_gbps))
    if recipe.rollout_sleep_wake:
        out.append(Phase("rollout wake", "sync", mdl.weights_gb / gpu.host_gbps))
    if recipe.driver_gbps:
        # one driver process: every sample of the batch (not the replica's share) goes to it
        # and back out to the actor
        out.append(
            Phase(
                "driver relay",
                "sync",
                2 * w.samples * w.trajectory_bytes / w.samples_per_task / GB / recipe.driver_gbps,
            )
        )
    return [p for p in out if p.seconds > 0]


def simulate_peer(cost: CostModel, recipe: PeerRecipe, *, iterations: int, warmup: int, trailing: int):
    """``iterations`` synchronous iterations of ``recipe`` on ``cost``'s workers; a
    :class:`~digen.sim.driver.SimResult` measured on the same window as the other modes."""

    inputs = cost.paper
    if inputs is None:
        raise ConfigError(
            f"mode {recipe.name} needs a paper-scale cost model (a configs/sim run config); a cost model "
            f"measured from a run has no recipe to restate"
        )
    if recipe.async_sync is not None:
        return simulate_async_peer(cost, recipe, iterations=iterations, warmup=warmup, trailing=trailing)
    samples = cost.samples
    # one SPMD program: one parallel degree on every GPU (the largest any GPU type needs), and
    # every replica the same share
    degree = max(w.gpus for w in cost.workers)
    replicas = [
        (f"{gpu.name}-{i:04d}", gpu) for gpu, count in inputs.testbed.gpus for i in range(count // degree)
    ]
    share = math.ceil(samples / len(replicas))
    by_type = {gpu.name: peer_phases(recipe, inputs, gpu, degree, share) for gpu, _ in inputs.testbed.gpus}
    phases = {name: by_type[gpu.name] for name, gpu in replicas}
    order = [p.name for p in next(iter(phases.values()))]
    rows: list[dict] = []
    step_ends: list[float] = []
    t = 0.0
    for it in range(iterations):
        for name in order:
            longest = 0.0
            for worker, gpu in replicas:
                p = next((x for x in phases[worker] if x.name == name), None)
                if p is None:
                    continue
                longest = max(longest, p.seconds)
                row = TimelineRow(
                    worker, gpu.name, Role.COLOCATED.value, p.kind, it, it, t, t + p.seconds, gpus=degree
                )
                if p.kind == "sync" or p.name in ("old log-prob", "reference forward"):
                    row.part = p.name
                rows.append(row.to_json())
            t += longest  # a collective ends every phase
        step_ends.append(t)
    res = SimResult(
        recipe.name,
        {worker: Role.COLOCATED for worker, _ in replicas},
        rows,
        step_ends,
        samples,
        cost.gpu_count,
        warmup,
        trailing,
    )
    measure_rows(res)
    return res


GEN_PHASES = ("generate", "decode", "reward")
"""What a standalone rollout GPU does (its engines stay awake: no sleep, wake or reward wake)."""
TRAIN_PHASES = ("old log-prob", "reference forward", "train", "optimizer steps")
"""What a standalone trainer GPU does (no rollout shares it: no actor onload or offload)."""
SYNC_PHASES = ("weight sync", "driver relay")


@dataclass(frozen=True)
class AsyncIteration:
    """One steady-state iteration of an asynchronous peer at one split."""

    rollout_gpus: int
    gen_s: float
    """A rollout GPU's generation and decode of its share of a batch (and its reward, where
    the reward is scored as generation goes: ``abort``)."""
    train_s: float
    """A trainer GPU's training of its share (FSDP over the trainers)."""
    sync_s: float
    """Weight sync into the rollout engines (and the driver's relay): both sides wait."""
    lost_s: float
    """Generation aborted at the sync and redone (``abort``, when the rollout is busy then)."""
    drain_s: float = 0.0
    """``drain``: the reward of the batch, scored as the drain before the sync reaps it (the
    trainers have finished and wait; UniRL's driver scores at reap time, so scoring overlaps
    nothing)."""
    staleness: int = 1
    """1: generation overlaps training; 0: they alternate (:attr:`PeerRecipe.async_staleness`)."""

    @property
    def seconds(self) -> float:
        if self.staleness == 0:
            return self.gen_s + self.lost_s + self.drain_s + self.train_s + self.sync_s
        return max(self.gen_s + self.lost_s, self.train_s) + self.drain_s + self.sync_s


def async_iteration(recipe: PeerRecipe, inputs: PaperInputs, rollout_gpus: int) -> AsyncIteration:
    """The iteration of ``recipe`` (``async_sync`` set) with ``rollout_gpus`` standalone rollout
    GPUs and the rest training. With staleness 1 (``async_staleness``) the next batch
    generates while this one trains; the weight sync stops both. At the sync the rollout is
    busy when generation is the longer side: ``abort`` loses what its in-flight requests had
    done (on average half of one batch's denoising loop per engine, verl-omni #628: 127 SD3.5
    images discarded per sync). ``drain`` (UniRL's ``AsyncDiffusionTrainer._drain_all``)
    finishes every in-flight generation and scores it before the sync: the trainers, done,
    wait for the generation and then for its reward. With staleness 0 (UniRL's default
    ``buffer_max_staleness``) a batch is launched only after the sync before it, so
    generation, reward and training run one after the other."""
    gpu, count = inputs.testbed.gpus[0]
    samples = inputs.workload.samples
    trainers = count - rollout_gpus
    gen_share = math.ceil(samples / rollout_gpus)
    train_share = math.ceil(samples / trainers)
    gen = peer_phases(recipe, inputs, gpu, 1, gen_share, group=trainers)
    train = peer_phases(recipe, inputs, gpu, 1, train_share, group=trainers)
    drained = ("reward",) if recipe.async_sync == "drain" else ()
    gen_s = sum(p.seconds for p in gen if p.name in GEN_PHASES and p.name not in drained)
    drain_s = sum(p.seconds for p in gen if p.name in drained)
    train_s = sum(p.seconds for p in train if p.name in TRAIN_PHASES)
    sync_s = sum(p.seconds for p in train if p.name in SYNC_PHASES)
    lost = 0.0
    if recipe.async_sync == "abort" and recipe.async_staleness > 0 and gen_s > train_s:
        one_batch = next(
            p.seconds for p in peer_phases(recipe, inputs, gpu, 1, recipe.gen_batch) if p.name == "generate"
        )
        lost = 0.5 * one_batch
    return AsyncIteration(rollout_gpus, gen_s, train_s, sync_s, lost, drain_s, recipe.async_staleness)


def best_async_split(recipe: PeerRecipe, inputs: PaperInputs) -> AsyncIteration:
    """The split of rollout and trainer GPUs at which the peer's iteration is shortest (the peer
    is given its best split, as digen's modes are)."""
    if len(inputs.testbed.gpus) != 1:
        raise ConfigError(f"mode {recipe.name}: an asynchronous peer is modelled on one GPU type only")
    count = inputs.testbed.gpus[0][1]
    if count < 2:
        raise ConfigError(
            f"mode {recipe.name} needs at least 2 GPUs (rollout and trainer); the testbed has {count}"
        )
    return min((async_iteration(recipe, inputs, r) for r in range(1, count)), key=lambda a: a.seconds)


def simulate_async_peer(cost: CostModel, recipe: PeerRecipe, *, iterations: int, warmup: int, trailing: int):
    """``iterations`` steady-state iterations of an asynchronous peer at its best split, laid on
    the timeline (rollout GPUs generate, trainers train, both wait at the sync)."""
    inputs = cost.paper
    assert inputs is not None
    it = best_async_split(recipe, inputs)
    gpu, count = inputs.testbed.gpus[0]
    names = [f"{gpu.name}-{i:04d}" for i in range(count)]
    roles = {n: (Role.ROLLOUT if i < it.rollout_gpus else Role.TRAINER) for i, n in enumerate(names)}
    rows: list[dict] = []
    period = it.seconds
    gen_end = it.gen_s + it.lost_s
    # staleness 1: both sides start at the sync, the drain's scoring after the longer one;
    # staleness 0: generation, its scoring, then training
    drain_at = max(gen_end, it.train_s) if it.staleness else gen_end
    train_at = 0.0 if it.staleness else gen_end + it.drain_s
    for k in range(iterations):
        t0 = k * period
        for n in names:
            if roles[n] is Role.ROLLOUT:
                busy = [("gen", "", 0.0, it.gen_s), ("gen", "aborted", it.gen_s, it.lost_s)]
                busy.append(("reward", "drain", drain_at, it.drain_s))
            else:
                busy = [("train", "", train_at, it.train_s)]
            for kind, part, at, dur in busy:
                if dur > 0:
                    rows.append(_row(n, gpu.name, roles[n], kind, k, t0 + at, t0 + at + dur, part))
            rows.append(
                _row(n, gpu.name, roles[n], "sync", k, t0 + period - it.sync_s, t0 + period, "weight sync")
            )
    res = SimResult(
        recipe.name,
        roles,
        rows,
        [(k + 1) * period for k in range(iterations)],
        cost.samples,
        count,
        warmup,
        trailing,
    )
    measure_rows(res)
    return res


def _row(worker: str, gpu: str, role: Role, kind: str, it: int, start: float, end: float, part: str) -> dict:
    return TimelineRow(worker, gpu, role.value, kind, it, it, start, end, gpus=1, part=part or None).to_json()
