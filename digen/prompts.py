"""Prompt datasets on disk, in the layouts Flow-GRPO ships (``dataset/<name>/``):

- ``train.txt`` / ``test.txt``: one prompt a line (Flow-GRPO's ``TextPromptDataset``; blank
  lines are skipped);
- ``train_metadata.jsonl`` / ``test_metadata.jsonl``: one JSON object a line with a
  ``prompt`` key and the rest of the prompt's metadata (GenEval's ``tag``, ``include``,
  ``exclude``...; Flow-GRPO's ``GenevalPromptDataset``). Each object is passed whole to the
  rewards as that prompt's metadata.

When a folder has both, the metadata file wins. Files are read once per process and cached
by path and modification time.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from digen.errors import ConfigError

Prompts = tuple[list[str], list[dict[str, Any]] | None]
"""(prompts, one metadata dict per prompt or None when the file carries none)."""


def split_file(folder: Path, split: str) -> Path:
    """``folder/{split}_metadata.jsonl`` if it exists, else ``folder/{split}.txt``.

    Raises:
        ConfigError: neither exists.
    """
    for name in (f"{split}_metadata.jsonl", f"{split}.txt"):
        if (folder / name).is_file():
            return folder / name
    raise ConfigError(
        f"prompts.dataset ({folder}) has no {split}_metadata.jsonl nor {split}.txt; "
        f"a prompt dataset folder holds {split}.txt (one prompt a line) or {split}_metadata.jsonl"
    )


def read_prompts(path: Path) -> Prompts:
    """Prompts (and metadata, for ``.jsonl``) of a prompt file.

    Raises:
        ConfigError: a ``.jsonl`` line that is not a JSON object with a string ``prompt``, or a
            file with no prompt.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"prompt file {path} is a folder; give a text file (one prompt a line) or .jsonl")
    return _read_cached(str(path.resolve()), path.stat().st_mtime_ns)


def decode_text(path: str, data: bytes) -> str:
    """``data`` as UTF-8 text; a :class:`ConfigError` naming the file, the byte and its offset
    (and line) when it is not, or when it holds a NUL byte (a binary file)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"prompt file {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"(line {line}) cannot be decoded; save it as UTF-8, one prompt a line"
        ) from None
    nul = text.find("\x00")
    if nul >= 0:
        offset = len(text[:nul].encode("utf-8"))
        raise ConfigError(
            f"prompt file {path} is not a text file: a NUL byte at offset {offset}; give a UTF-8 text "
            f"file, one prompt a line"
        )
    return text.removeprefix("\ufeff")  # a UTF-8 byte order mark is no part of the first prompt


@lru_cache(maxsize=16)
def _read_cached(path: str, mtime_ns: int) -> Prompts:
    text = decode_text(path, Path(path).read_bytes())
    if path.endswith(".jsonl"):
        metadata = [_metadata_line(path, i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
        prompts: list[str] = [m["prompt"] for m in metadata]
        result: Prompts = (prompts, metadata)
    else:
        result = ([ln.strip() for ln in text.splitlines() if ln.strip()], None)
    if not result[0]:
        raise ConfigError(f"prompt file {path} holds no prompt")
    return result


def _metadata_line(path: str, lineno: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} line {lineno} is not JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise ConfigError(
            f'{path} line {lineno} must be a JSON object with a "prompt" string, got {line[:80]!r}'
        )
    return obj


def metadata_by_prompt(prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{prompt: metadata}``; a prompt listed twice must carry the same metadata.

    Raises:
        ConfigError: the same prompt with two different metadata objects.
    """
    out: dict[str, dict[str, Any]] = {}
    for prompt, meta in zip(prompts, metadata, strict=True):
        if out.setdefault(prompt, meta) != meta:
            raise ConfigError(
                f"prompt {prompt!r} appears twice with different metadata; each prompt needs one metadata object"
            )
    return out
