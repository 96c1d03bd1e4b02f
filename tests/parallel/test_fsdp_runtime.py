"""``train.fsdp: true`` in the runtime: the trainer workers form one FSDP group and the job
computes what the reference computes.

Real embedded Redis, real Dask local cluster, real worker processes (1 rollout + 2 trainer
ranks over gloo). Full fine-tuning (LoRA off) with staleness 0: per-sample rewards equal the
reference run's, final weights within 1e-5, checkpoints interchangeable both ways.

The fault-free jobs run on the module's warm workers (``warm_cluster(1, 2)``): each job forms
its own FSDP group over the two warm trainers and takes it down at its end, so a later job's
group forms again on the same processes. The job that kills a rank starts its own cluster."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.config import build_config
from digen.errors import ConfigError
from digen.optim import ParameterStore
from tests.conftest import small_config_data
from tests.trainer.test_evaluation import last_checkpoint_scores

ITERATIONS = 3
TEST_PROMPTS = Path(__file__).resolve().parents[2] / "configs" / "prompts" / "general.txt"


def _config(model: Path, **sections):
    """Full fine-tuning with an EMA that moves twice a step, evaluated with the EMA after
    iterations 1 and 2 (3 test prompts, one chunk)."""
    data = small_config_data(
        model,
        iterations=ITERATIONS,
        model__lora={"enabled": False},
        output__keep_checkpoints=ITERATIONS,
        output__sample_grid_every=0,
        train__ema={"enabled": True, "every": 1, "micro_batches": 2, "eval": True},
        prompts__test_file=str(TEST_PROMPTS),
        rollout__eval_steps=2,
        eval={"every": 2, "num_prompts": 3, "batch_size": 3},
        **sections,
    )
    return build_config(data)


def _eval_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def _fsdp_config(model: Path):
    return _config(
        model,
        train__fsdp=True,
        schedule={"mode": "disaggregated", "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
    )


def _rewards(run: Path) -> dict[int, list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["rewards"] for r in rows}


def _full_stores_held(ctl) -> list[str]:
    """What of an optimizer the controller's process holds (nothing: the ranks own it)."""
    gc.collect()
    return [
        type(o).__name__ for o in gc.get_objects() if isinstance(o, ParameterStore | torch.optim.Optimizer)
    ]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --- config -----------------------------------------------------------------------------
def test_fsdp_config_rules(tiny_sd3):
    with pytest.raises(ConfigError) as err:
        build_config(
            small_config_data(
                tiny_sd3, train={"fsdp": True, "ema": {"enabled": True}}, schedule={"mode": "colocated"}
            )
        )
    text = "\n".join(err.value.problems)
    assert "train.fsdp (true) needs schedule.mode disaggregated or digen, got colocated" in text
    assert "train.ema" not in text  # the ranks keep the EMA of their shards
    with pytest.raises(ConfigError, match="schedule.tag \\(true\\) cannot be used with train.fsdp"):
        build_config(small_config_data(tiny_sd3, train__fsdp=True, schedule={"mode": "digen", "tag": True}))
    # digen mode: TAG (and RAT) resolve to off, the rest of the mode stays
    s = build_config(
        small_config_data(tiny_sd3, train__fsdp=True, schedule__mode="digen")
    ).schedule.resolved()
    assert (s.gap, s.tsp, s.tag, s.rat, s.max_staleness) == (True, True, False, False, 1)
    assert build_config(small_config_data(tiny_sd3, schedule__mode="digen")).schedule.resolved().tag is True


# --- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run(tiny_sd3, tmp_path_factory) -> Path:
    from digen.reference import run_reference

    out = tmp_path_factory.mktemp("ref") / "run"
    run_reference(_config(tiny_sd3), out)
    return out


@pytest.mark.slow
def test_fsdp_job_equals_reference(reference_run, tiny_sd3, tmp_path, warm_cluster):
    """From scratch: every iteration's rewards and the final weights match the reference; the
    trainer ranks both train every task; each checkpoint holds the reference's files and
    keys, and its AdamW moments and EMA (the ranks' shards, gathered) are the reference's (so a
    non-FSDP run resumes from it); the evaluations, of the EMA the ranks serve in shards with
    the evaluated versions, score what the reference's score."""
    from digen.runtime.controller import run_distributed

    out = tmp_path / "fsdp"
    held = ["not started"]
    run_distributed(
        _fsdp_config(tiny_sd3),
        out,
        scheduler=warm_cluster(1, 2),
        on_start=lambda ctl: held.__setitem__(slice(None), _full_stores_held(ctl)),
    )
    assert held == []  # the ranks hold the optimizer, sharded; the controller holds no tensor

    ref, got = _rewards(reference_run), _rewards(out)
    assert sorted(got) == list(range(ITERATIONS))
    for k in range(ITERATIONS):
        assert got[k] == pytest.approx(ref[k], abs=1e-6), f"iteration {k}"

    for k in range(ITERATIONS):
        folder = f"checkpoints/iter_{k:04d}"
        r_dir, g_dir = reference_run / folder, out / folder
        assert sorted(p.name for p in g_dir.iterdir()) == sorted(p.name for p in r_dir.iterdir())
        r_state, g_state = (json.loads((d / "state.json").read_text()) for d in (r_dir, g_dir))
        assert g_state["version"] == r_state["version"] == k + 1
        assert g_state["adam_steps"] == r_state["adam_steps"]
        assert (
            _max_diff(
                load_file(str(g_dir / "weights.safetensors")), load_file(str(r_dir / "weights.safetensors"))
            )
            <= 1e-5
        )
        g_opt, r_opt = (load_file(str(d / "optimizer.safetensors")) for d in (g_dir, r_dir))
        assert g_opt.keys() == r_opt.keys() and any(k.startswith("exp_avg_sq/") for k in g_opt)
        assert {k.removeprefix("ema/") for k in g_opt if k.startswith("ema/")} == set(
            load_file(str(g_dir / "weights.safetensors"))
        )
        for name in g_opt:
            if name.startswith("ema/"):  # an average of the weights: the weights' bound
                assert float((g_opt[name] - r_opt[name]).abs().max()) <= 1e-5, f"{folder} {name}"
            else:
                torch.testing.assert_close(
                    g_opt[name], r_opt[name], rtol=1e-4, atol=1e-8, msg=f"{folder} {name}"
                )
    first, last = (
        load_file(str(out / f"checkpoints/iter_{k:04d}/weights.safetensors")) for k in (0, ITERATIONS - 1)
    )
    assert _max_diff(first, last) > 1e-4, "training did not move the weights: the comparison would be vacuous"
    store, _ = ParameterStore.load(out / f"checkpoints/iter_{ITERATIONS - 1:04d}", _config(tiny_sd3).train)
    assert store.version == ITERATIONS
    assert store.ema is not None and _max_diff(store.ema, last) > 1e-5  # the EMA is not the weights
    ref_eval, got_eval = _eval_rows(reference_run), _eval_rows(out)
    assert [(r["iteration"], r["policy_version"]) for r in got_eval] == [(1, 2), (2, 3)]
    for r, g in zip(ref_eval, got_eval, strict=True):
        assert g["scores"]["reward"] == pytest.approx(r["scores"]["reward"], abs=1e-5), r["iteration"]
    by_ema, by_weights = last_checkpoint_scores(_fsdp_config(tiny_sd3), out)
    assert got_eval[-1]["scores"]["reward"] == pytest.approx(by_ema, abs=1e-5)
    # the weights score otherwise (measured: by 1.7e-4), well past the bound above
    assert max(abs(x - y) for x, y in zip(got_eval[-1]["scores"]["reward"], by_weights, strict=True)) > 5e-5

    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    train_workers = {e["worker"] for e in timeline if e["kind"] == "train"}
    assert train_workers == {"trainer-0", "trainer-1"}  # every rank trains its share of each task
    assert {e["worker"] for e in timeline if e["kind"] == "optim"} == {"trainer-0", "trainer-1"}
    assert all(e["version"] == e["iteration"] for e in timeline if e["kind"] in ("gen", "train"))


@pytest.mark.slow
def test_fsdp_resumes_a_reference_checkpoint(reference_run, tiny_sd3, tmp_path, warm_cluster):
    """A non-FSDP checkpoint (after iteration 0) resumes in an FSDP job: the ranks load its
    weights and their shards of its AdamW state, and iterations 1.. equal the reference's."""
    from digen.runtime.controller import run_distributed

    out = tmp_path / "resumed"
    shutil.copytree(reference_run, out)
    for later in range(1, ITERATIONS):
        shutil.rmtree(out / f"checkpoints/iter_{later:04d}")
    held = ["not started"]
    run_distributed(
        _fsdp_config(tiny_sd3),
        out,
        scheduler=warm_cluster(1, 2),
        resume=True,
        on_start=lambda ctl: held.__setitem__(slice(None), _full_stores_held(ctl)),
    )
    assert held == []  # the ranks read the checkpoint's weights and AdamW state; the controller neither

    ref, got = _rewards(reference_run), _rewards(out)
    assert sorted(got) == list(range(ITERATIONS))
    for k in range(1, ITERATIONS):
        assert got[k] == pytest.approx(ref[k], abs=1e-6), f"iteration {k}"
    last = f"checkpoints/iter_{ITERATIONS - 1:04d}/weights.safetensors"
    assert _max_diff(load_file(str(out / last)), load_file(str(reference_run / last))) <= 1e-5
    # the ranks took their shards of the checkpoint's EMA and went on averaging as the reference
    opt = f"checkpoints/iter_{ITERATIONS - 1:04d}/optimizer.safetensors"
    ema_got, ema_ref = (
        {k: v for k, v in load_file(str(d / opt)).items() if k.startswith("ema/")}
        for d in (out, reference_run)
    )
    assert ema_got and _max_diff(ema_got, ema_ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("split", ["groups", "samples"])
def test_fsdp_mini_batches_equal_the_reference(split, tiny_sd3, tmp_path, warm_cluster):
    """Two optimizer steps per rollout batch (``train.mini_batches``, whole groups or Flow-GRPO's
    shuffled samples): the ranks step after each mini-batch's tasks, and every iteration's
    rewards and the final weights match the reference's, which steps the same way."""
    from digen.reference import run_reference
    from digen.runtime.controller import run_distributed

    # mini-batch 1 trains off-policy, where Flow-GRPO's clip (1e-4) decides row by row: a
    # float32 round-off between the sharded and the whole sums could flip a row at the boundary,
    # a jump no tolerance bounds. A wide clip range keeps the comparison continuous.
    train = {"train__mini_batches": 2, "train__clip_range": 10.0, "train__mini_batch_split": split}
    ref = tmp_path / "ref"
    run_reference(_config(tiny_sd3, **train), ref)
    out = tmp_path / "fsdp"
    cfg = _config(
        tiny_sd3,
        **train,
        train__fsdp=True,
        schedule={"mode": "disaggregated", "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
    )
    run_distributed(cfg, out, scheduler=warm_cluster(1, 2))
    r_rows, g_rows = (
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (ref, out)
    )
    assert [r["policy_version"] for r in g_rows] == [r["policy_version"] for r in r_rows] == [2, 4, 6]
    for a, b in zip(r_rows, g_rows, strict=True):
        assert b["rewards"] == pytest.approx(a["rewards"], abs=1e-6), f"iteration {a['iteration']}"
        assert len(b["grad_norms"]) == 2
    last = f"checkpoints/iter_{ITERATIONS - 1:04d}/weights.safetensors"
    assert _max_diff(load_file(str(out / last)), load_file(str(ref / last))) <= 1e-5


@pytest.mark.slow
def test_fsdp_in_digen_mode_resumes_with_the_version_its_rollouts_lag_on(tiny_sd3, tmp_path, warm_cluster):
    """digen mode (staleness 1): the first iteration after --resume generates with the version
    before the checkpoint's, which no rank holds after a restart: the checkpoint keeps it
    (``previous_weights``, put together from the ranks' shards) and the ranks serve their
    shares of it again, so the resumed job runs on as the uninterrupted one does."""
    from digen.runtime.controller import run_distributed

    def cfg(iterations: int):
        data = small_config_data(
            tiny_sd3,
            iterations=iterations,
            model__lora={"enabled": False},
            output__sample_grid_every=0,
            train__fsdp=True,
            schedule={"mode": "digen"},
            cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        )
        return build_config(data)

    out = tmp_path / "run"
    run_distributed(cfg(2), out, scheduler=warm_cluster(1, 2))
    state = json.loads((out / "checkpoints/iter_0001/state.json").read_text())
    assert (state["version"], state["previous_version"]) == (2, 1)
    run_distributed(cfg(3), out, scheduler=warm_cluster(1, 2), resume=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[-1]["max_staleness"] == 1
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert {e["version"] for e in timeline if e["kind"] == "gen" and e["iteration"] == 2} == {1}


@pytest.mark.slow
def test_a_dead_rank_fails_the_job_with_a_resume_hint(tiny_sd3, tmp_path, monkeypatch):
    """trainer-1 is killed while training in iteration 1 (its Nanny restarts it, but an FSDP
    group cannot take a rank back): the job fails naming the FSDP group and --resume, after
    iteration 0's checkpoint."""
    from digen.controlplane.redis_conn import connect
    from digen.runtime.controller import run_distributed
    from digen.runtime.fsdp_group import FsdpGroupFailed
    from digen.testing.faults import Fault, arm, clear, fired

    monkeypatch.setenv("DIGEN_FAULTS", "1")  # the local workers inherit it
    cfg = _fsdp_config(tiny_sd3)
    cfg.schedule.lease_s = 10.0  # also the collective timeout of the rank left waiting
    job_id = "fsdp-dead-rank"
    r = connect(None)
    clear(r, job_id)
    arm(r, job_id, Fault("train", "kill", worker="trainer-1", iteration=1))
    out = tmp_path / "killed"
    try:
        with pytest.raises(FsdpGroupFailed, match=r"FSDP trainer group .* rerun with --resume"):
            run_distributed(cfg, out, job_id=job_id)
        assert [f["worker"] for f in fired(r, job_id)] == ["trainer-1"]
    finally:
        clear(r, job_id)
        r.close()
    assert sorted(_rewards(out)) == [0]
    assert (out / "checkpoints/iter_0000/optimizer.safetensors").exists()


@pytest.mark.slow
def test_fsdp_batched_tasks_gather_once_per_pass_of_the_batch(tiny_sd3, tmp_path, warm_cluster):
    """Two groups per train task (``train.groups_per_task``): each rank trains its share of a
    task's rows of both groups in one forward (one all-gather of the sharded weights, where
    one group per task makes two), and the job equals the reference that batches the same way."""
    from digen.reference import run_reference
    from digen.runtime.controller import run_distributed

    batched = {"train__groups_per_task": 2, "rollout__batch_size": 16}  # 4 groups: 2 tasks
    ref = tmp_path / "ref"
    run_reference(_config(tiny_sd3, **batched, schedule__tsp=True), ref)
    out = tmp_path / "fsdp"
    cfg = _config(
        tiny_sd3,
        **batched,
        train__fsdp=True,
        schedule={"mode": "disaggregated", "max_staleness": 0, "tsp": True},
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
    )
    run_distributed(cfg, out, scheduler=warm_cluster(1, 2))
    r_rows, g_rows = (
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (ref, out)
    )
    # 2 tasks of 16 rows (8 a rank) an iteration, 64 rows a forward: one gather per task
    assert [r["train_forwards"] for r in g_rows] == [r["train_forwards"] for r in r_rows] == [2] * ITERATIONS
    for a, b in zip(r_rows, g_rows, strict=True):
        assert b["rewards"] == pytest.approx(a["rewards"], abs=1e-6), f"iteration {a['iteration']}"
        assert b["trained_rows"] == a["trained_rows"] == 32
    last = f"checkpoints/iter_{ITERATIONS - 1:04d}/weights.safetensors"
    assert _max_diff(load_file(str(out / last)), load_file(str(ref / last))) <= 1e-5
