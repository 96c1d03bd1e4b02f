"""Flow-GRPO's ``config/grpo.py:RECIPE`` (on ``config/base.py``) as a digen config.

The recipe is read by :mod:`digen.importers.pyconfig` (parsed, never run). Besides the config,
Flow-GRPO fixes some numbers in the training script a recipe runs with (``scripts/train_*.py``
at yifan123/flow_grpo 9745241): the LoRA rank and alpha, the text length, the zero-advantage
filter, the EMA's decay and interval. :func:`script_for` picks that script from the model and
the recipe's name as Flow-GRPO's README pairs them, and :data:`SCRIPTS` holds its numbers.
docs/coming-from-flow-grpo.md is the same mapping for a reader; every key of base.py is either
carried below or named in :data:`NO_EQUIVALENT` (a test checks both against the committed
base.py).
"""

from __future__ import annotations

import ast
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digen.errors import ConfigError
from digen.importers.common import (
    Imported,
    family_problem,
    flow_grpo_member,
    served_reward,
    set_dotted,
    set_mini_batches,
)
from digen.importers.pyconfig import UNEVALUATED, ConfigModule, flatten


@dataclass(frozen=True)
class Script:
    """What a Flow-GRPO training script fixes in code."""

    lora_rank: int
    lora_alpha: int
    max_sequence_length: int | None  # None: the script passes none (the pipeline's own)
    drops_zero_advantage: bool  # `advantages.abs().sum(dim=1) != 0` filter in `main`
    windowed: bool  # reads sample.sde_window_size / sde_window_range
    lora_targets: tuple[str, ...]  # the script's LoraConfig(target_modules=[...])
    ema: bool = True  # builds flow_grpo/ema.py's EMAModuleWrapper (decay 0.9, interval 8)


_ATTN = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
         "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")  # fmt: skip  # train_sd3.py l.419-428
_FLUX = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
         "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
         "ff_context.net.2")  # fmt: skip  # train_flux.py l.411-424
_QWEN = (
    *_FLUX[:8],
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)  # l.410-423
_WAN = tuple(t.removeprefix("attn.") for t in _ATTN)  # train_wan2_1.py l.451-460

SCRIPTS: dict[str, Script] = {
    "train_sd3.py": Script(32, 64, 128, True, False, _ATTN),
    "train_sd3_fast.py": Script(32, 64, 128, True, True, _ATTN),
    "train_sd3_GRPO_Guard.py": Script(32, 64, 128, True, False, _ATTN),
    "train_flux.py": Script(64, 128, 128, False, False, _FLUX),
    "train_flux_fast.py": Script(64, 128, 128, False, True, _FLUX),
    "train_flux_kontext.py": Script(64, 128, 128, True, False, (*_FLUX, "proj_mlp")),
    "train_qwenimage.py": Script(64, 128, None, False, True, _QWEN, ema=False),
    "train_qwenimage_edit.py": Script(64, 128, None, False, True, _QWEN, ema=False),
    "train_wan2_1.py": Script(32, 64, 512, True, False, _WAN),
    "train_bagel.py": Script(64, 128, None, False, False, (), ema=False),
}

NO_EQUIVALENT: dict[str, str] = {
    "run_name": "digen names a run by its directory: digen train CONFIG --out runs/NAME",
    "logdir": "digen writes logs, metrics and checkpoints to the run directory (--out)",
    "save_dir": "checkpoints go to RUN_DIR/checkpoints (--out)",
    "debug": "a development switch of the peer's loop (skips saving and evaluation)",
    "num_epochs": "scripts/train_sd3.py loops until stopped (`while True`); digen runs "
    "`iterations` (one Flow-GRPO epoch each): set your budget with --set iterations=N",
    "resume_from": "a command-line flag in digen: digen train CONFIG --out RUN_DIR --resume",
    "allow_tf32": "digen leaves PyTorch's float32 matmul precision at its default (TF32 off); "
    "set torch.backends.cuda.matmul.allow_tf32 in your own launcher to match",
    "fsdp_optimizer_offload": "digen keeps the optimizer state on the GPU (train.fsdp shards it)",
    "pretrained.revision": "model.path is one local snapshot: pick the revision when you "
    "download it (huggingface-cli download --revision)",
    "prompt_fn_kwargs": "digen's prompt loaders take no arguments",
    "sample.eval_guidance_scale": "digen evaluates with rollout.guidance_scale (scripts/train_sd3.py "
    "also evaluates with sample.guidance_scale; only the *_fast scripts read this key)",
    "sample.kl_reward": "KL in the reward has no equivalent (train.kl_beta is the KL loss)",
    "train.use_8bit_adam": "digen's optimizer is torch.optim.AdamW (no bitsandbytes)",
    "train.clip_range_lt": "no Flow-GRPO script reads it (9745241): train.clip_range is the range",
    "train.clip_range_gt": "no Flow-GRPO script reads it (9745241): train.clip_range is the range",
    "train.timestep_shift": "read only by scripts/train_bagel.py (BAGEL, not a digen family)",
    "train.highclip_range": "no Flow-GRPO script reads it (9745241; config/grpo_guard.py sets it): "
    "train.clip_range is the range",
    "run_project": "the wandb project of scripts/train_sd3_GRPO_Guard.py (l.369): digen logs to the run "
    "directory (logging.*)",
    "train_attribute": "read by no script (9745241; a comment in config/grpo_guard.py)",
    "train.lora_path": "digen starts LoRA from zero: a pre-trained adapter is not loaded "
    "(merge it into model.path's weights first)",
    "train.sft": "the SFT term mixed into RL is not in digen",
    "train.sft_batch_size": "the SFT term mixed into RL is not in digen",
    "diffusion_loss": "read by no script of this recipe (9745241)",
    "sample.batch_size": "read by no script (9745241): sample.train_batch_size is the per-GPU batch",
    "sample.sample_time_per_prompt": "scripts/train_wan2_1.py's repeats of a prompt per epoch: not in digen",
    "sample.train_num_steps": "scripts/train_sd3_fast.py's shortened training trajectories: not in digen",
    "sample.mini_num_image_per_prompt": "scripts/train_sd3_fast.py trains a subset of each group: not in digen",
    "width": "digen's frames are square: model.resolution is the height",
}

# the keys a recipe may set that the translation below reads
_CARRIED = {
    "seed", "rationorm", "save_freq", "eval_freq", "num_checkpoint_limit", "mixed_precision", "use_lora",
    "dataset", "resolution", "activation_checkpointing", "pretrained.model", "sample.num_steps",
    "sample.eval_num_steps", "sample.guidance_scale", "sample.train_batch_size",
    "sample.num_image_per_prompt", "sample.test_batch_size", "sample.num_batches_per_epoch",
    "sample.global_std", "sample.noise_level", "sample.same_latent", "sample.sde_type",
    "sample.sde_window_size", "sample.sde_window_range", "train.batch_size", "train.learning_rate", "train.adam_beta1",
    "train.adam_beta2", "train.adam_weight_decay", "train.adam_epsilon",
    "train.gradient_accumulation_steps", "train.max_grad_norm", "train.num_inner_epochs",
    "train.cfg", "train.adv_clip_max", "train.clip_range", "train.timestep_fraction",
    "train.beta", "train.ema", "prompt_fn", "reward_fn", "per_prompt_stat_tracking", "height", "frames",
}  # fmt: skip

_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "no": "float32"}


def script_for(recipe: str, model: str, module: str = "grpo.py") -> str:
    """The training script of Flow-GRPO that runs ``recipe`` of ``config/<module>`` (its
    README's pairing: config/grpo_guard.py's recipes run scripts/train_sd3_GRPO_Guard.py)."""
    m = model.lower()
    if module == "grpo_guard.py":
        return "train_sd3_GRPO_Guard.py"
    fast = "fast" in recipe
    if "wan" in m:
        return "train_wan2_1.py"
    if "kontext" in m:
        return "train_flux_kontext.py"
    if "flux" in m:
        return "train_flux_fast.py" if fast else "train_flux.py"
    if "qwen-image-edit" in m:
        return "train_qwenimage_edit.py"
    if "qwen-image" in m:
        return "train_qwenimage.py"
    if "bagel" in m:
        return "train_bagel.py"
    return "train_sd3_fast.py" if fast else "train_sd3.py"


def read_recipe(spec: str) -> tuple[str, dict[str, Any]]:
    """(recipe name, its flat config) for ``PATH/grpo.py:RECIPE``; base.py next to it."""
    path_s, sep, recipe = spec.rpartition(":")
    if not sep or not recipe or not path_s:
        raise ConfigError(f"{spec!r}: expected PATH/grpo.py:RECIPE (e.g. config/grpo.py:pickscore_sd3)")
    path = Path(path_s)
    base_path = path.parent / "base.py"
    base = ConfigModule(base_path) if base_path.is_file() else None
    return recipe, flatten(ConfigModule(path, base=base).call(recipe))


def import_recipe(spec: str, *, gpus: int | None = None) -> Imported:
    """The digen config of Flow-GRPO's recipe ``spec`` (``PATH/grpo.py:RECIPE``). ``gpus``:
    the GPU count the recipe's batch is sized for, when the recipe has no ``gpu_number``."""
    recipe, fg = read_recipe(spec)
    out = Imported(source=f"Flow-GRPO {spec}", config={})
    module = Path(spec.rpartition(":")[0]).name
    _translate(recipe, fg, out, gpus or _gpu_number(spec, recipe), module)
    _refuse(recipe, fg, out)
    if why := family_problem(str(_get(fg, "pretrained.model", ""))):
        raise ConfigError(f"{out.source}: pretrained.model {why}")
    for key, value in fg.items():
        if key in _CARRIED:
            if value is UNEVALUATED:
                out.dropped[key] = "its expression is not one the importer evaluates: set it by hand"
            continue
        out.dropped.setdefault(key, NO_EQUIVALENT.get(key, "not a key digen's importer knows"))
    return out


def _refuse(recipe: str, fg: dict[str, Any], out: Imported) -> None:
    """A :class:`~digen.errors.ConfigError` naming the recipe key that makes it untrainable as
    digen trains GRPO (before the generic config check, which would name only digen's keys)."""
    group = _get(fg, "sample.num_image_per_prompt", 1)
    rollout = out.config["rollout"]
    if isinstance(group, int) and group < 2:
        raise ConfigError(
            f"{out.source}: sample.num_image_per_prompt ({group}) leaves no group to compare: GRPO "
            f"needs at least 2 images a prompt ({recipe} is the base the other recipes build on)"
        )
    if rollout["batch_size"] % rollout["group_size"]:
        per_gpu, batches = _get(fg, "sample.train_batch_size", 1), _get(fg, "sample.num_batches_per_epoch", 2)
        why = (
            f"{out.source}: the epoch's {rollout['batch_size']} images (sample.train_batch_size {per_gpu} "
            f"x {rollout['batch_size'] // max(1, per_gpu * batches)} GPUs x sample.num_batches_per_epoch "
            f"{batches}) are not whole groups of sample.num_image_per_prompt ({rollout['group_size']})"
        )
        mini = _get(fg, "sample.mini_num_image_per_prompt")
        if mini is not None:
            why += (
                f": the recipe sizes its batches with sample.mini_num_image_per_prompt ({mini}), which no "
                "script reads at 9745241 (train_sd3_fast.py trains whole groups)"
            )
        raise ConfigError(why)


def _gpu_number(spec: str, recipe: str) -> int | None:
    """The recipe's local ``gpu_number`` (Flow-GRPO sizes each recipe's batch for it)."""
    path = Path(spec.rpartition(":")[0])
    fn = ConfigModule(path).functions[recipe]
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "gpu_number" for t in stmt.targets
        ):
            if isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, int):
                return stmt.value.value
    return None


def _get(fg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = fg.get(key, default)
    return default if value is UNEVALUATED else value


def _translate(recipe: str, fg: dict[str, Any], out: Imported, gpus: int | None, module: str) -> None:
    c = out.config
    model = str(_get(fg, "pretrained.model", ""))
    script_name = script_for(recipe, model, module)
    script = SCRIPTS[script_name]
    out.source += f" (run by scripts/{script_name})"
    _model(fg, out, model, script, script_name)
    _prompts(fg, out)
    _rollout(fg, out, gpus)
    _train(fg, out, script)
    if script_name == "train_wan2_1.py":
        out.dropped["sample.noise_level"] = (
            f"train_wan2_1.py's SDE never reads it: flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py "
            f"sde_step_with_logprob takes std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma; digen's sde step "
            f"takes noise_level {out.config['rollout']['sde']['noise_level']} x sqrt(sigma / (1 - sigma)): "
            "a different noise schedule"
        )
    if script_name == "train_sd3_GRPO_Guard.py" and _get(fg, "rationorm", False):
        # the script's `config.rationorm` branch: GRPO-Guard's normalised ratio and 1/dt weights
        set_dotted(c, "train.algorithm", "grpo-guard")
    _reward(fg, out)
    set_dotted(c, "eval.every", _get(fg, "eval_freq", 20))
    set_dotted(c, "eval.seed", _get(fg, "seed", 42))
    if _get(fg, "sample.test_batch_size") is not None:
        set_dotted(c, "eval.batch_size", _get(fg, "sample.test_batch_size"))
    set_dotted(c, "output.checkpoint_every", _get(fg, "save_freq", 20))
    set_dotted(c, "output.keep_checkpoints", _get(fg, "num_checkpoint_limit", 5))
    set_dotted(c, "schedule.mode", "disaggregated")
    c["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}


def _model(fg: dict[str, Any], out: Imported, model: str, script: Script, script_name: str) -> None:
    c = out.config
    c["seed"] = _get(fg, "seed", 42)
    local = f"models/{model.rstrip('/').rsplit('/', 1)[-1]}" if model else "models/MODEL"
    set_dotted(c, "model.path", local)
    out.placeholders["model.path"] = (
        f"a local diffusers snapshot of {model}: huggingface-cli download {model} --local-dir {local}"
    )
    set_dotted(c, "model.resolution", _get(fg, "height", _get(fg, "resolution", 768)))
    if _get(fg, "frames") is not None:
        set_dotted(c, "model.num_frames", _get(fg, "frames"))
    precision = str(_get(fg, "mixed_precision", "fp16"))
    # Flow-GRPO casts only the text encoders to mixed_precision; the transformer, its LoRA and
    # the VAE stay float32 and the forward runs under autocast (docs/precision.md)
    set_dotted(c, "model.dtype", "float32")
    set_dotted(c, "model.text_encoder_dtype", _DTYPES.get(precision, "float32"))
    set_dotted(c, "model.vae_dtype", "float32")
    if precision in ("fp16", "bf16"):
        set_dotted(c, "model.autocast", "bfloat16")
    if precision == "fp16":
        out.dropped["mixed_precision (fp16)"] = (
            "accelerate autocasts the forward in float16 with a GradScaler; digen autocasts in bfloat16 "
            "(no loss scaler: docs/precision.md); the text encoders are float16 as the recipe's"
        )
    set_dotted(c, "model.device", "cuda")
    if script.max_sequence_length is not None:
        set_dotted(c, "model.max_sequence_length", script.max_sequence_length)
    lora = {"enabled": bool(_get(fg, "use_lora", True))}
    if lora["enabled"]:
        lora |= {"rank": script.lora_rank, "alpha": script.lora_alpha, "dtype": "float32"}
        if script.lora_targets:
            lora["target_modules"] = list(script.lora_targets)
    set_dotted(c, "model.lora", lora)


def _prompts(fg: dict[str, Any], out: Imported) -> None:
    dataset = str(_get(fg, "dataset", "") or "")
    name = posixpath.basename(dataset.rstrip("/")) or "PROMPTS"
    set_dotted(out.config, "prompts.dataset", f"data/{name}")
    out.placeholders["prompts.dataset"] = (
        f"Flow-GRPO's {dataset or 'dataset'} folder (train.txt/test.txt or *_metadata.jsonl), copied to data/{name}"
    )


def _rollout(fg: dict[str, Any], out: Imported, gpus: int | None) -> None:
    c = out.config
    per_gpu = _get(fg, "sample.train_batch_size", 1)
    batches = _get(fg, "sample.num_batches_per_epoch", 2)
    group = _get(fg, "sample.num_image_per_prompt", 1)
    if gpus is None:
        gpus = 1
        out.placeholders["rollout.batch_size"] = (
            "sized for 1 GPU: the recipe names no gpu_number (digen import-config --gpus N)"
        )
    set_dotted(c, "rollout.batch_size", int(per_gpu * gpus * batches))
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", _get(fg, "sample.num_steps", 40))
    set_dotted(c, "rollout.eval_steps", _get(fg, "sample.eval_num_steps", 40))
    set_dotted(c, "rollout.guidance_scale", float(_get(fg, "sample.guidance_scale", 4.5)))
    set_dotted(
        c,
        "rollout.sde",
        {"kind": _get(fg, "sample.sde_type", "sde"), "noise_level": _get(fg, "sample.noise_level", 0.7)},
    )
    set_dotted(c, "rollout.shared_noise", bool(_get(fg, "sample.same_latent", False)))


def _train(fg: dict[str, Any], out: Imported, script: Script) -> None:
    c = out.config
    set_dotted(c, "train.algorithm", "flow-grpo")
    per_gpu = _get(fg, "sample.train_batch_size", 1)
    micro = _get(fg, "train.batch_size", 1)
    accumulation = _get(fg, "train.gradient_accumulation_steps", 1)
    batches = _get(fg, "sample.num_batches_per_epoch", 2)
    # per GPU and epoch: batches x per_gpu samples, in micro-batches of train.batch_size, an
    # optimizer step every gradient_accumulation_steps of them
    steps = max(1, int(batches * per_gpu / micro / accumulation))
    set_mini_batches(out, steps, "train.gradient_accumulation_steps", "Flow-GRPO takes")
    window = _get(fg, "sample.sde_window_size", 0)
    if script.windowed and window:
        window_range = _get(fg, "sample.sde_window_range", (0, 10))  # base.py's (0, 10)
        set_dotted(
            c,
            "train.timesteps",
            {"strategy": "window", "window": window, "window_range": [int(v) for v in window_range]},
        )
    else:
        set_dotted(
            c, "train.timesteps", {"strategy": "prefix", "fraction": _get(fg, "train.timestep_fraction", 1.0)}
        )
        for key in ("sample.sde_window_size", "sample.sde_window_range"):
            out.dropped.setdefault(
                key, "read only by the windowed scripts (*_fast, qwenimage); this recipe's does not"
            )
    if c["train"]["algorithm"] == "flow-grpo":
        c["train"]["algorithm"] = flow_grpo_member(c)
    set_dotted(c, "train.clip_range", _get(fg, "train.clip_range", 1e-4))
    set_dotted(c, "train.adv_clip", float(_get(fg, "train.adv_clip_max", 5)))
    set_dotted(c, "train.global_std", bool(_get(fg, "sample.global_std", True)))
    set_dotted(c, "train.std_eps", 1.0e-4)
    set_dotted(c, "train.kl_beta", _get(fg, "train.beta", 0.0))
    set_dotted(c, "train.zero_advantage", "drop" if script.drops_zero_advantage else "keep")
    set_dotted(c, "train.lr", _get(fg, "train.learning_rate", 3e-4))
    set_dotted(c, "train.weight_decay", _get(fg, "train.adam_weight_decay", 1e-4))
    set_dotted(c, "train.betas", [_get(fg, "train.adam_beta1", 0.9), _get(fg, "train.adam_beta2", 0.999)])
    set_dotted(c, "train.adam_eps", _get(fg, "train.adam_epsilon", 1e-8))
    set_dotted(c, "train.grad_clip", float(_get(fg, "train.max_grad_norm", 1.0)))
    set_dotted(c, "train.rows_per_forward", micro)
    # EMAModuleWrapper(decay=0.9, update_step_interval=8) stepped once per micro-batch
    # (train_sd3.py l.445, 959-960): `accumulation` micro-batches an optimizer step
    ema = bool(_get(fg, "train.ema", False))
    if ema and not script.ema:
        ema = False
        out.dropped["train.ema"] = (
            "this recipe's script builds no EMA (its EMAModuleWrapper line is commented out)"
        )
    set_dotted(
        c,
        "train.ema",
        {
            "enabled": ema,
            "decay": 0.9,
            "warmup": True,
            "update": "micro_batch",
            "every": 8,
            "micro_batches": accumulation,
            # eval() samples with the EMA swapped in and save_ckpt saves it (l.218-219, 328-332)
            "eval": ema,
            "export": ema,
        },
    )
    if _get(fg, "activation_checkpointing", False):
        set_dotted(c, "train.fsdp", True)
        set_dotted(c, "train.activation_checkpointing", True)
    if _get(fg, "train.num_inner_epochs", 1) != 1:
        out.dropped["train.num_inner_epochs"] = "digen takes one pass over each rollout batch"
    if not _get(fg, "train.cfg", True) and c["rollout"]["guidance_scale"] > 1.0:
        out.dropped["train.cfg"] = "digen trains with CFG whenever it samples with it"
    if not _get(fg, "per_prompt_stat_tracking", True):
        out.dropped["per_prompt_stat_tracking"] = "digen's advantages are always per group"


def _reward(fg: dict[str, Any], out: Imported) -> None:
    rewards = _get(fg, "reward_fn", {}) or {}
    specs = []
    for name, weight in dict(rewards).items():
        spec: dict[str, Any] = {"name": str(name), "weight": float(weight)}
        if name == "pickscore":
            spec["kwargs"] = {"divisor": 26}  # flow_grpo/pickscore_scorer.py: score / 26
        specs.append(spec)
    from digen.rewards import available

    for spec in specs:
        if spec["name"] == "video_ocr":  # flow_grpo/rewards.py: ocr of a video's frames
            spec["name"] = "ocr"
        elif spec["name"] not in available():
            # served through the http reward (digen reward-server, or any scorer behind a URL)
            peer_name = spec["name"]
            spec.update(served_reward(peer_name, spec["weight"]))
            out.placeholders[f"reward {peer_name}"] = (
                "not a digen reward: serve it at the http reward's url (a placeholder), or name one of digen rewards"
            )
    if not specs:
        specs = [served_reward("reward")]
        out.placeholders["reward"] = (
            "the recipe names no reward_fn: serve one at the http reward's url (a placeholder), or name a digen reward"
        )
    out.config["reward"] = specs
