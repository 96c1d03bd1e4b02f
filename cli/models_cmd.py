"""digen CLI commands about models and rewards: ``reward-server`` (``make-tiny-model`` lives in
cli/main.py)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cli.main import app, handles_errors, out
from digen.errors import ConfigError


@app.command("reward-server")
@handles_errors
def reward_server(
    reward: Annotated[str, typer.Option("--reward", help="Registered reward name (see --list).")] = "",
    port: Annotated[int, typer.Option("--port")] = 8765,
    host: Annotated[
        str, typer.Option("--host", help="Interface to bind (0.0.0.0 to serve other hosts).")
    ] = "127.0.0.1",
    kwargs: Annotated[
        str, typer.Option("--kwargs", help='Reward arguments as JSON, e.g. \'{"channel": "red"}\'.')
    ] = "{}",
    max_batch: Annotated[int, typer.Option("--max-batch", help="Samples per reward call.")] = 64,
    list_: Annotated[bool, typer.Option("--list", help="List the registered rewards and exit.")] = False,
) -> None:
    """Serve a registered reward over HTTP (POST /score, GET /health) for `name: http` rewards."""
    from digen.rewards import available, build_reward
    from digen.rewards.server import serve_reward

    if list_:
        out.print("\n".join(available()))
        return
    if not reward:
        raise ConfigError(f"--reward is required; available: {', '.join(available())}")
    try:
        args = json.loads(kwargs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kwargs ({kwargs!r}) is not JSON: {exc.msg}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"--kwargs ({kwargs!r}) must be a JSON object")
    scorer = build_reward(reward, **args)
    out.print(f"serving reward {reward} on http://{host}:{port} (POST /score, GET /health); Ctrl-C stops")
    serve_reward(scorer, host=host, port=port, max_batch=max_batch)
