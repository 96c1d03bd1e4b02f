"""Build the digits demo's committed assets from scikit-learn's 8x8 digits, on the CPU.

    python scripts/make_digits_model.py [--out assets] [--seed 0] [--transformer-steps 600]

Writes (see digen/models/digits.py for the recipe):
    assets/digits-sd3/                      StableDiffusion3Pipeline folder (safetensors)
    assets/digits-classifier.safetensors    the digit_classifier reward's weights
    assets/digits-base-grid.png             base-model samples, row d = "a handwritten d"
    assets/digits-build.json                recipe, classifier accuracy, base rewards, timings

One CPU thread, fixed seeds: the same command rebuilds the same weights on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from digen.models.digits import DigitsRecipe, build_digits_assets

    defaults = DigitsRecipe()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "assets", help="assets folder (default: ./assets)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--transformer-steps",
        type=int,
        default=defaults.transformer_steps,
        help="flow-matching steps: more gives a stronger base model (less room for RL)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    recipe = DigitsRecipe(seed=args.seed, transformer_steps=args.transformer_steps)
    report = build_digits_assets(args.out, recipe)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
