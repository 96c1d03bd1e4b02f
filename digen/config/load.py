"""Loading a run configuration: a YAML file and ``--set a.b=value`` overrides into a
:class:`~digen.config.schema.Config`, checked as a whole.

Loading reports every problem at once (unknown keys, wrong types, impossible sizes, a missing
model folder, values that do not fit together) as one :class:`~digen.errors.ConfigError` whose
``problems`` list reads like ``rollout.group_size (5) must divide rollout.batch_size (12)``.
With ``algorithms`` (the default) the algorithm's own checks run too, from the algorithm
registry, which imports torch; the registry in turn names only the schema's types, so the
two do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from digen.config.names import ALGORITHM_NAMES, REWARD_NAMES
from digen.config.schema import MAX_LOCAL_WORKERS, REQUIRED, Config
from digen.errors import ConfigError, did_you_mean


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            node[k] = nxt
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=3", "c=x"]`` -> ``[("a.b", 3), ("c", "x")]`` (values parsed as YAML scalars)."""
    out, problems = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r} is not KEY=VALUE (e.g. --set rollout.group_size=4)")
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    if problems:
        raise ConfigError(problems)
    return out


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed beside the last one of ``loc`` (the section it names), for a hint."""
    node: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = node.model_fields.get(str(part))
        if field is None:
            return []
        inner: Any = field.annotation
        if get_origin(inner) is list:
            inner = get_args(inner)[0]
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        node = inner
    return list(node.model_fields)


def _describe(err: Any) -> str:  # a pydantic ErrorDetails
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "missing":
        return REQUIRED.get(loc) or f"{loc} is required (see configs/README.md for the keys)"
    if kind == "extra_forbidden":
        parent = ".".join(str(p) for p in err["loc"][:-1])
        hint = did_you_mean(str(err["loc"][-1]), _section_keys(tuple(err["loc"])))
        if hint and parent:
            hint = hint.replace(" '", f" '{parent}.", 1)
        return f"{loc}: unknown key{hint} (check the spelling; see configs/README.md for the keys)"
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    return f"{loc} ({shown}): {err['msg']}"


def _cross_checks(cfg: Config, check_paths: bool, algorithms: bool = True) -> list[str]:
    problems: list[str] = []
    r, t = cfg.rollout, cfg.train
    if r.batch_size % r.group_size:
        problems.append(
            f"rollout.group_size ({r.group_size}) must divide rollout.batch_size ({r.batch_size})"
        )
    if r.group_size < 2:
        problems.append(
            f"rollout.group_size ({r.group_size}) must be at least 2: GRPO compares samples of a group"
        )
    if r.sde.kind in ("sde", "dance") and r.sde.noise_level == 0:
        problems.append(
            "rollout.sde.noise_level (0) gives a deterministic ODE step with no log-prob; use > 0"
        )
    if r.sde.kind == "cps" and not 0 < r.sde.noise_level <= 1:
        problems.append(f"rollout.sde.noise_level ({r.sde.noise_level}) must lie in (0, 1] for cps")
    if t.timesteps.strategy == "window" and t.timesteps.window > r.num_steps - 1:
        problems.append(
            f"train.timesteps.window ({t.timesteps.window}) must be below rollout.num_steps ({r.num_steps})"
        )
    if cfg.model.autocast and cfg.model.dtype == "float64":
        problems.append(
            f"model.autocast ({cfg.model.autocast}) with model.dtype float64: a float64 model checks the "
            f"training math in float64 throughout; drop model.autocast or use model.dtype float32"
        )
    if t.kl_beta > 0 and not cfg.model.lora.enabled:
        problems.append(
            "train.kl_beta > 0 needs model.lora.enabled: the reference policy is the base weights"
        )
    s = cfg.schedule.resolved()
    cl = cfg.cluster.local
    if s.mode in ("disaggregated", "digen") and (cl.rollout_workers < 1 or cl.trainer_workers < 1):
        problems.append(
            f"schedule.mode {s.mode} needs cluster.local.rollout_workers >= 1 and trainer_workers >= 1 "
            f"(got {cl.rollout_workers} and {cl.trainer_workers})"
        )
    local = cl.rollout_workers + cl.trainer_workers + cl.reward_workers
    if local > MAX_LOCAL_WORKERS:
        problems.append(
            f"cluster.local has {local} workers (rollout {cl.rollout_workers}, trainer {cl.trainer_workers}, "
            f"reward {cl.reward_workers}): at most {MAX_LOCAL_WORKERS} on one machine; add nodes with digen worker"
        )
    if s.mode == "colocated" and cl.rollout_workers + cl.trainer_workers < 1:
        problems.append("schedule.mode colocated needs at least one worker in cluster.local")
    problems += _fsdp_checks(cfg)
    problems += _ema_checks(cfg)
    problems += _sp_checks(cfg, check_paths)
    problems += name_problems(cfg, algorithm=not algorithms)
    problems += _mini_batch_checks(cfg)
    if algorithms:
        from digen.algos.registry import config_problems
        from digen.algos.timesteps import window_range_problem

        problems += config_problems(cfg)
        ts = cfg.train.timesteps
        problem = window_range_problem(r.num_steps, ts.window, ts.window_range)
        if ts.strategy == "window" and ts.window <= r.num_steps - 1 and problem:
            problems.append(
                f"train.timesteps: {problem} (rollout.num_steps {r.num_steps}); set train.timesteps.window_range"
            )
    if cfg.eval.every and cfg.prompts.test_file is None and cfg.prompts.dataset is None:
        problems.append(
            f"eval.every ({cfg.eval.every}) needs prompts.test_file (held-out prompts, one per line) "
            f"or a prompts.dataset with a test split; set one or eval.every=0"
        )
    if cl.reward_workers and s.mode == "reference":
        problems.append(
            f"cluster.local.reward_workers ({cl.reward_workers}) needs a distributed schedule.mode: "
            f"reference scores in its one process"
        )
    if not cfg.reward:
        problems.append("reward: list at least one reward, e.g. [{name: brightness}]")
    if check_paths:
        model_dir = cfg.resolve_path(cfg.model.path)
        if not model_dir.exists():
            problems.append(
                f"model.path ({cfg.model.path}) does not exist; make a tiny one with "
                f"`digen make-tiny-model {cfg.model.path} --arch sd3` or point it at a diffusers folder"
            )
        elif not (model_dir / "model_index.json").exists():
            problems.append(
                f"model.path ({cfg.model.path}) is not a diffusers pipeline folder (no model_index.json)"
            )
        for key in ("dataset", "file", "test_file"):
            value = getattr(cfg.prompts, key)
            if value is not None and not cfg.resolve_path(value).exists():
                problems.append(f"prompts.{key} ({value}) does not exist")
    else:
        pass
    sec = cfg.security
    if sec.enabled:
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(sec, name)
            if value is None:
                problems.append(
                    f"security.{name} is missing: TLS needs ca_file, cert_file and key_file together"
                )
            elif check_paths and not cfg.resolve_path(value).exists():
                problems.append(
                    f"security.{name} ({value}) does not exist; docs/deploy.md shows how to make it"
                )
    if cfg.prompts.dataset is None and cfg.prompts.file is None and not cfg.prompts.items:
        problems.append("prompts: give prompts.items, prompts.file or prompts.dataset")
    return problems


def _sp_checks(cfg: Config, check_paths: bool) -> list[str]:
    """``rollout.sequence_parallel`` > 1 needs separate rollout workers (disaggregated or
    digen) and a family with a Ulysses processor; ``train.sequence_parallel`` > 1 is refused
    (trainer replicas are not formed: gradients at d > 1 exist at model level only)."""
    d, problems = cfg.rollout.sequence_parallel, []
    if cfg.train.sequence_parallel > 1:  # refused rather than silently run at d = 1
        problems.append(
            f"train.sequence_parallel ({cfg.train.sequence_parallel}): digen train does not form "
            f"sequence-parallel trainer replicas (only rollout ones, rollout.sequence_parallel); set it to 1"
        )
    if d == 1:
        return problems
    # the replica's ranks run one task in lock step (workers/sp_loop.py): a replica generates one
    # group at a time whatever max_batch says (leftover workers at d = 1 still batch), and a
    # max_batch the user asked for is refused rather than silently not applied to the replicas
    if cfg.rollout.max_batch > 1 and "max_batch" in cfg.rollout.model_fields_set:
        problems.append(
            f"rollout.max_batch ({cfg.rollout.max_batch}) with rollout.sequence_parallel ({d}): a "
            f"sequence-parallel replica generates one group at a time; set rollout.max_batch=1"
        )
    mode = cfg.schedule.resolved().mode
    if mode not in ("disaggregated", "digen"):
        problems.append(
            f"rollout.sequence_parallel ({d}) needs schedule.mode disaggregated or digen (replicas of "
            f"rollout workers), got {mode}; set schedule.mode=disaggregated or rollout.sequence_parallel=1"
        )
    model_dir = cfg.resolve_path(cfg.model.path)
    if check_paths and (model_dir / "model_index.json").exists():
        from digen.models.registry import detect_family
        from digen.parallel.ulysses import SP_FAMILIES

        family = detect_family(model_dir)
        if family not in SP_FAMILIES:
            problems.append(
                f"rollout.sequence_parallel ({d}): the {family} family has no Ulysses attention processor "
                f"(supported: {', '.join(SP_FAMILIES)}); set rollout.sequence_parallel=1"
            )
    return problems


def _reward_names() -> set[str]:
    """:data:`REWARD_NAMES`, and any reward this process registered beyond them (when it has
    imported the registry: a test's own reward)."""
    import sys

    registry = sys.modules.get("digen.rewards.registry")
    return set(REWARD_NAMES) | set(registry.available() if registry is not None else ())


def name_problems(cfg: Config, *, algorithm: bool = True) -> list[str]:
    """Each ``reward[i].name`` and (with ``algorithm``) ``train.algorithm`` is a name digen
    knows, checked from the tables of :mod:`digen.config.names` without importing torch: a
    misspelt name is reported with the config's other problems, before anything starts. What the registries
    say of the rest (a reward's kwargs, an algorithm's own checks) is
    :func:`digen.checks.check_inputs`'s."""
    problems: list[str] = []
    known = _reward_names()
    for i, spec in enumerate(cfg.reward):
        if spec.name not in known:
            hint, names = did_you_mean(spec.name, known), ", ".join(sorted(known))
            problems.append(
                f"reward[{i}].name: reward '{spec.name}' does not exist"
                + (f"{hint} (available: {names})" if hint else f"; available: {names}")
            )
    name = cfg.train.algorithm
    if algorithm and name is not None and name not in ALGORITHM_NAMES:
        hint, names = did_you_mean(name, ALGORITHM_NAMES), ", ".join(ALGORITHM_NAMES)
        problems.append(
            f"train.algorithm ({name!r}) is not a registered algorithm"
            + (
                f"{hint} (use one of {names})"
                if hint
                else f"; use one of {names} (digen algorithms lists them)"
            )
        )
    return problems


def _ema_checks(cfg: Config) -> list[str]:
    """``train.ema.eval`` and ``train.ema.export`` need an EMA to use."""
    e = cfg.train.ema
    return [
        f"train.ema.{key} (true) needs train.ema.enabled (false): there is no EMA to {what}; "
        f"set train.ema.enabled=true or train.ema.{key}=false"
        for key, what in (("eval", "evaluate"), ("export", "export"))
        if getattr(e, key) and not e.enabled
    ]


def _mini_batch_checks(cfg: Config) -> list[str]:
    """``train.mini_batches`` divides what it splits; ``train.kl_target`` has a weight. The
    algorithm's own checks are the registry's (:func:`digen.algos.registry.config_problems`)."""
    t, problems = cfg.train, []
    groups = cfg.rollout.prompts_per_iteration
    if groups and groups % t.mini_batches and t.mini_batch_split == "groups":
        problems.append(
            f"train.mini_batches ({t.mini_batches}) must divide the iteration's prompt groups "
            f"(rollout.batch_size / rollout.group_size = {groups}): each optimizer step takes whole groups; "
            f"or set train.mini_batch_split=samples"
        )
    if t.mini_batch_split == "samples" and cfg.rollout.batch_size % t.mini_batches:
        problems.append(
            f"train.mini_batches ({t.mini_batches}) must divide the iteration's samples (rollout.batch_size = "
            f"{cfg.rollout.batch_size}): with train.mini_batch_split samples each optimizer step takes an "
            f"equal share of them, as Flow-GRPO's"
        )
    if t.kl_target is not None and t.kl_beta == 0:
        problems.append(
            f"train.kl_target ({t.kl_target}) has no effect with train.kl_beta 0; set train.kl_beta > 0 "
            f"or leave train.kl_target unset"
        )
    return problems


def _fsdp_checks(cfg: Config) -> list[str]:
    """``train.fsdp`` needs a separate trainer group (no reference, no colocated) and trainers
    that only train (its EMA is sharded with the weights: :class:`digen.parallel.fsdp.ShardedTrainer`)."""
    t, s = cfg.train, cfg.schedule
    if not t.fsdp:
        return []
    problems = []
    if s.mode not in ("disaggregated", "digen"):
        why = "it runs in one process" if s.mode == "reference" else "every worker both generates and trains"
        problems.append(
            f"train.fsdp (true) needs schedule.mode disaggregated or digen, got {s.mode} ({why}); "
            f"set schedule.mode=disaggregated or train.fsdp=false"
        )
    reasons = {
        "tag": "a trainer rank holds 1/N of the weights and cannot generate on its own",
        "rat": "a rollout worker's gradient cannot reach the sharded optimizer",
    }
    for key, reason in reasons.items():
        if getattr(s, key):
            problems.append(
                f"schedule.{key} (true) cannot be used with train.fsdp: {reason}; drop schedule.{key}"
            )
    return problems


def _absolute_paths(cfg: Config) -> None:
    """Paths that exist relative to the config file become absolute, so every process of a
    job (worker loops start elsewhere) reads the same files. Other paths stay as written."""
    for section, key in (
        (cfg.model, "path"),
        (cfg.prompts, "file"),
        (cfg.prompts, "dataset"),
        (cfg.prompts, "test_file"),
    ):
        value = getattr(section, key)
        if value is not None and not Path(value).expanduser().is_absolute():
            resolved = cfg.resolve_path(value)
            if resolved.exists():
                setattr(section, key, str(resolved.resolve()))


def build_config(
    data: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source_dir: Path | None = None,
    check_paths: bool = True,
    algorithms: bool = True,
    also: Callable[[Config], list[str]] | None = None,
) -> Config:
    """Validate ``data`` (+ ``--set`` overrides) into a :class:`Config`; every problem at once.

    ``algorithms``: also check ``train.algorithm`` against the algorithm registry
    (:func:`digen.algos.registry.config_problems`), which imports torch. A process that must not load torch
    (the controller of a distributed run: ``digen train``, the job runner) passes False and
    leaves it to :func:`digen.checks.check_inputs`, which checks it with the rewards in a
    child process.

    ``also``: the caller's own problems of a config that has the right keys and types (what
    ``digen train`` knows beyond the file: where the embedded cluster's workers go on this
    machine's GPUs); they are reported with the cross-checks', in one :class:`ConfigError`."""
    data = dict(data)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(data, key, value)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()]) from None
    if source_dir is not None:
        cfg.source_dir = str(source_dir)
        _absolute_paths(cfg)
    problems = _cross_checks(cfg, check_paths, algorithms)
    if also is not None:
        problems += also(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: Path, what: str) -> Any:
    """The data of the YAML file ``path`` (``{}`` when it is empty); a one-line
    :class:`ConfigError` when it does not exist (``what`` names the file: "config file") or is
    not YAML (with the line and column of the problem)."""
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None


def load_config(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    check_paths: bool = True,
    algorithms: bool = True,
    also: Callable[[Config], list[str]] | None = None,
) -> Config:
    """Read a YAML config file; see :func:`build_config`."""
    p = Path(path)
    data = read_yaml(p, "config file")
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of config sections, got {type(data).__name__}")
    return build_config(
        data,
        overrides,
        source_dir=p.parent.resolve(),
        check_paths=check_paths,
        algorithms=algorithms,
        also=also,
    )


SECRET_WORDS = ("password", "passwd", "secret", "token", "api_key", "apikey", "credential")


def _mask_secrets(node: Any) -> Any:
    """``node`` with the value of every key that names a secret (``password``, ``token``,
    ``api_key``...) replaced by ``***``."""
    if isinstance(node, dict):
        return {
            k: "***"
            if any(w in str(k).lower() for w in SECRET_WORDS) and v not in (None, "")
            else _mask_secrets(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_mask_secrets(v) for v in node]
    return node


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what ``config.yaml`` in a run directory holds); values
    of keys that name secrets (e.g. a reward's ``api_key``) are written as ``***``."""
    data = cfg.model_dump(mode="json", exclude={"source_dir"})
    data["schedule"] = cfg.schedule.resolved().model_dump(mode="json")
    return yaml.safe_dump(_mask_secrets(data), sort_keys=False)
