"""``digen plan``'s memory prediction (:mod:`digen.memory`): measured on the ``meta`` device
from the model's shape, it scales with the rows per forward, drops with activation
checkpointing and LoRA, and a GPU whose workers do not fit is refused in one line naming the
key to change."""

from __future__ import annotations

from digen.cluster.placement import Gpu, place
from digen.config import build_config
from digen.memory import fit_problem, measure, predict
from tests.conftest import small_config_data


def _cfg(model, **train):
    data = small_config_data(model, train=train)
    data["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1, "workers_per_gpu": 2}}
    return build_config(data)


def test_the_prediction_follows_the_models_shape_and_the_keys(tiny_sd3):
    weights, transformer, trained, row = measure(_cfg(tiny_sd3))
    assert weights > transformer > 0 and trained > 0 and row.blocks == 2 and row.saved > row.block_inputs > 0
    trainer, rollout = predict(_cfg(tiny_sd3, rows_per_forward=8))
    assert (trainer.role, rollout.role) == ("trainer", "rollout")
    assert trainer.activations == 8 * row.saved and trainer.optimizer == 5 * 4 * trained
    assert rollout.total == rollout.weights == weights
    double = predict(_cfg(tiny_sd3, rows_per_forward=16))[0]
    assert double.activations == 2 * trainer.activations
    ckpt = predict(_cfg(tiny_sd3, rows_per_forward=8, activation_checkpointing=True))[0]
    assert 0 < ckpt.activations < trainer.activations
    assert predict(_cfg(tiny_sd3, ema={"enabled": True}))[0].optimizer == 6 * 4 * trained  # the EMA's copy
    full = build_config(
        {
            **small_config_data(tiny_sd3),
            "model": {**small_config_data(tiny_sd3)["model"], "lora": {"enabled": False}},
        }
    )
    assert predict(full)[0].optimizer > 10 * trainer.optimizer  # every weight trained, not the adapter


def test_a_gpu_whose_workers_do_not_fit_is_refused_naming_the_key(tiny_sd3):
    cfg = _cfg(tiny_sd3, rows_per_forward=64)
    estimates = predict(cfg)
    trainer = estimates[0]
    small = [Gpu(0, "NVIDIA Tiny", 0)]
    p = place([("rollout-0", "rollout"), ("trainer-0", "trainer")], small, workers_per_gpu=2)
    assert fit_problem(estimates, p, small) is None  # memory unknown: not judged
    per_row = trainer.activations / trainer.rows
    fixed = sum(e.total for e in estimates) - trainer.activations
    mib = int((fixed + 10.5 * per_row) / 2**20) + 1  # room for about 10 rows, not 64
    tight = [Gpu(0, "NVIDIA Tiny", mib)]
    problem = fit_problem(estimates, p, tight)
    assert problem is not None and "\n" not in problem
    assert "on GPU 0" in problem and "lower train.rows_per_forward to " in problem
    rows = int(problem.split("lower train.rows_per_forward to ")[1].split(",")[0])
    assert rows in (10, 11)  # the room left for rows, rounded to the MiB
    roomy = [Gpu(0, "NVIDIA Tiny", mib * 20)]
    assert fit_problem(estimates, p, roomy) is None


def test_plan_prints_each_workers_predicted_peak(tiny_sd3, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from digen.cli.main import app

    path = tmp_path / "cfg.yaml"
    data = small_config_data(tiny_sd3)
    data["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["plan", str(path), "--gpus", "2xh100"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    at = lines.index("memory (predicted peak per worker):")
    assert lines[at + 1].lstrip().startswith("trainer  ~") and "rows" in res.output
