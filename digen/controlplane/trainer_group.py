"""The job's trainer group in Redis: step commands, their commit decision, who holds what.

The trainers of a job (every trainer-role worker; in ``colocated`` mode every worker) own the
optimizer, replicated: each holds the whole AdamW state and applies the same step to the same
summed gradient (:mod:`digen.workers.trainer`). Redis carries only the small messages that
coordinate them; gradients and weights go worker to worker (:mod:`digen.dataplane`).

Keys (``P = digen:<job_id>:``, cleared with the job's other keys)::

    P tg:step            string  JSON of the newest step command (:class:`StepCommand`)
    P tg:step:mark       string  ``<id>@<epoch>/<writer>#<asked_again>`` of that command: what every worker
                                 loop reads each cycle (a member fetches the command when it changes)
    P tg:ok:<step>:<e>   set     members whose reduction of <step> in epoch <e> succeeded
    P tg:decision:<step> string  "commit:<e>" or "abort:<e>": written once (SET NX), so a
                                 step is either applied by every member or by none
    P tg:addr:<e>        string  JSON {host, store, backend}: rank 0's formation for epoch <e>
    P tg:addr:<e>:store:<s>:*    torch.distributed's store of that formation (gloo/NCCL addresses)
    P tg:holders         hash    worker -> JSON {"addr": blob server, "versions": [v, ...],
                                 "state": v or null}: the weight versions a worker serves and
                                 the optimizer state it holds
    P tg:why:<step>      hash    member -> why it aborted the step (a failure of its own)
    P tg:error:<step>    string  JSON {"message", "exit_code"}: the step's writer could not
                                 finish it (its checkpoint did not fit the disk, say)
    P tg:current         string  JSON {"version", "checkpoint", "keep_version"}: the newest
                                 committed version, the newest checkpoint folder and the older
                                 version members keep serving (a trainer that joins a running
                                 job starts from them)

An *epoch* is one membership of the group: the controller bumps it whenever the member list
changes (a trainer joined, left or restarted), and the members form a new torch.distributed
process group for it at the next step. A member is a worker *incarnation* (its name and the
token of its loop, :meth:`~digen.controlplane.jobstate.JobState.incarnations`): a trainer
restarted under its old name is a new member, which acts only on commands that name its
incarnation, never on one issued before it joined.

Commit protocol of one step (why: a member can die half-way through a collective, leaving the
others with different sums; the step must then be applied by all or none): each member
reduces, then adds itself to ``ok``; rank 0 writes ``commit`` once every member is in ``ok``;
the controller writes ``abort`` if a member leaves before that (whoever writes first wins).
Every member then applies the step (commit) or drops its sums (abort: the controller releases
the step's train tasks again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from digen.controlplane.jsonkeys import JsonKeys, Rendezvous
from digen.controlplane.messages import Message, TaskBlob
from digen.core.events import Role
from digen.errors import PayloadError

COMMIT, ABORT = "commit", "abort"


def holds_optimizer(role: Role, mode: str, fsdp: bool) -> bool:
    """The membership rule: whether a worker of ``role`` holds a share of the replicated
    optimizer (a member of the trainer group) in schedule mode ``mode``. Trainers do; in
    ``colocated`` mode every worker but a reward worker does; with ``train.fsdp`` none does
    (the FSDP ranks hold the shards: :mod:`digen.controlplane.fsdp_keys`). The controller
    (:meth:`digen.runtime.membership.Membership.members`) and the worker loops
    (:func:`digen.workers.loop.worker_loop`) both ask this one rule."""
    if fsdp or role is Role.REWARD:
        return False
    return role in (Role.TRAINER, Role.COLOCATED) or mode == "colocated"


@dataclass
class StepCommand(Message):
    """What the controller asks the trainer group to do for one optimizer step. Written as JSON
    by the controller (:meth:`dumps`) and read back checked by every member (:meth:`loads`,
    the exact reading of every message: :mod:`digen.controlplane.messages`): ``tg:step`` is in
    Redis, so its bytes are untrusted."""

    id: str
    """The step's task id (``step:<iteration>``, or ``step:<iteration>:<mini-batch>`` with
    ``train.mini_batches`` > 1); the writer acknowledges it in the queue."""
    iteration: int
    epoch: int
    members: list[str]
    """Sorted worker names; rank = position; rank 0 is the rendezvous and decides commits."""
    version: int
    """The version every member must hold before the step (it becomes ``version + 1``)."""
    rows: int
    """Trained (sample, step) rows summed in the gradient: the mean's divisor."""
    held: dict[str, list[str]] = field(default_factory=dict)
    """allreduce: member -> the train tasks in its running sum (checked before reducing)."""
    blobs: list[TaskBlob] = field(default_factory=list)
    """The train tasks whose gradients are kept as blobs, and where each is: every task's with
    ``train.reduce: exact`` (then in (group, part) order), else those of non-members (RAT)."""
    exact: bool = False
    writer: str = ""
    """The member that writes the checkpoint (if any) and acknowledges the step."""
    checkpoint: str | None = None
    """Folder of the checkpoint to write after the step (None: no checkpoint this step)."""
    keep_checkpoints: int = 2
    mini_batch: int = 0
    last_of_iteration: bool = True
    """This step ends its iteration's mini-batches (an algorithm's state moves after it)."""
    keep_version: int | None = None
    """Staleness 1: the version the iteration generated with (``mini_batches x iteration``),
    which the next iteration's rollouts may still use: members keep serving it, and a
    checkpoint holds it (``previous_weights.safetensors``)."""
    serve_from: int | None = None
    """Members keep serving every version from this one on (an evaluation still to run needs it)."""
    restore: str | None = None
    """The newest checkpoint folder, for a member that must start from it when no member holds
    the state (every trainer restarted): used only if its version is ``version``."""
    incarnations: dict[str, str] = field(default_factory=dict)
    """member -> its incarnation (the token of its loop) when the command was issued."""
    asked_again: int = 0
    """How many times the controller asked again for the step's acknowledgement because the
    one stored did not read (junk, quarantined): part of the :attr:`mark`, so the members see
    the command anew, and the writer, which applied the step already, acknowledges it again
    without stepping twice (:meth:`digen.workers.trainer.Member.run_step`)."""

    def names(self, worker: str, incarnation: str) -> bool:
        """Whether this command asks ``worker``'s incarnation ``incarnation`` to take part: a
        restarted worker, with its predecessor's name, is not asked by an older command."""
        return worker in self.members and self.incarnations.get(worker, incarnation) == incarnation

    def tasks(self) -> list[str]:
        """Every train task whose gradient the step sums (in members' sums and in blobs)."""
        return sorted({t for ts in self.held.values() for t in ts} | {b.task for b in self.blobs})

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def loads(cls, raw: bytes | str) -> StepCommand:
        """The command in ``raw``; :class:`PayloadError` naming the fault when it is not one
        (not JSON, not a map, a key unknown, missing or of the wrong kind, a ``held`` task or
        writer that is not a member)."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise PayloadError(f"a step command that is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise PayloadError(f"a step command is a map, got {type(data).__name__}")
        cmd = cls.read(data)
        strangers = (set(cmd.held) | ({cmd.writer} - {""})) - set(cmd.members)
        if strangers:
            raise PayloadError(f"a step command names workers that are not its members: {sorted(strangers)}")
        return cmd

    def rank(self, worker: str) -> int:
        return self.members.index(worker)

    @property
    def mark(self) -> str:
        """What identifies this command to a member: a new id, epoch or writer is new work, and
        so is the controller's asking again for its acknowledgement (``#<asked_again>``)."""
        return f"{self.id}@{self.epoch}/{self.writer}#{self.asked_again}"


class TrainerGroup(JsonKeys):
    """The trainer group's keys of one job (JSON values only; see the module docstring)."""

    def __init__(self, redis_client, job_id: str):
        super().__init__(redis_client, job_id, "tg")

    # --- steps ----------------------------------------------------------------------------
    def set_step(self, cmd: StepCommand) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.p + "step", cmd.dumps())
        pipe.set(self.p + "step:mark", cmd.mark)
        pipe.execute()

    def step(self) -> StepCommand | None:
        """The newest step command (None: none written); :class:`PayloadError` when what is
        there does not read as one."""
        raw = self.r.get(self.p + "step")
        return None if raw is None else StepCommand.loads(raw)

    def step_key(self) -> str:
        return self.p + "step"

    def report_ok(self, step: str, epoch: int, worker: str) -> None:
        self.r.sadd(self.p + f"ok:{step}:{epoch}", worker)

    def oks(self, step: str, epoch: int) -> set[str]:
        return {x.decode() for x in self.r.smembers(self.p + f"ok:{step}:{epoch}")}

    def decide(self, step: str, what: str, epoch: int) -> str:
        """Write the step's decision unless one is written; returns the one in force."""
        self.r.set(self.p + f"decision:{step}", f"{what}:{epoch}", nx=True)
        return self.decision(step) or f"{what}:{epoch}"

    def abort(self, step: str, epoch: int, worker: str, why: str) -> str:
        """A member could not take part in the step: record why, and decide abort (unless
        decided); returns the decision in force."""
        self.r.hset(self.p + f"why:{step}", worker, why)
        return self.decide(step, ABORT, epoch)

    def abort_reasons(self, step: str) -> dict[str, str]:
        """member -> why it aborted the step (the latest reason of each)."""
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.p + f"why:{step}").items()}

    def decision(self, step: str) -> str | None:
        raw = self.r.get(self.p + f"decision:{step}")
        return None if raw is None else raw.decode()

    def fail_step(self, step: str, message: str, exit_code: int) -> None:
        self.set_json(f"error:{step}", {"message": message, "exit_code": exit_code})

    def step_error(self, step: str) -> dict | None:
        return self.get_json(f"error:{step}")

    def forget_step(self, step: str) -> None:
        """Drop a step's decision and ok sets (before the controller asks for it again)."""
        keys = [
            self.p + f"decision:{step}",
            self.p + f"why:{step}",
            *self.r.scan_iter(match=self.p + f"ok:{step}:*", count=1000),
        ]
        self.r.delete(*keys)

    def set_current(self, version: int, checkpoint: str | None, keep_version: int | None) -> None:
        self.set_json("current", {"version": version, "checkpoint": checkpoint, "keep_version": keep_version})

    def current(self) -> dict | None:
        return self.get_json("current")

    # --- rendezvous -----------------------------------------------------------------------
    def rendezvous(self, epoch: int) -> Rendezvous:
        return Rendezvous(self, f"addr:{epoch}", "the trainer rendezvous")

    # --- what each member holds -------------------------------------------------------------
    def set_holding(
        self,
        worker: str,
        addr: str,
        versions: list[int],
        state: int | None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """``worker`` serves weight ``versions`` (whole, or with ``shard`` = (rank, world) its
        FSDP rank's dim-0 shard of each tensor) and holds the optimizer state of ``state``."""
        entry: dict = {"addr": addr, "versions": versions, "state": state}
        if shard is not None:
            entry["shard"] = list(shard)
        self.r.hset(self.p + "holders", worker, json.dumps(entry))

    def drop_holding(self, worker: str) -> None:
        self.r.hdel(self.p + "holders", worker)

    def holdings(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.r.hgetall(self.p + "holders").items()}

    def why_unserved(self, version: int) -> str | None:
        """Why no trainer will serve weights ``version`` (None: one does, or may soon): the
        members serve the versions from the oldest a generation may still load to the newest
        committed one, and only one step (the next version) is ever in flight. A version
        below every member's oldest was dropped for good; one beyond the newest plus one is
        no version the job makes next (a task that names it was not written by this job's
        controller). With no member serving anything yet (the trainers are loading), None."""
        served: set[int] = set()
        for h in self.holdings().values():
            versions = h.get("versions") if isinstance(h, dict) else None
            if isinstance(versions, list):
                served.update(v for v in versions if isinstance(v, int) and not isinstance(v, bool))
        if not served or version in served:
            return None
        oldest, newest = min(served), max(served)
        if version < oldest:
            return f"no trainer serves it any more (they serve versions {oldest} to {newest})"
        if version > newest + 1:
            return f"no step makes it next (the trainers serve versions {oldest} to {newest})"
        return None

    def holders_of(self, version: int) -> list[str]:
        """Blob server addresses of the workers that serve weights ``version`` whole (sorted by worker)."""
        return [
            h["addr"]
            for _, h in sorted(self.holdings().items())
            if version in h["versions"] and "shard" not in h
        ]

    def shard_holders(self, version: int) -> list[str] | None:
        """The blob server of each FSDP rank serving its shard of ``version``, in rank order;
        None unless every rank of the group serves it."""
        ranks: dict[int, str] = {}
        world = None
        for h in self.holdings().values():
            if version in h["versions"] and "shard" in h:
                ranks[h["shard"][0]] = h["addr"]
                world = h["shard"][1]
        if world is None or len(ranks) != world:
            return None
        return [ranks[r] for r in range(world)]

    def state_holders(self, version: int) -> list[tuple[str, str]]:
        """(worker, blob address) of the members whose optimizer state is at ``version``."""
        return [(w, h["addr"]) for w, h in sorted(self.holdings().items()) if h.get("state") == version]
