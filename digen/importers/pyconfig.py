"""A reader of ``ml_collections`` config files (Flow-GRPO's ``config/*.py``) that never runs them.

The file is parsed with :mod:`ast` and its functions are walked statement by statement:
assignments to ``config.a.b`` (and aliases such as ``sample = config.sample``), calls of
``base.get_config()`` or of another recipe of the same file, local variables, ``return``.
Expressions are evaluated only when they are literals, names already bound, ``config.x.y``
reads, arithmetic, comparisons, ``a if c else b``, f-strings and a few pure calls
(``int``, ``float``, ``min``, ``max``, ``os.path.join``, ``os.getcwd``). Any other expression
leaves its key unevaluated (:data:`UNEVALUATED`), reported by the importer; any other
statement (a loop, an import inside a function) is refused. Nothing of the file is executed,
imported or given to ``eval``.
"""

from __future__ import annotations

import ast
import operator
import posixpath
from pathlib import Path
from typing import Any

from digen.errors import ConfigError, did_you_mean


class Section(dict):
    """A ``ConfigDict()``: a section whose keys are config keys (a dict literal is a value)."""


class _Unevaluated:
    def __repr__(self) -> str:
        return "<unevaluated>"


UNEVALUATED: Any = _Unevaluated()
"""The value of a key whose expression is not one this reader evaluates."""

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_CALLS = {"int": int, "float": float, "min": min, "max": max, "abs": abs, "round": round, "bool": bool}


class _Fail(Exception):
    """An expression this reader does not evaluate."""


class ConfigModule:
    """The functions of one config file, by name, with the module that ``base`` names."""

    def __init__(self, path: Path, base: ConfigModule | None = None):
        if not path.is_file():
            raise ConfigError(f"{path} does not exist")
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as exc:
            raise ConfigError(f"{path} is not Python (line {exc.lineno}): {exc.msg}") from None
        self.path = path
        self.base = base
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def call(self, name: str, depth: int = 0) -> Section:
        """The config that function ``name`` returns, walked as described in the module docstring."""
        if name not in self.functions:
            raise ConfigError(f"{self.path} has no function {name!r}{did_you_mean(name, self.functions)}")
        if depth > 20:
            raise ConfigError(f"{self.path}: {name} calls recipes more than 20 deep")
        result = _Frame(self, depth).run(self.functions[name].body)
        if not isinstance(result, Section):
            raise ConfigError(f"{self.path}: {name} does not return a config")
        return result


class _Frame:
    def __init__(self, module: ConfigModule, depth: int):
        self.module = module
        self.depth = depth
        self.names: dict[str, Any] = {}

    def run(self, body: list[ast.stmt]) -> Any:
        for stmt in body:
            if isinstance(stmt, ast.Return):
                return self.value(stmt.value) if stmt.value is not None else None
            if isinstance(stmt, ast.Assign):
                value = self.value(stmt.value)
                for target in stmt.targets:
                    self.assign(target, value)
            elif isinstance(stmt, ast.AugAssign):
                op = _BINOPS.get(type(stmt.op))
                try:
                    current = self.expr(stmt.target)
                    value = op(current, self.expr(stmt.value)) if op else UNEVALUATED
                except _Fail:
                    value = UNEVALUATED
                self.assign(stmt.target, value)
            elif isinstance(stmt, (ast.Assert, ast.Expr, ast.Pass, ast.Import, ast.ImportFrom)):
                continue  # checks, docstrings and bare calls change no key
            else:
                where = f"{self.module.path}:{stmt.lineno}"
                raise ConfigError(f"{where}: a {type(stmt).__name__} statement is not read by the importer")
        return None

    def assign(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.names[target.id] = value
        elif isinstance(target, ast.Attribute):
            try:
                owner = self.expr(target.value)
            except _Fail:
                return
            if isinstance(owner, Section):
                owner[target.attr] = value
        # tuple unpacking and subscripts are not config keys

    def value(self, node: ast.expr) -> Any:
        try:
            return self.expr(node)
        except _Fail:
            return UNEVALUATED

    def expr(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise _Fail
        if isinstance(node, ast.Attribute):
            owner = self.expr(node.value)
            if isinstance(owner, Section) and node.attr in owner:
                return owner[node.attr]
            raise _Fail
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [self.expr(e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise _Fail
            return {self.expr(k): self.expr(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
        if isinstance(node, ast.UnaryOp):
            operand = self.expr(node.operand)
            if isinstance(node.op, ast.USub):
                return -operand
            if isinstance(node.op, ast.UAdd):
                return +operand
            if isinstance(node.op, ast.Not):
                return not operand
            raise _Fail
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self.expr(node.left), self.expr(node.right)
            if not all(isinstance(v, (int, float, str, tuple, list)) for v in (left, right)):
                raise _Fail
            if _too_big(node.op, left, right):
                raise _Fail
            try:
                return _BINOPS[type(node.op)](left, right)
            except (ArithmeticError, TypeError, ValueError):
                raise _Fail from None
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            return _CMPOPS[type(node.ops[0])](self.expr(node.left), self.expr(node.comparators[0]))
        if isinstance(node, ast.IfExp):
            return self.expr(node.body) if self.expr(node.test) else self.expr(node.orelse)
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                parts.append(str(self.expr(v.value)) if isinstance(v, ast.FormattedValue) else str(v.value))  # type: ignore[attr-defined]
            return "".join(parts)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise _Fail

    def call(self, node: ast.Call) -> Any:
        name = _dotted(node.func)
        if node.keywords:
            raise _Fail
        if name in ("ml_collections.ConfigDict", "ConfigDict") and not node.args:
            return Section()
        if name == "base.get_config" and self.module.base is not None and not node.args:
            return self.module.base.call("get_config", self.depth + 1)
        if name in self.module.functions and not node.args:
            return self.module.call(name, self.depth + 1)
        if name == "os.getcwd":
            return "."
        args = [self.expr(a) for a in node.args]
        if name == "os.path.join" and all(isinstance(a, str) for a in args):
            return posixpath.normpath(posixpath.join(*args))
        if name in _CALLS:
            try:
                return _CALLS[name](*args)
            except (TypeError, ValueError):
                raise _Fail from None
        raise _Fail


_MAX_ITEMS = 100_000
_MAX_BASE = 2**64


def _too_big(op: ast.operator, left: Any, right: Any) -> bool:
    """Whether ``left op right`` could take more than a small bounded time or memory (a config
    value is a number or a short string; ``"a" * 10**12`` or ``9 ** 9 ** 9`` is refused)."""
    sizes = [len(v) for v in (left, right) if isinstance(v, (str, tuple, list))]
    counts = [abs(v) for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
    if isinstance(op, ast.Mult) and sizes and counts:
        return sizes[0] * counts[0] > _MAX_ITEMS
    if isinstance(op, ast.Add) and len(sizes) == 2:
        return sum(sizes) > _MAX_ITEMS
    if isinstance(op, ast.Pow):
        return (
            not all(isinstance(v, (int, float)) for v in (left, right))
            or abs(left) > _MAX_BASE
            or abs(right) > 64
        )
    if isinstance(op, ast.Mult) and all(isinstance(v, int) for v in (left, right)):
        return abs(left).bit_length() + abs(right).bit_length() > 4096
    return False


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def flatten(section: Section, prefix: str = "") -> dict[str, Any]:
    """``{"train.learning_rate": 3e-4, ...}``: every key of ``section`` (nested sections
    recursed into; a dict literal such as ``reward_fn`` is one value)."""
    flat: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, Section) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = dict(value) if isinstance(value, Section) else value
    return flat
