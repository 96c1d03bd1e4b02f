"""The ``digen`` command line (Typer): the entry point. The only code that prints to the
terminal or exits lives in this package.

:mod:`digen.cli.app` holds the Typer app, the consoles, the error handling and the shared options;
each command module registers its commands on the app when imported here:

- :mod:`digen.cli.train` ``train`` (with :mod:`digen.cli.progress` and :mod:`digen.cli.console`: the live
  display and where log records go);
- :mod:`digen.cli.models_cmd` ``make-tiny-model``, ``reward-server``;
- :mod:`digen.cli.bench` ``bench``, ``report``;
- :mod:`digen.cli.export_cmd` ``export``;
- :mod:`digen.cli.service` ``submit``, ``serve``, ``status``, ``logs``, ``cancel``, ``worker``;
- :mod:`digen.cli.certs_cmd` ``certs``;
- :mod:`digen.cli.simulate` ``simulate``, ``sp-bench``;
- :mod:`digen.cli.machine` ``plan``, ``doctor``;
- :mod:`digen.cli.import_cmd` ``import-config``.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (a :class:`~digen.errors.ConfigError`).
"""

from __future__ import annotations

# isort: off
# importing a command module registers its commands; this order is that of ``digen --help``
from digen.cli import train, models_cmd, algorithms_cmd, bench, export_cmd  # noqa: F401
from digen.cli import service, certs_cmd, simulate, machine  # noqa: F401
from digen.cli import import_cmd  # noqa: F401  (``import-config``)

# isort: on
from digen.cli.app import app

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
