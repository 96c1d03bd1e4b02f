"""The simulator checked against published figures it was not fitted to.

Each :class:`PublishedFigure` is one number a peer published (a step's seconds, or one phase's),
the simulation config that restates its run (``configs/sim/*.yaml``), the peer mode that ran
it and the band of prediction error ``docs/simulator.md`` states for it. :func:`validate`
predicts each from the cost model alone: no term of the model is tuned to these figures (a
term found wrong by one of them is named in the docs, with the figure that found it).

A peer's iteration is the sum of its phases (:func:`digen.sim.peers.peer_phases`), each on one
replica's share: on one GPU type that is the peer mode's s/iteration (``tests/sim`` checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from digen.sim.catalog import load_sim_config
from digen.sim.peers import peer_phases


@dataclass(frozen=True)
class PublishedFigure:
    name: str
    config: str
    """The simulation config of the run (a file of ``configs/sim``)."""
    mode: str
    """The peer mode that restates the run (its recipe at the run's commit)."""
    seconds: float
    """The published figure."""
    source: str
    band: tuple[float, float]
    """The prediction error the docs state for it: ``lo <= predicted / published - 1 <= hi``."""
    phases: tuple[str, ...] = ()
    """The seconds of these phases instead of the whole step's: those the peer's own timer
    covers (VeRL-Omni's ``gen`` timer wraps ``generate_sequences``, whose vLLM-Omni requests
    decode their images, and ``sleep_replicas``: ray_diffusion_trainer.py ``fit()`` at 9401c4b0)."""
    gen_batch: int | None = None
    """The measurement's generation batch where it differs from the mode's recipe."""


GEN_TIMER = ("generate", "decode", "rollout sleep")
"""The peer phases inside VeRL-Omni's ``gen`` timer (what rollout_batching.md reports)."""

FIGURES: tuple[PublishedFigure, ...] = (
    PublishedFigure(
        "Qwen-Image OCR LoRA r64, CFG 4, 4 x H800: step",
        "verl-omni-published.yaml",
        "verl-omni-unbatched",
        420.0,
        "verl-omni docs/algo/performance.md, 2026-04-24",
        (-0.15, 0.15),
    ),
    PublishedFigure(
        "Qwen-Image full fine-tune, no CFG, 4 x H200: step",
        "verl-omni-full-h200.yaml",
        "verl-omni-unbatched",
        250.0,
        "verl-omni docs/algo/performance.md @c415a591 (2026-05-14), run_qwen_image_ocr.sh",
        (-0.15, 0.15),
    ),
    PublishedFigure(
        "Qwen-Image full fine-tune, no CFG, 64 x H100 (FSDP1): step",
        "verl-omni-full-h100x64.yaml",
        "verl-omni-unbatched",
        105.0,
        "verl-omni docs/algo/performance.md @d07f42ba (2026-06-05), run_qwen_image_ocr.sh, FSDP1",
        (-0.80, -0.70),
    ),
    PublishedFigure(
        "Qwen-Image OCR generation, unbatched, 4 x H800",
        "verl-omni-published.yaml",
        "verl-omni-unbatched",
        226.4,
        "verl-omni docs/start/rollout_batching.md",
        (-0.20, -0.15),
        phases=GEN_TIMER,
    ),
    PublishedFigure(
        "Qwen-Image OCR generation, batched (32 per call), 4 x H800",
        "verl-omni-published.yaml",
        "verl-omni",
        107.9,
        "verl-omni docs/start/rollout_batching.md",
        (-0.20, -0.15),
        phases=GEN_TIMER,
        gen_batch=32,
    ),
)
"""The published figures (``docs/simulator.md#validation-against-published-figures``)."""


@dataclass(frozen=True)
class Prediction:
    figure: PublishedFigure
    seconds: float

    @property
    def error(self) -> float:
        """``predicted / published - 1``."""
        return self.seconds / self.figure.seconds - 1

    @property
    def within_band(self) -> bool:
        lo, hi = self.figure.band
        return lo <= self.error <= hi


def predict(figure: PublishedFigure, folder: Path) -> Prediction:
    """The cost model's seconds for ``figure``: the peer's phases on one replica's share of the
    run's samples (every replica runs the same share), summed, or the named phase's."""
    setup = load_sim_config(folder / figure.config)
    paper = setup.cost.paper
    assert paper is not None
    recipe = paper.peers[figure.mode]
    if figure.gen_batch is not None:
        recipe = replace(recipe, gen_batch=figure.gen_batch)
    gpu, count = paper.testbed.gpus[0]
    degree = setup.cost.workers[0].gpus
    share = math.ceil(setup.workload.samples / (count // degree))
    phases = peer_phases(recipe, paper, gpu, degree, share)
    if figure.phases:
        return Prediction(figure, sum(p.seconds for p in phases if p.name in figure.phases))
    return Prediction(figure, sum(p.seconds for p in phases))


def validate(folder: Path) -> list[Prediction]:
    """Every published figure's prediction (:data:`FIGURES`) from the configs of ``folder``."""
    return [predict(f, folder) for f in FIGURES]


def markdown_validation(predictions: list[Prediction]) -> str:
    """The validation table of ``docs/simulator.md``."""
    lines = [
        "| published figure | mode | published s | predicted s | error | band | source |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in predictions:
        f = p.figure
        band = f"{100 * f.band[0]:+.0f}% .. {100 * f.band[1]:+.0f}%"
        lines.append(
            f"| {f.name} | {f.mode} | {f.seconds:g} | {p.seconds:.1f} | {100 * p.error:+.1f}% | {band} | {f.source} |"
        )
    return "\n".join(lines)
