"""The run directory: config, metrics, timeline, samples, checkpoints, summary.

Layout (docs/architecture.md, "The run directory")::

    config.yaml  metrics.jsonl  timeline.jsonl  summary.json
    samples/iter_NNNN.png  timeline.png  rewards.png
    checkpoints/iter_NNNN/{weights,optimizer}.safetensors state.json

``checkpoints/iter_NNNN`` holds the state *after* iteration NNNN's optimizer step. Resuming
from it truncates ``metrics.jsonl`` and ``timeline.jsonl`` to iterations <= NNNN, so a run
killed at any point and resumed has every iteration exactly once.

A run holds :class:`RunLock` on its directory while it uses it (``RUN_DIR/.digen.lock``, an
OS ``flock`` that names the holder's pid and host; released at exit, and by the kernel when
the process dies, even by SIGKILL): a second run into the same directory is refused.

A full disk anywhere in a run (``ENOSPC``, or safetensors' error for it) becomes one
:class:`DiskFull` line naming the path, the bytes needed and the last intact checkpoint
(:func:`disk_writes`, :func:`disk_full_error`); every writer of run files goes through it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from digen.config import Config, dump_config
from digen.errors import CheckpointError, ConfigError, DigenError

RUN_DIR_MODE = 0o750
"""The most a run directory's mode allows (less where the umask says so): its files, samples
and checkpoints are the user's and their group's, never world-readable (the files themselves
follow the umask; nobody else can enter the directory to read them)."""

LOCK_NAME = ".digen.lock"
"""The run directory's lock file (holds the pid and host of the run using the directory)."""


class RunDirBusy(ConfigError):
    """The run directory is in use by another run (its :class:`RunLock` is held)."""


class DiskFull(DigenError):
    """A write of a run file failed for lack of space: the run ends, the last intact
    checkpoint is kept (``--resume`` continues from it once space is freed)."""


# --- the run directory's lock -----------------------------------------------------------


def private_dir(root: Path) -> Path:
    """Create ``root`` (and its parents, as the umask makes them) for a run and take away what
    :data:`RUN_DIR_MODE` does not allow: an existing folder of this user's (a new or empty one,
    or a run directory) loses its access for others; the group's bits follow the umask. A
    folder of another user's is left as it is (the run fails to write there if it must)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    st = root.stat()
    if st.st_uid == os.getuid():
        mode = (st.st_mode & 0o7777) & (RUN_DIR_MODE | 0o7000) & ~umask | 0o700
        if mode != st.st_mode & 0o7777:
            os.chmod(root, mode)
    return root


_HELD: dict[Path, list[int]] = {}  # resolved root -> [fd, count] (re-entrant within a process)
_HELD_LOCK = threading.Lock()


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on {info['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        return "another process (its lock file names no holder yet)"


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.digen.lock`` while a run uses the directory.

    :meth:`acquire` creates the directory (the run has been accepted by then) and writes the
    holder's pid, host and start time into the lock file; a second process is refused with
    :class:`RunDirBusy` (exit 2) naming them. The kernel drops the lock when its process dies
    (SIGKILL included), so a stale lock file is simply taken over. Re-entrant within one
    process (the job runner takes it, then the training it starts). :meth:`release` deletes
    the file while still holding the lock; a waiter that opened the old file notices (its
    inode is no longer the path's) and opens the new one.
    """

    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        self.path = self.root / LOCK_NAME
        self._key = Path(os.path.realpath(self.root))

    def acquire(self) -> RunLock:
        with _HELD_LOCK:
            if self._key in _HELD:
                _HELD[self._key][1] += 1
                return self
        private_dir(self.root)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
                os.close(fd)
                raise RunDirBusy(
                    f"run directory {self.root} is in use by {holder}; wait for that run to end "
                    f"(or stop it), or choose another --out"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder deleted the file we locked: lock the new one
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        with _HELD_LOCK:
            _HELD[self._key] = [fd, 1]
        return self

    def release(self) -> None:
        with _HELD_LOCK:
            entry = _HELD.get(self._key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[self._key]
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(entry[0])

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def holder(root: Path) -> str | None:
        """Who holds ``root``'s lock ("pid N on HOST (since ...)"), or None when nobody does."""
        path = Path(root) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            return None
        finally:
            os.close(fd)


# --- a full disk ------------------------------------------------------------------------


def is_disk_full(exc: BaseException) -> bool:
    """``ENOSPC``/``EDQUOT`` from the OS, or the same from safetensors' Rust writer."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return type(exc).__name__ == "SafetensorError" and (
        "No space left" in text or "StorageFull" in text or "os error 28" in text or "code: 28" in text
    )


def _size(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def latest_intact_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint of the run in ``root`` (``state.json`` written last)."""
    folder = Path(root) / "checkpoints"
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.glob("iter_*") if p.suffix != ".tmp" and (p / "state.json").exists())
    return done[-1] if done else None


def holds_rows(root: Path) -> bool:
    """The run directory ``root`` holds metrics rows (a fresh run there is refused)."""
    return bool(_read_jsonl(Path(root) / "metrics.jsonl"))


def checkpoint_advice(root: Path, *, once: str = "") -> str:
    """What a run that stopped keeps, and how to go on (the end of its one-line error): its
    newest intact checkpoint and ``--resume``, or, with none, a fresh run (with another
    ``--out`` or after deleting ``root``, if it holds rows). ``once``: a condition the rerun
    waits for (" once Redis is back")."""
    ckpt = latest_intact_checkpoint(root)
    if ckpt is not None:
        return f"the last checkpoint is {ckpt}: rerun with --resume{once}"
    if holds_rows(root):
        return (
            f"no checkpoint was written yet, nothing to --resume from: start a fresh run without --resume"
            f"{once}, with another --out or after deleting {root}"
        )
    return (
        f"no checkpoint was written yet, nothing to --resume from: rerun without --resume{once} (a fresh run)"
    )


def disk_full_error(exc: BaseException, path: Path | str | None, root: Path, needed: int | None) -> DiskFull:
    """The one-line error of a full disk: what was written, how much it needed, what is kept."""
    where = path if path is not None else getattr(exc, "filename", None) or root
    try:
        free = f", {_size(free_bytes(Path(where)))} free"
    except OSError:
        free = ""
    ckpt = latest_intact_checkpoint(root)
    kept = (
        f"the last intact checkpoint is {ckpt}: free some space and rerun with --resume"
        if ckpt is not None
        else "no checkpoint was written yet: free some space and rerun"
    )
    return DiskFull(f"the disk is full: writing {where} needed {_size(needed)}{free}; {kept}")


@contextmanager
def disk_writes(root: Path, path: Path | str | None = None, needed: int | None = None) -> Iterator[None]:
    """Writes of run files inside: a full disk becomes :func:`disk_full_error` (one line)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise disk_full_error(exc, path, root, needed) from None
        raise


def directory_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash: everything after it is dropped
    return rows


class RunDir:
    """Writes one run's files. ``resume`` picks up the newest readable checkpoint."""

    def __init__(self, root: Path, cfg: Config, *, resume: bool = False):
        self.root = Path(root)
        self.cfg = cfg
        private_dir(self.root)
        self.checkpoints = self.root / "checkpoints"
        self.samples = self.root / "samples"
        if not resume and holds_rows(self.root):
            if latest_intact_checkpoint(self.root) is None:
                raise ConfigError(
                    f"run directory {self.root} already holds a run that wrote no checkpoint (nothing to "
                    f"--resume from); choose another --out, or delete it to start over"
                )
            raise ConfigError(
                f"run directory {self.root} already holds a run; pass --resume to continue it or choose "
                f"another --out"
            )
        if not resume:  # a resume writes it once its checkpoint has loaded: a failed one changes nothing
            self.write_config()

    def write_config(self) -> None:
        text = dump_config(self.cfg)
        with disk_writes(self.root, self.root / "config.yaml", len(text.encode())):
            (self.root / "config.yaml").write_text(text)

    # --- checkpoints ---------------------------------------------------------------
    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints / f"iter_{iteration:04d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (one with ``state.json``, written last)."""
        if not self.checkpoints.exists():
            return None
        done = sorted(p for p in self.checkpoints.glob("iter_*") if (p / "state.json").exists())
        return done[-1] if done else None

    def prune_checkpoints(self) -> None:
        prune_checkpoints(self.checkpoints, self.cfg.output.keep_checkpoints)

    def resumed(self, iteration: int) -> dict:
        """The run resumes from ``iteration``'s checkpoint, whose weights have loaded: drop the
        metrics, timeline and eval rows of later iterations and write this run's
        ``config.yaml``. Called only then, so a refused resume changes nothing here. Returns
        the announcement for the run's progress (``{"event": "resumed", "iteration": N,
        "checkpoint": PATH}``: the console and ``digen.log`` say "resumed from iteration ...")."""
        self.write_config()
        for name in ("metrics.jsonl", "timeline.jsonl", "eval.jsonl"):
            path = self.root / name
            if not path.exists():
                continue
            rows = [r for r in _read_jsonl(path) if int(r.get("iteration", -1)) <= iteration]
            text = "".join(json.dumps(r) + "\n" for r in rows)
            with disk_writes(self.root, path, len(text.encode())):
                path.write_text(text)
        return {"event": "resumed", "iteration": iteration, "checkpoint": str(self.checkpoint_dir(iteration))}

    # --- logs ------------------------------------------------------------------------
    def append(self, name: str, rows: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in rows)
        with disk_writes(self.root, self.root / name, len(text.encode())), open(self.root / name, "a") as f:
            f.write(text)
            f.flush()

    def metrics(self) -> list[dict]:
        return _read_jsonl(self.root / "metrics.jsonl")

    def timeline(self) -> list[dict]:
        return _read_jsonl(self.root / "timeline.jsonl")

    def write_summary(self, mode: str) -> dict:
        """``summary.json`` from ``metrics.jsonl`` (and returns it)."""
        rows = self.metrics()
        if not rows:
            raise CheckpointError(f"{self.root}/metrics.jsonl is empty: no iteration finished")
        samples = sum(r["samples"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        busy_total, worker_total = self._busy_and_worker_seconds(rows)
        head, tail = rows[:3], rows[-3:]
        first, first_se = _mean_se(head)
        last, last_se = _mean_se(tail)
        summary = {
            "mode": mode,
            "iterations": len(rows),
            "samples": samples,
            "wall_s": round(wall, 4),
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "bubble_ratio": 1 - busy_total / worker_total if worker_total > 0 else 0.0,
            "reward_first": first,
            "reward_last": last,
            "reward_first_se": first_se,
            "reward_last_se": last_se,
            "reward_gain_in_se": (last - first) / math.hypot(first_se, last_se)
            if math.hypot(first_se, last_se) > 0
            else 0.0,
            "max_staleness": max(r["max_staleness"] for r in rows),
        }
        text = json.dumps(summary, indent=1)
        with disk_writes(self.root, self.root / "summary.json", len(text.encode())):
            (self.root / "summary.json").write_text(text)
        return summary

    def _busy_and_worker_seconds(self, rows: list[dict]) -> tuple[float, float]:
        """Busy and available worker-seconds over the run, from the whole timeline (a task
        that straddles an iteration boundary counts in full, which per-iteration rows, written
        before it ends, cannot do); falls back to the metrics rows."""
        events = [e for e in self.timeline() if e.get("role") != "controller" and e.get("kind") != "sync"]
        wall = sum(r["wall_s"] for r in rows)
        workers = max((int(r.get("workers", 1)) for r in rows), default=1)
        if events and wall > 0:
            return sum(e["end"] - e["start"] for e in events), workers * wall
        return sum(r.get("busy_s", 0.0) for r in rows), sum(r.get("worker_s", 0.0) for r in rows)


def finalize_checkpoint(folder: Path, keep: int) -> None:
    """Make the staged checkpoint ``iter_NNNN.tmp`` beside ``folder`` the checkpoint ``folder``
    (one rename), then keep the newest ``keep`` of its parent (:func:`prune_checkpoints`)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    prune_checkpoints(folder.parent, keep)


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints in ``folder`` (``iter_NNNN``)."""
    done = sorted(p for p in folder.glob("iter_*") if (p / "state.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _mean_se(rows: list[dict]) -> tuple[float, float]:
    """Mean reward over the samples of ``rows`` and its standard error (from each
    iteration's mean, std and sample count)."""
    n = sum(r["samples"] for r in rows)
    if n == 0:
        return 0.0, 0.0
    mean = sum(r["reward_mean"] * r["samples"] for r in rows) / n
    # pooled variance around the pooled mean
    ss = sum(r["samples"] * (r["reward_std"] ** 2 + (r["reward_mean"] - mean) ** 2) for r in rows)
    var = ss / max(n - 1, 1)
    return mean, math.sqrt(var / n)
