"""One iteration's bookkeeping, shared by the reference trainer and the controller.

:class:`IterationBook` receives group rewards as groups finish generating, says which groups
can train (GAP: a group's advantages need only its own rewards; with ``train.global_std`` they
need the whole batch, and with ``train.mini_batch_split: samples`` the shuffle does, so
nothing trains before the last group is scored), builds each group's
train-task spec (advantages, trained steps per sample), collects task gradients (in the
reference loop; the distributed trainers keep theirs) and, once every group of a mini-batch is
in, sums them in (group, part) order (one mini-batch per optimizer step: ``train.mini_batches``;
whole groups, :func:`digen.core.scheduler.mini_batch_of`, or with ``train.mini_batch_split:
samples`` a seeded shuffle of the samples, :meth:`IterationBook.sample_split`, where a train
task's ``part`` is its mini-batch) and produces the iteration's metrics.
:func:`finish_iteration` records an iteration's end the same way in every mode.

No torch here: the controller imports this module and holds no tensor. Rewards are plain
floats (float32 values, as the rewards a worker computes), advantages come from
:func:`digen.core.advantages.group_advantages` and the metrics are float64 sums of them; the
reference loop books its iterations with the same code, so every mode computes the same
advantages and specs. Only :meth:`IterationBook.gradient`, the reference loop's gradient sum,
touches tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from digen.config import Config
from digen.core.advantages import float32, gdpo_advantages, group_advantages, per_reward_advantages
from digen.core.scheduler import mini_batch_of, task_groups
from digen.errors import RewardError
from digen.rundir import RunDir
from digen.seeding import permutation
from digen.task_records import GroupTask, TrainSpec, TrainStats
from digen.viz import GridRow, write_sample_grid

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict], None]
"""Called with each iteration's metrics row (and start/eval notices) as a run goes."""


def progress_line(m: dict, total: int) -> str:
    """One iteration's progress as a log line, from its metrics row ``m``: what ``digen
    train`` writes to ``RUN_DIR/digen.log`` and ``digen serve`` to the job's log, in every
    mode; an announcement (``{"event": ...}``) as ``event: key=value, ...``, a resume as
    ``resumed from iteration N/TOTAL (checkpoint PATH)`` (N iterations done, as the bar counts)."""
    if m.get("event") == "resumed":
        return f"resumed from iteration {int(m['iteration']) + 1}/{total} (checkpoint {m.get('checkpoint')})"
    if "event" in m or "iteration" not in m:
        return f"{m.get('event', 'event')}: " + ", ".join(f"{k}={v}" for k, v in m.items() if k != "event")
    return (
        f"iteration {int(m['iteration']) + 1}/{total}  reward {m.get('reward_mean', float('nan')):.4f} "
        f"± {m.get('reward_std', float('nan')):.4f}  loss {m.get('loss', float('nan')):.3g}  "
        f"{m.get('samples_per_s', 0.0):.1f} samples/s  bubble {m.get('bubble_ratio', 0.0):.2f}"
    )


def within_iteration(book: IterationBook) -> dict:
    """Where iteration ``book.iteration`` stands, for the progress display: ``{"event":
    "progress", "iteration", "generated", "trained", "samples"}``, the samples generated and
    scored so far, those whose train task has counted, and the iteration's sample count.

    A train task counts its groups' trained samples (``train.groups_per_task``), a half or a
    mini-batch part its share of them: the parts of a group are the tasks released for it (the
    distributed controller opens each released task's stats), or ``train.mini_batches`` with
    ``train.mini_batch_split: samples``."""
    total = sum(len(t.sample_ids) for t in book.groups)
    generated = sum(len(v) for v in book.rewards.values())
    trained = 0.0
    for (g, _), st in book.stats.items():
        if st.rows <= 0:
            continue
        parts = book.cfg.train.mini_batches if book.by_samples else sum(1 for h, _ in book.stats if h == g)
        for h in book.task_groups(g):
            if h in book.specs:
                trained += len(book.specs[h].samples) / max(parts, 1)
    return {
        "event": "progress",
        "iteration": book.iteration,
        "generated": generated,
        "trained": min(round(trained), total),
        "samples": total,
    }


@dataclass
class IterationBook:
    cfg: Config
    iteration: int
    groups: list[GroupTask]
    rewards: dict[int, list[float]] = field(default_factory=dict)
    """Per scored group, its samples' rewards (float32 values; NaN or inf: dropped)."""
    grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    """Per train task, keyed (group, part): part 0 or 1 for a group trained as two halves,
    0 for a whole group; summed in key order."""
    stats: dict[tuple[int, int], TrainStats] = field(default_factory=dict)
    specs: dict[int, TrainSpec] = field(default_factory=dict)
    """Released groups' train specs (a group is released once its spec is built)."""
    reward_parts: dict[int, list[list[float]]] = field(default_factory=dict)
    """Per scored group, each sample's score of each of the config's rewards (float32 values,
    ``[n][K]``): kept only with ``train.multi_reward`` ``per_reward`` or ``gdpo``."""
    _adv: dict[int, list[float]] = field(default_factory=dict)
    zero_std_groups: int = 0
    zero_advantage_dropped: int = 0
    """Samples released groups left out for a zero advantage (``train.zero_advantage: drop``)."""
    _split: dict[tuple[int, int], int] | None = None
    _switched_on: set[tuple[int, int]] | None = None

    @property
    def by_samples(self) -> bool:
        """``train.mini_batch_split: samples``: a train task's ``part`` is its mini-batch."""
        return self.cfg.train.mini_batch_split == "samples"

    # --- generation side -----------------------------------------------------------
    def add_rewards(self, group: int, rewards: Sequence[float], parts: Any = None) -> None:
        """A group's rewards (rounded to float32, as a worker's reward tensor is) and, with
        ``train.multi_reward`` ``per_reward`` or ``gdpo``, ``parts``: each sample's score of each reward
        (``[n][K]``, K the config's reward count), checked here (it came from a worker); a
        group with no finite reward (lost, or dropped) may come without them.

        Raises:
            RewardError: ``parts`` missing or not ``n`` rows of ``K`` numbers.
        """
        if self.cfg.train.multi_reward != "sum":
            self.reward_parts[group] = self._checked_parts(group, rewards, parts)
        self.rewards[group] = float32(rewards)

    def _checked_parts(self, group: int, rewards: Sequence[float], parts: Any) -> list[list[float]]:
        n, k = len(rewards), len(self.cfg.reward)
        if parts is None and not any(math.isfinite(float(r)) for r in rewards):
            return [[float("nan")] * k for _ in range(n)]
        where = f"iteration {self.iteration} group {group}"
        ok = (
            isinstance(parts, list)
            and len(parts) == n
            and all(
                isinstance(row, list)
                and len(row) == k
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in row)
                for row in parts
            )
        )
        if not ok:
            got = "none" if parts is None else f"{type(parts).__name__} {str(parts)[:80]}"
            raise RewardError(
                f"{where}: train.multi_reward is {self.cfg.train.multi_reward}, so the group's result must carry "
                f"reward_parts, {n} rows of {k} per-reward scores; got {got}"
            )
        return [float32(row) for row in parts]

    def trainable_groups(self) -> list[int]:
        """Groups whose train task can be released now and was not yet (in group order)."""
        if not self.cfg.train.group_local_advantages or self.by_samples:  # the batch's std, or the shuffle
            ready = list(range(len(self.groups))) if len(self.rewards) == len(self.groups) else []
        else:
            ready = sorted(self.rewards)
        return [g for g in ready if g not in self.specs]

    def _advantages(self, group: int) -> list[float]:
        """Advantages of a group's samples (NaN where the sample is dropped)."""
        if group in self._adv:
            return self._adv[group]
        t = self.cfg.train
        eps = 1e-8 if t.unbiased_std else t.std_eps
        batch = not t.group_local_advantages
        if batch:  # every group at once: the batch's std (global_std, gdpo)
            rows = [(g, i) for g in sorted(self.rewards) for i in range(len(self.rewards[g]))]
        else:
            rows = [(group, i) for i in range(len(self.rewards[group]))]
        ok = [(g, i) for g, i in rows if math.isfinite(self.rewards[g][i])]
        if t.multi_reward != "sum":  # and every reward's own score (a worker's bytes)
            ok = [(g, i) for g, i in ok if all(math.isfinite(x) for x in self.reward_parts[g][i])]
        adv = {key: float("nan") for key in rows}
        if ok:
            ids = [g for g, _ in ok]
            kw = {"global_std": t.global_std, "eps": eps, "clip": t.adv_clip, "unbiased": t.unbiased_std}
            weights = [spec.weight for spec in self.cfg.reward]
            if t.multi_reward == "per_reward":  # DanceGRPO's: one advantage per reward, weighted and summed
                a = per_reward_advantages([self.reward_parts[g][i] for g, i in ok], ids, weights, **kw)
            elif t.multi_reward == "gdpo":  # Flow-Factory's: per reward in the group, the sum over the batch
                a = gdpo_advantages([self.reward_parts[g][i] for g, i in ok], ids, weights, clip=t.adv_clip)
            else:  # the weighted reward sum, normalised once
                a = group_advantages([self.rewards[g][i] for g, i in ok], ids, **kw)
            adv.update(zip(ok, a.values, strict=True))
            if batch:
                self.zero_std_groups = a.zero_std_groups
            else:
                self.zero_std_groups += a.zero_std_groups
        for g in sorted({g for g, _ in rows}):
            self._adv[g] = [adv[(g, i)] for i in range(len(self.rewards[g]))]
        return self._adv[group]

    def train_spec(self, group: int) -> TrainSpec:
        """The train task of a scored group (marks it released; the same spec every call)."""
        if group in self.specs:
            return self.specs[group]
        adv = self._advantages(group)
        task = self.groups[group]
        keep = [i for i in range(len(adv)) if math.isfinite(adv[i])]
        dropped = len(adv) - len(keep)
        if self.cfg.train.zero_advantage == "drop":  # Flow-GRPO's filter (TrainConfig.zero_advantage)
            back = self._zero_switched_on() if self.by_samples else set()
            trained = [i for i in keep if adv[i] != 0.0 or (group, i) in back]
            self.zero_advantage_dropped += len(keep) - len(trained)
            keep = trained
        if dropped:
            log.warning(
                "iteration %d group %d: %d sample(s) with non-finite reward dropped",
                self.iteration,
                group,
                dropped,
            )
        self.specs[group] = TrainSpec(
            iteration=self.iteration,
            group=group,
            gen_version=task.version,
            samples=keep,
            sample_ids=[task.sample_ids[i] for i in keep],
            advantages=[adv[i] for i in keep],
        )
        return self.specs[group]

    def task_spec(self, group: int, part: int | None) -> TrainSpec:
        """The spec of one train task: the group's, or its half ``part`` (with
        ``train.mini_batch_split: samples``: its samples of mini-batch ``part``)."""
        spec = self.train_spec(group)
        if part is None:
            return spec
        if self.by_samples:
            split = self.sample_split()
            return spec.select(j for j, i in enumerate(spec.samples) if split[(group, i)] == part)
        return spec.half(part)

    def task_groups(self, group: int) -> range:
        """The groups of the train task named by (or holding) ``group``: one, or with
        ``train.groups_per_task`` n > 1 a run of up to n consecutive groups
        (:func:`digen.core.scheduler.task_groups`)."""
        t = self.cfg.train
        return task_groups(group, len(self.groups), t.mini_batches, t.groups_per_task, self.by_samples)

    def task_specs(self, group: int, part: int | None) -> list[TrainSpec]:
        """The specs of train task (``group``, ``part``), one per group it carries, in group
        order (:meth:`task_spec` of each)."""
        return [self.task_spec(g, part) for g in self.task_groups(group)]

    def _zero_switched_on(self) -> set[tuple[int, int]]:
        """``zero_advantage: drop`` with the samples split: the zero-advantage samples switched
        back on, as Flow-GRPO does (scripts/train_sd3.py ``main``: when the kept count does not
        divide its micro-batch count, ``torch.randperm`` over the dropped samples, in batch
        order, picks the ones to keep), here until the count divides ``mini_batches``; the
        draw is the iteration's ``"zero_advantage"`` stream. Needs every group scored."""
        if self._switched_on is None:
            self._switched_on, kept, zero = set(), 0, []
            for g in range(len(self.groups)):
                for i, a in enumerate(self._advantages(g)):
                    if math.isfinite(a):
                        kept += a != 0.0
                        if a == 0.0:
                            zero.append((g, i))
            need = -kept % self.cfg.train.mini_batches
            if need and len(zero) >= need:
                draw = permutation(len(zero), self.cfg.seed, self.iteration, "zero_advantage")
                self._switched_on = {zero[j] for j in draw[:need]}
        return self._switched_on

    def sample_split(self) -> dict[tuple[int, int], int]:
        """``train.mini_batch_split: samples``: (group, sample position) -> mini-batch of every
        trained sample. Flow-GRPO's inner epoch (scripts/train_sd3.py ``main``): the trained
        samples, in batch order, permuted (here by :func:`~digen.seeding.permutation` of the
        iteration's ``"mini_batches"`` stream: the same draw in every mode) and cut into
        ``mini_batches`` consecutive equal parts; a count that does not divide (non-finite
        rewards only) gives the first ``count % M`` parts one sample more. Needs every group
        scored (it releases them all)."""
        if self._split is None:
            rows = [(g, i) for g in range(len(self.groups)) for i in self.train_spec(g).samples]
            order = [rows[j] for j in permutation(len(rows), self.cfg.seed, self.iteration, "mini_batches")]
            m_total = self.cfg.train.mini_batches
            size, extra = divmod(len(order), m_total)
            split: dict[tuple[int, int], int] = {}
            start = 0
            for m in range(m_total):
                end = start + size + (m < extra)
                split.update((key, m) for key in order[start:end])
                start = end
            self._split = split
        return self._split

    # --- training side -------------------------------------------------------------
    def add_gradient(
        self, group: int, grads: dict[str, torch.Tensor], stats: TrainStats, part: int | None = None
    ) -> None:
        key = (group, part or 0)
        self.grads.setdefault(key, grads)
        self.stats.setdefault(key, stats)

    def mini_batch(self, group: int) -> int:
        """The mini-batch (optimizer step of the iteration) ``group`` trains in (whole groups)."""
        return mini_batch_of(group, len(self.groups), self.cfg.train.mini_batches)

    def task_mini_batch(self, group: int, part: int | None) -> int:
        """The mini-batch of train task (``group``, ``part``): the group's, or with
        ``train.mini_batch_split: samples`` its part."""
        return (part or 0) if self.by_samples else self.mini_batch(group)

    def trained_rows(self, mini_batch: int | None = None) -> int:
        """The (sample, step) rows one mini-batch's train tasks trained (None: every task
        collected): what its step divides the summed gradient by.

        Raises :class:`RewardError` when no row trained (every reward NaN or inf, or every
        group's task dropped): there is nothing to step on."""
        order = sorted(k for k in self.stats if mini_batch is None or self.task_mini_batch(*k) == mini_batch)
        rows = sum(self.stats[g].rows for g in order)
        where = f"iteration {self.iteration}" + (
            f" mini-batch {mini_batch}" if mini_batch is not None and self.cfg.train.mini_batches > 1 else ""
        )
        if rows == 0 and self.zero_advantage_dropped:
            n = sum(
                1
                for g in range(len(self.groups))
                if mini_batch is None or self.by_samples or self.mini_batch(g) == mini_batch
            )
            raise RewardError(
                f"{where}: every trainable sample has advantage 0 (all {n} groups flat) and "
                f"train.zero_advantage is 'drop', so no row trains; use train.zero_advantage: keep, or more "
                f"samples per group"
            )
        if rows == 0:
            r = self.per_sample_rewards()
            bad = sum(1 for x in r if not math.isfinite(x))
            raise RewardError(
                f"{where}: no sample can be trained ({bad} of {len(r)} rewards are NaN or inf, "
                f"the other groups were dropped); check the reward: it must give each sample a finite score"
            )
        return rows

    def gradient(self, mini_batch: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """Summed gradient (group order, a split group's halves in order) and the number of
        trained rows of one mini-batch's groups (None: every group collected): the reference
        loop's; the distributed trainers sum their own. The one method here that computes with
        tensors: it imports torch's code when called, never in the controller."""
        from digen.training import sum_gradients

        rows = self.trained_rows(mini_batch)
        order = sorted(k for k in self.grads if mini_batch is None or self.task_mini_batch(*k) == mini_batch)
        return sum_gradients([self.grads[g] for g in order]), rows

    def metrics(self) -> dict:
        """The iteration's learning metrics (timing metrics are added by the caller); the
        reward mean and std are float64 over the float32 rewards."""
        r = self.per_sample_rewards()
        rv = [x for x in r if math.isfinite(x)]
        mean = math.fsum(rv) / len(rv) if rv else float("nan")
        total = TrainStats()
        for g in sorted(self.stats):
            total.add(self.stats[g])
        rows = max(total.rows, 1)
        return {
            "iteration": self.iteration,
            "samples": len(rv),
            "dropped_samples": len(r) - len(rv),
            "reward_mean": mean,
            "reward_std": math.sqrt(math.fsum((x - mean) ** 2 for x in rv) / len(rv)) if rv else float("nan"),
            "loss": total.loss / rows,
            "approx_kl": total.approx_kl / rows,
            "clipfrac": total.clipped / rows,
            "kl": total.kl / rows,
            "ratio_max_dev": total.ratio_max_dev,
            "zero_std_ratio": self.zero_std_groups / len(self.groups),
            "zero_advantage_dropped": self.zero_advantage_dropped,
            "trained_rows": total.rows,
            "train_forwards": total.forwards,
            "rewards": [round(x, 7) for x in r],
        }

    def per_sample_rewards(self) -> list[float]:
        return [x for g in sorted(self.rewards) for x in self.rewards[g]]


def busy_seconds(events: list[dict], start: float | None = None, end: float | None = None) -> float:
    """Worker-seconds of non-``sync`` task time within ``[start, end]`` (unbounded when None):
    each event counts by its overlap with the window, whatever iteration it belongs to, so a
    task straddling an iteration boundary (GAP, staleness 1) counts on both sides, as
    :func:`digen.bench.worker_stats` clips it."""
    lo, hi = float("-inf") if start is None else start, float("inf") if end is None else end
    return sum(max(0.0, min(e["end"], hi) - max(e["start"], lo)) for e in events if e["kind"] != "sync")


def cache_metrics(events: list[dict]) -> dict:
    """The prompt-embedding caches' hits and misses that ``events`` report (each worker's on
    its tasks' last events, :meth:`digen.prompt_cache.EmbedCache.report`) and their hit
    rate; empty when no event reports any."""
    hits = sum(int(e.get("embed_hits", 0)) for e in events)
    misses = sum(int(e.get("embed_misses", 0)) for e in events)
    if not hits + misses:
        return {}
    return {
        "embed_cache_hits": hits,
        "embed_cache_misses": misses,
        "embed_cache_hit_rate": hits / (hits + misses),
    }


def timing_metrics(
    events: list[dict], workers: int, wall_s: float, samples: int, window: tuple[float, float] | None = None
) -> dict:
    """``wall_s``, ``samples_per_s`` and the bubble ratio of one iteration's timeline; with
    ``window`` (start, end), busy time is the events' overlap with it (:func:`busy_seconds`)."""
    busy = busy_seconds(events, *(window or (None, None)))
    worker_s = workers * wall_s
    return {
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "busy_s": busy,
        "worker_s": worker_s,
        "bubble_ratio": max(0.0, 1 - busy / worker_s) if worker_s > 0 else 0.0,
    }


def draws_grid(cfg: Config, iteration: int) -> bool:
    """Whether ``samples/iter_NNNN.png`` is drawn for ``iteration`` (``output.sample_grid_every``
    and the last iteration)."""
    every = cfg.output.sample_grid_every
    return bool(every) and (iteration % every == 0 or iteration == cfg.iterations - 1)


def checkpoints(cfg: Config, iteration: int) -> bool:
    """Whether the state after ``iteration``'s step is checkpointed (``output.checkpoint_every``
    and the last iteration)."""
    return (iteration + 1) % cfg.output.checkpoint_every == 0 or iteration == cfg.iterations - 1


@dataclass
class IterationEnd:
    """What the end of one iteration records, whoever ran it (the reference loop, the
    distributed controller, an FSDP group's step)."""

    step_stats: dict
    """The optimizer step's numbers (``grad_norm``)."""
    version: int
    """The policy version after the step."""
    max_staleness: int
    """Largest (iteration - generating version) over the iteration's groups."""
    workers: int
    events: list[dict]
    """Timeline rows of work done in the iteration's window (busy time); with ``window``, those
    of other iterations count by their overlap with it."""
    wall_s: float
    window: tuple[float, float] | None = None
    timeline: list[dict] = field(default_factory=list)
    """The iteration's own timeline rows (``timeline.jsonl``)."""
    grid: list[GridRow] | None = None
    """The sample grid's rows (None: no grid this iteration)."""
    dropped: int = 0
    """Samples scored but never trained (their train task died: ``schedule.on_poison: drop``)."""
    dead_tasks: list[str] = field(default_factory=list)


def finish_iteration(run: RunDir, book: IterationBook, end: IterationEnd) -> dict:
    """Write the iteration's metrics row, timeline rows and sample grid; returns the metrics
    row. The caller then puts the iteration's checkpoint in place (after the row: a run
    resumed from checkpoint k has row k) and tells its progress callback (after the
    checkpoint: a job cancelled from there keeps it)."""
    k = book.iteration
    metrics = book.metrics()
    metrics.update(end.step_stats)
    if end.dead_tasks:
        metrics["dead_tasks"] = sorted(end.dead_tasks)
        metrics["samples"] -= end.dropped
        metrics["dropped_samples"] += end.dropped
    metrics.update(timing_metrics(end.events, end.workers, end.wall_s, metrics["samples"], window=end.window))
    metrics.update(cache_metrics(end.timeline))
    metrics.update(
        {"policy_version": end.version, "max_staleness": end.max_staleness, "workers": end.workers}
    )
    run.append("timeline.jsonl", end.timeline)
    run.append("metrics.jsonl", [metrics])
    if end.grid:
        write_sample_grid(run.samples / f"iter_{k:04d}.png", k, end.grid, prompts=run.cfg.prompt_list())
    return metrics
