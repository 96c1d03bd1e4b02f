"""A DanceGRPO launch script (``scripts/finetune/*.sh``) as a digen config.

The script's ``torchrun ... fastvideo/train_grpo_*.py --flag value ...`` call is read by
:mod:`digen.importers.shell` (never run); the flags are those of the training script's
argparse (XueZeyue/DanceGRPO 15cc71d, ``fastvideo/train_grpo_flux.py``), with its defaults
(:data:`DEFAULTS`) where the script passes none. Per rollout batch DanceGRPO samples
``--train_batch_size`` prompts on each of ``--nnodes x --nproc_per_node`` GPUs,
``--num_generations`` images each, and steps the optimizer after every
``--gradient_accumulation_steps`` samples of a GPU (``train_one_step``). Every flag is carried
or named in :data:`NO_EQUIVALENT`; docs/coming-from-dancegrpo.md is the same mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from digen.errors import ConfigError
from digen.importers.common import Imported, served_reward, set_dotted, set_mini_batches
from digen.importers.shell import read_command, scalar, unresolved

DEFAULTS: dict[str, Any] = {
    "train_batch_size": 16, "num_generations": 16, "gradient_accumulation_steps": 1,
    "learning_rate": 1e-4, "weight_decay": 0.01, "max_grad_norm": 2.0, "lr_warmup_steps": 10,
    "lr_scheduler": "constant_with_warmup", "shift": 1.0, "timestep_fraction": 1.0,
    "clip_range": 1e-4, "adv_clip_max": 5.0, "ema_decay": 0.995, "checkpointing_steps": 500,
    "master_weight_type": "fp32", "lora_rank": 128, "lora_alpha": 256,
    "vq_coef": 1.0, "mq_coef": 0.0,  # train_grpo_hunyuan.py's argparse
}  # fmt: skip

# fastvideo/train_grpo_flux_lora.py's LoraConfig(target_modules=...): the attention
# projections of every block (the single blocks' attn.to_q/k/v too; their output is proj_out)
LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")

NOT_A_FAMILY = {
    "train_grpo_sd.py": "trains Stable Diffusion v1.x (a UNet, fastvideo/config_sd/base.py: "
    "runwayml/stable-diffusion-v1-5) from an ml_collections config, not a digen family",
    "train_grpo_qwenimage_edit.py": "trains Qwen-Image-Edit (a source image with each prompt), not a digen family",
    "train_grpo_skyreels_i2v.py": "trains SkyReels image-to-video (a first frame with each prompt), not a digen family",
}

NO_EQUIVALENT = {
    "vae_model_path": "the VAE is read from model.path's snapshot",
    "dit_model_name_or_path": "the transformer is read from model.path's snapshot",
    "cache_dir": "digen never downloads: model.path is a local folder",
    "num_latent_t": "latent frames follow model.num_frames (1 for an image model)",
    "t": "an image model has no frames (--t 1); a video script's is model.num_frames",
    "sp_size": "DanceGRPO's sequence parallelism: digen's is rollout.sequence_parallel",
    "train_sp_batch_size": "DanceGRPO's sequence-parallel batch: no equivalent",
    "dataloader_num_workers": "digen's prompt loader has no worker processes",
    "output_dir": "digen writes to the run directory: digen train CONFIG --out RUN_DIR",
    "logging_dir": "logs go to the run directory (--out); logging.tensorboard",
    "resume_from_checkpoint": "a command-line flag in digen: digen train CONFIG --out RUN_DIR --resume",
    "allow_tf32": "digen leaves PyTorch's float32 matmul precision at its default (TF32 off)",
    "cfg": "the probability of an empty caption in DanceGRPO's LatentDataset; digen keeps every prompt",
    "sampler_seed": "the prompt sampler's seed: digen draws prompts from `seed`",
    "shift": "digen uses the scheduler config's shift of model.path (FLUX: resolution-dependent), "
    "not a fixed sd3_time_shift",
    "lr_scheduler": "digen's learning rate is constant",
    "lr_warmup_steps": "digen's learning rate is constant (no warm-up)",
    "lr_num_cycles": "digen's learning rate is constant",
    "lr_power": "digen's learning rate is constant",
    "selective_checkpointing": "train.activation_checkpointing checkpoints every block",
    "use_cpu_offload": "digen keeps parameters and optimizer state on the GPU",
    "fsdp_sharding_startegy": "train.fsdp is FULL_SHARD",
    "master_weight_type": "model.dtype float32 holds the master weights",
    "precondition_outputs": "not read by the GRPO scripts",
    "loss_coef": "not read by the GRPO scripts",
    "ema_start_step": "digen's EMA starts at the first step",
    "data_json_path": "DanceGRPO reads precomputed text embeddings; digen encodes prompts itself",
    "model_type": "FastVideo's model loader name (train_grpo_hunyuan.py l.531-534): digen reads the family "
    "from model.path's model_index.json",
    "validation_prompt_dir": "read by no GRPO script (15cc71d): digen evaluates with eval.*",
    "validation_steps": "read by no GRPO script (15cc71d): digen evaluates with eval.*",
    "validation_sampling_steps": "read by no GRPO script (15cc71d): digen evaluates with eval.*",
    "log_validation": "read by no GRPO script (15cc71d): digen evaluates with eval.*",
    "checkpoints_total_limit": "read by no GRPO script (15cc71d); digen keeps output.keep_checkpoints",
    "tracker_project_name": "the wandb project (train_grpo_hunyuan.py l.617): digen logs to the run "
    "directory (logging.*)",
    "fps": "the frame rate of the MP4 VideoAlign scores (train_grpo_hunyuan.py l.259); digen's http reward "
    "receives the decoded frames",
}

_CARRIED = {
    "seed", "pretrained_model_name_or_path", "train_batch_size", "num_generations", "gradient_accumulation_steps",
    "max_train_steps", "learning_rate", "weight_decay", "max_grad_norm", "mixed_precision", "checkpointing_steps",
    "h", "w", "sampling_steps", "eta", "use_hpsv2", "use_pickscore", "use_group", "ignore_last",
    "init_same_noise", "timestep_fraction", "clip_range", "adv_clip_max", "use_ema", "ema_decay",
    "lora_rank", "lora_alpha", "gradient_checkpointing", "cfg_infer", "use_same_noise", "use_videoalign",
    "vq_coef", "mq_coef",
}  # fmt: skip


def import_script(spec: str) -> Imported:
    """The digen config of the DanceGRPO launch script at ``spec``."""
    path = Path(spec)
    command = read_command(path, "fastvideo/train_grpo")
    script = command.program  # fastvideo/train_grpo_flux_lora.py: the variant is in its name
    if Path(script).name in NOT_A_FAMILY:
        raise ConfigError(
            f"DanceGRPO {path.name}: {script} {NOT_A_FAMILY[Path(script).name]} (docs/models.md)"
        )
    flags = _flags(command.args)
    for key in sorted(_CARRIED & flags.keys()):
        if why := unresolved(f"--{key}", flags[key]):
            raise ConfigError(f"DanceGRPO {path.name}: {why}")
    gpus = _launcher_gpus(command.launcher)
    out = Imported(source=f"DanceGRPO {path.name}", config={})
    _translate(flags, gpus, script, out)
    for key in flags:
        if key == "t" and "num_frames" in out.config["model"]:
            continue  # a video script's frames: model.num_frames
        if key not in _CARRIED:
            out.dropped.setdefault(f"--{key}", NO_EQUIVALENT.get(key, "not a flag digen's importer knows"))
    return out


def _flags(words: list[str]) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            if eq:
                flags[name] = scalar(value)
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                flags[name] = scalar(words[i + 1])
                i += 1
            else:
                flags[name] = True  # a store_true switch
        i += 1
    return flags


def _launcher_gpus(before: list[str]) -> int:
    opts = _flags(before)
    nodes, per_node = opts.get("nnodes", 1), opts.get("nproc_per_node", 1)
    if not isinstance(nodes, int) or not isinstance(per_node, int):
        raise ConfigError("the torchrun line's --nnodes / --nproc_per_node are not numbers")
    return nodes * per_node


def _translate(f: dict[str, Any], gpus: int, script: str, out: Imported) -> None:
    c = out.config
    get = lambda key: f.get(key, DEFAULTS.get(key))  # noqa: E731
    c["seed"] = get("seed") if isinstance(get("seed"), int) else 42
    if get("max_train_steps"):
        c["iterations"] = get("max_train_steps")
    model = str(get("pretrained_model_name_or_path") or "models/MODEL")
    flux = "flux" in script or "flux" in model.lower()
    set_dotted(c, "model.path", model)
    out.placeholders["model.path"] = (
        f"{model}: a local diffusers snapshot (DanceGRPO's README downloads it there)"
    )
    set_dotted(c, "model.resolution", get("h") or 720)
    if get("w") and get("w") != get("h"):
        out.dropped["--w"] = f"digen's images are square: model.resolution {get('h')}"
    # DanceGRPO loads the transformer in bf16 and trains fp32 master weights (--master_weight_type
    # fp32) under bf16 autocast
    set_dotted(c, "model.dtype", "float32")
    if get("mixed_precision") == "bf16":
        set_dotted(c, "model.autocast", "bfloat16")
    set_dotted(c, "model.vae_dtype", "bfloat16")  # AutoencoderKL.from_pretrained(..., torch_dtype=bfloat16)
    set_dotted(c, "model.device", "cuda")
    if "lora" in Path(script).name:  # fastvideo/train_grpo_flux_lora.py: a LoRA on the float32 base
        lora = {"enabled": True, "rank": get("lora_rank"), "alpha": get("lora_alpha"), "dtype": "float32"}
        set_dotted(c, "model.lora", lora | {"target_modules": list(LORA_TARGETS)})
        if get("gradient_checkpointing"):
            set_dotted(c, "train.activation_checkpointing", True)
    else:
        set_dotted(c, "model.lora", {"enabled": False})
        set_dotted(c, "train.fsdp", True)
        if get("gradient_checkpointing"):
            set_dotted(c, "train.activation_checkpointing", True)
    set_dotted(c, "prompts.file", "data/prompts.txt")
    out.placeholders["prompts.file"] = (
        "the prompt file DanceGRPO's preprocessing embedded (its data/prompts.txt), one a line"
    )
    prompts, group = get("train_batch_size") * gpus, get("num_generations")
    set_dotted(c, "rollout.batch_size", prompts * group)
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", get("sampling_steps") or 16)
    video = "hunyuan" in script or "wan" in script
    if video and isinstance(get("t"), int):  # Wan's script trains single frames: --t 1
        set_dotted(c, "model.num_frames", get("t"))  # --t: the frames a rollout generates
    if "hunyuan" in script:
        # train_grpo_hunyuan.py passes guidance=tensor([6018.0], dtype=bfloat16) (hard-coded): the
        # embedded guidance 6.018 x 1000, which bfloat16 rounds to 6016
        guidance = 6.018
        out.dropped["guidance (train_grpo_hunyuan.py, hard-coded)"] = (
            "6018.0 in bfloat16 (6016) as the peer passes it; digen's hunyuan-video family embeds 6.018 x 1000 "
            "in model.dtype (float32: 6018)"
        )
    elif "wan" in script:
        # train_grpo_wan_2_1.py: true CFG with --cfg_infer when > 1 (sampling and re-scoring)
        cfg_infer = f.get("cfg_infer", 5.0)
        guidance = float(cfg_infer) if isinstance(cfg_infer, (int, float)) and cfg_infer > 1 else 1.0
    else:
        guidance = 3.5 if flux else 1.0  # train_grpo_flux.py: guidance 3.5, hard-coded
    set_dotted(c, "rollout.guidance_scale", guidance)
    set_dotted(c, "rollout.sde", {"kind": "dance", "noise_level": get("eta") or 0.3})
    # --init_same_noise (flux, wan, qwenimage); train_grpo_hunyuan.py's is --use_same_noise
    set_dotted(c, "rollout.shared_noise", bool(get("init_same_noise") or get("use_same_noise")))
    set_dotted(c, "train.algorithm", "dance-grpo")
    per_gpu = get("train_batch_size") * group
    c.setdefault("train", {})
    set_mini_batches(
        out, per_gpu // get("gradient_accumulation_steps"), "--gradient_accumulation_steps", "DanceGRPO takes"
    )
    set_dotted(c, "train.timesteps", {"strategy": "random", "fraction": get("timestep_fraction")})
    if not get("ignore_last"):
        out.dropped["--ignore_last (absent)"] = "digen's random timesteps never train the last step"
    if not get("use_group"):
        out.dropped["--use_group (absent)"] = (
            "digen's advantages are always per group (not over the whole batch)"
        )
    set_dotted(c, "train.unbiased_std", True)
    set_dotted(c, "train.std_eps", 1e-8)
    set_dotted(c, "train.clip_range", get("clip_range"))
    set_dotted(c, "train.adv_clip", float(get("adv_clip_max")))
    set_dotted(c, "train.lr", get("learning_rate"))
    set_dotted(c, "train.weight_decay", get("weight_decay"))
    set_dotted(c, "train.grad_clip", float(get("max_grad_norm")))
    set_dotted(c, "train.rows_per_forward", 1)
    if get("use_ema"):
        # FSDP_EMA.update once per rollout batch, a fixed decay (train_grpo_flux.py l.866-867)
        # under train.fsdp (the 8-GPU full fine-tune) each rank keeps the EMA of its shards;
        # DanceGRPO saves it beside the weights and evaluates nothing (train.ema.eval/export off)
        ema = {"enabled": True, "decay": get("ema_decay"), "warmup": False, "update": "iteration"}
        set_dotted(c, "train.ema", ema)
    reward = "hpsv2" if get("use_hpsv2") else "pickscore" if get("use_pickscore") else None
    c["reward"] = [{"name": reward, "weight": 1.0} if reward else served_reward("reward")]
    if get("use_videoalign"):
        # VideoAlign's visual and motion quality, one group advantage each, weighted by --vq_coef /
        # --mq_coef and summed (train_grpo_hunyuan.py l.370-395, 449-477): train.multi_reward
        # per_reward. A coefficient of 0 leaves its reward out (its term is 0: nothing to score)
        vq, mq = float(get("vq_coef")), float(get("mq_coef"))
        c["reward"] = [
            served_reward(name, w) for name, w in (("videoalign_vq", vq), ("videoalign_mq", mq)) if w
        ]
        if not c["reward"]:
            raise ConfigError(
                f"DanceGRPO {Path(script).name}: --vq_coef and --mq_coef are both 0: no reward trains"
            )
        set_dotted(c, "train.multi_reward", "per_reward")
        out.placeholders["reward"] = "VideoAlign (VideoReward) is not a digen reward: serve its VQ" + (
            " and MQ scores at the http rewards' urls"
            if len(c["reward"]) > 1
            else " score at the http reward's url"
        )
    if f.get("bestofn"):
        out.dropped["--bestofn"] = (
            f"train_grpo_hunyuan.py trains only the {f['bestofn'] // 2} best and {f['bestofn'] // 2} worst samples "
            "of each rollout batch by advantage; digen trains every sample"
        )
    if reward is None and not get("use_videoalign"):
        out.placeholders["reward"] = (
            "the script names no --use_hpsv2/--use_pickscore: serve a reward at the http reward's url "
            "(a placeholder), or name a digen reward"
        )
    set_dotted(c, "output.checkpoint_every", get("checkpointing_steps"))
    set_dotted(c, "schedule.mode", "disaggregated")
    c["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}
