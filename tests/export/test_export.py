"""``digen export``: the LoRA folder and the pipeline folder load in stock diffusers and sample
what digen's policy samples at that checkpoint (every family, tiny random models).

A run directory is made with digen's own code (``RunDir`` writes ``config.yaml``,
``save_checkpoint`` the ``ParameterStore`` checkpoint) holding a LoRA with non-zero, random
``lora_B`` and ``alpha / r = 3`` (a scale of 1 would hide a wrong alpha). The comparison is the
ODE sample: digen's Euler loop with the policy vs the stock pipeline's ``__call__`` with the
exported weights, same starting latents and steps, compared as latents to 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from digen.assembly import build_policy
from digen.config import build_config
from digen.errors import CheckpointError, ConfigError
from digen.export import LORA_WEIGHT_NAME, diffusers_lora, export_run, find_checkpoint
from digen.models.hunyuan_video import byte_level_tokenizer
from digen.optim import ParameterStore, save_checkpoint
from digen.rundir import RunDir
from tests.conftest import small_config_data
from tests.models._helpers import RES, euler_sample, noise

PROMPT = "a photo of a cat"
STEPS = 2
RANK, ALPHA = 4, 12


# Per family: the guidance digen samples with and the stock pipeline's arguments for the same.
FAMILIES: dict[str, dict[str, Any]] = {
    "sd3": {"scale": 4.5, "uncond": True, "call": {"guidance_scale": 4.5}},
    "flux": {"scale": 3.5, "uncond": False, "call": {"guidance_scale": 3.5}},
    "qwen-image": {"scale": 4.0, "uncond": True, "call": {"negative_prompt": " ", "true_cfg_scale": 4.0}},
    "wan": {"scale": 5.0, "uncond": True, "frames": 5, "call": {"guidance_scale": 5.0, "num_frames": 5}},
    "hunyuan-video": {
        "scale": 6.0,
        "uncond": False,
        "frames": 5,
        "call": {"guidance_scale": 6.0, "num_frames": 5},
    },
}


def run_config(model_dir: Path, arch: str, *, lora: bool = True):
    data = small_config_data(model_dir, model__lora={"enabled": lora, "rank": RANK, "alpha": ALPHA})
    if "frames" in FAMILIES[arch]:
        data["model"]["num_frames"] = FAMILIES[arch]["frames"]
    return build_config(data)


def random_weights(state: dict[str, torch.Tensor], seed: int, *, std: float) -> dict[str, torch.Tensor]:
    """``state`` moved by seeded noise (every tensor, lora_B included, non-zero after)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + std * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def make_run(root: Path, model_dir: Path, arch: str, *, lora: bool = True, iterations=(0,)):
    """A run directory with one checkpoint per iteration (different weights each); returns it
    and ``{iteration: weights}``."""
    cfg = run_config(model_dir, arch, lora=lora)
    run = RunDir(root, cfg)
    policy = build_policy(cfg)
    saved = {}
    for it in iterations:
        weights = random_weights(policy.trainable_state_dict(), seed=100 + it, std=0.05 if lora else 0.02)
        save_checkpoint(
            run.checkpoint_dir(it),
            ParameterStore(weights, cfg.train, version=it + 1),
            it,
            keep=cfg.output.keep_checkpoints,
        )
        saved[it] = weights
    return root, saved


def digen_sample(model_dir: Path, arch: str, weights: dict[str, torch.Tensor] | None, *, lora=True):
    """digen's ODE sample (latents) with ``weights`` loaded into the policy (None: the base)."""
    policy = build_policy(run_config(model_dir, arch, lora=lora))
    if weights is not None:
        policy.load_trainable_state_dict(weights)
    spec = FAMILIES[arch]
    embeds = policy.encode_prompts([PROMPT], with_uncond=spec["uncond"])
    x0 = noise(policy, 1, seed=5)
    return euler_sample(policy, x0, embeds, spec["scale"], steps=STEPS), x0, policy.max_sequence_length


def stock_pipeline(folder: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if type(pipe).__name__ == "HunyuanVideoPipeline":
        # transformers 5 reopens the byte-level Llama tokenizer wrongly (issue 45488): the fix
        # any user of stock diffusers needs too, independent of the LoRA
        pipe.tokenizer = byte_level_tokenizer(pipe.tokenizer)
    return pipe


def stock_sample(pipe, arch: str, x0: torch.Tensor, max_sequence_length: int) -> torch.Tensor:
    """The stock pipeline's latents for the same prompt, start latents and steps."""
    with torch.no_grad():
        return pipe(
            PROMPT,
            height=RES,
            width=RES,
            num_inference_steps=STEPS,
            latents=x0.clone(),
            max_sequence_length=max_sequence_length,
            output_type="latent",
            return_dict=False,
            **FAMILIES[arch]["call"],
        )[0]


@pytest.fixture(scope="module")
def lora_runs(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One LoRA run per family with checkpoints after iterations 0 and 1."""
    root = tmp_path_factory.mktemp("export_runs")
    return {arch: make_run(root / arch, tiny_models(arch), arch, iterations=(0, 1)) for arch in FAMILIES}


# --- LoRA folder -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.slow
def test_lora_export_loads_in_stock_diffusers_and_samples_like_digen(arch, lora_runs, tiny_models, tmp_path):
    run, saved = lora_runs[arch]
    result = export_run(run, tmp_path / "lora")
    assert result.kind == "lora" and result.family == arch and result.iteration == 1
    assert result.policy_version == 2 and (result.lora_rank, result.lora_alpha) == (RANK, ALPHA)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["digen_export.json", LORA_WEIGHT_NAME]

    ours, x0, seq = digen_sample(tiny_models(arch), arch, saved[1])
    pipe = stock_pipeline(tiny_models(arch))
    base = stock_sample(pipe, arch, x0, seq)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = stock_sample(pipe, arch, x0, seq)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (theirs - base).abs().max() > 1e-3  # the adapter has an effect


@pytest.mark.slow
def test_lora_file_layout_and_folded_scale(lora_runs, tmp_path):
    """diffusers' layout: ``transformer.``-prefixed peft keys, adapter metadata r = lora_alpha
    = rank, and ``lora_B`` carrying alpha / r; loaded as a plain dict (no metadata: diffusers
    then assumes lora_alpha = r) it is the same adapter."""
    run, saved = lora_runs["sd3"]
    export_run(run, tmp_path / "lora")
    file = tmp_path / "lora" / LORA_WEIGHT_NAME
    with safe_open(str(file), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert set(tensors) == {f"transformer.{k}" for k in saved[1]}
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == RANK
    key = next(k for k in saved[1] if k.endswith("lora_B.weight"))
    torch.testing.assert_close(tensors[f"transformer.{key}"], saved[1][key] * ALPHA / RANK)
    a_key = key.replace("lora_B", "lora_A")
    assert torch.equal(tensors[f"transformer.{a_key}"], saved[1][a_key])


@pytest.mark.slow
def test_lora_loaded_without_metadata_is_the_same_adapter(lora_runs, tiny_models, tmp_path):
    from safetensors.torch import load_file

    run, saved = lora_runs["sd3"]
    export_run(run, tmp_path / "lora")
    ours, x0, seq = digen_sample(tiny_models("sd3"), "sd3", saved[1])
    pipe = stock_pipeline(tiny_models("sd3"))
    pipe.load_lora_weights(load_file(str(tmp_path / "lora" / LORA_WEIGHT_NAME)))
    torch.testing.assert_close(stock_sample(pipe, "sd3", x0, seq), ours, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_checkpoint_selects_the_iteration(lora_runs, tiny_models, tmp_path):
    run, saved = lora_runs["flux"]
    result = export_run(run, tmp_path / "lora", iteration=0)
    assert result.iteration == 0 and result.policy_version == 1 and result.checkpoint == "iter_0000"
    ours, x0, seq = digen_sample(tiny_models("flux"), "flux", saved[0])
    newest, _, _ = digen_sample(tiny_models("flux"), "flux", saved[1])
    pipe = stock_pipeline(tiny_models("flux"))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = stock_sample(pipe, "flux", x0, seq)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (theirs - newest).abs().max() > 1e-3


@pytest.mark.slow
def test_ema_exports_the_checkpoints_averaged_weights(lora_runs, tiny_models, tmp_path):
    """``--ema``: the EMA copy the checkpoint keeps (``ema/<name>`` in optimizer.safetensors)
    instead of the policy; refused, by name, when the run kept none."""
    from safetensors.torch import load_file

    cfg = run_config(tiny_models("sd3"), "sd3")
    cfg.train.ema.enabled = True
    run = RunDir(tmp_path / "run", cfg)
    policy = build_policy(cfg)
    store = ParameterStore(random_weights(policy.trainable_state_dict(), seed=1, std=0.05), cfg.train, 1)
    store.ema = random_weights(policy.trainable_state_dict(), seed=2, std=0.05)
    save_checkpoint(run.checkpoint_dir(0), store, 0, keep=cfg.output.keep_checkpoints)
    result = export_run(tmp_path / "run", tmp_path / "ema", ema=True)
    assert result.weights == "ema"
    exported = load_file(str(tmp_path / "ema" / LORA_WEIGHT_NAME))
    expected, _ = diffusers_lora(store.ema, alpha=ALPHA)
    assert set(exported) == {f"transformer.{k}" for k in expected}
    assert all(torch.equal(exported[f"transformer.{k}"], v) for k, v in expected.items())
    assert not torch.equal(
        expected[next(iter(expected))], diffusers_lora(store.weights(), alpha=ALPHA)[0][next(iter(expected))]
    )
    with pytest.raises(CheckpointError, match="--ema: checkpoint .* holds no EMA weights"):
        export_run(lora_runs["sd3"][0], tmp_path / "none", ema=True)


def test_a_run_with_train_ema_export_exports_its_ema_unless_told_not_to(tiny_models, tmp_path):
    """``train.ema.export``: ``digen export`` without ``--ema`` exports the EMA; ``--no-ema``
    (``ema=False``) the policy's weights; a run without the key, the policy's."""
    from safetensors.torch import load_file

    policy = None
    runs = {}
    for key in (True, False):
        cfg = run_config(tiny_models("sd3"), "sd3")
        cfg.train.ema.enabled, cfg.train.ema.export = True, key
        run = RunDir(tmp_path / f"run-{key}", cfg)
        policy = policy or build_policy(cfg)
        store = ParameterStore(random_weights(policy.trainable_state_dict(), seed=1, std=0.05), cfg.train, 1)
        store.ema = random_weights(policy.trainable_state_dict(), seed=2, std=0.05)
        save_checkpoint(run.checkpoint_dir(0), store, 0, keep=cfg.output.keep_checkpoints)
        runs[key] = store

    def exported(run: str, out: str, **kw) -> tuple[str, dict[str, torch.Tensor]]:
        result = export_run(tmp_path / run, tmp_path / out, **kw)
        return result.weights, load_file(str(tmp_path / out / LORA_WEIGHT_NAME))

    store = runs[True]
    for (run, out, kw), (what, source) in {
        ("run-True", "default", ()): ("ema", store.ema),
        ("run-True", "no-ema", (("ema", False),)): ("policy", store.weights()),
        ("run-False", "off", ()): ("policy", runs[False].weights()),
    }.items():
        weights, got = exported(run, out, **dict(kw))
        expected, _ = diffusers_lora(source, alpha=ALPHA)
        assert weights == what and set(got) == {f"transformer.{k}" for k in expected}
        assert all(torch.equal(got[f"transformer.{k}"], v) for k, v in expected.items()), (run, out)


# --- pipeline folder -------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.slow
def test_merged_export_is_a_pipeline_folder_that_samples_like_digen(arch, lora_runs, tiny_models, tmp_path):
    run, saved = lora_runs[arch]
    result = export_run(run, tmp_path / "merged", merge=True)
    assert result.kind == "pipeline" and result.trained == "lora"
    ours, x0, seq = digen_sample(tiny_models(arch), arch, saved[1])
    theirs = stock_sample(stock_pipeline(tmp_path / "merged"), arch, x0, seq)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    base = stock_sample(stock_pipeline(tiny_models(arch)), arch, x0, seq)
    assert (theirs - base).abs().max() > 1e-3
    # every component but the transformer is the base's, byte for byte
    for f in tiny_models(arch).rglob("*"):
        rel = f.relative_to(tiny_models(arch))
        if f.is_file() and rel.parts[0] != "transformer":
            assert (tmp_path / "merged" / rel).read_bytes() == f.read_bytes(), rel


@pytest.mark.parametrize("arch", ["sd3", "qwen-image"])
@pytest.mark.slow
def test_full_fine_tune_exports_a_pipeline_folder(arch, tiny_models, tmp_path):
    run, saved = make_run(tmp_path / "run", tiny_models(arch), arch, lora=False)
    result = export_run(run, tmp_path / "full")
    assert result.kind == "pipeline" and result.trained == "full" and result.lora_rank is None
    ours, x0, seq = digen_sample(tiny_models(arch), arch, saved[0], lora=False)
    theirs = stock_sample(stock_pipeline(tmp_path / "full"), arch, x0, seq)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    base = stock_sample(stock_pipeline(tiny_models(arch)), arch, x0, seq)
    assert (theirs - base).abs().max() > 1e-3


# --- errors ----------------------------------------------------------------------------
@pytest.mark.slow
def test_no_checkpoint_bad_iteration_and_not_a_run(tiny_models, tmp_path, lora_runs):
    cfg = run_config(tiny_models("sd3"), "sd3")
    RunDir(tmp_path / "empty", cfg)
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        export_run(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"--checkpoint \(7\) is not a checkpoint of .*iterations 0, 1"):
        find_checkpoint(lora_runs["sd3"][0], 7)
    with pytest.raises(ConfigError, match=r"is not a digen run directory \(no config.yaml\)"):
        export_run(tmp_path, tmp_path / "out")
    with pytest.raises(ConfigError, match="does not exist"):
        export_run(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_out_dir_must_be_empty_unless_forced(lora_runs, tmp_path):
    run, _ = lora_runs["sd3"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"--out .* is not empty; .* --force"):
        export_run(run, out)
    assert (out / "keep.txt").read_text() == "x"
    export_run(run, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["digen_export.json", LORA_WEIGHT_NAME]
    with pytest.raises(ConfigError, match="is or contains RUN_DIR"):
        export_run(run, run.parent, force=True)
    with pytest.raises(ConfigError, match="is or contains the checkpoint"):
        export_run(run, run / "checkpoints", force=True)
    assert (run / "config.yaml").exists()


@pytest.mark.slow
def test_moved_base_model_and_mismatched_checkpoint(lora_runs, tiny_models, tmp_path):
    run, _ = lora_runs["sd3"]
    with pytest.raises(ConfigError, match="does not exist"):
        export_run(run, tmp_path / "out", model_path=tmp_path / "gone")
    # a LoRA trained on SD3 merged into FLUX: named, not silently written
    with pytest.raises(CheckpointError, match="is model.path the model the run trained"):
        export_run(run, tmp_path / "out", merge=True, model_path=tiny_models("flux"))
    assert not (tmp_path / "out").exists()


def test_unpaired_lora_is_refused():
    with pytest.raises(CheckpointError, match="not a lora_A"):
        diffusers_lora({"x.lora_A.weight": torch.zeros(2, 3)}, alpha=4)


# --- end to end ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.slow
def test_cli_exports_a_trained_run(tiny_sd3, tmp_path):
    """One real reference iteration, then ``digen export``: the stock pipeline with the LoRA
    samples what the trained policy samples, and not what the base does."""
    from safetensors.torch import load_file

    from digen.cli.main import app
    from digen.reference import run_reference

    data = small_config_data(
        tiny_sd3,
        iterations=1,
        model__lora={"enabled": True, "rank": RANK, "alpha": ALPHA},
        train__lr=2e-2,
        output__sample_grid_every=0,
    )
    run_reference(build_config(data), tmp_path / "run")
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "lora")])
    assert res.exit_code == 0, res.output
    assert "iteration 0" in res.output and "load_lora_weights" in res.output
    # the hint names the run's base model, not a placeholder
    assert f"StableDiffusion3Pipeline.from_pretrained({str(Path(tiny_sd3).resolve())!r})" in res.output
    assert "BASE" not in res.output
    weights = load_file(str(tmp_path / "run/checkpoints/iter_0000/weights.safetensors"))
    ours, x0, seq = digen_sample(tiny_sd3, "sd3", weights)
    pipe = stock_pipeline(tiny_sd3)
    base = stock_sample(pipe, "sd3", x0, seq)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = stock_sample(pipe, "sd3", x0, seq)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (theirs - base).abs().max() > 1e-4

    again = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "lora")])
    assert again.exit_code == 2 and "--force" in again.output
    bad = runner.invoke(
        app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--checkpoint", "3"]
    )
    assert bad.exit_code == 2 and "--checkpoint (3)" in bad.output
