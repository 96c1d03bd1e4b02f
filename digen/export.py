"""Export a run's trained weights to diffusers (``digen export``).

Two outputs, both opened by stock diffusers with no digen installed:

* **LoRA folder**: ``pytorch_lora_weights.safetensors`` written by the family pipeline's own
  ``save_lora_weights`` (diffusers ``loaders/lora_pipeline.py``), which
  ``pipeline.load_lora_weights(DIR)`` loads. Keys are digen's peft keys under the
  ``"transformer."`` prefix (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``),
  the layout diffusers' own training scripts write.
* **Pipeline folder** (``merge=True``, and always for a full fine-tune): the base pipeline's
  components copied file for file, with ``transformer/`` replaced by the trained one (LoRA
  merged in: ``W + (alpha / r) * B @ A``), which ``DiffusionPipeline.from_pretrained`` opens.

The LoRA scale. peft scales an adapter's output by ``lora_alpha / r``. diffusers reads
``lora_alpha`` from the file's ``lora_adapter_metadata`` (diffusers >= 0.34); without it, or in
a loader that ignores it, ``get_peft_kwargs`` (``utils/peft_utils.py``) takes
``lora_alpha = r``, i.e. scale 1. So the export folds the scale into ``lora_B``
(``B' = (alpha / r) * B``) and records ``lora_alpha = r`` in the metadata: the adapter computes
``W x + B' A x = W x + (alpha / r) B A x`` in every loader, with or without metadata.

Which weights: ``RUN_DIR/checkpoints/iter_NNNN/weights.safetensors`` (the policy after
iteration NNNN's optimizer step, :class:`digen.optim.ParameterStore`), the newest complete
checkpoint unless an iteration is named.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from digen.config import Config, load_config
from digen.errors import CheckpointError, ConfigError
from digen.models.pipeline_policy import read_model_index
from digen.models.registry import detect_family

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PROVENANCE_NAME = "digen_export.json"
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote (also saved as ``digen_export.json`` in the output)."""

    out_dir: str
    kind: Literal["lora", "pipeline"]
    family: str
    pipeline_class: str
    run_dir: str
    checkpoint: str
    iteration: int
    policy_version: int
    trained: Literal["lora", "full"]
    weights: Literal["policy", "ema"]
    lora_rank: int | None
    lora_alpha: int | None
    base_model: str = ""
    """The base pipeline folder the run trained on (``model.path``, or ``--model-path``): what a
    LoRA export loads onto."""


# --- the run ---------------------------------------------------------------------------
def checkpoints_of(run_dir: Path) -> dict[int, Path]:
    """``{iteration: folder}`` of the complete checkpoints (``state.json`` is written last)."""
    found = {}
    for folder in (run_dir / "checkpoints").glob("iter_*"):
        suffix = folder.name.removeprefix("iter_")
        if suffix.isdigit() and (folder / "state.json").is_file():
            found[int(suffix)] = folder
    return dict(sorted(found.items()))


def find_checkpoint(run_dir: Path, iteration: int | None = None) -> Path:
    """The checkpoint folder of ``iteration`` (None: the newest). ``CheckpointError`` naming
    the run and the iterations that exist when there is none or not that one."""
    found = checkpoints_of(run_dir)
    if not found:
        raise CheckpointError(
            f"run directory {run_dir} has no checkpoint (no checkpoints/iter_NNNN/state.json); "
            "a run writes one every output.checkpoint_every iterations and at its end"
        )
    if iteration is None:
        return found[max(found)]
    if iteration not in found:
        listed = ", ".join(str(i) for i in found)
        raise CheckpointError(
            f"--checkpoint ({iteration}) is not a checkpoint of {run_dir}; it has iterations {listed} "
            f"(older ones are pruned to output.keep_checkpoints)"
        )
    return found[iteration]


def read_run_config(run_dir: Path, model_path: str | Path | None = None) -> Config:
    """The run's ``config.yaml``, with ``model.path`` replaced by ``model_path`` when given
    (the base weights moved since training)."""
    file = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR ({run_dir}) does not exist or is not a folder")
    if not file.is_file():
        raise ConfigError(f"RUN_DIR ({run_dir}) is not a digen run directory (no config.yaml)")
    overrides = [f"model.path={Path(model_path).resolve()}"] if model_path is not None else []
    return load_config(file, overrides, check_paths=False)


def read_weights(checkpoint: Path, *, ema: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``weights.safetensors`` (or with ``ema`` the EMA copy ``ParameterStore.save`` keeps in
    ``optimizer.safetensors`` as ``ema/<name>``) and ``state.json`` of a checkpoint folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = json.loads((checkpoint / "state.json").read_text())
        weights = load_file(str(checkpoint / "weights.safetensors"))
        if ema:
            opt = load_file(str(checkpoint / "optimizer.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint} cannot be read ({exc.__class__.__name__}: {exc})"
        ) from None
    if not ema:
        return weights, state
    averaged = {k.removeprefix("ema/"): v for k, v in opt.items() if k.startswith("ema/")}
    if set(averaged) != set(weights):
        raise CheckpointError(
            f"--ema: checkpoint {checkpoint} holds no EMA weights (the run had train.ema.enabled: false); "
            "export without --ema"
        )
    return averaged, state


def is_lora_state(weights: dict[str, torch.Tensor]) -> bool:
    """True when every tensor is a LoRA ``lora_A``/``lora_B`` weight (else a full fine-tune)."""
    return bool(weights) and all(_lora_part(k) is not None for k in weights)


def _lora_part(key: str) -> tuple[str, str] | None:
    """``"blocks.0.to_q.lora_A.weight"`` -> ``("blocks.0.to_q", "A")``; None for other keys."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if key.endswith(suffix):
            return key.removesuffix(suffix), part
    return None


def lora_pairs(weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A [r, in], B [out, r])}``; ``CheckpointError`` when a half is missing."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        module, part = _lora_part(key) or (key, "?")
        halves.setdefault(module, {})[part] = tensor
    pairs = {}
    for module, h in sorted(halves.items()):
        if set(h) != {"A", "B"} or h["A"].ndim != 2 or h["B"].ndim != 2 or h["B"].shape[1] != h["A"].shape[0]:
            raise CheckpointError(
                f"LoRA weights of {module} are not a lora_A [r, in] / lora_B [out, r] pair "
                f"(got {sorted(h)} with shapes {[tuple(t.shape) for t in h.values()]})"
            )
        pairs[module] = (h["A"], h["B"])
    return pairs


def lora_rank(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise CheckpointError(f"LoRA modules have different ranks {sorted(ranks)}; digen trains one rank")
    return ranks.pop()


# --- LoRA in diffusers' layout -----------------------------------------------------------
def diffusers_lora(
    weights: dict[str, torch.Tensor], *, alpha: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """digen's peft LoRA state -> (transformer LoRA layers with the scale folded into
    ``lora_B``, the peft ``LoraConfig`` kwargs diffusers stores as adapter metadata).

    Keys stay peft's (``blocks.0.attn.to_q.lora_A.weight``); ``save_lora_weights`` adds the
    ``"transformer."`` prefix. See the module docstring for why the scale is folded."""
    pairs = lora_pairs(weights)
    rank = lora_rank(pairs)
    scale = alpha / rank
    layers: dict[str, torch.Tensor] = {}
    for module, (a, b) in pairs.items():
        layers[f"{module}.lora_A.weight"] = a.float().contiguous()
        layers[f"{module}.lora_B.weight"] = (b.float() * scale).contiguous()
    metadata = {"r": rank, "lora_alpha": rank, "target_modules": sorted(pairs)}
    return layers, metadata


def merged_transformer_state(
    base: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], *, alpha: int
) -> dict[str, torch.Tensor]:
    """``base`` (a transformer's state dict) with every LoRA pair merged into its linear
    weight: ``W + (alpha / r) * B @ A``, computed in float32 and cast back to ``W``'s dtype
    (what peft's ``merge`` computes for a ``Linear``)."""
    pairs = lora_pairs(weights)
    scale = alpha / lora_rank(pairs)
    merged = dict(base)
    for module, (a, b) in pairs.items():
        key = f"{module}.weight"
        w = base.get(key)
        if w is None or w.shape != (b.shape[0], a.shape[1]):
            shape = None if w is None else tuple(w.shape)
            raise CheckpointError(
                f"LoRA module {module} (out {b.shape[0]}, in {a.shape[1]}) has no matching linear weight "
                f"in the base transformer (found {shape}); is model.path the model the run trained?"
            )
        delta = b.float() @ a.float()
        merged[key] = (w.float() + scale * delta).to(w.dtype)
    return merged


# --- writing ---------------------------------------------------------------------------
def prepare_out_dir(out_dir: Path, *, force: bool) -> Path:
    """A fresh staging folder next to ``out_dir``; refuses a non-empty ``out_dir`` without
    ``force`` (with it, ``out_dir`` is replaced once the export is complete)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out ({out_dir}) is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(
            f"--out ({out_dir}) is not empty; choose another folder or pass --force to replace it"
        )
    staging = out_dir.with_name(out_dir.name + ".export-tmp")
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    return staging


def _refuse_overlap(out_dir: Path, keep: dict[str, Path]) -> None:
    """``--out`` may not be, or hold, a folder the export reads (``--force`` would delete it)."""
    target = out_dir.resolve()
    for what, folder in keep.items():
        source = folder.resolve()
        if source == target or target in source.parents:
            raise ConfigError(f"--out ({out_dir}) is or contains {what} ({folder}); choose another folder")


def finish_out_dir(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def write_lora(folder: Path, pipeline_class: str, layers: dict[str, torch.Tensor], metadata: dict) -> None:
    """``pytorch_lora_weights.safetensors`` through the pipeline class's ``save_lora_weights``."""
    import inspect

    import diffusers

    save = getattr(diffusers, pipeline_class).save_lora_weights
    extra = {}
    if "transformer_lora_adapter_metadata" in inspect.signature(save).parameters:  # diffusers >= 0.34
        extra["transformer_lora_adapter_metadata"] = metadata  # older: none, and the folded scale needs none
    save(str(folder), transformer_lora_layers=layers, weight_name=LORA_WEIGHT_NAME, **extra)


def write_pipeline(
    folder: Path,
    base_dir: Path,
    weights: dict[str, torch.Tensor],
    *,
    lora_alpha: int | None,
    dtype: torch.dtype,
) -> None:
    """Copy ``base_dir`` without its transformer, then save the trained transformer (base
    weights in ``dtype`` + merged LoRA, or the fully fine-tuned weights) as ``transformer/``."""
    for entry in base_dir.iterdir():
        if entry.name in ("transformer", ".cache"):
            continue
        target = folder / entry.name
        if entry.is_dir():
            shutil.copytree(entry, target)  # follows symlinks (a Hub cache snapshot holds links)
        else:
            shutil.copy2(entry, target)
    transformer = load_base_transformer(base_dir, dtype)
    base = transformer.state_dict()
    if lora_alpha is not None:
        state = merged_transformer_state(base, weights, alpha=lora_alpha)
    else:
        _check_full_state(base, weights)
        state = {**base, **{k: v.to(base[k].dtype) for k, v in weights.items()}}
    transformer.load_state_dict(state, strict=True)
    transformer.save_pretrained(str(folder / "transformer"))


def load_base_transformer(base_dir: Path, dtype: torch.dtype) -> Any:
    """The base pipeline's transformer (class from ``model_index.json``) in ``dtype``."""
    import diffusers

    entry = read_model_index(base_dir).get("transformer")
    if not isinstance(entry, list) or len(entry) != 2 or not hasattr(diffusers, str(entry[1])):
        raise ConfigError(f"model.path {base_dir}: model_index.json names no diffusers transformer ({entry})")
    model_cls = getattr(diffusers, str(entry[1]))
    return model_cls.from_pretrained(str(base_dir / "transformer"), torch_dtype=dtype, local_files_only=True)


def _check_full_state(base: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    unknown = sorted(set(weights) - set(base))
    wrong = sorted(k for k in set(weights) & set(base) if weights[k].shape != base[k].shape)
    if unknown or wrong:
        raise CheckpointError(
            f"the checkpoint does not fit the base transformer: {len(unknown)} unknown tensors {unknown[:3]}, "
            f"{len(wrong)} of another shape {wrong[:3]}; is model.path the model the run trained?"
        )


# --- the command -----------------------------------------------------------------------
def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    iteration: int | None = None,
    merge: bool = False,
    force: bool = False,
    model_path: str | Path | None = None,
    ema: bool | None = None,
) -> ExportResult:
    """Export checkpoint ``iteration`` (None: the newest) of ``run_dir`` to ``out_dir``: a
    diffusers LoRA folder, or with ``merge`` (always for a full fine-tune) a pipeline folder.
    ``model_path`` overrides the run's ``model.path`` (the base pipeline); ``ema`` exports the
    checkpoint's EMA weights instead of the policy's (Flow-GRPO saves and evaluates its EMA);
    None: as the run's ``train.ema.export`` says."""
    run = Path(run_dir)
    out = Path(out_dir)
    cfg = read_run_config(run, model_path)
    if ema is None:
        ema = cfg.train.ema.enabled and cfg.train.ema.export
    checkpoint = find_checkpoint(run, iteration)
    weights, state = read_weights(checkpoint, ema=ema)
    trained_lora = is_lora_state(weights)
    if trained_lora != cfg.model.lora.enabled:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds {'LoRA' if trained_lora else 'full transformer'} weights but the "
            f"run's config.yaml says model.lora.enabled: {cfg.model.lora.enabled}"
        )
    base_dir = cfg.resolve_path(cfg.model.path)
    family = detect_family(base_dir)
    pipeline_class = str(read_model_index(base_dir)["_class_name"])
    alpha = cfg.model.lora.alpha if trained_lora else None
    kind: Literal["lora", "pipeline"] = "lora" if trained_lora and not merge else "pipeline"
    _refuse_overlap(out, {"RUN_DIR": run, "the checkpoint": checkpoint, "model.path": base_dir})
    staging = prepare_out_dir(out, force=force)
    try:
        if kind == "lora":
            layers, metadata = diffusers_lora(weights, alpha=cfg.model.lora.alpha)
            write_lora(staging, pipeline_class, layers, metadata)
        else:
            write_pipeline(staging, base_dir, weights, lora_alpha=alpha, dtype=DTYPES[cfg.model.dtype])
        result = ExportResult(
            out_dir=str(out),
            kind=kind,
            family=family,
            pipeline_class=pipeline_class,
            run_dir=str(run.resolve()),
            checkpoint=checkpoint.name,
            iteration=int(state.get("iteration", checkpoint.name.removeprefix("iter_"))),
            policy_version=int(state.get("version", -1)),
            trained="lora" if trained_lora else "full",
            weights="ema" if ema else "policy",
            lora_rank=lora_rank(lora_pairs(weights)) if trained_lora else None,
            lora_alpha=alpha,
            base_model=str(base_dir.resolve()),
        )
        (staging / PROVENANCE_NAME).write_text(json.dumps(asdict(result), indent=1) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finish_out_dir(staging, out)
    return result
