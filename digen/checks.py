"""Every input of a run, checked before anything starts (Redis, Dask, the run directory).

:func:`check_inputs` is called where a run starts (:func:`digen.engine.run_training`,
``digen submit``, the job runner) and reads only files: the prompt files (decoded as UTF-8;
an error names the file and the byte offset), the rewards (names, with a "did you mean",
their arguments, URLs, finite numbers, and the prompts where a reward can say which it
cannot score), the model folder's JSON configs (resolution against the VAE's scale and the
transformer's patch, the position-embedding grid, frames against the VAE's time
compression, ``max_sequence_length`` against the text encoder and its tokenizer), the run
directory (in use by another run, already holding a run, ``--resume`` without checkpoint) and
the free space on its disk against the size of a checkpoint. Config values themselves
(finite, in range) are :mod:`digen.config`'s validators. Problems are reported together as
one :class:`~digen.errors.ConfigError` (exit 2); too little disk space is a
:class:`~digen.rundir.DiskFull` (exit 1).

``train.algorithm`` against the algorithm registry and the rewards are checked here too
(:func:`registry_problems`): their registries' modules import torch, which the controller of a
distributed run does not load (docs/architecture.md), so for those modes these checks run in a
short-lived child process (:func:`registries_apart`, ``python -m digen.checks``), the same
functions as in the reference loop's process. With ``health`` that child also asks each
reward server once (:func:`reward_health`), so a run that starts right after the check pays
for one child, not two (the controller's :func:`~digen.runtime.controller.preflight` skips
it then).
"""

from __future__ import annotations

import inspect
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from digen.config import Config
from digen.errors import ConfigError, DigenError, RewardError
from digen.lora_targets import DEFAULT_TARGETS, is_target
from digen.rundir import DiskFull, RunLock, directory_bytes, free_bytes, holds_rows, latest_intact_checkpoint

DISK_MARGIN_BYTES = 16 * 2**20
"""Free space kept for logs, metrics and sample grids beyond the checkpoints."""


def check_inputs(
    cfg: Config,
    out: Path | None,
    *,
    resume: bool = False,
    run_dir: bool = True,
    files: bool = True,
    health: bool = False,
    fresh: bool = False,
) -> None:
    """Check ``cfg`` (and the run directory ``out``) before a run starts; every problem found
    is reported at once (see the module docstring).

    ``run_dir``: also check the directory's state (in use, holds a run, has a checkpoint to
    resume); off for a job runner's retry, which drops an earlier attempt's rows itself.
    ``files``: read the files (prompts, model folder, run directory, free space); off for
    ``digen submit --no-check-paths``, whose files exist only where the job runs.
    ``health``: for a distributed run about to start, also ask each reward server once when
    nothing else is wrong (:class:`~digen.errors.RewardError` when one does not answer).
    ``fresh``: a run without ``--resume`` is refused on a directory that already holds a run
    (``digen train``; a job runner's attempt takes over an earlier attempt's rows itself)."""
    problems: list[str] = []
    prompts: list[str] = []
    if files:
        prompts, prompt_problems_ = prompt_lists(cfg)
        problems += prompt_problems_
    if files and (cfg.resolve_path(cfg.model.path) / "model_index.json").is_file():
        problems += model_problems(cfg)
    if files and out is not None and run_dir:
        found = run_dir_problems(out, resume, iterations=cfg.iterations, fresh=fresh)
        problems += found or (checkpoint_fit_problems(cfg, out) if resume else [])
    if cfg.schedule.mode == "reference":
        problems = registry_problems(cfg, prompts) + problems
    else:  # the controller's process: no torch
        problems = registries_apart(cfg, prompts, health=health and not problems) + problems
    if problems:
        raise ConfigError(problems)
    if files and out is not None:
        check_free_space(cfg, out, resume)


# --- prompts -----------------------------------------------------------------------------


def prompt_lists(cfg: Config) -> tuple[list[str], list[str]]:
    """Every prompt a run reads (training and held-out), and the problems reading them (a file
    that is not UTF-8 text, holds no prompt, a malformed ``.jsonl`` line)."""
    prompts: list[str] = []
    problems: list[str] = []
    for read in (cfg.prompt_list, lambda: cfg.test_prompt_list()[0]):
        try:
            prompts += read()
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
        except OSError as exc:
            problems.append(f"prompt file {exc.filename} cannot be read ({exc.strerror})")
    return prompts, problems


# --- rewards -----------------------------------------------------------------------------


def url_problem(where: str, url: Any) -> str | None:
    """Why ``url`` is not a usable http(s) URL (scheme, host, port), or None."""
    if not isinstance(url, str):
        return f"{where} ({url!r}) must be an http(s) URL such as http://127.0.0.1:8765"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return f"{where} ({url}) is not an http(s) URL; use e.g. http://127.0.0.1:8765"
    try:
        port = parsed.port
    except ValueError:
        raw = parsed.netloc.rsplit(":", 1)[-1]
        return f"{where} ({url}): port {raw!r} is not a number from 1 to 65535"
    if port is not None and not 1 <= port <= 65535:
        return f"{where} ({url}): port {port} is not a number from 1 to 65535"
    return None


def reward_problems(cfg: Config, prompts: list[str]) -> list[str]:
    """Each reward of ``cfg.reward``: it exists, takes its kwargs, its URLs parse, its numbers
    are finite, and it can score ``prompts`` (where the reward says which it cannot)."""
    import digen.rewards  # noqa: F401 - registers the built-in rewards
    from digen.rewards import registry

    problems: list[str] = []
    for i, spec in enumerate(cfg.reward):
        where = f"reward[{i}]"
        factory = registry.factory(spec.name)
        if factory is None:
            problems.append(registry.unknown(spec.name, f"{where}.name: "))
            continue
        if not math.isfinite(spec.weight):
            problems.append(f"{where}.weight ({spec.weight}) must be a finite number")
        try:
            inspect.signature(factory).bind(**spec.kwargs)
        except TypeError as exc:
            problems.append(f"reward '{spec.name}' got bad kwargs {sorted(spec.kwargs)}: {exc}")
            continue
        for key, value in spec.kwargs.items():
            if key == "url" or key.endswith("_url"):
                bad = url_problem(f"{where}.kwargs.{key}", value)
                if bad:
                    problems.append(bad)
            elif isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{where}.kwargs.{key} ({value}) must be a finite number")
        check = getattr(factory, "prompt_problems", None)
        if callable(check) and prompts:
            problems += [f"{where} ({spec.name}): {p}" for p in check(prompts, **spec.kwargs)]
    return problems


def registry_problems(cfg: Config, prompts: list[str]) -> list[str]:
    """The problems of ``train.algorithm`` (:func:`digen.algos.registry.config_problems`) and of
    the rewards (:func:`reward_problems`): what the registries, torch's code, say of the config."""
    from digen.algos.registry import config_problems

    return config_problems(cfg) + reward_problems(cfg, prompts)


def reward_health(cfg: Config) -> None:
    """Build the configured reward and ask each part that has a health check (an HTTP
    reward's ``GET /health``) once: :class:`~digen.errors.RewardError` when one does not
    answer, :class:`~digen.errors.ConfigError` for arguments it refuses."""
    from digen.assembly import build_reward

    reward = build_reward(cfg)
    try:
        for part, _ in getattr(reward, "parts", [(reward, 1.0)]):
            if callable(getattr(part, "health", None)):
                part.health()
    finally:
        reward.close()


REWARD_CHECK_TIMEOUT_S = 300.0
"""The longest a child process checking the algorithm and the rewards may take (it imports
torch, the algorithms and the rewards; an HTTP reward's health check waits up to its
``timeout_s``)."""


def registries_apart(cfg: Config, prompts: list[str], *, health: bool = False) -> list[str]:
    """:func:`registry_problems` (and with ``health`` :func:`reward_health`) in a child process
    (``python -m digen.checks``, its config and prompts as JSON on stdin, its answer a JSON
    line on stdout). Returns the problems; raises the health check's error."""
    request = {"config": cfg.model_dump(mode="json"), "prompts": prompts, "health": health}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "digen.checks"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=REWARD_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise DigenError(
            f"checking the algorithm and the rewards took more than {REWARD_CHECK_TIMEOUT_S:g} s; "
            f"check the reward servers"
        ) from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise DigenError(f"the child process checking the algorithm and the rewards failed: {why}")
    answer = json.loads(lines[-1])
    if answer.get("error") is not None:
        kind = {"ConfigError": ConfigError, "RewardError": RewardError}.get(answer["kind"], DigenError)
        raise kind(answer["error"])
    return [str(p) for p in answer["problems"]]


def _check_rewards_here() -> None:
    """``python -m digen.checks``: :func:`registries_apart`'s child."""
    request = json.loads(sys.stdin.read())
    cfg = Config.model_validate(request["config"])
    answer: dict[str, Any] = {"problems": registry_problems(cfg, list(request["prompts"])), "error": None}
    if request["health"] and not answer["problems"]:
        try:
            reward_health(cfg)
        except (ConfigError, RewardError) as exc:
            answer.update(error=str(exc), kind=type(exc).__name__)
    print(json.dumps(answer), flush=True)


# --- the model folder --------------------------------------------------------------------

_TEXT = {
    # pipeline class -> (tokenizer folder, text encoder folder) that max_sequence_length sizes
    "StableDiffusion3Pipeline": ("tokenizer_3", "text_encoder_3"),
    "FluxPipeline": ("tokenizer_2", "text_encoder_2"),
    "WanPipeline": ("tokenizer", "text_encoder"),
    "QwenImagePipeline": ("tokenizer", "text_encoder"),
    "HunyuanVideoPipeline": ("tokenizer", "text_encoder"),
}
FAMILY_SEQUENCE_LENGTH: dict[str, tuple[int, str]] = {
    # pipeline class -> (prompt tokens when model.max_sequence_length is unset, whose value);
    # the family adapters' ``default_max_sequence_length`` (tests/config check they agree)
    "StableDiffusion3Pipeline": (128, "Flow-GRPO's scripts/train_sd3.py; StableDiffusion3Pipeline's is 256"),
    "FluxPipeline": (512, "FluxPipeline's; Flow-GRPO's scripts/train_flux.py uses 128"),
    "WanPipeline": (512, "WanPipeline's"),
    "QwenImagePipeline": (512, "QwenImagePipeline's"),
    "HunyuanVideoPipeline": (256, "HunyuanVideoPipeline's"),
}
"""``model.max_sequence_length: null`` means the family's own length, as its peer sets it."""
_PACKED = {"FluxPipeline", "QwenImagePipeline"}  # latents packed 2x2 into tokens
_HUGE = 10**7  # a tokenizer's "no limit" model_max_length (1e30 in many configs)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _find_ints(node: Any, key: str) -> list[int]:
    """Every integer value of ``key`` anywhere in a nested JSON config."""
    found: list[int] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and isinstance(v, int) and not isinstance(v, bool):
                found.append(v)
            else:
                found += _find_ints(v, key)
    elif isinstance(node, list):
        for v in node:
            found += _find_ints(v, key)
    return found


def vae_scales(vae: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of a VAE from its ``config.json``."""
    spatial = vae.get("spatial_compression_ratio") or vae.get("scale_factor_spatial")
    if not spatial and isinstance(vae.get("temperal_downsample"), list):
        spatial = 2 ** len(vae["temperal_downsample"])
    if not spatial and isinstance(vae.get("block_out_channels"), list):
        spatial = 2 ** (len(vae["block_out_channels"]) - 1)
    temporal = vae.get("temporal_compression_ratio") or vae.get("scale_factor_temporal") or 1
    if temporal == 1 and isinstance(vae.get("temperal_downsample"), list) and "scale_factor_spatial" in vae:
        temporal = 2 ** sum(bool(x) for x in vae["temperal_downsample"])
    return int(spatial or 1), int(temporal)


def sequence_limit(model_dir: Path, pipeline: str) -> tuple[int, str] | None:
    """The most prompt tokens the pipeline's sized text encoder takes, and where that limit
    comes from (its tokenizer's ``model_max_length``, its ``max_position_embeddings``)."""
    names = _TEXT.get(pipeline)
    if names is None:
        return None
    limits: list[tuple[int, str]] = []
    tok = _json(model_dir / names[0] / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok, int | float) and 0 < tok < _HUGE:
        limits.append((int(tok), f"{names[0]}'s model_max_length"))
    enc = _json(model_dir / names[1] / "config.json")
    positions = [v for v in _find_ints(enc, "max_position_embeddings") if v > 0]
    if positions:
        limits.append((min(positions), f"{names[1]}'s max_position_embeddings"))
    return min(limits) if limits else None


def model_problems(cfg: Config) -> list[str]:
    """``model.resolution``, ``model.num_frames`` and ``model.max_sequence_length`` against the
    limits in the model folder's configs."""
    model_dir = cfg.resolve_path(cfg.model.path)
    pipeline = str(_json(model_dir / "model_index.json").get("_class_name", ""))
    vae = _json(model_dir / "vae" / "config.json")
    transformer = _json(model_dir / "transformer" / "config.json")
    problems: list[str] = []
    m = cfg.model
    if vae:
        spatial, temporal = vae_scales(vae)
        patch = transformer.get("patch_size") or 1
        patch = int(patch[-1] if isinstance(patch, list) else patch)
        if pipeline in _PACKED:
            patch, why = 2, "2x2 packing"
        else:
            why = f"patch {patch}"
        multiple = spatial * patch
        if m.resolution % multiple:
            lower = max(multiple, m.resolution // multiple * multiple)
            problems.append(
                f"model.resolution ({m.resolution}) must be a multiple of {multiple} for {model_dir.name} "
                f"(VAE scale {spatial} x {why}); try {lower} or {lower + multiple}"
            )
        grid = transformer.get("pos_embed_max_size")
        if isinstance(grid, int) and m.resolution // multiple > grid:
            problems.append(
                f"model.resolution ({m.resolution}) is too large for {model_dir.name}: its transformer's "
                f"position grid is {grid} patches a side (pos_embed_max_size), at most {grid * multiple} pixels"
            )
        if m.num_frames is not None and temporal > 1 and (m.num_frames - 1) % temporal:
            fix = max(1, (m.num_frames - 1) // temporal * temporal + 1)
            problems.append(
                f"model.num_frames ({m.num_frames}) must be {temporal}k + 1 for {model_dir.name} (the VAE "
                f"compresses time {temporal}x after the first frame); try {fix}"
            )
    problems += _sequence_problems(cfg, model_dir, pipeline)
    return problems


def _sequence_problems(cfg: Config, model_dir: Path, pipeline: str) -> list[str]:
    """``model.max_sequence_length`` (unset: the family's own, :data:`FAMILY_SEQUENCE_LENGTH`)
    against the most tokens the text encoder takes: a longer one is refused, never cut."""
    limit = sequence_limit(model_dir, pipeline)
    length = cfg.model.max_sequence_length
    shown = str(length)
    if length is None and pipeline in FAMILY_SEQUENCE_LENGTH:
        length, whose = FAMILY_SEQUENCE_LENGTH[pipeline]
        shown = f"unset: {length}, the family's own, {whose}"
    if limit is None or length is None or length <= limit[0]:
        return []
    return [
        f"model.max_sequence_length ({shown}) exceeds {limit[0]}, the most tokens "
        f"{model_dir.name}'s text encoder takes ({limit[1]}); set model.max_sequence_length={limit[0]} or less"
    ]


# --- the run directory and its disk ------------------------------------------------------


RUN_MARKERS = ("metrics.jsonl", "timeline.jsonl", "summary.json", "digen.log", ".digen.lock")
"""Files only a run writes: a folder holding one of them (or ``checkpoints/iter_NNNN``, or a
``config.yaml`` that is a resolved digen config) is a run directory."""


def is_run_dir(folder: Path) -> bool:
    """``folder`` holds a run's files (:data:`RUN_MARKERS`, a checkpoint, or digen's own
    ``config.yaml``, which a run writes first)."""
    folder = Path(folder)
    if any((folder / name).exists() for name in RUN_MARKERS) or any((folder / "checkpoints").glob("iter_*")):
        return True
    try:
        import yaml

        data = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"seed", "iterations", "model", "rollout", "train", "schedule"} <= set(
        data
    )


def out_problems(out: Path) -> list[str]:
    """``--out`` that cannot be a run directory: a file (or a path under one), or a folder
    that holds other files and no run. A new or empty folder, or a run directory, is fine; a
    user's folder is never written into (its ``config.yaml`` would be replaced)."""
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            what = f"{out} is a file" if p == out else f"{out} is under {p}, a file"
            return [f"--out: {what}, not a folder; choose a new folder (or a run directory, with --resume)"]
        if p.exists():
            break
    if not out.is_dir():
        return []
    try:
        names = sorted(p.name for p in out.iterdir())
    except OSError as exc:
        return [f"--out: {out} cannot be read ({exc.strerror}); choose another folder"]
    if not names or is_run_dir(out):
        return []
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [
        f"--out: {out} is a folder that is not a run directory (it holds {shown}); a run writes its "
        f"config.yaml, metrics and checkpoints there: choose a new or empty folder"
    ]


def run_dir_problems(
    out: Path, resume: bool, iterations: int | None = None, *, fresh: bool = False
) -> list[str]:
    """``--out`` is a file or a folder of other files (:func:`out_problems`); the directory is
    in use by another run; ``--resume`` finds no checkpoint, or its newest checkpoint already
    holds ``iterations`` (the target) or more: there is nothing to run; with ``fresh``, a run
    without ``--resume`` into a directory that already holds one (:func:`held_run_problems`)."""
    out = Path(out)
    if problems := out_problems(out):
        return problems
    holder = RunLock.holder(out)
    if holder is not None:
        return [
            f"run directory {out} is in use by {holder}; wait for that run to end, or choose another --out"
        ]
    if resume and latest_intact_checkpoint(out) is None:
        if holds_rows(out):  # a run stopped before its first checkpoint: a fresh one elsewhere
            return [
                f"--resume: {out} has no checkpoint (its run stopped before writing one); start a fresh "
                f"run without --resume, with another --out or after deleting {out}"
            ]
        return [f"--resume: {out} has no checkpoint yet; start without --resume"]
    if resume and iterations is not None:
        return resume_target_problems(out, iterations)
    if not resume and fresh:
        return held_run_problems(out)
    return []


def held_run_problems(out: Path) -> list[str]:
    """A fresh run into ``out``, which already holds a run's rows: refused (the same words as
    :class:`~digen.rundir.RunDir`, which refuses it too, for the callers that skip this check)."""
    if not holds_rows(out):
        return []
    if latest_intact_checkpoint(out) is None:
        return [
            f"run directory {out} already holds a run that wrote no checkpoint (nothing to --resume from); "
            f"choose another --out, or delete it to start over"
        ]
    return [f"run directory {out} already holds a run; pass --resume to continue it or choose another --out"]


def checkpoint_fit_problems(cfg: Config, out: Path) -> list[str]:
    """``--resume`` with a config whose trained tensors are not the newest checkpoint's: LoRA
    on or off, another ``model.lora.rank`` (read from the checkpoint's tensor shapes) or other
    ``model.lora.target_modules`` (from the run's ``config.yaml``). Refused before anything is
    written: a resume that fails to load its weights would otherwise have started the cluster.
    ``model.lora.alpha`` and the rest may change on a resume."""
    ckpt = latest_intact_checkpoint(out)
    if ckpt is None:
        return []
    shapes = {k: s for k, s in _safetensors_shapes(ckpt / "weights.safetensors").items() if "/" not in k}
    if not shapes:
        return []  # an unreadable checkpoint: the resume names it
    lora = cfg.model.lora
    ranks = {s[0] for k, s in shapes.items() if k.endswith(".lora_A.weight") and s}
    found: list[str] = []
    if lora.enabled and not ranks:
        found.append(
            "holds the whole transformer (model.lora.enabled was false), this config trains a LoRA adapter"
        )
    elif not lora.enabled and ranks:
        found.append("holds a LoRA adapter, this config sets model.lora.enabled=false")
    elif lora.enabled and ranks != {lora.rank}:
        found.append(
            f"holds a LoRA adapter of rank {', '.join(map(str, sorted(ranks)))}, this config sets model.lora.rank={lora.rank}"
        )
    if lora.enabled and not found:
        try:
            import yaml

            before = (yaml.safe_load((Path(out) / "config.yaml").read_text()) or {})["model"]["lora"]
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            before = None
        if (
            isinstance(before, dict)
            and "target_modules" in before
            and before["target_modules"] != lora.target_modules
        ):
            found.append(
                f"was trained with model.lora.target_modules={before['target_modules']}, this config sets "
                f"{lora.target_modules}"
            )
    return [
        f"--resume: the checkpoint {ckpt} {why}: its weights do not fit; resume with the run's own config "
        f"({Path(out) / 'config.yaml'}), or start a fresh run with another --out"
        for why in found
    ]


def resume_target_problems(out: Path, iterations: int) -> list[str]:
    """``--resume`` to ``iterations`` when the newest checkpoint already holds that many
    completed iterations or more (its ``state.json``'s ``iteration`` counts from 0): a run
    with nothing to do is bad input, not a silent success. A checkpoint that cannot be read
    is left to the resume itself, which names it."""
    ckpt = latest_intact_checkpoint(out)
    try:
        done = int(json.loads((ckpt / "state.json").read_text())["iteration"]) + 1 if ckpt else 0
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if iterations > done:
        return []
    return [
        f"--resume: {out} has completed {done} iterations (checkpoint {ckpt.name if ckpt else '-'}), and "
        f"iterations is {iterations}: nothing to run; raise the target, e.g. --set iterations={done + 1}"
    ]


SAFETENSORS_HEADER_MAX = 100 * 2**20
"""The largest header safetensors reads (its own limit)."""


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (its data is not read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(SAFETENSORS_HEADER_MAX, path.stat().st_size - 8):
                return {}  # not a safetensors file (its first 8 bytes are no header size)
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return {}
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def checkpoint_estimate(cfg: Config, out: Path, resume: bool) -> int:
    """About how many bytes one checkpoint of this run takes: the newest one when resuming,
    else the trained tensors (the LoRA adapter, or the whole transformer) in float32 three
    times (weights, AdamW's two moments), plus the EMA copy and, with staleness 1, the
    previous version's weights."""
    ckpt = latest_intact_checkpoint(out) if resume else None
    if ckpt is not None:
        return directory_bytes(ckpt)
    model_dir = cfg.resolve_path(cfg.model.path)
    shapes: dict[str, list[int]] = {}
    for f in sorted((model_dir / "transformer").glob("*.safetensors")):
        shapes.update(_safetensors_shapes(f))
    lora = cfg.model.lora
    if lora.enabled:
        # the modules the adapter wraps: the config's targets, else the family's default (the
        # table the model adapters inject), else every attention projection
        pipeline = str(_json(model_dir / "model_index.json").get("_class_name", ""))
        targets = tuple(lora.target_modules or DEFAULT_TARGETS.get(pipeline, ()))
        n = 0
        for name, shape in shapes.items():
            module = name.removesuffix(".weight")
            if len(shape) != 2 or module == name:
                continue  # a LoRA wraps a Linear: a 2-D .weight
            if is_target(module, targets) if targets else "attn" in module:
                n += lora.rank * (shape[0] + shape[1])
    else:
        n = sum(math.prod(s) for s in shapes.values())
    copies = 3 + int(cfg.train.ema.enabled) + int(cfg.schedule.resolved().max_staleness or 0)
    return 4 * n * copies


def check_free_space(cfg: Config, out: Path, resume: bool) -> None:
    """Refuse to start when the disk of ``out`` cannot hold a checkpoint being written beside
    the newest one (plus a margin for logs and samples)."""
    each = checkpoint_estimate(cfg, out, resume)
    need = 2 * each + DISK_MARGIN_BYTES
    free = free_bytes(out)
    if free < need:
        raise DiskFull(
            f"the disk of {out} has {free} bytes ({free / 2**20:.1f} MiB) free; this run needs about {need} "
            f"bytes ({need / 2**20:.1f} MiB): a checkpoint of about {each / 2**20:.1f} MiB written beside "
            f"the newest one, and logs; free some space or choose another --out"
        )


if __name__ == "__main__":
    _check_rewards_here()
