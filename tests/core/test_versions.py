"""The version rule: every version the run names is ``M i + m`` at some (i, m)."""

from __future__ import annotations

import pytest

from digen.core import versions


@pytest.mark.parametrize("m_total", [1, 2, 4])
def test_every_version_is_the_one_rule(m_total: int):
    for i in range(5):
        steps = [versions.version(i, m, m_total) for m in range(m_total)]
        assert steps == list(range(m_total * i, m_total * (i + 1)))  # one step per mini-batch, no gap
        assert versions.published_after(i, m_total) == versions.version(i, m_total - 1, m_total) + 1
        assert all(versions.iteration_of(v + 1, m_total) == i for v in steps)  # its steps made them
        assert versions.generation_version(i, m_total, 0) == versions.version(i, 0, m_total)
        assert versions.generation_version(i + 1, m_total, 1) == versions.version(i, 0, m_total)
        assert versions.iterations_behind(i + 1, versions.generation_version(i + 1, m_total, 1), m_total) == 1
    assert versions.iteration_of(0, m_total) == -1
    assert versions.generation_version(0, m_total, 1) == 0


def test_the_kept_version_is_what_the_next_iteration_generates_with():
    assert versions.kept_version(3, 2, 0) is None
    assert versions.kept_version(3, 2, 1) == versions.generation_version(4, 2, 1) == 6
