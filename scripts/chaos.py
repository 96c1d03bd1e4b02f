"""A seeded random-kill chaos run against its fault-free twin.

Runs a config twice on the embedded local cluster: once fault-free (the twin), once while a
killer thread SIGKILLs a worker process (trainers and rollout workers, seeded choice) every
``--gap`` seconds (seeded, uniform), ``--kills`` times; each killed worker's Nanny restarts it
under its name. Then prints, per iteration, the twin's and the chaos run's samples, dropped
samples and trained rows, and the final weights' largest difference::

    PYTHONPATH=$PWD python scripts/chaos.py configs/quickstart.yaml --out runs/chaos --seed 1 \\
        --set iterations=8 --set train.reduce=exact --set schedule.max_staleness=0 \\
        --set cluster.local.trainer_workers=2 --set cluster.local.rollout_workers=2

Exit 0 when every iteration trained the twin's rows and samples (and, with ``--exact``, the
final weights are ``torch.equal``: use it where the twin is reproducible, i.e. staleness 0,
``train.reduce: exact``, ``schedule.rat: false`` and ``schedule.task_seconds`` pinned), else 1.
The kill moments are wall-clock times, so two runs of one seed kill at different points of the
job; the victims and gaps are the seed's. The deterministic replay of one interleaving is
``tests/reliability/test_chaos.py``.

``--controller-kill`` adds a third run: ``digen train`` as a process of its own, with the same
seeded worker killer inside it, whose *controller* is SIGKILLed once a seeded number of
iterations is in its ``metrics.jsonl`` (its workers are orphaned; the embedded Redis's
watchdog stops the Redis it started), then ``digen train --resume`` into the same run
directory, to the end. That run is compared with the twin as the in-process one is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from safetensors.torch import load_file

from digen.cluster.cluster import scheduler_identity
from digen.config import load_config
from digen.runtime.controller import run_distributed


def worker_pids(client) -> dict[str, int]:
    """Worker name -> the pid of its process (the workers that answer now)."""
    names = {a: str(w.get("name", a)) for a, w in scheduler_identity(client)["workers"].items()}
    pids = client.run(os.getpid, on_error="ignore")
    return {names[a]: int(p) for a, p in pids.items() if a in names and isinstance(p, int)}


def killer(box: dict, rng: random.Random, kills: int, gap: tuple[float, float], roles: list[str], done, log):
    """SIGKILL a worker of ``roles`` every ``gap`` seconds, ``kills`` times, until ``done``."""
    while kills > 0 and not done.wait(rng.uniform(*gap)):
        ctl = box.get("ctl")
        if ctl is None:
            continue
        try:
            pids = worker_pids(ctl.client)
        except Exception as exc:  # noqa: BLE001 - the cluster is busy restarting: try at the next gap
            print(f"chaos: no worker list ({type(exc).__name__}); next try later", file=sys.stderr)
            continue
        victims = sorted(n for n in pids if n.rsplit("-", 1)[0] in roles)
        if not victims:
            continue
        name = rng.choice(victims)
        os.kill(pids[name], signal.SIGKILL)
        log.append({"worker": name, "pid": pids[name], "iteration": len(box.get("rows", []))})
        print(
            f"chaos: SIGKILL {name} (pid {pids[name]}) during iteration {log[-1]['iteration']}",
            file=sys.stderr,
        )
        kills -= 1


def run(cfg, out: Path, *, seed: int | None, kills: int, gap: tuple[float, float], roles: list[str]):
    box: dict = {"rows": []}
    log: list[dict] = []
    done = threading.Event()
    thread = None
    if seed is not None:
        rng = random.Random(seed)
        thread = threading.Thread(target=killer, args=(box, rng, kills, gap, roles, done, log), daemon=True)
        thread.start()
    try:
        run_distributed(
            cfg,
            out,
            job_id=f"chaos-{out.name}",
            on_start=lambda ctl: box.update(ctl=ctl),
            progress=lambda row: box["rows"].append(row) if "iteration" in row else None,
        )
    finally:
        done.set()
        if thread is not None:
            thread.join()
    return log


CHAOS_CHILD = r"""
import json, random, sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from chaos import killer  # noqa: E402
from digen.config import load_config  # noqa: E402
from digen.runtime.controller import run_distributed  # noqa: E402

args = json.loads(sys.argv[2])
cfg = load_config(args["config"], args["overrides"])
box, log, done = {"rows": []}, [], threading.Event()
if args["kills"]:
    rng = random.Random(args["seed"])
    threading.Thread(
        target=killer, args=(box, rng, args["kills"], tuple(args["gap"]), args["roles"], done, log), daemon=True
    ).start()
run_distributed(
    cfg, Path(args["out"]), job_id="chaos-" + Path(args["out"]).name, resume=args["resume"],
    on_start=lambda ctl: box.update(ctl=ctl),
    progress=lambda row: box["rows"].append(row) if "iteration" in row else None,
)
done.set()
"""


def run_killed_controller(args, out: Path, rng: random.Random) -> dict:
    """The ``--controller-kill`` run: a controller process SIGKILLed after a seeded number of
    iterations (worker kills inside it as in :func:`run`), then ``--resume`` to the end."""
    iterations = load_config(args.config, args.overrides).iterations
    kill_after = rng.randint(1, max(1, iterations - 2))
    child = {
        "config": args.config,
        "overrides": args.overrides,
        "out": str(out),
        "seed": args.seed,
        "kills": args.kills,
        "gap": list(args.gap),
        "roles": args.roles,
        "resume": False,
    }
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.Popen([sys.executable, "-c", CHAOS_CHILD, here, json.dumps(child)])
    rows = out / "metrics.jsonl"
    while proc.poll() is None:
        done = len(rows.read_text().splitlines()) if rows.exists() else 0
        if done >= kill_after:
            os.kill(proc.pid, signal.SIGKILL)
            print(
                f"chaos: SIGKILL the controller (pid {proc.pid}) after {done} iteration(s)", file=sys.stderr
            )
            break
        time.sleep(0.05)
    proc.wait()
    killed_at = len(rows.read_text().splitlines()) if rows.exists() else 0
    resumed = subprocess.run(
        [sys.executable, "-c", CHAOS_CHILD, here, json.dumps({**child, "kills": 0, "resume": True})]
    )
    return {"controller_killed_after": killed_at, "resume_exit": resumed.returncode}


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out: Path):
    return load_file(str(sorted((out / "checkpoints").glob("iter_*"))[-1] / "weights.safetensors"))


def compare(twin: Path, chaos: Path, exact: bool) -> bool:
    """Print the comparison; True when the chaos run trained what the twin trained."""
    a, b = metrics(twin), metrics(chaos)
    ok = [m["iteration"] for m in a] == [m["iteration"] for m in b]
    print("| iteration | samples (twin / chaos) | dropped | trained rows (twin / chaos) | dead tasks |")
    print("|---|---|---|---|---|")
    for x, y in zip(a, b, strict=False):
        same = (x["samples"], x["trained_rows"]) == (y["samples"], y["trained_rows"])
        ok &= same and y["dropped_samples"] == x["dropped_samples"]
        print(
            f"| {y['iteration']} | {x['samples']} / {y['samples']} | {x['dropped_samples']} / "
            f"{y['dropped_samples']} | {x['trained_rows']} / {y['trained_rows']}{'' if same else ' **differs**'} | "
            f"{', '.join(y.get('dead_tasks', [])) or '-'} |"
        )
    wa, wb = final_weights(twin), final_weights(chaos)
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    scale = max(float(wa[k].abs().max()) for k in wa)
    equal = all(bool((wa[k] == wb[k]).all()) for k in wa)
    print(
        f"final weights: max |diff| {diff:.3g} (relative {diff / max(scale, 1e-30):.3g}), torch.equal: {equal}"
    )
    return ok and (equal or not exact)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--gap", type=float, nargs=2, default=(8.0, 20.0), metavar=("MIN_S", "MAX_S"))
    ap.add_argument("--roles", nargs="+", default=["trainer", "rollout"])
    ap.add_argument("--exact", action="store_true", help="also require torch.equal final weights")
    ap.add_argument(
        "--controller-kill",
        action="store_true",
        help="also run one whose controller is SIGKILLed mid-job, then resumed (--resume)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    run(cfg, args.out / "twin", seed=None, kills=0, gap=args.gap, roles=args.roles)
    log = run(
        cfg, args.out / "chaos", seed=args.seed, kills=args.kills, gap=tuple(args.gap), roles=args.roles
    )
    killed = ", ".join(f"{k['worker']}@{k['iteration']}" for k in log)
    print(f"seed {args.seed}: {len(log)} kill(s): {killed}")
    ok = compare(args.out / "twin", args.out / "chaos", args.exact)
    if args.controller_kill:
        res = run_killed_controller(args, args.out / "resumed", random.Random(args.seed + 1))
        print(
            f"controller SIGKILLed after {res['controller_killed_after']} iteration(s); --resume exit {res['resume_exit']}"
        )
        ok &= res["resume_exit"] == 0 and compare(args.out / "twin", args.out / "resumed", args.exact)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
