"""The arguments a launch script passes to its trainer, read without running the script.

VeRL-Omni's ``examples/**/*.sh`` and DanceGRPO's ``scripts/finetune/*.sh`` set a few shell
variables (``NAME=value``, ``NAME=${NAME:-default}``) and call one Python entry point with
``key=value`` (Hydra) or ``--flag value`` arguments over backslash-continued lines. This reads
the variables as the shell would assign them (quoted values, values with spaces, trailing
``# comments``, ``export NAME=...``; ``${NAME:-default}`` gives its default, ``$((A * B / C))``
of known integers its value), substitutes them where they appear as ``$NAME`` or ``${NAME}``,
and splits the call's words with :mod:`shlex`. Nothing is executed; a word that still holds
``$`` (a command substitution, a variable of the user's environment) stays as written, and
:func:`unresolved` names it for the importer's refusal.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import NamedTuple

import yaml

from digen.errors import ConfigError

_VAR = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_DEFAULT = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*:-(.*)\}$")
_ARITH = re.compile(r"\$\(\(\s*([A-Za-z0-9_ +\-*/]+?)\s*\)\)")


def read_script(path: Path, entry: str) -> list[str]:
    """The words after ``entry`` (a substring of the command, e.g. ``main_diffusion``) in
    the script at ``path``, variables substituted."""
    return read_command(path, entry).args


class Command(NamedTuple):
    """A launch script's call: ``launcher`` (the words before the program, ``torchrun
    --nnodes=2 ...``), ``program`` (the word naming the entry point, e.g.
    ``fastvideo/train_grpo_flux_lora.py``: an importer reads the variant from it) and ``args``."""

    launcher: list[str]
    program: str
    args: list[str]


def read_command(path: Path, entry: str) -> Command:
    """The first command line of the script at ``path`` whose words name ``entry``."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    text = re.sub(r"\\[ \t]*(\r?\n|\Z)", " ", path.read_text())
    variables: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if entry in line:
            try:
                # as the shell: split the line, then expand each word (a value's own quotes stay)
                words = shlex.split(_substitute(line, variables, names=False), comments=True)
                words = [_substitute(w, variables) for w in words]
            except ValueError as exc:
                raise ConfigError(
                    f"{path}: the command line naming {entry} does not split as shell words: {exc}"
                ) from None
            for i, word in enumerate(words):
                if entry in word:
                    return Command(words[:i], word, words[i + 1 :])
        match = _VAR.match(line)
        if match:
            name, value = match.group(1), _assigned(match.group(2), variables)
            if value is not None:
                variables[name] = value
    runs = _programs(text)
    also = f" (it runs {', '.join(runs)})" if runs else ""
    raise ConfigError(f"{path} does not call {entry}{also}; not a recipe digen's importer reads")


def _programs(text: str) -> list[str]:
    """What the script's command lines run, in order: Python programs (``-m module`` or
    ``file.py``) and other scripts (``bash .../other.sh``: a wrapper, whose own recipe is
    that script)."""
    found: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        m = re.search(r"python[0-9.]*\s+(?:-m\s+(\S+)|(\S+\.py))|\bbash\s+\"?([^\"\s]+\.sh)", line)
        name = m and (m.group(1) or m.group(2) or Path(m.group(3)).name)
        if name and name not in found:
            found.append(name)
    return found[:3]


def _assigned(rest: str, variables: dict[str, str]) -> str | None:
    """The value ``NAME=rest`` gives NAME, as the shell reads it: quotes removed, a trailing
    ``# comment`` and spaces dropped, ``$((...))`` of known integers computed, ``${NAME:-d}``
    its default ``d`` (the importer does not see the user's environment). None where the line
    is not a plain assignment (``A=1 command ...``, an unbalanced quote)."""
    try:
        words = shlex.split(_substitute(rest, variables), comments=True)
    except ValueError:
        return None
    if len(words) > 1:
        return None
    value = words[0] if words else ""
    while default := _DEFAULT.match(value):  # ${A:-${B:-x}}: the innermost default
        value = default.group(1)
    return _substitute(value, variables)


def _substitute(text: str, variables: dict[str, str], *, names: bool = True) -> str:
    """``text`` with ``$((...))`` of known integers computed and (``names``) ``$NAME`` and
    ``${NAME}`` replaced by the known values."""

    def arith(match: re.Match[str]) -> str:
        expr = re.sub(
            r"[A-Za-z_][A-Za-z0-9_]*", lambda m: variables.get(m.group(0), m.group(0)), match.group(1)
        )
        if re.fullmatch(r"[0-9 +\-*/]+", expr):
            terms = re.split(r"\s*(/|\*|\+|-)\s*", expr.strip())
            value = int(terms[0])
            for op, term in zip(terms[1::2], terms[2::2], strict=True):
                n = int(term)
                value = {"/": value // n if n else value, "*": value * n, "+": value + n, "-": value - n}[op]
            return str(value)
        return match.group(0)

    text = _ARITH.sub(arith, text)
    if not names:
        return text
    for name in sorted(variables, key=len, reverse=True):
        text = text.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return text


def scalar(text: str) -> object:
    """A command-line value as the peer's parser reads it: numbers (``1e-5`` too), booleans,
    ``null``, lists ``[0,5]``; anything else the string itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (list, dict)) or value is None else text


def unresolved(key: str, value: object) -> str | None:
    """Why ``key=value`` cannot be read (its value still names a shell variable or command the
    script computes at run time), or None."""
    if isinstance(value, str) and "$" in value:
        return (
            f"{key}={value}: the launch script computes it at run time (a variable of the environment or "
            "a command); give the value with --set on the digen key it maps to"
        )
    return None
