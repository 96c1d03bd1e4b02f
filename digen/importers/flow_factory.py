"""A Flow-Factory recipe (``examples/<trainer>/<lora|full>/<model>/*.yaml``) as a digen config.

Flow-Factory (X-GenGroup/Flow-Factory, read at a0b2bc5) describes a run in one YAML file:
``model`` (``model_type``, ``finetune_type``, LoRA), ``train`` (``trainer_type``, batch and
optimizer, KL, EMA), ``scheduler`` (the SDE: ``dynamics_type``, ``noise_level``, the steps
eligible for noise ``sde_steps`` of which ``num_sde_steps`` are drawn each rollout), ``eval``
and ``rewards``. The file is read with ``yaml.safe_load`` (never executed).

This importer carries what digen trains: ``trainer_type: grpo`` on the model types of digen's
families (:data:`MODEL_TYPES`); anything else is refused in one line naming the key. Other
trainers are added here by the engineer who brings their algorithm into digen
(:data:`TRAINERS`). docs/coming-from-flow-factory.md is the same mapping for a reader.
Per epoch Flow-Factory samples ``unique_sample_num_per_epoch`` prompts, ``group_size``
images each, and takes ``gradient_step_per_epoch`` optimizer steps over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from digen.config import read_yaml
from digen.errors import ConfigError
from digen.importers.common import Imported, family_problem, served_reward, set_dotted, set_mini_batches

# model.model_type -> digen family (None: not a digen family, with what it is)
MODEL_TYPES: dict[str, str | None] = {
    "sd3-5": "sd3", "flux1": "flux", "qwen-image": "qwen-image", "wan2_t2v": "wan",
    "flux1-kontext": None, "flux2": None, "flux2-klein": None, "qwen-image-edit-plus": None,
    "wan2_i2v": None, "wan2_v2v": None, "z-image": None, "ltx2_t2av": None, "ltx2_i2av": None,
}  # fmt: skip

# train.trainer_type -> digen algorithm (the rollout decides the Flow-GRPO member)
TRAINERS: dict[str, str] = {"grpo": "flow-grpo"}
# Flow-Factory trainers digen has an algorithm for, whose own keys this importer does not map yet
UNMAPPED: dict[str, str] = {"nft": "diffusion-nft", "awm": "awm", "dgpo": "dgpo"}

_DYNAMICS = {"Flow-SDE": "sde", "CPS": "cps", "Dance-SDE": "dance"}
_REWARDS = {"pick_score": "pickscore", "pickscore": "pickscore", "clip_score": "clipscore",
            "clipscore": "clipscore", "hpsv2": "hpsv2", "image_reward": "imagereward",
            "aesthetic": "aesthetic", "ocr": "ocr"}  # fmt: skip
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}

NO_EQUIVALENT = {
    "launcher": "digen starts its own workers (cluster.*)",
    "config_file": "DeepSpeed/accelerate settings: train.fsdp shards a full fine-tune",
    "num_processes": "scale cluster.local (rollout_workers, trainer_workers) to your GPUs",
    "main_process_port": "digen's processes find each other through Dask",
    "log": "logs, checkpoints and samples go to the run directory (--out); logging.*",
    "data.preprocessing_batch_size": "digen encodes prompts as it goes",
    "data.dataloader_num_workers": "digen's prompt loader has no worker processes",
    "data.force_reprocess": "digen keeps no prompt cache",
    "data.cache_dir": "digen keeps no prompt cache",
    "data.max_dataset_size": "digen reads every prompt of prompts.dataset",
    "data.sampler_type": "digen draws each iteration's prompts from `seed`",
    "model.resume_path": "a command-line flag in digen: digen train CONFIG --out RUN_DIR --resume",
    "model.resume_type": "digen resumes its own checkpoints (--resume)",
    "model.attn_backend": "digen uses PyTorch's scaled-dot-product attention",
    "train.ref_param_device": "the reference is the base weights with LoRA off: no copy",
    "train.ema_device": "the EMA lives beside the weights",
    "scheduler.seed": "digen draws the SDE window from `seed`",
    "eval.resolution": "digen evaluates at model.resolution",
    "eval.per_device_batch_size": "eval.batch_size",
    "eval.guidance_scale": "digen evaluates with rollout.guidance_scale",
    "eval.seed": "eval.seed is digen's `seed`",
    "eval_rewards": "digen evaluates with the training reward",
}


def import_recipe(spec: str) -> Imported:
    """The digen config of the Flow-Factory recipe at ``spec``."""
    path = Path(spec)
    data = read_yaml(path, "Flow-Factory recipe")
    if not isinstance(data, dict) or not isinstance(data.get("train"), dict):
        raise ConfigError(f"{spec} is not a Flow-Factory recipe (a mapping with a train section)")
    out = Imported(source=f"Flow-Factory {path.name}", config={})
    model, train = data.get("model") or {}, data["train"]
    trainer = str(train.get("trainer_type", "grpo"))
    if trainer in UNMAPPED:
        raise ConfigError(
            f"{out.source}: train.trainer_type={trainer}: digen trains it (train.algorithm: {UNMAPPED[trainer]}, "
            f"docs/algorithms.md) but this importer maps only {', '.join(sorted(TRAINERS))}'s keys; write its "
            "train section by hand"
        )
    if trainer not in TRAINERS:
        raise ConfigError(
            f"{out.source}: train.trainer_type={trainer} is not an algorithm this importer maps to digen "
            f"(it maps {', '.join(sorted(TRAINERS))})"
        )
    model_type = str(model.get("model_type", ""))
    name = str(model.get("model_name_or_path") or "")
    if MODEL_TYPES.get(model_type) is None or "wan2.2" in name.lower():
        why = family_problem(name) or (
            f"{name}: Wan2.2 is not a digen model family (digen's wan is Wan2.1)"
            if "wan2.2" in name.lower()
            else f"{model_type or name} is not a digen model family"
        )
        raise ConfigError(f"{out.source}: model.model_type={model_type}: {why} (docs/models.md lists them)")
    _translate(data, out, MODEL_TYPES[model_type] or "")
    return out


def _translate(data: dict[str, Any], out: Imported, family: str) -> None:
    c = out.config
    model, train = data.get("model") or {}, data["train"]
    sched, ev = data.get("scheduler") or {}, data.get("eval") or {}
    c["seed"] = train.get("seed", 42) if isinstance(train.get("seed", 42), int) else 42
    name = str(model.get("model_name_or_path") or "MODEL")
    local = f"models/{name.rstrip('/').rsplit('/', 1)[-1]}"
    set_dotted(c, "model.path", local)
    out.placeholders["model.path"] = (
        f"a local diffusers snapshot of {name}: huggingface-cli download {name} --local-dir {local}"
    )
    resolution = train.get("resolution", 512)
    if isinstance(resolution, list):
        if len(set(resolution)) != 1:
            out.dropped["train.resolution"] = f"digen's frames are square: model.resolution {resolution[0]}"
        resolution = resolution[0]
    set_dotted(c, "model.resolution", int(resolution))
    if family == "wan" and train.get("num_frames"):
        set_dotted(c, "model.num_frames", int(train["num_frames"]))
    set_dotted(c, "model.dtype", "float32")
    precision = str(data.get("mixed_precision", "bf16"))
    set_dotted(c, "model.text_encoder_dtype", _DTYPES.get(precision, "float32"))
    if precision in ("bf16", "fp16"):
        set_dotted(c, "model.autocast", "bfloat16")
    if precision == "fp16":
        out.dropped["mixed_precision (fp16)"] = (
            "digen autocasts in bfloat16 (no loss scaler: docs/precision.md)"
        )
    set_dotted(c, "model.device", "cuda")
    lora = str(model.get("finetune_type", "lora")) == "lora"
    if lora:
        spec: dict[str, Any] = {"enabled": True, "rank": int(model.get("lora_rank", 32)),
                                "alpha": int(model.get("lora_alpha", 64)), "dtype": "float32"}  # fmt: skip
        targets = model.get("target_modules", "default")
        if isinstance(targets, list):
            spec["target_modules"] = [str(t) for t in targets]
        elif targets != "default":
            out.dropped["model.target_modules"] = f"{targets!r}: digen adapts the family's default targets"
        else:
            out.dropped["model.target_modules (default)"] = (
                "Flow-Factory's per-model default list; digen's family default (docs/models.md, LoRA targets)"
            )
        set_dotted(c, "model.lora", spec)
    else:
        set_dotted(c, "model.lora", {"enabled": False})
        set_dotted(c, "train.fsdp", True)
    dataset = str((data.get("data") or {}).get("dataset_dir") or "dataset/PROMPTS")
    set_dotted(c, "prompts.dataset", f"data/{Path(dataset).name}")
    out.placeholders["prompts.dataset"] = (
        f"Flow-Factory's {dataset} (train.txt / test.txt), copied to data/{Path(dataset).name}"
    )
    _rollout(train, sched, ev, out)
    _train(train, sched, out)
    _rewards(data.get("rewards") or [], out)
    eval_every = ev.get("eval_freq", 0)
    set_dotted(c, "eval.every", int(eval_every) if isinstance(eval_every, int) else 0)
    save = (data.get("log") or {}).get("save_freq", 20)
    set_dotted(c, "output.checkpoint_every", int(save) if isinstance(save, int) and save > 0 else 1)
    set_dotted(c, "schedule.mode", "disaggregated")
    c["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}
    for section in ("launcher", "config_file", "num_processes", "main_process_port", "log", "eval_rewards"):
        if section in data:
            out.dropped.setdefault(section, NO_EQUIVALENT[section])
    for sect_name, sect in (("data", data.get("data") or {}), ("model", model), ("train", train),
                            ("scheduler", sched), ("eval", ev)):  # fmt: skip
        for key in sect:
            full = f"{sect_name}.{key}"
            if full in NO_EQUIVALENT:
                out.dropped.setdefault(full, NO_EQUIVALENT[full])


def _rollout(train: dict[str, Any], sched: dict[str, Any], ev: dict[str, Any], out: Imported) -> None:
    c = out.config
    group = int(train.get("group_size", 16))
    prompts = int(train.get("unique_sample_num_per_epoch", 48))
    set_dotted(c, "rollout.batch_size", prompts * group)
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", int(train.get("num_inference_steps", 10)))
    set_dotted(c, "rollout.eval_steps", int(ev.get("num_inference_steps", 40)))
    set_dotted(c, "rollout.guidance_scale", float(train.get("guidance_scale", 1.0)))
    dynamics = str(sched.get("dynamics_type", "Flow-SDE"))
    if dynamics not in _DYNAMICS:
        raise ConfigError(
            f"{out.source}: scheduler.dynamics_type={dynamics} samples no SDE a GRPO trainer scores "
            f"(digen's: {', '.join(_DYNAMICS)})"
        )
    set_dotted(
        c, "rollout.sde", {"kind": _DYNAMICS[dynamics], "noise_level": float(sched.get("noise_level", 0.7))}
    )


def _train(train: dict[str, Any], sched: dict[str, Any], out: Imported) -> None:
    c = out.config
    set_dotted(c, "train.algorithm", TRAINERS[str(train.get("trainer_type", "grpo"))])
    steps = train.get("gradient_step_per_epoch", 1)
    set_mini_batches(
        out,
        int(steps) if isinstance(steps, int) else 1,
        "train.gradient_step_per_epoch",
        "Flow-Factory takes",
    )
    n = c["rollout"]["num_steps"]
    pool = sched.get("sde_steps")
    pool = [int(i) for i in pool] if isinstance(pool, list) and pool else list(range(max(1, n - 1)))
    count = sched.get("num_sde_steps")
    count = len(pool) if count is None else min(int(count), len(pool))
    lo, hi = min(pool), max(pool) + 1
    set_dotted(c, "train.timesteps", {"strategy": "window", "window": count, "window_range": [lo, hi]})
    if count < len(pool) or pool != list(range(lo, hi)):
        out.dropped["scheduler.sde_steps / num_sde_steps"] = (
            f"Flow-Factory draws {count} of {pool} at random each rollout, not necessarily adjacent "
            "(flow_match_euler_discrete.py current_sde_steps: randperm of the pool); digen trains a contiguous "
            f"window of {count} inside [{lo}, {hi}]"
        )
    if c["train"]["algorithm"] == "flow-grpo":
        c["train"]["algorithm"] = "cps" if c["rollout"]["sde"]["kind"] == "cps" else "flow-grpo-fast"
    set_dotted(c, "train.clip_range", float(train.get("clip_range", 1e-4)))
    set_dotted(c, "train.adv_clip", float(train.get("adv_clip_range", 5.0)))
    # GRPOTrainingArguments' defaults (src/flow_factory/hparams/training_args.py l.414-420):
    # global_std True, advantage_aggregation 'gdpo'
    set_dotted(c, "train.global_std", bool(train.get("global_std", True)))
    # Flow-Factory divides by max(std, 1e-6) (advantage_processor.py l.259-262, 385); digen by
    # std + std_eps: with 1e-6 the same to 1e-6 / std relative (a flat group is 0 in both)
    set_dotted(c, "train.std_eps", 1e-6)
    set_dotted(c, "train.kl_beta", float(train.get("kl_beta", 0.0)))
    if float(train.get("kl_beta", 0.0)) > 0:
        set_dotted(c, "train.kl_target", "velocity" if train.get("kl_type") == "v-based" else "mean")
    aggregation = str(train.get("advantage_aggregation", "gdpo"))
    if aggregation not in ("sum", "gdpo"):
        raise ConfigError(
            f"{out.source}: train.advantage_aggregation={aggregation} is not Flow-Factory's sum or gdpo "
            "(advantage_processor.py compute_advantages)"
        )
    # 'sum': the weighted reward sum normalised in its group; 'gdpo': each reward normalised in its
    # group, the weighted sum normalised over the batch (advantage_processor.py compute_gdpo)
    set_dotted(c, "train.multi_reward", aggregation)
    if train.get("enable_gradient_checkpointing"):
        set_dotted(c, "train.activation_checkpointing", True)
    set_dotted(c, "train.lr", float(train.get("learning_rate", 3e-4)))
    set_dotted(c, "train.weight_decay", float(train.get("adam_weight_decay", 1e-4)))
    betas = train.get("adam_betas", [0.9, 0.999])
    set_dotted(c, "train.betas", [float(b) for b in betas])
    set_dotted(c, "train.adam_eps", float(train.get("adam_epsilon", 1e-8)))
    set_dotted(c, "train.grad_clip", float(train.get("max_grad_norm", 1.0)))
    set_dotted(c, "train.rows_per_forward", int(train.get("per_device_batch_size", 1)))
    if float(train.get("ema_decay", 0) or 0) > 0:
        out.dropped["train.ema_decay / ema_update_interval"] = (
            "Flow-Factory's EMA (every N epochs) is not mapped: set train.ema (docs/algorithms.md, EMA) to keep one"
        )


def _rewards(rewards: list[Any], out: Imported) -> None:
    specs: list[dict[str, Any]] = []
    for r in rewards if isinstance(rewards, list) else [rewards]:
        if not isinstance(r, dict):
            continue
        name, weight = str(r.get("name", "reward")), float(r.get("weight", 1.0))
        ours = _REWARDS.get(name.lower())
        specs.append({"name": ours, "weight": weight} if ours else served_reward(name, weight))
        if not ours:
            out.placeholders[f"reward ({name})"] = (
                f"Flow-Factory's {r.get('reward_model', name)} is not a digen reward: serve it at the http reward's url"
            )
    out.config["reward"] = specs or [served_reward("reward")]
