"""Compare digen's ``imagereward`` loader with the ``image-reward`` package's own model code.

Run by hand (not in CI: the package's ``vit.py`` needs ``timm==0.6.13``, whose import pulls
``torchvision``, and its ``med.py`` needs transformers 4.x, while digen runs on transformers 5)::

    pip install --no-deps --target /tmp/irpkgs image-reward==1.5 timm==0.6.13 fairscale==0.4.13 \
        torchvision==0.28.0
    pip install --no-deps --target /tmp/irtf4 transformers==4.46.3 tokenizers==0.20.3 \
        huggingface_hub==0.26.5
    PYTHONPATH=$PWD python scripts/check_imagereward_package.py --pkgs /tmp/irpkgs --tf4 /tmp/irtf4

Two processes. The reference one (``--role reference``, transformers 4 first on the path) builds
the package's network from its own classes (``ImageReward/models/BLIP/vit.py``
``VisionTransformer``, ``med.py`` ``BertModel``, ``blip.py`` ``init_tokenizer``,
``ImageReward/ImageReward.py`` ``MLP``, ``_transform`` and ``ImageReward.score`` /
``inference_rank``) at tiny sizes with random weights, saves its ``state_dict`` as
``ImageReward.pt``, and scores PNG images with ``ImageReward.score``; it also builds the
real-size ``ImageReward(med_config)`` on the meta device and writes its parameter shapes.
The digen one loads the same files through :class:`digen.rewards.imagereward.ImageRewardScore`,
scores the same images and prompts, and prints the largest score difference, the token ids
compared, and the real-size parameter count of both.

``ImageReward.__init__`` and ``BLIP_Pretrain.__init__`` fix the real sizes (``create_vit('large')``,
``MLP(768)``), so the tiny model sets the attributes they set, from the same classes; the
real-size model is built by ``ImageReward.__init__`` itself (on CPU: ``vit.py`` calls ``.item()``,
which the meta device refuses). ``med_config.json`` is not in the package (``load`` downloads
it); the real-size one here has BLIP's ``configs/med_config.json`` values.

Package ``__init__`` files are not executed (``ImageReward/__init__.py`` imports ``ReFL``,
``diffusers`` and OpenAI ``clip``; ``torchvision/__init__.py`` loads the CUDA build's C
extension, which the CPU torch cannot): the modules used are imported as they are. Nothing is
replaced or stubbed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

V_WIDTH, V_DEPTH, V_HEADS, PATCH, SIZE = 128, 2, 2, 8, 32
T_WIDTH, T_HEADS, T_DEPTH, T_INNER, T_POS = 64, 4, 2, 96, 40
WORDS = ["a", "cat", "dog", "red", "car", "on", "the", "road", "two", "blue", "sky", "##s", "sat", "mat"]
VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
PROMPTS = ["a cat", "A red car on the road", "two dogs", " ".join(["blue sky"] * 30), "a cat sat on the mat"]
IMAGE_SIZES = [(32, 32), (56, 40), (40, 56), (77, 45), (33, 90)]  # (width, height): crops, odd offsets
BLIP_MED_CONFIG = {  # salesforce/BLIP configs/med_config.json, which ImageReward's repeats
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30524,
    "encoder_width": 768,
    "add_cross_attention": True,
}


def bare_package(name: str, path: Path) -> None:
    """Register package ``name`` at ``path`` without running its ``__init__``."""
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(path)]
    sys.modules[name] = module


def write_inputs(work: Path) -> None:
    """Tokenizer folder (named as ``init_tokenizer`` asks for it), tiny med_config, PNG images."""
    import numpy as np
    from PIL import Image

    tok = work / "bert-base-uncased"
    tok.mkdir(parents=True, exist_ok=True)
    (tok / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (tok / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    med = {
        **BLIP_MED_CONFIG,
        "hidden_size": T_WIDTH,
        "intermediate_size": T_INNER,
        "num_attention_heads": T_HEADS,
        "num_hidden_layers": T_DEPTH,
        "max_position_embeddings": T_POS,
        "vocab_size": len(VOCAB) + 2,  # + [DEC], [ENC]
    }
    (work / "med_config.json").write_text(json.dumps(med))
    (work / "med_config_real.json").write_text(json.dumps(BLIP_MED_CONFIG))
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(IMAGE_SIZES):
        smooth = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(smooth).resize((w, h), Image.Resampling.BILINEAR)
        noise = rng.integers(-20, 21, (h, w, 3))
        Image.fromarray(np.clip(np.asarray(image, dtype=np.int64) + noise, 0, 255).astype(np.uint8)).save(
            work / f"image{i}.png"
        )


def reference(work: Path, pkgs: Path) -> None:
    """The package's model at tiny sizes: checkpoint, scores, token ids, real-size shapes."""
    import torch
    from PIL import Image
    from torch import nn

    sys.path.append(str(pkgs))
    bare_package("torchvision", pkgs / "torchvision")
    for name in ("ImageReward", "ImageReward.models", "ImageReward.models.BLIP"):
        bare_package(name, pkgs.joinpath(*name.split(".")))
    from ImageReward import ImageReward as ir_module
    from ImageReward.models.BLIP import blip, med, vit

    os.chdir(work)  # init_tokenizer's from_pretrained('bert-base-uncased') finds the folder here
    torch.manual_seed(0)
    model = ir_module.ImageReward.__new__(ir_module.ImageReward)
    nn.Module.__init__(model)
    model.device = "cpu"
    model.blip = nn.Module()  # BLIP_Pretrain's attributes, ViT at tiny size (create_vit's sizes are fixed)
    model.blip.visual_encoder = vit.VisionTransformer(
        img_size=SIZE, patch_size=PATCH, embed_dim=V_WIDTH, depth=V_DEPTH, num_heads=V_HEADS
    )
    model.blip.tokenizer = blip.init_tokenizer()
    config = med.BertConfig.from_json_file(str(work / "med_config.json"))
    config.encoder_width = V_WIDTH
    model.blip.text_encoder = med.BertModel(config=config, add_pooling_layer=False)
    model.blip.vision_proj, model.blip.text_proj = nn.Linear(V_WIDTH, 16), nn.Linear(T_WIDTH, 16)
    model.preprocess = ir_module._transform(SIZE)
    model.mlp = ir_module.MLP(T_WIDTH)
    real = ir_module.ImageReward(med_config=str(work / "med_config_real.json"))  # ~1.9 GB (no meta: .item())
    model.mean, model.std = real.mean, real.std
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # LayerNorms away from 1/0
        for p in model.mlp.parameters():
            p.mul_(4.0)  # scores spread over units, not thousandths
    model.eval()
    torch.save(model.state_dict(), work / "ImageReward.pt")

    seen: list[list[int]] = []
    model.blip.text_encoder.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(args[0][0].tolist()), with_kwargs=True
    )
    images = [Image.open(work / f"image{i}.png") for i in range(len(IMAGE_SIZES))]
    with torch.no_grad():
        scores = [model.score(p, im) for p, im in zip(PROMPTS, images, strict=True)]
        _, ranked = model.inference_rank(PROMPTS[1], images)
    result = {
        "scores": scores,
        "rank_prompt1": ranked,
        "token_ids": seen[: len(PROMPTS)],
        "preprocess": repr(model.preprocess),
        "mean_std": [real.mean, real.std],
        "real_shapes": {k: list(v.shape) for k, v in real.state_dict().items()},
        "real_vit": {
            "embed_dim": real.blip.visual_encoder.embed_dim,
            "depth": len(real.blip.visual_encoder.blocks),
            "num_heads": real.blip.visual_encoder.blocks[0].attn.num_heads,
            "patch": list(real.blip.visual_encoder.patch_embed.patch_size),
            "image_size": list(real.blip.visual_encoder.patch_embed.img_size),
            "eps": real.blip.visual_encoder.norm.eps,
        },
        "real_parameters": sum(p.numel() for p in real.parameters()),
    }
    (work / "reference.json").write_text(json.dumps(result))


def digen_side(work: Path) -> dict:
    """The same files through digen's loader; differences against the reference."""
    import numpy as np
    import torch
    from PIL import Image

    from digen.rewards.imagereward import ImageRewardScore, build_imagereward

    ref = json.loads((work / "reference.json").read_text())
    reward = ImageRewardScore(
        checkpoint=work / "ImageReward.pt",
        med_config=work / "med_config.json",
        tokenizer=work / "bert-base-uncased",
    )
    got = []
    for i, prompt in enumerate(PROMPTS):
        pixels = np.array(Image.open(work / f"image{i}.png").convert("RGB"))
        image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255
        got.append(float(reward(image, [prompt])[0]))
    rank = []
    for i in range(len(IMAGE_SIZES)):
        pixels = np.array(Image.open(work / f"image{i}.png").convert("RGB"))
        image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255
        rank.append(float(reward(image, [PROMPTS[1]])[0]))
    ids = reward.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35)["input_ids"]
    shapes = {k: torch.empty(v, device="meta") for k, v in ref["real_shapes"].items()}
    with torch.device("meta"):
        real = build_imagereward(shapes, work / "med_config_real.json", "the real-size shapes")
    diff = np.abs(np.array(got + rank) - np.array(ref["scores"] + ref["rank_prompt1"]))
    return {
        "reference_scores": ref["scores"],
        "digen_scores": got,
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(diff.max() / np.abs(ref["scores"] + ref["rank_prompt1"]).max()),
        "token_ids_equal": ids == ref["token_ids"],
        "reference_preprocess": ref["preprocess"],
        "reference_mean_std": ref["mean_std"],
        "reference_real_vit": ref["real_vit"],
        "reference_real_parameters": ref["real_parameters"],
        "digen_real_parameters": sum(p.numel() for p in real.parameters()),
        "digen_real_vit": {
            "hidden_size": real.vision.config.hidden_size,
            "layers": real.vision.config.num_hidden_layers,
            "heads": real.vision.config.num_attention_heads,
            "patch": real.vision.config.patch_size,
            "image_size": real.vision.config.image_size,
            "eps": real.vision.config.layer_norm_eps,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pkgs", type=Path, required=True, help="--target folder of image-reward, timm, ...")
    parser.add_argument("--tf4", type=Path, required=True, help="--target folder of transformers 4.x")
    parser.add_argument("--work", type=Path, default=Path("/tmp/imagereward-check"))
    parser.add_argument("--role", choices=["digen", "reference"], default="digen")
    args = parser.parse_args()
    if args.role == "reference":
        reference(args.work, args.pkgs)
        return
    write_inputs(args.work)
    env = {**os.environ, "PYTHONPATH": str(args.tf4), "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, __file__, "--role", "reference", "--pkgs", str(args.pkgs), "--tf4", str(args.tf4)]
        + ["--work", str(args.work)],
        env=env,
        check=True,
    )
    print(json.dumps(digen_side(args.work), indent=1))


if __name__ == "__main__":
    main()
