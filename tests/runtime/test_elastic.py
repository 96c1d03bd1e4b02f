"""Workers joining and leaving mid-job, and one-step-bounded staleness, read from the run's
own timeline (not from the code's claims)."""

from __future__ import annotations

import json
import pprint
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from digen.cluster.cluster import add_local_worker, list_workers
from digen.runtime.controller import run_distributed
from digen.testing.faults import Fault, arm
from tests.conftest import faults_on
from tests.reliability.conftest import run_job

pytestmark = pytest.mark.slow


def timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wait_for(cond, what: str, timeout: float = 300) -> None:
    """Poll ``cond`` until true; the timeout only guards against a hang."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _faults() -> Iterator[None]:
    """Fault hooks on in the workers: tests order two workers' tasks with hold/signal faults
    (digen.testing.faults), so what they check does not depend on the machine's speed."""
    with faults_on():
        yield


def no_hold_expired(fired: list[dict]) -> bool:
    return not [f for f in fired if f["action"] == "hold_expired"]


def thread_stacks() -> str:
    """Every thread's stack in this process (run on a worker with ``client.run``)."""
    frames = sys._current_frames().items()
    return "\n".join(f"--- thread {tid}\n" + "".join(traceback.format_stack(f)) for tid, f in frames)


def watch_newcomer(ctl, name: str, stop: threading.Event, report: dict, after_s: float = 60.0) -> None:
    """Once the latest hold has waited ``after_s`` and ``name`` has generated nothing of
    iteration 4, write into ``report`` what the controller, Redis and the rollout workers'
    own threads say: the failure message of a hold that expires says where the newcomer
    was, not only that it never took work."""
    from digen.testing.faults import fired

    held = None
    while held is None or time.time() - held < after_s:
        if stop.wait(1.0):
            return
        got = fired(ctl.job.r, ctl.job.job_id)
        if any(f["point"] == "gen" and f["action"] == "signal" and f["worker"] == name for f in got):
            return
        held = max((f["t"] for f in got if f["action"] == "hold"), default=None)
    fut, job = ctl.members.loops.get(name), ctl.job
    report["controller"] = {
        "workers": sorted(ctl.workers),
        "loop": None if fut is None else (fut.key, fut.status),
        "tags": {n: (r.value, b) for n, (r, b) in ctl.dispatch.tags.items()},
        "restarting": dict(ctl.members.restarting),
        "loop_failures": dict(ctl.members.loop_failures),
    }
    report["redis"] = {
        "tag": job.tag(name),
        "ready": job.is_ready(name),
        "startup": job.startup_notes().get(name),
        "tasks": ctl.queue.progress([f"gen:{it}:{g}" for it in (3, 4) for g in range(2)]),
    }
    try:
        report["dask"] = {w.name: w.address for w in list_workers(ctl.client)}
        rollouts = [n for n in ("rollout-0", name) if n in ctl.workers]
        report["stacks"] = ctl.client.run(thread_stacks, workers=[ctl.workers[n].address for n in rollouts])
    except Exception as exc:  # noqa: BLE001 - a report, whatever Dask says
        report["dask_error"] = repr(exc)


def join_faults(name: str) -> list[Fault]:
    """The order between rollout-0 and ``name``, a rollout worker added at the end of
    iteration 1, whatever the speeds (no hold waits on a flag set after it: no cycle):

    - the controller registers the newcomer before iteration 3's step: rollout-0 holds its
      first group of iteration 3 until the newcomer's loop has started, which the controller
      does in the look at the cluster that turns the worker into a ``WorkerJoined``. The
      newcomer is then tagged at iteration 2's or 3's boundary, before iteration 4 is
      released. (Without it, a controller that looks every half second could first see the
      worker after iterations 2 and 3, a quarter second each on a fast machine: tagged at
      iteration 4's boundary, which the next hold never lets come.)
    - each generates one group of iteration 4: rollout-0 holds its group until the newcomer
      has generated the other one (the job cannot end before the newcomer has loaded the
      model and taken work), and the newcomer holds its group until rollout-0 has taken the
      other one (fetched the weights of version 4, which only an iteration-4 generation task
      does), so an idle newcomer cannot generate both while rollout-0 is slow to come back."""
    return [
        Fault("start", "signal", worker=name, flag="started"),
        Fault("gen", "hold", worker="rollout-0", iteration=3, flag="started", seconds=300),
        Fault("gen", "hold", worker="rollout-0", iteration=4, flag="newcomer", seconds=300),
        Fault("sync", "signal", worker="rollout-0", iteration=4, flag="rollout-0"),
        Fault("gen", "hold", worker=name, iteration=4, flag="rollout-0", seconds=300),
        Fault("gen", "signal", worker=name, iteration=4, flag="newcomer"),
    ]


def gen_tasks(run: Path) -> dict[str, list[tuple[int, int]]]:
    """worker -> the (iteration, version) of each group it generated (a failure's message)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for e in timeline(run):
        if e["kind"] == "gen":
            out.setdefault(e["worker"], []).append((e["iteration"], e["version"]))
    return out


def test_staleness_one_is_bounded_and_never_mixes_versions(small_config, tmp_path):
    cfg = small_config(iterations=4, schedule__mode="digen", schedule__tag=False)
    out = tmp_path / "run"
    summary = run_distributed(cfg, out)
    events = timeline(out)
    gen_versions: dict[tuple[int, str], set[int]] = {}
    for e in events:
        if e["kind"] in ("gen", "decode", "reward"):
            gen_versions.setdefault((e["iteration"], e["worker"]), set()).add(e["version"])
    # iteration i generates with version max(0, i - 1), one version per trajectory
    for (it, _), versions in gen_versions.items():
        assert versions == {max(0, it - 1)}
    for e in events:
        if e["kind"] == "train":
            assert e["version"] == e["iteration"]
    assert summary["max_staleness"] == 1
    assert [m["max_staleness"] for m in metrics(out)] == [0, 1, 1, 1]


def test_worker_joining_mid_job_gets_tasks_from_the_next_iteration(small_config, tmp_path):
    cfg = small_config(
        iterations=6,
        schedule__mode="disaggregated",
        schedule__gap=True,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    joined = {}
    holder = {}
    stop, report = threading.Event(), {}

    def on_start(ctl):
        holder["ctl"] = ctl

    def progress(m):
        if "event" in m:  # the start notice comes before on_start
            return
        ctl = holder["ctl"]
        if m["iteration"] == 1:
            name = add_local_worker(ctl.cluster, "rollout", "cpu")
            joined.update(name=name, after=m["iteration"] + 1)
            wait_for(lambda: name in {w.name for w in list_workers(ctl.client)}, "worker never joined Dask")
            # the newcomer is tagged before iteration 4, which it and rollout-0 generate one
            # group each (join_faults); its loop is started by the controller's next look at
            # the cluster, and the controller itself is never held: it must go on looking
            arm(ctl.job.r, ctl.job.job_id, *join_faults(name))
            threading.Thread(target=watch_newcomer, args=(ctl, name, stop, report), daemon=True).start()

    try:
        fired = run_job(cfg, out, "elastic-join", on_start=on_start, progress=progress)
    finally:
        stop.set()
    assert joined, "the worker was never added"
    name = joined["name"]
    gens = gen_tasks(out)
    why = f"{pprint.pformat(fired, width=110)}\n{pprint.pformat(report, width=110)}\n{gens}"
    assert no_hold_expired(fired), why
    want = [("start", "signal", name, None)]
    if any(it == 3 for it, _ in gens.get("rollout-0", [])):  # else the newcomer, tagged at
        want.append(("gen", "hold", "rollout-0", 3))  # iteration 2's boundary, generated both
    want += [("gen", "hold", "rollout-0", 4), ("sync", "signal", "rollout-0", 4)]
    want += [("gen", "hold", name, 4), ("gen", "signal", name, 4)]
    got = Counter((f["point"], f["action"], f["worker"], f["iteration"]) for f in fired)
    assert got == Counter(want), why
    newcomer = [e for e in timeline(out) if e["worker"] == name]
    assert 4 in {e["iteration"] for e in newcomer}, f"{name} received no task of iteration 4\n{why}"
    assert min(e["iteration"] for e in newcomer) >= joined["after"], why
    gen4 = Counter(w for w, tasks in gens.items() for it, _ in tasks if it == 4)
    assert gen4 == {"rollout-0": 1, name: 1}, why
    assert [m["samples"] for m in metrics(out)] == [8] * 6, why


def test_worker_killed_mid_job_loses_no_sample(small_config, tmp_path):
    from digen.reference import run_reference

    cfg = small_config(
        iterations=4,
        schedule__mode="disaggregated",
        schedule__gap=True,
        schedule__lease_s=20.0,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    ref = tmp_path / "ref"
    run_reference(small_config(iterations=4), ref)
    out = tmp_path / "run"
    # killed with a generated group of iteration 1 in hand, before it is stored
    fired = run_job(cfg, out, "elastic-kill", Fault("gen", "kill", worker="rollout-0", iteration=1))
    assert [(f["action"], f["worker"], f["iteration"]) for f in fired] == [("kill", "rollout-0", 1)]
    got = metrics(out)
    assert [m["iteration"] for m in got] == [0, 1, 2, 3]
    assert [m["samples"] for m in got] == [8] * 4
    want = metrics(ref)
    for g, w in zip(got, want, strict=True):
        assert g["rewards"] == pytest.approx(w["rewards"], abs=1e-6)


def test_tag_idle_trainer_generates_when_generation_is_the_bottleneck(small_config, tmp_path):
    # pinned speeds: generation 8 s per group, training 1 s: TAG gives the trainer 2 groups
    # of generation per iteration (tests/core/test_scheduler.py checks that search)
    cfg = small_config(
        iterations=5,
        schedule__mode="digen",
        schedule__task_seconds={"gen": 8.0, "train": 1.0},
        rollout__batch_size=16,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    # rollout-0 holds its first group of iteration 2 until the trainer has generated a group:
    # the trainer, idle once iteration 1 is trained, finds generation in the queue
    fired = run_job(
        cfg,
        out,
        "elastic-tag",
        Fault("gen", "hold", worker="rollout-0", task="gen:2:0", flag="stolen", seconds=300),
        Fault("gen", "signal", worker="trainer-0", flag="stolen"),
    )
    why = f"{pprint.pformat(fired, width=110)}\n{gen_tasks(out)}"
    assert no_hold_expired(fired), why
    # the trainer generates a group whatever the speeds: the budget is set before iteration
    # 2's generation is released, and while rollout-0 holds gen:2:0 the rest of it waits in
    # the queue for the trainer. It may also take gen:2:0 itself, before rollout-0 does:
    # then nothing holds
    got = [(f["point"], f["action"], f["worker"], f["task"]) for f in fired]
    signals = [x for x in got if x[:3] == ("gen", "signal", "trainer-0")]
    others = [x for x in got if x not in signals]
    assert len(signals) == 1 and others in ([], [("gen", "hold", "rollout-0", "gen:2:0")]), why
    events = timeline(out)
    stolen = [e for e in events if e["worker"].startswith("trainer") and e["kind"] == "gen"]
    assert stolen, f"the trainer never generated\n{why}"
    # the first budget comes at the first iteration boundary; the trainer generates with
    # the version the iteration's rollouts use (staleness 1), one version per trajectory
    assert min(e["iteration"] for e in stolen) >= 1, why
    assert all(e["version"] == e["iteration"] - 1 for e in stolen), why
    assert not [e for e in events if e["worker"].startswith("rollout") and e["kind"] == "train"], why
    assert [m["samples"] for m in metrics(out)] == [16] * 5, why


def rat_faults() -> list[Fault]:
    """The order of iterations 1-3 between rollout-0 and trainer-0, whatever the speeds (no
    hold waits on a flag set after it: no cycle). Iteration k's train tasks are released at
    iteration k-1's step, whole group 0 first, with the generation of iteration k+1; each
    worker leases the oldest task of its queues, rollout-0 training only with its own queue
    empty:

    - rollout-0 is held while the step releases iteration k's tasks: at the acknowledgement
      of its last task before that step (gen:1:3; then its half train:(k-1):1:1), until the
      trainer has trained the whole group 0. (An idle rollout-0 that looks at the generation
      queue just before the release and at the train queue just after it would take the
      whole train:k:0.) Acknowledged, the task counts for the step all the same.
    - the trainer has leased the first half, train:k:1:0, before rollout-0 stores its last
      group of iteration k+1 (a slow trainer could leave it to rollout-0), and holds it
      until rollout-0 has trained a half: that is train:k:1:1, the oldest task left.

    The last iteration has nothing to generate after it: left to the race (any task, to
    either worker)."""
    faults = [Fault("acked", "hold", worker="rollout-0", task="gen:1:3", flag="whole-1", seconds=300)]
    for k in (1, 2, 3):
        faults += [
            Fault("train", "signal", worker="trainer-0", task=f"train:{k}:0", flag=f"whole-{k}"),
            Fault("fetch", "signal", worker="trainer-0", task=f"train:{k}:1:0", flag=f"leased-{k}"),
            Fault("gen", "hold", worker="rollout-0", task=f"gen:{k + 1}:3", flag=f"leased-{k}", seconds=300),
            Fault(
                "train", "hold", worker="trainer-0", task=f"train:{k}:1:0", flag=f"helped-{k}", seconds=300
            ),
            Fault("train", "signal", worker="rollout-0", iteration=k, flag=f"helped-{k}"),
        ]
        if k < 3:
            faults.append(
                Fault(
                    "acked",
                    "hold",
                    worker="rollout-0",
                    task=f"train:{k}:1:1",
                    flag=f"whole-{k + 1}",
                    seconds=300,
                )
            )
    return faults


def rat_fired() -> Counter:
    """(point, action, worker, task) of each fault :func:`rat_faults` fires, every time."""
    want = [("acked", "hold", "rollout-0", "gen:1:3")]
    for k in (1, 2, 3):
        want += [
            ("train", "signal", "trainer-0", f"train:{k}:0"),
            ("fetch", "signal", "trainer-0", f"train:{k}:1:0"),
            ("gen", "hold", "rollout-0", f"gen:{k + 1}:3"),
            ("train", "hold", "trainer-0", f"train:{k}:1:0"),
            ("train", "signal", "rollout-0", f"train:{k}:1:1"),
        ]
        if k < 3:
            want.append(("acked", "hold", "rollout-0", f"train:{k}:1:1"))
    return Counter(want)


def trained(events: list[dict]) -> dict[str, list[str]]:
    """worker -> the train tasks it ran, in the timeline's order (a failure's message)."""
    out: dict[str, list[str]] = {}
    for e in events:
        if e["kind"] == "train":
            out.setdefault(e["worker"], []).append(e["task"])
    return out


def test_rat_idle_rollout_trains_half_groups_when_training_is_the_bottleneck(small_config, tmp_path):
    # pinned speeds: generation 1 s per group, training 3 s: from iteration 1 on, RAT gives
    # the rollout worker 3 half groups, so groups 1-3 of each iteration train as halves
    # (tests/core/test_scheduler.py checks that search)
    cfg = small_config(
        iterations=5,
        schedule__mode="digen",
        schedule__task_seconds={"gen": 1.0, "train": 3.0},
        rollout__batch_size=16,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(cfg, out, "elastic-rat", *rat_faults())
    events = timeline(out)
    why = f"{pprint.pformat(fired, width=110)}\n{trained(events)}"
    assert no_hold_expired(fired), why
    assert Counter((f["point"], f["action"], f["worker"], f["task"]) for f in fired) == rat_fired(), why
    train = [e for e in events if e["kind"] == "train"]
    # iteration 0 trains 4 whole groups (no speeds known at start), then 1 whole + 3 x 2 halves
    assert Counter(e["iteration"] for e in train) == {0: 4, 1: 7, 2: 7, 3: 7, 4: 7}, why
    for k in range(5):
        assert sum(e.get("share", 1.0) for e in train if e["iteration"] == k) == 4.0, why
    helped = [e for e in train if e["worker"].startswith("rollout")]
    assert {1, 2, 3} <= {e["iteration"] for e in helped}, f"the rollout worker never trained\n{why}"
    assert min(e["iteration"] for e in helped) >= 1, why
    # a rollout worker trains the version it generated the next iteration with (staleness 1:
    # iteration k, version k), and while it generates next, halves only
    assert all(e["version"] == e["iteration"] for e in helped), why
    assert all(e.get("share") == 0.5 for e in helped if e["iteration"] < 4), why
    assert not [e for e in events if e["worker"].startswith("trainer") and e["kind"] == "gen"], why
    assert [m["samples"] for m in metrics(out)] == [16] * 5, why
