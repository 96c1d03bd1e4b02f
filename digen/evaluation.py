"""Held-out evaluation: the current policy on the test prompts, ODE sampler, fixed seeds.

Every ``eval.every`` iterations (and after the last one) the policy samples the first
``eval.num_prompts`` prompts of ``prompts.test_file``, one sample per prompt, with the
deterministic Euler ODE sampler (no SDE noise, as Flow-GRPO's ``eval`` uses
``noise_level=0`` in ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``) at
``rollout.eval_steps`` steps. Test prompt ``i`` always starts from the same noise, drawn from
its own stream ``(\"eval\", eval.seed, i)`` (:mod:`digen.seeding`): training's streams are
untouched, so evaluating does not change what is trained. Every reward of the config is
reported separately, plus their weighted sum (``reward``).

The test prompts are cut in chunks of :func:`eval_batch_size` prompts (:class:`EvalTask`),
one batched sampling each: the reference trainer runs them in turn, the distributed modes as ``eval``
tasks on rollout workers, and both produce the same numbers for the same weights.

With ``train.ema.eval`` the chunks are sampled with the EMA of the evaluated version instead
of its weights (Flow-GRPO's ``eval``): that version carries its EMA (:func:`carries_ema`) and
the evaluator swaps it in for the chunk and back (:func:`digen.evaluator.evaluate_chunk`).

``RUN_DIR/eval.jsonl`` gets one row per evaluation (:meth:`EvalBook.row`), and
``RUN_DIR/eval/iter_NNNN.png`` its grid.

This module plans evaluations and books their results, without torch (the controller uses
it); the sampling and scoring of a chunk is :mod:`digen.evaluator`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from PIL import Image

from digen.config import Config
from digen.core.versions import published_after
from digen.records import Record
from digen.rundir import RunDir
from digen.viz import write_eval_grid

TOTAL = "reward"
"""Key of the weighted sum of the rewards (what training maximises)."""


def held_out_prompts(cfg: Config) -> list[str]:
    """The evaluated prompts: the first ``eval.num_prompts`` of ``prompts.test_file`` or the
    ``prompts.dataset``'s test split (all with 0); empty without either."""
    prompts, _ = cfg.test_prompt_list()
    n = cfg.eval.num_prompts
    return prompts[:n] if n else prompts


@dataclass(frozen=True)
class EvalTask(Record):
    """One chunk of an evaluation: test prompts ``indices`` with weights ``version``
    (the version after ``iteration``'s step)."""

    iteration: int
    chunk: int
    version: int
    indices: tuple[int, ...]
    prompts: tuple[str, ...]


def eval_batch_size(cfg: Config) -> int:
    """Test prompts per ``eval`` task: ``eval.batch_size``, or with 0 (auto) the most whose
    denoising steps do not exceed one generation task's: ``floor(group_size x num_steps /
    eval_steps)``, at least 1 (defaults: 4 x 8 / 20 -> 1).

    Why small: a running ``eval`` task is never interrupted, so a generation task released
    while it runs waits for its remainder (the scheduler and the pull order guarantee no
    more, :mod:`digen.core.scheduler`); with this size that wait is at most about one
    generation task, the granularity the pipeline already works at. Larger chunks batch
    better on a big accelerator; set ``eval.batch_size`` when the bubbles are long enough."""
    if cfg.eval.batch_size:
        return cfg.eval.batch_size
    r = cfg.rollout
    return max(1, (r.group_size * r.num_steps) // r.eval_steps)


def eval_version(cfg: Config, iteration: int) -> int:
    """The version evaluated after ``iteration``: the weights after its last optimizer step
    (``train.mini_batches`` steps an iteration)."""
    return published_after(iteration, cfg.train.mini_batches)


def evaluates_ema(cfg: Config) -> bool:
    """Whether evaluations sample with the EMA weights (``train.ema.eval``)."""
    return cfg.train.ema.enabled and cfg.train.ema.eval


def carries_ema(cfg: Config, version: int) -> bool:
    """Whether version ``version`` travels with its EMA (``ema/<name>``,
    :func:`digen.algos.state.with_ema`): an evaluated version (:func:`eval_version`) when
    evaluations use the EMA. Only those: the others would carry twice the bytes for nothing
    (a full fine-tune's EMA is as large as its weights)."""
    m = cfg.train.mini_batches
    if not (evaluates_ema(cfg) and cfg.eval.every) or version <= 0 or version % m:
        return False
    return evaluates(cfg, version // m - 1)


def plan_eval(cfg: Config, prompts: list[str], iteration: int) -> list[EvalTask]:
    """The chunks of the evaluation after ``iteration`` (of :func:`eval_version`)."""
    b = eval_batch_size(cfg)
    v = eval_version(cfg, iteration)
    return [
        EvalTask(iteration, c, v, tuple(range(s, min(s + b, len(prompts)))), tuple(prompts[s : s + b]))
        for c, s in enumerate(range(0, len(prompts), b))
    ]


def eval_task_count(cfg: Config) -> int:
    """Chunks per evaluation (0 when evaluation is off)."""
    if not cfg.eval.every:
        return 0
    return math.ceil(len(held_out_prompts(cfg)) / eval_batch_size(cfg))


def evaluates(cfg: Config, iteration: int) -> bool:
    """Whether the version after ``iteration`` is evaluated (the scheduler's rule)."""
    e = cfg.eval.every
    return e > 0 and ((iteration + 1) % e == 0 or iteration == cfg.iterations - 1)


@dataclass
class EvalResult:
    """One chunk's samples: their grid ``cells`` (one per prompt, :func:`digen.viz.image_cells`)
    and ``scores`` ``{component: one float per prompt}``."""

    task: EvalTask
    cells: Image.Image
    scores: dict[str, list[float]]


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std of the finite values (NaN when there is none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan")
    mean = math.fsum(finite) / len(finite)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / len(finite))


@dataclass
class EvalBook:
    """The chunks of one evaluation as they arrive, in any order, each counted once."""

    iteration: int
    version: int
    tasks: int
    results: dict[int, EvalResult] = field(default_factory=dict)
    cost_s: float = 0.0
    """Worker-seconds its tasks took."""
    events: list[dict] = field(default_factory=list)
    """Timeline rows of its tasks (distributed modes)."""

    def add(self, result: EvalResult, seconds: float = 0.0) -> None:
        if result.task.chunk not in self.results:
            self.results[result.task.chunk] = result
            self.cost_s += seconds

    @property
    def complete(self) -> bool:
        return len(self.results) == self.tasks

    def ordered(self) -> list[EvalResult]:
        return [self.results[c] for c in sorted(self.results)]

    def row(self) -> dict:
        """The ``eval.jsonl`` row: ``iteration``, ``policy_version``, ``num_prompts``, then
        ``<component>_mean`` / ``<component>_std`` of each reward (``reward`` = weighted sum),
        ``cost_s`` and the per-prompt ``scores`` (test-prompt order)."""
        parts = self.ordered()
        names = list(parts[0].scores) if parts else [TOTAL]
        scores = {k: [float(x) for p in parts for x in p.scores[k]] for k in names}
        row: dict = {
            "iteration": self.iteration,
            "policy_version": self.version,
            "num_prompts": sum(len(p.task.indices) for p in parts),
        }
        for k in names:
            row[f"{k}_mean"], row[f"{k}_std"] = _mean_std(scores[k])
        row["cost_s"] = self.cost_s
        row["scores"] = scores
        return row


def write_evaluation(run: RunDir, book: EvalBook) -> dict:
    """Append the evaluation's row to ``eval.jsonl`` and draw ``eval/iter_NNNN.png``."""
    row = book.row()
    run.append("eval.jsonl", [row])
    parts = book.ordered()
    if parts:
        write_eval_grid(
            run.root / "eval" / f"iter_{book.iteration:04d}.png",
            [(p.cells, len(p.task.indices)) for p in parts],
            [q for p in parts for q in p.task.prompts],
            row["scores"][TOTAL],
            header=f"eval after iteration {book.iteration} · policy v{book.version} · ODE {row['num_prompts']} prompts",
        )
    return row


def progress_row(row: dict) -> dict:
    """The progress message of an evaluation: ``{"event": "eval", ...}``, the row without its
    per-prompt scores (loggers read it with :func:`eval_metrics`)."""
    return {"event": "eval", **{k: v for k, v in row.items() if k != "scores"}}


def eval_metrics(row: dict) -> dict[str, float]:
    """An ``eval.jsonl`` row as logger scalars ``eval/<component>_mean`` ... (namespaced)."""
    skip = ("event", "iteration", "scores")
    return {
        f"eval/{k}": float(v)
        for k, v in row.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    }


# --- cost on the timeline ------------------------------------------------------------------
WAITERS = {"rollout": ("gen",), "colocated": ("gen", "train")}
"""Per role of a worker that evaluates: the kinds it pulls before ``eval``
(:func:`digen.core.policy.pull_order`), whose waits an ``eval`` task can cause."""


@dataclass(frozen=True)
class TaskSpan:
    """One task on the timeline: released (controller clock; None when not recorded), leased
    (the worker's clock before the lease; its first row's start when not recorded), end."""

    task: str
    kind: str
    worker: str
    role: str
    released: float | None
    leased: float
    end: float


def task_spans(rows: list[dict]) -> list[TaskSpan]:
    """The timeline's rows grouped by task (rows with a ``task`` id), in order of lease."""
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        if "task" in r:
            by_task.setdefault(r["task"], []).append(r)
    spans = [
        TaskSpan(
            task,
            task.split(":", 1)[0],
            rs[0]["worker"],
            rs[0]["role"],
            rs[0].get("released"),
            float(rs[0].get("leased", min(r["start"] for r in rs))),
            max(float(r["end"]) for r in rs),
        )
        for task, rs in by_task.items()
    ]
    return sorted(spans, key=lambda s: s.leased)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _union_overlap(windows: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``windows``."""
    covered, edge = 0.0, lo
    for a, b in sorted(windows):
        a, b = max(a, edge), min(b, hi)
        if b > a:
            covered += b - a
            edge = b
    return covered


def eval_interference(rows: list[dict]) -> dict[str, float]:
    """What ``eval`` tasks cost the tasks an iteration needs, from the timeline rows:

    - ``eval_wait_s``: seconds released gen (colocated: and train) tasks waited while the
      worker that then ran them ran an ``eval`` task (from release to lease, overlapped with
      that worker's ``eval`` spans); the rule allows one ``eval`` task's remainder per wait,
      so ``eval_max_wait_s`` (the longest of one task) is at most ``eval_max_task_s``;
    - ``eval_overtakes``: ``eval`` tasks a worker leased while a task it then ran was already
      released, each a break of the rule (the pull order puts ``eval`` last, and the
      scheduler releases it only when no generation task is outstanding): must be 0;
    - ``eval_busy_s``: seconds of ``eval`` tasks (lease to end); ``eval_in_bubbles_s`` of it
      while no task of a kind the worker pulls first (:data:`WAITERS`) waited in a queue,
      ``eval_outside_bubbles_s`` the rest;
    - ``eval_max_task_s``: the longest ``eval`` task (the bound on one wait).

    A released time is the controller's, a lease time the worker's: one clock on one machine
    (the local cluster), skewed by the hosts' offset otherwise."""
    spans = task_spans(rows)
    evals = [s for s in spans if s.kind == "eval"]
    waits = [s for s in spans if s.kind in ("gen", "train") and s.released is not None]
    wait_s, longest, overtakes = 0.0, 0.0, 0
    for t in waits:
        assert t.released is not None
        mine = 0.0
        for e in evals:
            if e.worker == t.worker and t.kind in WAITERS.get(e.role, ()):
                mine += _overlap(t.released, t.leased, e.leased, e.end)
                overtakes += t.released <= e.leased < t.leased
        wait_s, longest = wait_s + mine, max(longest, mine)
    busy = sum(e.end - e.leased for e in evals)
    outside = 0.0
    for e in evals:
        kinds = WAITERS.get(e.role, ())
        windows = [(t.released, t.leased) for t in waits if t.kind in kinds and t.released is not None]
        outside += _union_overlap(windows, e.leased, e.end)
    return {
        "eval_wait_s": wait_s,
        "eval_max_wait_s": longest,
        "eval_overtakes": float(overtakes),
        "eval_busy_s": busy,
        "eval_in_bubbles_s": busy - outside,
        "eval_outside_bubbles_s": outside,
        "eval_max_task_s": max((e.end - e.leased for e in evals), default=0.0),
    }
