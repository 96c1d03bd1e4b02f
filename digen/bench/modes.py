"""The bench's modes: a base schedule mode with ``-toggle`` / ``+toggle`` ablations, and the
config each mode runs (:func:`mode_config`)."""

from __future__ import annotations

from typing import Any

from digen.config import Config
from digen.errors import ConfigError

BASE_MODES = ("reference", "colocated", "disaggregated", "digen")
TOGGLES = {"gap": "gap", "tsp": "tsp", "tag": "tag", "rat": "rat", "async": "max_staleness", "eval": "eval"}


def parse_modes(text: str) -> list[str]:
    """``"reference,digen,digen-tag"`` -> the list, validated. A mode is a base mode
    (reference, colocated, disaggregated, digen) with optional ``-toggle`` / ``+toggle``
    suffixes switching gap, tsp, tag, rat, async (staleness 1) or eval (held-out evaluation)
    off / on: ``digen-tag``, ``digen+eval``; and an optional ``@B`` at the end, the
    ``rollout.max_batch`` it runs with (default the config's): ``digen@4``, ``colocated@1``."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError("--modes is empty; e.g. --modes reference,colocated,disaggregated,digen")
    problems = []
    for m in modes:
        try:
            _mode_parts(m)
        except ValueError as exc:
            problems.append(str(exc))
    if len(set(modes)) != len(modes):
        problems.append(f"--modes ({text}) lists a mode twice")
    if problems:
        raise ConfigError(problems)
    return modes


def _max_batch(mode: str) -> tuple[str, int | None]:
    """``"digen-tag@4"`` -> ``("digen-tag", 4)``; no ``@``: ``(mode, None)``."""
    if "@" not in mode:
        return mode, None
    name, _, b = mode.rpartition("@")
    if not b.isdigit() or int(b) < 1:
        raise ValueError(f"mode {mode!r}: @{b} must be a rollout.max_batch of at least 1, e.g. {name}@4")
    return name, int(b)


def _mode_parts(mode: str) -> tuple[str, dict[str, Any]]:
    """``"digen-tag+gap"`` -> ``("digen", {"tag": False, "gap": True})``."""
    mode, _ = _max_batch(mode)
    base, rest = mode, ""
    for i, ch in enumerate(mode):
        if ch in "+-":
            base, rest = mode[:i], mode[i:]
            break
    if base not in BASE_MODES:
        raise ValueError(f"mode {mode!r}: {base!r} is not one of {', '.join(BASE_MODES)}")
    toggles: dict[str, Any] = {}
    token, sign = "", ""
    for ch in rest + "+":
        if ch in "+-":
            if token:
                if token not in TOGGLES:
                    raise ValueError(f"mode {mode!r}: toggle {token!r} is not one of {', '.join(TOGGLES)}")
                key = TOGGLES[token]
                on = sign == "+"
                toggles[key] = (1 if on else 0) if key == "max_staleness" else on
            token, sign = "", ch
        else:
            token += ch
    if base == "reference" and set(toggles) - {"eval"}:
        raise ValueError(f"mode {mode!r}: reference takes no toggles but eval")
    return base, toggles


def parse_workers(text: str | None) -> tuple[int, int] | None:
    """``"1,1"`` -> (rollout workers, trainer workers); None keeps the config's."""
    if text is None:
        return None
    try:
        r, t = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--workers ({text}) must be ROLLOUT,TRAINER worker counts, e.g. --workers 1,1"
        ) from None
    if r < 1 or t < 1:
        raise ConfigError(f"--workers ({text}): every mode needs at least 1 rollout and 1 trainer worker")
    return r, t


def mode_config(cfg: Config, mode: str, workers: tuple[int, int] | None = None) -> Config:
    """``cfg`` set to run ``mode``: its toggles, the worker counts, a checkpoint only at the end
    and no sample grids (disk writes are not what the bench measures)."""
    base, toggles = _mode_parts(mode)
    data = cfg.model_dump(mode="json")
    batch = _max_batch(mode)[1]
    if batch is not None:
        data["rollout"]["max_batch"] = batch
    if "eval" in toggles:
        data["eval"]["every"] = (cfg.eval.every or 1) if toggles.pop("eval") else 0
    sched = data["schedule"]
    sched.update({"mode": base, "gap": None, "tsp": None, "tag": None, "rat": None, "max_staleness": None})
    sched.update(toggles)
    if workers is not None:
        data["cluster"]["local"].update({"rollout_workers": workers[0], "trainer_workers": workers[1]})
    data["output"].update({"checkpoint_every": cfg.iterations, "sample_grid_every": 0})
    data["logging"].update({"tensorboard": False, "wandb": False})
    out = Config.model_validate(data)
    out.source_dir = cfg.source_dir
    return out
