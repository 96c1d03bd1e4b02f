"""digen CLI commands about models and rewards: ``make-tiny-model`` and ``reward-server``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from digen.cli.app import app, handles_errors, out
from digen.errors import ConfigError


@app.command("make-tiny-model")
@handles_errors
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the diffusers pipeline into.")],
    arch: Annotated[
        str, typer.Option("--arch", help="sd3 | flux | qwen-image | wan | hunyuan-video")
    ] = "sd3",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resolution: Annotated[int, typer.Option("--resolution")] = 32,
    layers: Annotated[
        int | None, typer.Option("--layers", help="sd3: transformer blocks (default 2).")
    ] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="sd3: attention heads (default 2).")] = None,
    head_dim: Annotated[
        int | None, typer.Option("--head-dim", help="sd3: width of a head (default 16).")
    ] = None,
) -> None:
    """Write a tiny random-weight diffusers pipeline folder (offline) for tests and demos;
    --layers/--heads/--head-dim make an sd3 transformer of a real size (4, 24, 64: 336M
    parameters, 1.25 GiB in float32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from digen.models import make_tiny_model

    size = {k: v for k, v in (("layers", layers), ("heads", heads), ("head_dim", head_dim)) if v is not None}
    path = make_tiny_model(out_dir, arch=arch, seed=seed, resolution=resolution, **size)
    out.print(f"wrote tiny {arch} pipeline to {path}", markup=False)


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
