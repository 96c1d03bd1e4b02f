"""Model families behind one interface: :class:`FlowPolicy` adapters over diffusers pipelines.

``load_policy(path, ...)`` opens a local diffusers pipeline folder (SD3.5, FLUX.1, ...) as a
:class:`FlowPolicy`; ``make_tiny_model(out, arch)`` writes a tiny random-weight folder of any
family for tests and demos. Families live in :data:`FAMILIES` (see ``registry.py``).
"""

from digen.models.base import FlowPolicy, PromptEmbeds
from digen.models.registry import FAMILIES, Family, detect_family, load_policy, make_tiny_model

__all__ = [
    "FAMILIES",
    "Family",
    "FlowPolicy",
    "PromptEmbeds",
    "detect_family",
    "load_policy",
    "make_tiny_model",
]
