"""The launch-script reader as the shell reads assignments, ``import-config --set``, refusals
that name the peer's key, and a device the machine lacks as one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.config import build_config
from digen.errors import ConfigError
from digen.importers import import_config
from digen.importers.shell import read_command
from tests.conftest import required

PEERS = Path(__file__).resolve().parents[1] / "data" / "peers"
GRPO = PEERS / "flow_grpo" / "config" / "grpo.py"
VO = PEERS / "verl_omni" / "examples" / "flowgrpo_trainer"
DANCE = PEERS / "dance_grpo" / "scripts" / "finetune" / "finetune_flux_grpo.sh"

SCRIPT = """\
#!/bin/bash
export NNODES=${NNODES:-2}          # nodes
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
TOTAL=$((NNODES * GPUS_PER_NODE))   {trailing}
BATCH=$((32 * TOTAL / 4))   # scaled
NAME="a name with spaces"  # quoted
LIST=${LIST:-'["q","k"]'}
CMD=$(date +%s)
FROM_ENV=${FROM_ENV}
python3 -m trainer.main a.batch=$BATCH b.name="$NAME" c.list=$LIST d.total=${TOTAL} e=$CMD f=$FROM_ENV # comment
"""


def test_assignments_read_as_the_shell_reads_them(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(
        SCRIPT.replace("{trailing}", "")
    )  # trailing spaces after the arithmetic, as in VeRL-Omni's
    command = read_command(path, "trainer.main")
    assert command.program == "trainer.main" and command.launcher == ["python3", "-m"]
    assert command.args == [
        "a.batch=64", "b.name=a name with spaces", 'c.list=["q","k"]', "d.total=8", "e=$CMD",
        "f=${FROM_ENV}",
    ]  # fmt: skip


def test_a_script_that_runs_another_trainer_is_refused_naming_what_it_runs(tmp_path):
    """A VeRL-Omni LLM script (verl.trainer.main_ppo) and a wrapper of another recipe
    (``bash "$DIR/run_x.sh" overrides``): the refusal names what they run instead."""
    llm = tmp_path / "llm.sh"
    llm.write_text(
        "#!/bin/bash\n# python3 -m verl_omni.trainer.main_diffusion in a comment\npython3 -m verl.trainer.main_ppo a=1\n"
    )
    with pytest.raises(
        ConfigError, match=r"does not call trainer.main_diffusion \(it runs verl.trainer.main_ppo\); not"
    ):
        read_command(llm, "trainer.main_diffusion")
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text('#!/bin/bash\nSCRIPT_DIR=/x\nN=2 bash "$SCRIPT_DIR/run_qwen_image_ocr.sh" \\\n  a=1\n')
    with pytest.raises(ConfigError, match=r"\(it runs run_qwen_image_ocr.sh\)"):
        read_command(wrapper, "trainer.main_diffusion")


@pytest.mark.parametrize(
    "script",
    [
        "qwen_image/run_qwen_image_ocr_lora_multi_node.sh",
        "sd35/run_sd35_medium_ocr_lora_v1_separate_async.sh",
    ],
)
def test_the_two_scripts_that_crashed_the_reader_import(script):
    """`TRAIN_BATCH_SIZE=$((32 * TOTAL_GPUS / 4))   ` and `TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-8}   # comment`
    used to leave `$TRAIN_BATCH_SIZE` in the command (ValueError from int())."""
    result = import_config("verl-omni", str(VO / script))
    result.validate()
    expected = {
        "qwen_image/run_qwen_image_ocr_lora_multi_node.sh": 64 * 16,
        "sd35/run_sd35_medium_ocr_lora_v1_separate_async.sh": 8 * 8,
    }
    assert result.config["rollout"]["batch_size"] == expected[script]


def test_a_value_computed_at_run_time_is_refused_naming_the_key(tmp_path):
    text = (VO / "sd35" / "run_sd35_medium_ocr_lora.sh").read_text()
    bad = tmp_path / "examples" / "run.sh"
    bad.parent.mkdir()
    bad.write_text(text.replace("data.train_batch_size=", "data.train_batch_size=$(nproc)", 1))
    generated = PEERS / "verl_omni" / "verl_omni" / "trainer" / "config" / "_generated_diffusion_trainer.yaml"
    (tmp_path / "verl_omni" / "trainer" / "config").mkdir(parents=True)
    (tmp_path / "verl_omni" / "trainer" / "config" / generated.name).write_text(generated.read_text())
    with pytest.raises(
        ConfigError, match=r"data.train_batch_size=\$\(nproc\)\S*: the launch script computes it at run time"
    ):
        import_config("verl-omni", str(bad))


@pytest.mark.parametrize(
    "recipe, cause",
    [
        ("compressibility", "sample.num_image_per_prompt (1) leaves no group to compare"),
        ("pickscore_sd3_fast", "sample.mini_num_image_per_prompt (9), which no script reads"),
    ],
)
def test_refusals_name_the_peer_s_key(recipe, cause):
    r = CliRunner().invoke(app, ["import-config", "flow-grpo", f"{GRPO}:{recipe}"])
    assert r.exit_code == 2 and cause in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_import_config_set_overrides_and_says_so(tmp_path):
    out = tmp_path / "dance.yaml"
    r = CliRunner().invoke(
        app,
        ["import-config", "dance-grpo", str(DANCE), "--out", str(out), "--set", "model.device=auto",
         "--set", "model.path=models/flux", "--set", "rollout.num_steps=8"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "# Set by --set (not the peer's):" in text and "#   model.device: 'auto'" in text
    cfg = build_config(__import__("yaml").safe_load(text), check_paths=False)
    assert (cfg.model.device, cfg.model.path, cfg.rollout.num_steps) == ("auto", "models/flux", 8)
    assert "fill in model.path" not in r.output  # the user gave it
    bad = CliRunner().invoke(app, ["import-config", "dance-grpo", str(DANCE), "--set", "rollout.num_steps"])
    assert bad.exit_code == 2 and "is not KEY=VALUE" in bad.output


def test_a_cuda_device_on_a_machine_without_one_is_one_line(monkeypatch, tmp_path):
    from digen.engine import device_problem, run_training

    monkeypatch.setenv("DIGEN_FAKE_GPUS", "")  # nvidia-smi lists none
    cfg = build_config(required({"model": {"device": "cuda"}}), check_paths=False)
    with pytest.raises(ConfigError) as err:
        run_training(cfg, tmp_path / "run")
    assert str(err.value) == device_problem(cfg) and "--set model.device=auto" in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing started
    assert device_problem(build_config(required({"model": {"device": "auto"}}), check_paths=False)) is None
    monkeypatch.setenv("DIGEN_FAKE_GPUS", "1xH100")
    assert device_problem(cfg) is None
