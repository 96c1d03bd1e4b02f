"""The rank command a group's leader broadcasts (:class:`digen.workers.ranks.RankCommand`):
it survives the JSON a broadcast carries whole, and what is not one is a PayloadError naming
the fault (a follower's group then fails or breaks, never runs a guess)."""

from __future__ import annotations

import json

import pytest

from digen.controlplane.queue import LeasedTask
from digen.errors import PayloadError
from digen.workers.ranks import IDLE, STOP, TASK, RankCommand

TASKS = [
    LeasedTask("train", "train:3:1:0", {"spec": {"rows": [1, 2]}, "version": 3}, 2),
    LeasedTask("step", "step:3:1", {"iteration": 3, "rows": 16}, 1),
    LeasedTask("gen", "gen:0:4", {"prompt": "a cat", "score": True}, 1),
]


def _wire(cmd: RankCommand) -> object:
    """As a broadcast carries it (:func:`digen.parallel.comm.broadcast_json`): JSON text."""
    return json.loads(json.dumps(cmd.to_json()))


@pytest.mark.parametrize("cmd", [RankCommand(STOP), RankCommand(IDLE), *map(RankCommand.of, TASKS)])
def test_a_rank_command_survives_the_broadcast_whole(cmd):
    back = RankCommand.read(_wire(cmd))
    assert back == cmd
    assert (back.op == TASK) == (back.task is not None)


def test_nothing_leased_is_idle_and_a_leased_task_is_its_command():
    assert RankCommand.of(None) == RankCommand(IDLE)
    cmd = RankCommand.of(TASKS[0])
    assert cmd.op == TASK and cmd.task is TASKS[0]
    assert cmd.to_json() == {
        "op": "task",
        "queue": "train",
        "id": "train:3:1:0",
        "payload": TASKS[0].payload,
        "attempt": 2,
    }


GOOD = RankCommand.of(TASKS[0]).to_json()


@pytest.mark.parametrize(
    ("raw", "fault"),
    [
        (["op", "stop"], "a rank command is a map, got list"),
        (None, "a rank command is a map, got NoneType"),
        ({"op": "train"}, "op is one of stop, idle, task, got 'train'"),
        ({}, "op is one of stop, idle, task, got None"),
        ({"op": "stop", "id": "gen:0:0"}, "a rank command 'stop' has the keys ['op']; these differ: ['id']"),
        ({"op": "task"}, "these differ: ['attempt', 'id', 'payload', 'queue']"),
        ({**GOOD, "extra": 1}, "these differ: ['extra']"),
        ({**GOOD, "id": "not-a-task"}, "a rank command's id is a task id, got 'not-a-task'"),
        ({**GOOD, "id": 7}, "a rank command's id is a task id, got 7"),
        ({**GOOD, "queue": ""}, "a rank command's queue is a name, got ''"),
        ({**GOOD, "payload": [1, 2]}, "payload is a text-keyed map, got list"),
        ({**GOOD, "attempt": 0}, "attempt is a positive integer, got 0"),
        ({**GOOD, "attempt": True}, "attempt is a positive integer, got True"),
        ({**GOOD, "attempt": "1"}, "attempt is a positive integer, got '1'"),
    ],
)
def test_junk_is_refused_naming_the_fault(raw, fault):
    with pytest.raises(PayloadError) as err:
        RankCommand.read(raw)
    assert fault in str(err.value)


def test_a_command_is_one_of_its_ops_with_a_task_exactly_when_it_runs_one():
    with pytest.raises(ValueError, match="op is one of stop, idle, task, got 'go'"):
        RankCommand("go")
    with pytest.raises(ValueError, match="a rank command 'task' needs task"):
        RankCommand(TASK)
    with pytest.raises(ValueError, match="a rank command 'idle' carries no task"):
        RankCommand(IDLE, TASKS[0])
