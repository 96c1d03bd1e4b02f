"""Where log records go: the console (digen's warnings; Dask's only with --verbose, its errors
as one line) and the run's ``RUN_DIR/digen.log``. :func:`setup_logging` installs both."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONSOLE: dict = {}
"""The console's settings of this command (``verbose``, ``log_file``), for :func:`digen.cli.app.crash`."""
PROGRESS_LOG = logging.getLogger("digen.progress")
"""``digen train``'s progress, one line per iteration (:func:`digen.iteration.progress_line`):
to ``RUN_DIR/digen.log`` in every mode, never to the console, which shows the live display."""
DASK_LOGGERS = ("distributed", "tornado", "bokeh")
"""Loggers of Dask's libraries: to the run's log file; on the console only with --verbose
(their errors always, as one line)."""


def _is_dask(record: logging.LogRecord) -> bool:
    return record.name.split(".")[0] in DASK_LOGGERS


class ConsoleFormatter(logging.Formatter):
    """digen's records as ``LEVEL name: message``; without --verbose a Dask error becomes one
    line that names the log file holding the rest."""

    def __init__(self, verbose: bool, log_file: Path | None):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.verbose, self.log_file = verbose, log_file

    def format(self, record: logging.LogRecord) -> str:
        if not self.verbose and record.exc_info and not _is_dask(record):
            exc = record.exc_info[1]
            where = (
                f"the traceback is in {self.log_file}" if self.log_file else "--verbose prints the traceback"
            )
            text = (str(exc).strip().splitlines() or [""])[0] if exc is not None else ""
            return f"{self.formatMessage(self._message(record))} ({type(exc).__name__}: {text}; {where})"
        if self.verbose or not _is_dask(record):
            return super().format(record)
        first = (record.getMessage().strip().splitlines() or [""])[0]
        where = f"the full message is in {self.log_file}" if self.log_file else "rerun with --verbose"
        return (
            f"error from Dask ({record.name}): {first}; {where}. If the cluster cannot start, check "
            f"that no other digen run holds the CPU/GPU and rerun; --verbose shows Dask's log here"
        )

    @staticmethod
    def _message(record: logging.LogRecord) -> logging.LogRecord:
        record.message = record.getMessage()
        return record


class _LogFile(logging.FileHandler):
    """``RUN_DIR/digen.log``: a write that fails (a full disk) prints one line, once, and the
    file is written no more, instead of a ``--- Logging error ---`` block per record."""

    broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            self._give_up(exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the buffered tail could not be written
            self._give_up(exc)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        self._give_up(sys.exc_info()[1])

    def _give_up(self, exc: BaseException | None) -> None:
        if not self.broken:
            self.broken = True
            sys.stderr.write(
                f"warning: {self.baseFilename} cannot be written ({exc}); the run log stops here\n"
            )


class RunLog(logging.Handler):
    """``RUN_DIR/digen.log`` (appended, INFO and up), held in memory until :meth:`open`: a
    command that fails before its run starts (bad input) leaves a stored run untouched; a
    fresh run directory gets the held lines at exit either way (:meth:`close`)."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path
        self.fresh = not path.parent.exists() or not any(path.parent.iterdir())
        self.held: list[logging.LogRecord] = []
        self.file: _LogFile | None = None
        self.discarded = False
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def open(self) -> None:
        if self.file is None and not self.discarded:
            try:
                from digen.rundir import private_dir

                private_dir(self.path.parent)  # the run directory: not world-readable
                self.file = _LogFile(self.path, encoding="utf-8")
            except OSError as exc:
                sys.stderr.write(f"warning: {self.path} cannot be written ({exc})\n")
                self.discarded = True
                self.held = []
                return
            self.file.setFormatter(self.formatter)
            for rec in self.held:
                self.file.emit(rec)
            self.held = []

    def discard(self) -> None:
        """Write nothing (the run directory belongs to another run)."""
        self.discarded = True
        self.held = []

    def write(self, record: logging.LogRecord) -> bool:
        """Write ``record`` to the file now (opened by then); True if it was written."""
        if self.file is None or self.file.broken:
            return False
        self.file.emit(record)
        self.file.flush()
        return not self.file.broken

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.emit(record)
        elif len(self.held) < 100_000 and not self.discarded:
            self.held.append(record)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is None and self.held and self.fresh:
            self.open()
        if self.file is not None:
            self.file.close()
        super().close()


def open_run_log() -> None:
    """Start writing ``RUN_DIR/digen.log`` (the run has started: its directory is checked)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, RunLog):
            h.open()


def _not_progress(record: logging.LogRecord) -> bool:
    return record.name != PROGRESS_LOG.name


def _quiet_dask(record: logging.LogRecord) -> bool:
    return not _is_dask(record) or record.levelno >= logging.ERROR


def setup_logging(
    verbose: bool, log_file: Path | None = None, dask: bool = False, quiet: bool = False
) -> None:
    """Console: digen's warnings (errors only with ``quiet``, everything at INFO with
    ``verbose``); ``log_file`` (appended):
    INFO and up of digen and, with ``dask``, of Dask, whose own stderr handler is removed so
    its records reach these two. Without ``verbose`` Dask's worker processes print errors only."""
    CONSOLE.update(verbose=verbose, log_file=log_file)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "digen", False):  # a second call (tests, bench): replace, never stack
            root.removeHandler(h)
            h.close()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING)
    console.setFormatter(ConsoleFormatter(verbose, log_file))
    console.addFilter(_not_progress)
    if not verbose:
        console.addFilter(_quiet_dask)
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        handlers.append(RunLog(log_file))
    for h in handlers:
        h.digen = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.INFO if verbose or log_file is not None else logging.WARNING)
    if dask:
        _route_dask_logs(verbose)


def _route_dask_logs(verbose: bool) -> None:
    """Send Dask's records to the root handlers (they print to stderr on their own at import)."""
    import distributed  # noqa: F401 - its import installs the handlers removed here

    from digen.cluster import cluster

    for name in ("distributed", "distributed.client", "bokeh", "tornado", "tornado.application"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lg.removeHandler(h)
        lg.propagate = True
    logging.getLogger("distributed").setLevel(logging.INFO)
    cluster.worker_console_level = logging.INFO if verbose else logging.ERROR
