"""The measured window is each mode's steady state: no mode beats the bound, and the number of
measured iterations does not move the result."""

from __future__ import annotations

import pytest

from digen.errors import ConfigError
from digen.sim.costmodel import Testbed as Bed
from digen.sim.costmodel import Workload, paper_costmodel
from digen.sim.driver import MODES, simulate
from digen.sim.measure import measured_window
from digen.sim.study import SimSettings, run_study
from tests.sim.conftest import split, uniform_model
from tests.sim.test_study import H100, MID, MODEL


def workloads():
    """A uniform cluster where digen's last iteration, with nothing to overlap, beat the bound
    (1.04 of it, measured to the job's end), and a mixed one (the LP bound's fractional
    worker)."""
    mixed = Workload("w", MODEL, steps=10, timestep_fraction=0.4, prompts=8, group_size=4, samples_per_task=1)
    return [
        uniform_model(workers=4, tasks=16),
        paper_costmodel(mixed, Bed("t", 25, ((H100, 4), (MID, 8)))),
    ]


def steady(measured: int) -> SimSettings:
    return SimSettings(iterations=3 + measured + 1, warmup=3, neighbours=1, trailing=1)


@pytest.mark.parametrize("cost", workloads())
def test_no_mode_beats_its_bound_and_more_iterations_change_nothing(cost):
    modes = [m for m, mode in MODES.items() if mode.peer is None]  # the peers: tests/sim/test_peers.py
    four, eight = (run_study(cost, modes, steady(n)) for n in (4, 8))
    for a, b in zip(four.results, eight.results, strict=True):
        assert 0 < a.fraction_of_bound <= 1 + 1e-9, a.mode
        assert 0 < b.fraction_of_bound <= 1 + 1e-9, b.mode
        assert b.sim.s_per_iteration == pytest.approx(a.sim.s_per_iteration, rel=0.01), a.mode


def test_the_jobs_last_iteration_is_not_measured():
    cost = uniform_model(workers=4, tasks=16)
    res = simulate(cost, MODES["digen"], split(cost, 2), iterations=8, warmup=3, trailing=1)
    ends = res.step_ends
    assert res.window == (ends[2], ends[6])
    assert res.s_per_iteration == pytest.approx((ends[6] - ends[2]) / 4)
    last, steady_s = ends[7] - ends[6], ends[6] - ends[5]
    assert last < 0.95 * steady_s  # with nothing to generate next, every worker trains it
    to_the_end = simulate(cost, MODES["digen"], split(cost, 2), iterations=8, warmup=3, trailing=0)
    assert to_the_end.s_per_iteration < res.s_per_iteration


def test_measured_window_takes_whole_iterations_from_step_to_step():
    ends = [1.0, 2.0, 3.5, 4.0, 6.0]
    assert measured_window(ends, 0) == (0.0, 6.0)
    assert measured_window(ends, 2, 1) == (2.0, 4.0)
    with pytest.raises(ConfigError, match="must exceed"):
        simulate(uniform_model(), MODES["digen"], split(uniform_model(), 2), iterations=3, warmup=2)
