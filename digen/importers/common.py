"""What every importer shares: :class:`Imported` (the config, the keys left out, the
placeholders) and the helpers that set a dotted key and the optimizer steps per rollout batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml


@dataclass
class Imported:
    """The result of an import: ``config`` (a digen config mapping), ``dropped`` (peer key ->
    why it has no digen equivalent), ``placeholders`` (digen key -> what to put there)."""

    source: str
    config: dict[str, Any]
    dropped: dict[str, str] = field(default_factory=dict)
    placeholders: dict[str, str] = field(default_factory=dict)
    overridden: dict[str, Any] = field(default_factory=dict)
    """digen key -> the value ``digen import-config --set`` gave it over the peer's."""

    def validate(self) -> None:
        """Raise the :class:`~digen.errors.ConfigError` of every problem digen's config finds in
        :attr:`config` (paths are not checked: the placeholders need not exist yet)."""
        from digen.config import build_config
        from digen.errors import ConfigError

        try:
            build_config(self.config, check_paths=False)
        except ConfigError as exc:
            raise ConfigError([f"the imported config of {self.source}: {p}" for p in exc.problems]) from None

    def to_yaml(self) -> str:
        """The config as YAML, headed by comments naming its source, the placeholders and the
        keys left out (a reader of the file sees what the import did not carry)."""
        lines = [f"# Imported by `digen import-config` from {self.source}."]
        if self.placeholders:
            lines.append("# Placeholders to fill in:")
            lines += [f"#   {k}: {why}" for k, why in self.placeholders.items()]
        if self.overridden:
            lines.append("# Set by --set (not the peer's):")
            lines += [f"#   {k}: {v!r}" for k, v in self.overridden.items()]
        if self.dropped:
            lines.append("# Not carried (no digen equivalent):")
            lines += [f"#   {k}: {why}" for k, why in self.dropped.items()]
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False)
        return "\n".join(lines) + "\n" + body


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b][c] = value`` for ``key`` ``"a.b.c"``, creating the sections on the way."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def flow_grpo_member(config: dict[str, Any]) -> str:
    """The Flow-GRPO family member ``config``'s sampler and timesteps name: flow-grpo-fast for
    the window strategy, cps for the CPS step, else flow-grpo (as digen infers when unset)."""
    if config["train"]["timesteps"]["strategy"] == "window":
        return "flow-grpo-fast"
    return "cps" if config["rollout"]["sde"]["kind"] == "cps" else "flow-grpo"


def set_mini_batches(out: Imported, steps: int, peer_key: str, what: str) -> None:
    """``train.mini_batches`` for the peer's ``steps`` optimizer steps per rollout batch.

    With ``train.mini_batch_split`` in this digen (``samples``: the peer's split of the
    samples into equal parts) the peer's count is kept where it divides the samples; with
    whole-group mini-batches it is the largest count up to the peer's that divides the groups,
    and the difference is listed under ``peer_key``. An algorithm whose loss reads a whole group
    (:data:`digen.config.WHOLE_GROUP_ALGORITHMS`, in ``train.algorithm`` before this call) always
    takes whole-group mini-batches."""
    from digen.config import WHOLE_GROUP_ALGORITHMS, TrainConfig

    rollout = out.config["rollout"]
    samples, groups = rollout["batch_size"], rollout["batch_size"] // max(1, rollout["group_size"])
    steps = max(1, steps)
    whole = out.config.get("train", {}).get("algorithm") in WHOLE_GROUP_ALGORITHMS
    by_samples = "mini_batch_split" in TrainConfig.model_fields and not whole
    if by_samples:
        set_dotted(out.config, "train.mini_batch_split", "samples")
    units = samples if by_samples else groups
    fit = max(d for d in range(1, steps + 1) if units % d == 0)
    if fit != steps:
        unit = "samples" if by_samples else "prompt groups"
        out.dropped[peer_key] = (
            f"{what} {steps} optimizer steps per rollout batch; digen's must divide its {units} {unit}: {fit}"
        )
    set_dotted(out.config, "train.mini_batches", fit)


def served_reward(name: str, weight: float = 1.0) -> dict[str, Any]:
    """A reward digen does not have, as the ``http`` reward at a placeholder URL on this host
    (``digen reward-server`` or any scorer behind it). Never a stand-in that trains: a run
    whose URL answers nothing fails its start-up check, naming the URL."""
    return {
        "name": "http",
        "weight": weight,
        "kwargs": {"url": f"http://127.0.0.1:8765/{name}", "name": name},
    }


# model names (a Hub id, a folder, a peer's example folder) of the peers' recipes whose model
# is not a digen family (docs/models.md): a config for them would load another pipeline
NOT_FAMILIES = {
    "kontext": "FLUX.1-Kontext (image editing: a source image with each prompt)",
    "qwen-image-edit": "Qwen-Image-Edit (image editing: a source image with each prompt)",
    "qwen_image_edit": "Qwen-Image-Edit (image editing: a source image with each prompt)",
    "bagel": "BAGEL (a unified understanding-and-generation model)",
    "ltx2": "LTX-2 (joint audio-video generation)",
    "ltx-2": "LTX-2 (joint audio-video generation)",
    "minimax": "MiniMax H3 (text-to-video-and-audio)",
}


def family_problem(*names: str) -> str | None:
    """Why the recipe's model (named by any of ``names``) is not one digen trains, or None."""
    for name in names:
        low = name.lower()
        for key, what in NOT_FAMILIES.items():
            if key in low:
                return f"{name}: {what} is not a digen model family (docs/models.md lists them)"
    return None
