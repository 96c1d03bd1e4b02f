"""Held-out evaluation in the reference trainer: rows, components, determinism, no effect on
training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.assembly import build_policy, build_reward
from digen.config import EmaConfig, build_config
from digen.errors import ConfigError
from digen.evaluation import EvalBook, EvalResult, EvalTask, held_out_prompts, plan_eval
from digen.evaluator import evaluate_chunk
from digen.reference import run_reference
from digen.viz import image_cells
from tests.conftest import small_config_data

TEST_PROMPTS = ["a purple cube", "an orange cat", "a white cloud", "a black road", "a pink flower"]
REWARDS = [{"name": "brightness"}, {"name": "jpeg_compressibility", "weight": 0.5}]


def eval_config(model: Path, tmp: Path, **sections):
    path = tmp / "test.txt"
    path.write_text("\n".join(TEST_PROMPTS) + "\n")
    data = small_config_data(
        model,
        iterations=3,
        reward=REWARDS,
        prompts__test_file=str(path),
        rollout__eval_steps=3,
        eval={"every": 2, "num_prompts": 4, "seed": 7, "batch_size": 3},
        **sections,
    )
    return build_config(data)


def eval_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    return load_file(str(last / "weights.safetensors"))


@pytest.fixture(scope="module")
def eval_run(tiny_sd3, tmp_path_factory) -> tuple[Path, object]:
    """(run directory, config) of the reference on :func:`eval_config`, run once for the
    module's tests that only read it."""
    tmp = tmp_path_factory.mktemp("eval")
    cfg = eval_config(tiny_sd3, tmp)
    run_reference(cfg, tmp / "run")
    return tmp / "run", cfg


def test_eval_rows_every_n_iterations_and_at_the_end(eval_run):
    run = eval_run[0]
    rows = eval_rows(run)
    assert [(r["iteration"], r["policy_version"]) for r in rows] == [(1, 2), (2, 3)]
    for r in rows:
        assert r["num_prompts"] == 4
        assert set(r["scores"]) == {"reward", "brightness", "jpeg_compressibility"}
        assert all(len(v) == 4 for v in r["scores"].values())
        b, j = torch.tensor(r["scores"]["brightness"]), torch.tensor(r["scores"]["jpeg_compressibility"])
        assert torch.allclose(torch.tensor(r["scores"]["reward"]), b + 0.5 * j, atol=1e-5)
        assert r["brightness_mean"] == pytest.approx(float(b.double().mean()))
        assert r["brightness_std"] == pytest.approx(float(b.double().std(unbiased=False)))
    assert rows[0]["scores"] != rows[1]["scores"]  # another version, other images
    assert sorted(p.name for p in (run / "eval").glob("*.png")) == [
        "iter_0001.png",
        "iter_0002.png",
    ]


def test_eval_does_not_change_training(eval_run, tmp_path):
    on_run, on = eval_run
    off = on.model_copy(update={"eval": on.eval.model_copy(update={"every": 0})})
    run_reference(off, tmp_path / "off")
    assert (on_run / "eval.jsonl").exists() and not (tmp_path / "off" / "eval.jsonl").exists()
    a, b = weights(on_run), weights(tmp_path / "off")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    metrics = [(run / "metrics.jsonl").read_text().splitlines() for run in (on_run, tmp_path / "off")]
    assert [json.loads(x)["rewards"] for x in metrics[0]] == [json.loads(x)["rewards"] for x in metrics[1]]


def test_evaluate_chunk_is_deterministic_and_uses_the_ode_sampler(tiny_sd3, tmp_path):
    cfg = eval_config(tiny_sd3, tmp_path)
    policy, reward = build_policy(cfg), build_reward(cfg)
    task = plan_eval(cfg, held_out_prompts(cfg), 0)[0]
    a, b = evaluate_chunk(policy, task, cfg, reward), evaluate_chunk(policy, task, cfg, reward)
    assert a.cells.tobytes() == b.cells.tobytes() and a.scores == b.scores
    assert a.cells.height == 64 and a.cells.width == 64 * len(task.indices)  # one grid cell per prompt
    other = evaluate_chunk(
        policy, task, cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"seed": 8})}), reward
    )
    assert a.cells.tobytes() != other.cells.tobytes()  # the seed decides the noise


def test_plan_eval_chunks_the_first_num_prompts(tiny_sd3, tmp_path):
    cfg = eval_config(tiny_sd3, tmp_path)
    tasks = plan_eval(cfg, held_out_prompts(cfg), 4)
    assert [t.indices for t in tasks] == [(0, 1, 2), (3,)]
    assert [t.prompts for t in tasks] == [tuple(TEST_PROMPTS[:3]), (TEST_PROMPTS[3],)]
    assert {t.version for t in tasks} == {5}
    assert EvalTask.from_json(json.loads(json.dumps(tasks[0].to_json()))) == tasks[0]


def test_eval_book_counts_a_chunk_once_in_any_order():
    book = EvalBook(0, 1, 2)
    img = image_cells(torch.zeros((1, 3, 8, 8), dtype=torch.uint8))
    r1 = EvalResult(EvalTask(0, 1, 1, (1,), ("b",)), img, {"reward": [2.0]})
    r0 = EvalResult(EvalTask(0, 0, 1, (0,), ("a",)), img, {"reward": [1.0]})
    book.add(r1)
    book.add(r1)
    assert not book.complete
    book.add(r0)
    row = book.row()
    assert row["scores"] == {"reward": [1.0, 2.0]} and row["reward_mean"] == 1.5 and row["reward_std"] == 0.5


def test_eval_needs_a_test_file(tiny_sd3):
    with pytest.raises(ConfigError, match="eval.every"):
        build_config(small_config_data(tiny_sd3, eval={"every": 1}))


def test_auto_eval_batch_size_matches_one_generation_task(tiny_sd3, tmp_path):
    from digen.evaluation import eval_batch_size

    cfg = eval_config(tiny_sd3, tmp_path)
    assert eval_batch_size(cfg) == 3  # set explicitly
    cfg.eval.batch_size = 0
    cfg.rollout.group_size, cfg.rollout.num_steps, cfg.rollout.eval_steps = 4, 8, 20
    assert eval_batch_size(cfg) == 1  # 4 x 8 = 32 denoising steps hold one 20-step prompt
    cfg.rollout.group_size, cfg.rollout.num_steps, cfg.rollout.eval_steps = 16, 10, 40
    assert eval_batch_size(cfg) == 4  # Flow-GRPO-like: 160 steps per group, 40 per eval prompt
    cfg.rollout.eval_steps = 3
    assert len(plan_eval(cfg, TEST_PROMPTS, 0)) == 1  # 53 prompts fit: one chunk


# --- with the EMA weights (train.ema.eval) ---------------------------------------------
EMA = {"enabled": True, "every": 1, "eval": True}
"""An EMA that moves at every step (the default moves every 8th), evaluated."""
EMA_LR = 0.03
"""A learning rate at which the EMA and the weights score apart (by 2.6e-4 after 3 steps; at
the tests' usual 1e-3, by 1e-5)."""


def _shifted(weights: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: v + by * torch.ones_like(v) for k, v in weights.items()}


def test_ema_eval_samples_the_ema_and_gives_the_weights_back(tiny_sd3, tmp_path):
    """The chunk's scores and images are those of a policy holding the EMA as its weights;
    afterwards the policy holds its own weights again, bit for bit. With the key off the
    same version is evaluated with its weights."""
    from digen.algos.state import load_version, with_ema
    from digen.evaluator import sample_chunk

    cfg = eval_config(tiny_sd3, tmp_path, train__ema=EMA)
    off = eval_config(tiny_sd3, tmp_path, train__ema={**EMA, "eval": False})
    policy, reward = build_policy(cfg), build_reward(cfg)
    base = policy.trainable_state_dict()
    w, ema = _shifted(base, 0.02), _shifted(base, -0.03)
    whole = plan_eval(cfg, held_out_prompts(cfg), 0)[0]
    task = EvalTask(0, 0, whole.version, whole.indices[:1], whole.prompts[:1])  # one prompt: fast
    load_version(policy, with_ema(w, ema))
    got = evaluate_chunk(policy, task, cfg, reward)
    after = policy.trainable_state_dict()
    assert all(torch.equal(after[k], w[k].to(after[k].dtype)) for k in w)
    plain = evaluate_chunk(policy, task, off, reward)
    by_weights = sample_chunk(policy, task, cfg, reward)
    load_version(policy, ema)
    by_ema = sample_chunk(policy, task, cfg, reward)
    assert got.scores == by_ema.scores and got.cells.tobytes() == by_ema.cells.tobytes()
    assert plain.scores == by_weights.scores and plain.cells.tobytes() == by_weights.cells.tobytes()
    assert got.cells.tobytes() != plain.cells.tobytes()
    load_version(policy, w)  # a version loaded without its EMA cannot be evaluated with it
    with pytest.raises(RuntimeError, match="without its EMA"):
        evaluate_chunk(policy, task, cfg, reward)


def test_only_evaluated_versions_carry_the_ema(tiny_sd3, tmp_path):
    from digen.evaluation import carries_ema

    cfg = eval_config(tiny_sd3, tmp_path, train__ema=EMA, train__mini_batches=2)
    cfg.iterations = 5
    assert [v for v in range(12) if carries_ema(cfg, v)] == [4, 8, 10]  # after iterations 1, 3, 4
    cfg.train.ema.eval = False
    assert not any(carries_ema(cfg, v) for v in range(12))
    cfg.train.ema.eval, cfg.eval.every = True, 0
    assert not any(carries_ema(cfg, v) for v in range(12))


def last_checkpoint_scores(cfg, run: Path) -> tuple[list[float], list[float]]:
    """The ``reward`` scores of the evaluation after ``cfg``'s last iteration, sampled here from
    ``run``'s last checkpoint: (with its EMA, ``ema/<name>`` in optimizer.safetensors; with its
    weights)."""
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    opt = load_file(str(last / "optimizer.safetensors"))
    ema = {k.removeprefix("ema/"): v for k, v in opt.items() if k.startswith("ema/")}
    w = load_file(str(last / "weights.safetensors"))
    assert ema.keys() == w.keys() and any(not torch.equal(ema[k], w[k]) for k in w)
    plain = cfg.model_copy(update={"train": cfg.train.model_copy(update={"ema": EmaConfig()})})
    policy, reward = build_policy(plain), build_reward(plain)
    tasks = plan_eval(plain, held_out_prompts(plain), cfg.iterations - 1)

    def scores(tensors: dict[str, torch.Tensor]) -> list[float]:
        policy.load_trainable_state_dict(tensors)
        return [x for t in tasks for x in evaluate_chunk(policy, t, plain, reward).scores["reward"]]

    return scores(ema), scores(w)


def test_reference_ema_eval_scores_the_checkpoints_ema(tiny_sd3, tmp_path):
    """The reference run's last evaluation is the evaluation of the last checkpoint's EMA;
    with the key off, of its weights; the key changes nothing in training."""
    on = eval_config(tiny_sd3, tmp_path, train__ema=EMA, train__lr=EMA_LR)
    off = eval_config(tiny_sd3, tmp_path, train__ema={**EMA, "eval": False}, train__lr=EMA_LR)
    run_reference(on, tmp_path / "on")
    run_reference(off, tmp_path / "off")
    a, b = weights(tmp_path / "on"), weights(tmp_path / "off")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    by_ema, by_weights = last_checkpoint_scores(on, tmp_path / "on")
    row_on, row_off = eval_rows(tmp_path / "on")[-1], eval_rows(tmp_path / "off")[-1]
    assert row_on["policy_version"] == row_off["policy_version"] == 3
    # the same sampling of the same tensors in another process state: measured apart by at
    # most 6e-8 (float32 rounding)
    assert row_on["scores"]["reward"] == pytest.approx(by_ema, abs=1e-6)
    assert row_off["scores"]["reward"] == pytest.approx(by_weights, abs=1e-6)
    assert max(abs(x - y) for x, y in zip(by_ema, by_weights, strict=True)) > 1e-4
