"""The files the simulator is handed: simulation configs and their catalog (YAML), a
sequence-parallel calibration and a data-plane bench result (JSON), a run's ``config.yaml``.

One reader for all of them, so that a wrong path or a broken file reads the same whichever
option named it: a :class:`~digen.errors.ConfigError` that names the file and says what to
pass instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from digen.errors import ConfigError


def read_mapping(path: str | Path, fix: str) -> dict:
    """The mapping a YAML file holds, or a JSON one (by its ``.json`` suffix); an empty YAML
    file is an empty mapping. ``fix``: what to pass instead, the end of every error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p} does not exist or is not a file: {fix}")
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        data = json.loads(p.read_text()) if kind == "JSON" else yaml.safe_load(p.read_text()) or {}
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p} is not valid {kind}: {exc}; {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping, got {type(data).__name__}: {fix}")
    return data
