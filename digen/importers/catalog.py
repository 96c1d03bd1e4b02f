"""Every recipe of the peers, imported: the table of docs/peer-recipes.md.

:func:`rows` runs :func:`digen.importers.import_config` on each recipe and launch script of a
folder laid out as tests/data/peers (``flow_grpo/config/*.py``, ``verl_omni/examples/**/*.sh``,
``dance_grpo/scripts/finetune/*.sh``) and records, for each: imported (with the algorithm it
trains and what the import says differs from the peer) or refused (and the one line why).
:func:`markdown` renders the page; tests/importers/test_catalog.py keeps the committed page
equal to it. Regenerate with ``python -m digen.importers.catalog tests/data/peers >
docs/peer-recipes.md``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from digen.errors import DigenError

# keys whose "not carried" reason is bookkeeping (paths, logging, placement, engines), not
# what is trained: left out of the "what differs" column, which lists the rest by name
_BOOKKEEPING = (
    "run_name", "logdir", "save_dir", "debug", "num_epochs", "resume_from", "save_freq", "eval_freq",
    "output_dir", "logging_dir", "cache_dir", "vae_model_path", "dit_model_name_or_path", "data_json_path",
    "dataloader_num_workers", "resume_from_checkpoint", "checkpointing_steps", "allow_tf32", "sampler_seed",
    "trainer.", "data.", "reward.", "ray_kwargs", "global_profiler", "transfer_queue", "critic", "skip",
    "actor_rollout_ref.rollout.*", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.agent",
    "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon",
    "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.log_prob",
    "actor_rollout_ref.ref", "actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.actor.checkpoint",
    "actor_rollout_ref.actor.profiler", "actor_rollout_ref.model.*", "actor_rollout_ref.actor.*",
    "actor_rollout_ref.*", "actor_rollout_ref.hybrid", "algorithm.*", "distillation", "pretrained.revision",
    "prompt_fn_kwargs", "--sp_size", "--train_sp_batch_size", "--vae_model_path", "--cache_dir",
    "--data_json_path", "--dataloader_num_workers", "--output_dir", "--logging_dir", "--allow_tf32",
    "--sampler_seed", "--checkpointing_steps", "--validation", "--log_validation", "--tracker_project_name",
    "--checkpoints_total_limit", "--fps", "--model_type", "--num_latent_t", "--master_port",
    "launcher", "config_file", "num_processes", "main_process_port", "log", "eval_rewards", "eval.",
    "model.resume", "model.attn_backend", "train.ref_param_device", "train.ema_device", "scheduler.seed",
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    peer: str
    recipe: str  # the recipe's name or the script's path under its peer folder
    imported: bool
    algorithm: str  # train.algorithm, "" when refused
    note: str  # what differs (imported) or why not (refused)


_ENGINE = (
    "actor_rollout_ref.rollout.engine_kwargs", "actor_rollout_ref.rollout.rollout_attn_backend",
    "actor_rollout_ref.rollout.seed", "actor_rollout_ref.rollout.max_num_seqs", "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node",
    "actor_rollout_ref.rollout.data_parallel_size", "actor_rollout_ref.rollout.step_execution",
    "actor_rollout_ref.rollout.max_prompt_embed_length", "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.rollout_adapter", "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.val_kwargs",
    "actor_rollout_ref.model.attn_backend", "actor_rollout_ref.model.lora_init_weights",
    "actor_rollout_ref.model.lora_adapter_path", "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.trust_remote_code", "actor_rollout_ref.model.custom_chat_template",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.veomni_config",
)  # fmt: skip


def _differs(dropped: dict[str, str], unchanged: set[str]) -> str:
    """The keys the import could not carry that the recipe itself sets (a base default it leaves
    alone, a section collapsed as ``* (N more keys)``, bookkeeping and engine settings left out)."""
    keys = [
        k
        for k in dropped
        if k not in unchanged
        and "more keys" not in k
        and not any(k.startswith(b) or k.lstrip("-").startswith(b) for b in (*_BOOKKEEPING, *_ENGINE))
    ]
    return ", ".join(f"`{k}`" for k in keys) if keys else "-"


def _one(peer: str, recipe: str, spec: str, root: Path, unchanged: set[str] | None = None) -> Row:
    from digen.importers import import_config
    from digen.importers.flow_grpo import NO_EQUIVALENT

    try:
        result = import_config(peer, spec)
        result.validate()
    except DigenError as exc:
        why = str(exc).splitlines()[0].replace(f"{root}/", "")
        source, sep, rest = why.partition("): ")
        why = rest if sep and source.count("(") == 1 else why.split(": ", 1)[-1] if ": " in why else why
        return Row(peer, recipe, False, "", why.replace("|", "/"))
    # a base default the recipe leaves alone is left out only where its reason is the generic one
    quiet = {k for k in unchanged or () if result.dropped.get(k) == NO_EQUIVALENT.get(k)}
    return Row(peer, recipe, True, str(result.config["train"]["algorithm"]), _differs(result.dropped, quiet))


def rows(root: Path) -> list[Row]:
    """One :class:`Row` per recipe of the three peers under ``root``."""
    out: list[Row] = []
    from digen.importers.pyconfig import ConfigModule, flatten

    base_path = root / "flow_grpo" / "config" / "base.py"
    base = flatten(ConfigModule(base_path).call("get_config"))
    for module in sorted((root / "flow_grpo" / "config").glob("*.py")):
        if module.name == "base.py":
            continue
        tree = ast.parse(module.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "get_config"]
        for name in names:
            recipe = f"{module.name}:{name}"
            if module.name in ("dpo.py", "sft.py"):
                what = "DPO" if module.name == "dpo.py" else "supervised fine-tuning"
                out.append(
                    Row(
                        "flow-grpo",
                        recipe,
                        False,
                        "",
                        f"a {what} recipe (scripts/train_sd3_{module.stem}.py), not an RL algorithm digen trains",
                    )
                )
                continue
            try:
                own = flatten(ConfigModule(module, base=ConfigModule(base_path)).call(name))
            except DigenError:
                own = {}
            unchanged = {k for k, v in own.items() if k in base and base[k] == v}
            out.append(_one("flow-grpo", recipe, f"{module}:{name}", root, unchanged))
    for script in sorted((root / "verl_omni" / "examples").rglob("*.sh")):
        out.append(_one("verl-omni", str(script.relative_to(root / "verl_omni")), str(script), root))
    for script in sorted((root / "dance_grpo" / "scripts" / "finetune").glob("*.sh")):
        out.append(_one("dance-grpo", str(script.relative_to(root / "dance_grpo")), str(script), root))
    for recipe in sorted((root / "flow_factory" / "examples").rglob("*.yaml")):
        out.append(_one("flow-factory", str(recipe.relative_to(root / "flow_factory")), str(recipe), root))
    return out


_PEERS = {
    "flow-grpo": "Flow-GRPO (9745241)",
    "verl-omni": "VeRL-Omni (a1139ba)",
    "dance-grpo": "DanceGRPO (15cc71d)",
    "flow-factory": "Flow-Factory (a0b2bc5, a selection)",
}


def markdown(table: list[Row]) -> str:
    """docs/peer-recipes.md."""
    lines = [
        "# Every peer recipe in digen",
        "",
        "<!-- generated: python -m digen.importers.catalog tests/data/peers > docs/peer-recipes.md;",
        "     tests/importers/test_catalog.py keeps this page equal to the importers' output -->",
        "",
        "`digen import-config` on every recipe and launch script of the three peers at the commits the",
        "[Flow-GRPO](coming-from-flow-grpo.md), [VeRL-Omni](coming-from-verl-omni.md) and",
        "[DanceGRPO](coming-from-dancegrpo.md) pages cite (their files are kept in tests/data/peers with",
        "their licences). *Imported*: the config trains the algorithm named, and the last column lists",
        "each peer key the import could not carry (its reason is in the import's notes and in the",
        "written file's header; paths, logging and engine placement left out). *Refused*: the one-line",
        "reason `digen import-config` gives, naming the peer's key.",
        "",
    ]
    for peer, title in _PEERS.items():
        mine = [r for r in table if r.peer == peer]
        n = sum(r.imported for r in mine)
        lines += [f"## {title}: {n} of {len(mine)} imported", ""]
        lines += ["| recipe | result | what differs, or why not |", "|---|---|---|"]
        for r in mine:
            result = f"imported: `{r.algorithm}`" if r.imported else "refused"
            lines.append(f"| `{r.recipe}` | {result} | {r.note} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown(rows(Path(sys.argv[1]))))
