"""``digen bench``: the same workload in several schedule modes, side by side, on the local cluster.

Runs are *interleaved and repeated*: round 1 runs every mode once, round 2 again (in reverse
order, so slow drifts of the machine hit every mode alike), and so on. Each run is a normal
training run in its own run directory (``OUT/runs/<mode>/round_<r>``); the bench reads back
its ``metrics.jsonl`` and ``timeline.jsonl`` and reports per mode, over iterations
``>= warmup`` (iteration 0 includes model loading and worker start-up):

- ``samples_per_s``: median over all rounds' iterations of the per-iteration samples/s;
  ``s_per_iteration``: median iteration wall time;
- ``bubble_ratio`` (idle worker-seconds / worker-seconds, docs/architecture.md "metrics.jsonl") overall and
  per role, from the timeline clipped to the measured window (a task running across an
  iteration boundary counts on both sides); ``bubble_ratio_metrics`` is the same from
  ``metrics.jsonl``'s ``busy_s``/``worker_s``;
- ``speedup_vs_colocated`` / ``speedup_vs_disaggregated``: ratio of ``samples_per_s``;
- ``bound_samples_per_s``: the zero-bubble bound of the mode's workers from their measured
  task durations (docs/simulator.md, :func:`digen.sim.bounds.lp_bound`), or from the tasks'
  CPU seconds where more workers were busy than there are cores or the throughput beat it
  (``bound_source``; both in ``bound_samples_per_s_wall`` / ``_cpu``), and
  ``fraction_of_bound``, with ``bound_valid`` false where even that bound does not hold
  (:func:`digen.bench.summary.choose_bound`);
- per worker: measured generation and training rates (per wall-clock and per CPU second),
  busy fraction and peak RSS;
- held-out evaluation's cost (``+eval`` / ``-eval`` on a mode turns ``eval`` on, with the
  config's ``eval.every`` or 1, or off): ``evaluations`` per run and ``eval_worker_s``, the
  worker-seconds its ``eval`` tasks took per run; run ``digen+eval,digen-eval`` side by side
  to read its effect on ``s_per_iteration``.
- ``worker_redis_round_trips_per_s`` / ``_per_cycle``: the requests the worker loops sent to
  Redis (counted by their client, :func:`digen.controlplane.redis_conn.count_round_trips`) per
  second of the measured window, summed over workers, and per pass through a loop.

Plus the TSP micro-benchmark: one train task of K timesteps per sample as one batched
forward/backward (``tsp=True``) vs K sequential forwards (``tsp=False``), per K.

The package, one module per part:

- :mod:`digen.bench.modes` the modes and the config each runs;
- :mod:`digen.bench.runs` running them (:func:`run_bench`, :func:`run_one`);
- :mod:`digen.bench.memory` peak memory of the run's processes while they live;
- :mod:`digen.bench.stats` reading a run back: per-worker task times, rates, busy time;
- :mod:`digen.bench.summary` bench.json's object per mode;
- :mod:`digen.bench.tsp` the TSP micro-benchmark;
- :mod:`digen.bench.report` ``bench.json``, ``tsp.json`` and the Markdown (``bench.md``).

Another program of the bench (a micro-benchmark such as the data plane's) is one more module
here, run from :func:`run_bench` beside :func:`tsp_microbench`, its rows carried by
:class:`BenchResult` and written and tabled by :mod:`digen.bench.report`.
"""

from __future__ import annotations

from digen.bench.memory import MemorySampler, peak_rss_mb, reset_peak_rss
from digen.bench.modes import BASE_MODES, TOGGLES, mode_config, parse_modes, parse_workers
from digen.bench.report import eval_table, markdown_table, startup_table, write_outputs
from digen.bench.runs import BenchResult, Notify, run_bench, run_one
from digen.bench.stats import RatePool, RunRecord, WorkerStats, bubble_by_role, measured_window, worker_stats
from digen.bench.summary import (
    add_speedups,
    add_startup_ratios,
    eval_cost,
    eval_interference_per_run,
    startup_summary,
    summarize,
)
from digen.bench.tsp import tsp_microbench

__all__ = [
    "BASE_MODES",
    "TOGGLES",
    "BenchResult",
    "MemorySampler",
    "Notify",
    "RatePool",
    "RunRecord",
    "WorkerStats",
    "add_speedups",
    "add_startup_ratios",
    "bubble_by_role",
    "eval_cost",
    "eval_interference_per_run",
    "eval_table",
    "markdown_table",
    "measured_window",
    "mode_config",
    "parse_modes",
    "parse_workers",
    "peak_rss_mb",
    "reset_peak_rss",
    "run_bench",
    "run_one",
    "startup_summary",
    "startup_table",
    "summarize",
    "tsp_microbench",
    "worker_stats",
    "write_outputs",
]
