"""Config importers: a peer framework's recipe turned into a digen config.

Each importer reads the peer's own files as data, never as code (a peer's config file is
untrusted input; Flow-GRPO's ``config/*.py`` are parsed with :mod:`ast` and only literals and
simple arithmetic are evaluated), and returns an :class:`Imported`: the digen config as a
mapping, every peer key it could not carry with the reason, and the values it had to invent
(a local model folder for a Hub id, a prompt folder) so the user knows what to supply.

- :mod:`digen.importers.flow_grpo`: Flow-GRPO's ``config/grpo.py:RECIPE`` (with ``base.py``);
- :mod:`digen.importers.verl_omni`: VeRL-Omni's Hydra YAML, with the ``key=value`` overrides of
  one of its ``examples/*.sh`` launch scripts;
- :mod:`digen.importers.dance_grpo`: the ``--flag value`` arguments of a DanceGRPO
  ``scripts/finetune/*.sh`` script;
- :mod:`digen.importers.flow_factory`: a Flow-Factory ``examples/**/*.yaml`` recipe (its GRPO
  trainer and its clean-sample trainers dgpo, awm, nft and dpo on digen's families).

The pages ``docs/coming-from-*.md`` hold the same mappings for a reader.
"""

from __future__ import annotations

from digen.importers.common import Imported, flow_grpo_member, set_dotted, set_mini_batches

PEERS = ("flow-grpo", "verl-omni", "dance-grpo", "flow-factory")

__all__ = ["PEERS", "Imported", "flow_grpo_member", "import_config", "set_dotted", "set_mini_batches"]


def import_config(peer: str, spec: str, *, gpus: int | None = None) -> Imported:
    """Import ``spec`` (a path, for Flow-GRPO ``PATH/grpo.py:RECIPE``) written for ``peer``."""
    from digen.errors import ConfigError, did_you_mean

    if peer == "flow-grpo":
        from digen.importers.flow_grpo import import_recipe

        return import_recipe(spec, gpus=gpus)
    if peer == "verl-omni":
        from digen.importers.verl_omni import import_verl_omni

        return import_verl_omni(spec)
    if peer == "dance-grpo":
        from digen.importers.dance_grpo import import_script

        return import_script(spec)
    if peer == "flow-factory":
        from digen.importers.flow_factory import import_recipe as import_flow_factory

        return import_flow_factory(spec)
    raise ConfigError(f"unknown peer {peer!r} (one of {', '.join(PEERS)}){did_you_mean(peer, PEERS)}")
