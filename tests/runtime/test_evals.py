"""The controller's evaluation book-keeping: which weight versions stay published."""

from __future__ import annotations

from digen.config import build_config
from digen.core.events import TaskKind, TaskRef
from digen.runtime.evals import Evaluations
from tests.conftest import required


def test_versions_of_waiting_and_running_evaluations_stay_published(tmp_path):
    cfg = build_config(
        required(
            {
                "iterations": 9,
                "eval": {"every": 2, "batch_size": 2},
                "prompts": {"items": ["a", "b"], "test_file": "t.txt"},
            }
        ),
        check_paths=False,
    )
    evals = Evaluations(cfg, run=None, job=None, prompts=["a", "b", "c"])  # type: ignore[arg-type]
    assert evals.keep_from(6, []) == 6
    # the scheduler holds back the evaluation after iteration 3 (version 4)
    assert evals.keep_from(6, [3]) == 4
    # released: chunk payloads of the evaluation after iteration 1 (version 2) are out
    payload = evals.payload(TaskRef(TaskKind.EVAL, 1, 1))
    assert payload.task.version == 2 and payload.task.prompts == ("c",)
    assert evals.keep_from(6, [3]) == 2
    assert evals.pending(TaskRef(TaskKind.EVAL, 1, 0)) and not evals.pending(TaskRef(TaskKind.EVAL, 5, 0))
