"""A trainer's share of the optimizer: its running gradient sum, its replica of AdamW, the
versions it serves, and its part in each optimizer step.

Every member of the job's trainer group (:mod:`digen.controlplane.trainer_group`: the trainer
workers; every worker in ``colocated`` mode) holds the whole optimizer state, replicated. Why
replicated rather than sharded (ZeRO-1): a member that dies takes nothing with it but the
gradients it had not reduced yet (any survivor holds the whole state, and a newcomer copies it
from one), there is no collective after the step (each member applies the same update to the
same sum), and at the sizes LoRA trains (a FLUX r64 adapter is 684 MiB in float32; AdamW
three times that) a replica fits every GPU. A model whose full fine-tune does not fit one
device is trained with ``train.fsdp`` (:mod:`digen.workers.fsdp_loop`), which shards instead.

Between steps a member trains tasks like any worker and adds each gradient whose
acknowledgement won into its running sum (:class:`~digen.dataplane.reduce.TaskSum`). At a step
command (:meth:`Member.run_step`) it:

1. makes sure it holds the state the step starts from (a newcomer or a restarted member copies
   it from a member that does, else loads the newest checkpoint if that is the same version);
2. sums the gradients: ``allreduce`` (its running sum, plus, on rank 0, the gradients rollout
   workers computed under RAT, fetched from them; then a ring all-reduce over the epoch's
   process group) or ``exact`` (every task's gradient fetched and folded in (group, part)
   order);
3. reports success and waits for the step's decision (commit once every member succeeded;
   abort if any failed or left: then every member drops its sum and the tasks run again);
4. on commit applies AdamW, loads the new weights into its policy, serves the new version as a
   blob ``weights:<v>`` in the dtype of the trained tensors (and keeps serving the version the command
   names ``keep_version``, which a staleness-1 rollout may still need: the one the iteration
   generated with, ``mini_batches`` steps back), and, if it is the step's writer, writes the
   checkpoint and acknowledges the step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from digen.assembly import trained_dtype
from digen.controlplane.messages import BlobRef, StepAck
from digen.controlplane.trainer_group import ABORT, COMMIT, StepCommand
from digen.core import blobnames
from digen.core.events import Role, TaskRef
from digen.dataplane.blobs import BlobLost, BlobStore, Expect, fetch
from digen.dataplane.reduce import TaskSum, all_reduce_sum, flatten, ordered_sum, unflatten
from digen.dataplane.wire import host_copy, on_host
from digen.errors import DigenError
from digen.evaluation import carries_ema
from digen.optim import ParameterStore, stage_checkpoint
from digen.parallel.comm import comm_device, trainer_backend
from digen.testing import faults
from digen.workers.context import POLL_S, WorkerContext, event, join_group

log = logging.getLogger(__name__)


class StateLost(RuntimeError):
    """No member holds the optimizer state a step starts from, and no checkpoint has it."""


def serve_state(blobs: BlobStore, name: str, store: ParameterStore) -> None:
    """Offer ``store``'s state as blob ``name``, for a newcomer to copy: a snapshot taken when
    one first asks (:meth:`~digen.optim.ParameterStore.state_copy`), hashed over that snapshot,
    never the store's own tensors, which the next step rewrites in place (a newcomer would copy
    half a step labelled as the old version). Asked after the store stepped, it is refused as
    missing: the newcomer tries another holder or the next version. Why not a copy at every
    step: every member would hold a second state (2 GiB for a FLUX LoRA r64) that almost no
    one fetches."""
    version = store.version
    _, _, state = store.state_parts()

    def snapshot() -> dict[str, torch.Tensor]:
        taken = store.state_copy(version, host_copy)
        if taken is None:
            raise BlobLost(f"the state of version {version} is gone: this store holds {store.version}")
        return taken

    blobs.put_snapshot(name, snapshot, {"state": json.dumps(state)})


def serve_weights(
    blobs: BlobStore,
    job: str,
    versions: dict[int, Callable[[], dict[str, torch.Tensor]]],
    keep_from: int | None = None,
) -> None:
    """Serve each of ``versions`` (version -> how to make what it serves: a host copy) as blob
    ``weights:<v>``, and drop the state blobs and the weight blobs of other versions (those
    from ``keep_from`` on stay). A version already served is left as it is: its blob is made
    once, from one host copy (pinned, on a side stream, cast on the way:
    :func:`~digen.dataplane.wire.host_copy`) and hashed once, when first asked for; every
    rollout's fetch after that sends those same bytes, never a copy from the device."""
    names = blobs.names()
    for held in blobnames.of_job(names, job, blobnames.WEIGHTS):
        if held.version not in versions and (keep_from is None or held.version < keep_from):
            blobs.drop(str(held))
    blobs.drop(*(str(b) for b in blobnames.of_job(names, job, blobnames.STATE)))
    for ver, make in versions.items():
        if blobs.get(blobnames.weights(job, ver)) is None:
            blobs.put(blobnames.weights(job, ver), make(), {"version": str(ver)})


@dataclass
class Member:
    """One worker's share of the trainer group (see the module docstring)."""

    ctx: WorkerContext
    store: ParameterStore
    kept: tuple[int, dict[str, torch.Tensor]] | None = None
    """(version, weights) of an older version served while a staleness-1 rollout may still
    need it (the one the current iteration generated with)."""
    sums: TaskSum = field(default_factory=TaskSum)
    applied: dict[str, StepAck] = field(default_factory=dict)
    """Steps this member applied: id -> its acknowledgement (sent by the writer)."""
    handled: set[str] = field(default_factory=set)
    """The marks (:attr:`~digen.controlplane.trainer_group.StepCommand.mark`: step id, epoch,
    writer, times asked again) of the step commands already acted on."""
    pg_epoch: int | None = None
    """The epoch whose process group this member belongs to (None: none formed)."""
    backend: str = "gloo"
    """The backend of that group (``nccl`` or ``gloo``)."""

    # --- set-up -------------------------------------------------------------------------
    @staticmethod
    def start(ctx: WorkerContext) -> Member:
        """The member of a starting worker, holding the job's current state: version 0 from its
        own (seeded) build at the start of a job; the checkpoint a resumed job starts from; or,
        joining a running job (a new trainer, a restarted one), the newest version copied from
        a member that holds it (else from the newest checkpoint, if that is the same version),
        so that its train tasks never wait for a version only a dead trainer held."""
        cfg = ctx.cfg
        store = ParameterStore(ctx.ensure_policy().trainable_state_dict(), cfg.train, device=ctx.device)
        member = Member(ctx, store)
        current = ctx.trainer_group.current()
        if current is not None and current["version"] != store.version:
            member.ensure_state(current["version"], current.get("checkpoint"), current.get("keep_version"))
        member.load_policy()
        member.serve()
        return member

    def ema_version(self) -> bool:
        """Whether the store's version is served and loaded with its EMA (it is evaluated
        with it: :func:`~digen.evaluation.carries_ema`)."""
        return carries_ema(self.ctx.cfg, self.store.version)

    def load_policy(self) -> None:
        """The store's version into the worker's policy, copied from the live tensors in place
        (:meth:`~digen.optim.ParameterStore.load_into`: no clone of the model on the device)."""
        self.store.load_into(self.ctx.ensure_policy(), ema=self.ema_version())
        self.ctx.version = self.store.version

    def serve(self, keep_from: int | None = None) -> None:
        """Offer the store's version (and the kept older one) as weight blobs in the dtype the
        policy holds its trained tensors in (:func:`~digen.assembly.trained_dtype`: the bits
        this trainer computes with, so a rollout that loads them computes with the same), and
        the state as a blob a newcomer copies; tell Redis."""
        ctx, v = self.ctx, self.store.version
        dtype = trained_dtype(ctx.cfg)
        ema = self.ema_version()  # evaluated with its EMA: served with it
        versions = {v: lambda: self.store.weights_copy(lambda w: host_copy(w, dtype), ema=ema)}
        if self.kept is not None:
            kept = self.kept[1]
            versions[self.kept[0]] = lambda: on_host(kept, dtype)  # a copy already: nothing rewrites it
        job = ctx.job.job_id
        serve_weights(ctx.blobs, job, versions, keep_from)
        serve_state(ctx.blobs, blobnames.state(job, v), self.store)
        served = blobnames.versions(ctx.blobs.names(), job)
        ctx.trainer_group.set_holding(ctx.name, ctx.blob_addr, served, v)

    # --- between steps ----------------------------------------------------------------------
    def add(self, task_id: str, grads: dict[str, torch.Tensor]) -> None:
        """Count a train task this member ran and whose acknowledgement won (a gradient not
        shaped as the trained tensors is refused: :class:`~digen.dataplane.reduce.GradientMismatch`)."""
        self.sums.like = self.store.params
        self.sums.add(task_id, grads)

    # --- a step -----------------------------------------------------------------------------
    def run_step(self, cmd: StepCommand) -> None:
        """Take part in step ``cmd`` (see the module docstring); returns once it is applied
        (or finished, as its writer) or aborted."""
        ctx, me = self.ctx, self.ctx.name
        if not cmd.names(me, ctx.incarnation) or cmd.mark in self.handled:
            return  # not asked of this incarnation (a restarted worker: its predecessor was)
        self.handled.add(cmd.mark)
        # applied already: a new writer finishes it, or the writer acknowledges it again (the
        # controller asks again when the acknowledgement stored did not read); never twice
        if cmd.id in self.applied:
            if cmd.writer == me:
                self.finish(cmd, self.applied[cmd.id])
            return
        if (decided := ctx.trainer_group.decision(cmd.id)) is not None and decided != f"{COMMIT}:{cmd.epoch}":
            log.info("%s: step %s (epoch %d) was aborted before it took part", me, cmd.id, cmd.epoch)
            self.sums.clear()
            return
        t0 = time.time()
        try:
            self.ensure_state(cmd.version, cmd.restore, cmd.keep_version)
            grad = self.reduce(cmd)
            kept = self._keep(cmd.keep_version)
        except Exception as exc:  # a peer died mid-collective, a blob was lost, a check failed
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            decided = ctx.trainer_group.abort(cmd.id, cmd.epoch, me, why)
            if decided == f"{ABORT}:{cmd.epoch}":
                log.warning("%s: step %s (epoch %d) aborted: %s", me, cmd.id, cmd.epoch, why)
            else:  # decided without it (a commit it missed): nothing was aborted
                log.info(
                    "%s: step %s (epoch %d) was decided (%s) before: %s", me, cmd.id, cmd.epoch, decided, why
                )
            self.leave_group()
            self.sums.clear()
            return
        faults.point("reduced", ctx.job, me, task=cmd.id, iteration=cmd.iteration)
        ctx.trainer_group.report_ok(cmd.id, cmd.epoch, me)
        faults.point("reported", ctx.job, me, task=cmd.id, iteration=cmd.iteration)
        if self.await_decision(cmd) != f"{COMMIT}:{cmd.epoch}":
            log.info("%s: step %s (epoch %d) aborted; its tasks run again", me, cmd.id, cmd.epoch)
            self.sums.clear()
            return
        t1 = time.time()
        opt = self.store.step(grad, cmd.rows, last_of_iteration=cmd.last_of_iteration)
        t2 = time.time()
        self.kept = kept
        self.sums.clear()
        self.load_policy()
        self.serve(cmd.serve_from)
        t3 = time.time()
        ref = TaskRef.parse(f"train:{cmd.iteration}:0")
        optim = event(ctx, Role.TRAINER, "optim", ref, cmd.version, t0, t2)
        optim.set(reduce_s=t1 - t0, step_s=t2 - t1, task=cmd.id)
        events = [optim, event(ctx, Role.TRAINER, "sync", ref, self.store.version, t2, t3)]
        ack = StepAck(
            worker=me,
            start=t0,
            end=t3,
            events=events,
            grad_norm=float(opt["grad_norm"]),
            version=self.store.version,
        )
        self.applied = {cmd.id: ack}
        if cmd.writer == me:
            self.finish(cmd, self.applied[cmd.id])

    def finish(self, cmd: StepCommand, result: StepAck) -> None:
        """As the step's writer: stage its checkpoint (if asked: the controller puts it in
        place once the iteration's metrics row is written), then acknowledge it."""
        t0 = time.time()
        ctx = self.ctx
        if cmd.checkpoint is not None:
            try:
                faults.point("checkpoint", ctx.job, ctx.name, task=cmd.id, iteration=cmd.iteration)
                stage_checkpoint(Path(cmd.checkpoint), self.store, cmd.iteration, self.kept)
            except Exception as exc:  # a full disk, say: the job ends naming it (a retry would not fit)
                what = str(exc) if isinstance(exc, DigenError) else f"{type(exc).__name__}: {exc}"
                log.error("%s could not write the checkpoint of step %s: %s", ctx.name, cmd.id, what)
                message = f"the checkpoint of iteration {cmd.iteration} could not be written: {what}"
                ctx.trainer_group.fail_step(cmd.id, message, getattr(exc, "exit_code", 1))
                return
        done = replace(result, worker=ctx.name, start=t0, end=time.time(), checkpoint=cmd.checkpoint)
        if not ctx.queue.ack(cmd.id, done.to_json(), worker=ctx.name):
            log.info("step %s was already acknowledged", cmd.id)

    def ensure_state(self, version: int, restore: str | None, keep_version: int | None) -> None:
        """Hold the optimizer state of ``version``: copied from a member that holds it, else
        loaded from the checkpoint folder ``restore`` if that is the same version, else
        :class:`StateLost`. With ``keep_version`` that older version comes too (it is served
        to staleness-1 rollouts): from a peer that serves it, or the checkpoint's
        ``previous_weights``."""
        if self.store.version == version:
            return
        ctx = self.ctx
        tried = []
        for worker, addr in ctx.trainer_group.state_holders(version):
            if worker == ctx.name:
                continue
            try:
                tensors, meta = fetch(addr, blobnames.state(ctx.job.job_id, version))
            except BlobLost as exc:
                tried.append(str(exc))
                continue
            weights = {k[2:]: t for k, t in tensors.items() if k.startswith("w/")}
            opt = {k[2:]: t for k, t in tensors.items() if k.startswith("o/")}
            self.store = ParameterStore.restore(
                weights, opt, json.loads(meta["state"]), ctx.cfg.train, ctx.device
            )
            self.kept = self._keep(keep_version)
            log.info("%s copied the optimizer state of version %d from %s", ctx.name, version, worker)
            self.load_policy()
            faults.point("sync", ctx.job, ctx.name, task=f"state:{version}", iteration=version)
            return
        if restore is not None and (Path(restore) / "state.json").exists():
            folder = Path(restore)
            store, state = ParameterStore.load(folder, ctx.cfg.train, device=ctx.device)
            if store.version == version:
                prev = folder / "previous_weights.safetensors"
                self.store = store
                # a checkpoint without previous_version holds the version before (one step an iteration)
                held = int(state.get("previous_version", version - 1))
                self.kept = None
                if keep_version is not None and keep_version == held and prev.exists():
                    self.kept = (held, load_file(str(prev)))
                log.info("%s loaded the optimizer state of version %d from %s", ctx.name, version, folder)
                self.load_policy()
                return
            tried.append(f"checkpoint {folder} holds version {store.version}")
        raise StateLost(
            f"no trainer holds the optimizer state of version {version} and no checkpoint has it "
            f"({'; '.join(tried) or 'no holder'}); every trainer that held it is gone: rerun with --resume"
        )

    def _keep(self, version: int | None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, weights) of the older version to keep serving: the store's own (a step
        that starts from it), the one kept already, or a copy from a peer that serves it
        (None if none does: its rollouts fetch it from whoever still has it). The weights are
        in host memory, float32, owned: :meth:`serve` offers them with no further copy but a
        cast, and a checkpoint writes them as its previous version; nothing of them is kept
        on the device (a full fine-tune would hold the model twice there)."""
        if version is None:
            return None
        if self.store.version == version:  # a host copy: it is only served and checkpointed
            return version, self.store.weights_copy(host_copy, ema=self.ema_version())
        if self.kept is not None and self.kept[0] == version:
            return self.kept
        for addr in self.ctx.trainer_group.holders_of(version):
            if addr == self.ctx.blob_addr:
                continue
            try:
                got, _ = fetch(
                    addr, blobnames.weights(self.ctx.job.job_id, version), expect=Expect(version=version)
                )
                return version, {k: t.float() for k, t in got.items()}
            except BlobLost:
                continue
        return None

    def reduce(self, cmd: StepCommand) -> dict[str, torch.Tensor]:
        """The step's summed gradient (see the module docstring)."""
        ctx = self.ctx
        if cmd.exact:
            return ordered_sum((self._blob(b.blob) for b in cmd.blobs), like=self.store.params)
        held = sorted(cmd.held.get(ctx.name, []))
        if sorted(self.sums.tasks) != held:
            raise RuntimeError(
                f"{ctx.name} holds the gradients of {sorted(self.sums.tasks)}, the step counts {held}"
            )
        if cmd.rank(ctx.name) == 0:  # gradients of non-members (RAT), added once
            self.sums.like = self.store.params
            for b in cmd.blobs:
                self.sums.add(b.task, self._blob(b.blob))
        world = len(cmd.members)
        names, like = self.store.names, self.store.params
        if world == 1:
            if self.sums.total is None:
                raise RuntimeError(f"step {cmd.id}: no gradient to step on")
            return self.sums.total
        if self.sums.flat is None:  # no task this step: it adds zeros
            self.sums.flat = flatten(None, names, like)
            self.sums.total = unflatten(self.sums.flat, names, like)
        self.join_group(cmd)
        flat = self.sums.flat.to(self._comm_device())
        faults.point("reduce", ctx.job, ctx.name, task=cmd.id, iteration=cmd.iteration)
        all_reduce_sum(flat)
        return unflatten(flat.to(self.ctx.device), names, like)

    def _blob(self, ref: BlobRef) -> dict[str, torch.Tensor]:
        """A gradient kept as a blob, checked against the digest its task's result published."""
        if ref.addr == self.ctx.blob_addr:
            own = self.ctx.blobs.get(ref.name)
            if own is None or (ref.digest and own.digest != ref.digest):
                raise BlobLost(f"{ref.name}: this worker no longer holds it")
            return own.tensors
        return fetch(ref.addr, ref.name, expect=Expect(digest=ref.digest or None))[0]

    def _comm_device(self) -> torch.device:
        """Where the all-reduce's buffer lives: the rank's GPU for NCCL, the host for gloo (on
        CPU, or a group whose members share a GPU: :func:`~digen.parallel.comm.trainer_backend`)."""
        return comm_device(self.backend, torch.device(self.ctx.device))

    def join_group(self, cmd: StepCommand) -> None:
        """Be in the process group of the command's epoch (formed anew when it changed)."""
        if self.pg_epoch == cmd.epoch and dist.is_initialized():
            return
        self.leave_group()
        ctx = self.ctx
        device = torch.device(ctx.device)

        # a rank that waits for rank 0's address gives up once the step is decided: rank 0
        # found it aborted before it took part (another member's failure, the controller) and
        # will never publish this epoch's address; waiting on would miss every later command
        def decided() -> str | None:
            d = ctx.trainer_group.decision(cmd.id)
            return None if d is None else f"step {cmd.id} was decided ({d})"

        addr = join_group(
            ctx,
            replace(ctx.trainer_group.rendezvous(cmd.epoch), gone=decided),
            cmd.rank(ctx.name),
            len(cmd.members),
            device,
            backend=trainer_backend(device),
        )
        if addr is None:
            why = decided() or "the job stopped"
            raise RuntimeError(f"no trainer group formed for epoch {cmd.epoch}: {why} during the rendezvous")
        self.pg_epoch = cmd.epoch
        self.backend = addr["backend"]  # the leader's choice
        log.info(
            "%s is rank %d of %d of the trainer group (epoch %d, %s)",
            ctx.name,
            cmd.rank(ctx.name),
            len(cmd.members),
            cmd.epoch,
            self.backend,
        )

    def leave_group(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a broken group is torn down anyway
                log.debug("destroying the trainer process group: %s", exc)
        self.pg_epoch = None

    def await_decision(self, cmd: StepCommand) -> str:
        """The step's decision; rank 0 commits it once every member reported success."""
        ctx = self.ctx
        while True:
            decided = ctx.trainer_group.decision(cmd.id)
            if decided is not None:
                return decided
            if cmd.rank(ctx.name) == 0 and ctx.trainer_group.oks(cmd.id, cmd.epoch) >= set(cmd.members):
                return ctx.trainer_group.decide(cmd.id, COMMIT, cmd.epoch)
            if ctx.job.status() != "running":
                return ctx.trainer_group.decide(cmd.id, ABORT, cmd.epoch)
            time.sleep(POLL_S / 10)
