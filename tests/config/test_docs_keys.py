"""The config keys digen's docs name are keys of digen's config (docs/install.md once named
``output.tensorboard`` for ``logging.tensorboard``). The pages that map a peer's keys
(coming-from-*.md, peer-recipes.md, algorithms.md) name the peer's keys beside digen's and
are left out."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from digen.config import Config

DOCS = Path(__file__).resolve().parents[2] / "docs"
PEER_PAGES = ("coming-from-", "peer-recipes", "algorithms")
SECTIONS = "logging|output|model|rollout|train|schedule|cluster|eval|prompts|security"
NOT_KEYS = {
    "eval.jsonl",  # a run file
    "security.yaml",  # digen certs' file
    "rollout.groupsize",  # the misspelt key of the error table
    "train.gradient_accumulation_steps",  # Flow-GRPO's, in guarantees.md's mini-batch section
}


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    inner = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return inner[0] if inner else None


def is_key(parts: list[str]) -> bool:
    """Whether ``parts`` names a field of :class:`Config` (below a field that is not a section,
    a dict or a leaf, anything goes)."""
    model: type[BaseModel] | None = Config
    for p in parts:
        if model is None:
            return True
        if p not in model.model_fields:
            return False
        model = _model_of(model.model_fields[p].annotation)
    return True


def test_every_config_key_the_docs_name_exists():
    named = {
        (m.group(1).rstrip("."), path.name)
        for path in sorted(DOCS.rglob("*.md"))
        if not path.name.startswith(PEER_PAGES)
        for m in re.finditer(rf"`((?:{SECTIONS})\.[a-z_][a-z_0-9.]*)", path.read_text())
    }
    assert len(named) > 50  # the pattern finds the docs' keys
    unknown = sorted((page, key) for key, page in named if key not in NOT_KEYS and not is_key(key.split(".")))
    assert unknown == [], unknown


def test_a_key_that_is_not_there_is_found():
    assert not is_key(["output", "tensorboard"]) and is_key(["logging", "tensorboard"])
