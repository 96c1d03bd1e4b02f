"""Tiny tokenizers and text encoders, built offline, for the tiny-model builders.

Every family's tiny builder (``tiny.py`` and the video/Qwen builders) gets its text stack here:

- :func:`byte_level_bpe` learns a small byte-level BPE (vocab + merges) from a built-in word
  list, the format of CLIP's ``vocab.json``/``merges.txt`` (``end_of_word_suffix="</w>"``) and
  of GPT-2/Qwen/Llama-3 style tokenizers (``end_of_word_suffix=""``).
- :func:`tiny_clip_tokenizer` / :func:`tiny_t5_tokenizer`: a ``CLIPTokenizer`` from those files
  and a ``T5TokenizerFast`` from a ``tokenizers`` Unigram model saved as ``tokenizer.json``.
- :func:`tiny_clip_text_model` / :func:`tiny_t5_encoder` (T5 or UMT5): randomly initialised
  encoders sized to the tokenizer, deterministic given ``seed``.

Nothing here downloads anything. Tokenizers are lowercase-only: the built-in vocabulary covers
lowercase letters, digits, space and common punctuation; anything else falls back to bytes
(CLIP) or ``<unk>`` (T5).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

# Words the tiny tokenizers learn merges/pieces for: typical prompt vocabulary.
WORDS: tuple[str, ...] = tuple(
    (
        "a an the of and with on in at to from by for is are photo picture image painting drawing "
        "portrait close up view high quality detailed realistic style art cat cats dog dogs bird horse "
        "cow sheep elephant bear zebra giraffe person people man woman child car bus truck train "
        "boat airplane bicycle motorcycle bench chair couch bed table clock vase book cup bottle bowl "
        "banana apple orange pizza cake donut sandwich broccoli carrot tree flower flowers grass sky "
        "cloud clouds sun moon star stars mountain river sea ocean beach city street house building "
        "room window door red green blue yellow black white brown pink purple gray grey gold silver "
        "one two three four five six seven eight nine ten small large big little old new young "
        "happy bright dark light night day morning sunset snow rain water fire stone wood metal glass "
        "sitting standing running flying walking holding wearing eating playing next top bottom left "
        "right behind front under over above below near sign says text word hello world"
    ).split()
)

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-character map of byte-level BPE (GPT-2 convention):
    printable Latin-1 bytes map to themselves, the rest to code points from 256 upward."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars), strict=True))


def byte_level_bpe(
    num_merges: int = 256, *, end_of_word_suffix: str = "</w>", words: tuple[str, ...] = WORDS
) -> tuple[dict[str, int], list[str]]:
    """Learn a byte-level BPE over ``words``: (vocab token -> id, merges "a b").

    The vocab holds all 256 byte characters (and, with a suffix, their end-of-word forms), then
    one token per merge, in merge order; special tokens are the caller's to append. Ties between
    equally frequent pairs break lexicographically, so the result is deterministic.
    """
    byte_map = bytes_to_unicode()
    base = [byte_map[b] for b in range(256)]
    vocab_list = base + ([c + end_of_word_suffix for c in base] if end_of_word_suffix else [])
    corpus: Counter[tuple[str, ...]] = Counter()
    for word in words:
        chars = [byte_map[b] for b in word.encode("utf-8")]
        chars[-1] += end_of_word_suffix
        corpus[tuple(chars)] += 1
    merges: list[str] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in corpus.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        vocab_list.append(best[0] + best[1])
        corpus = Counter({_merge(symbols, best): count for symbols, count in corpus.items()})
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def clip_bpe() -> tuple[dict[str, int], list[str]]:
    """The tiny CLIP vocab (byte-level BPE with ``</w>`` word ends, then ``<|startoftext|>`` and
    ``<|endoftext|>`` as the last two ids) and its merges."""
    vocab, merges = byte_level_bpe(end_of_word_suffix="</w>")
    vocab[CLIP_BOS] = len(vocab)
    vocab[CLIP_EOS] = len(vocab)
    return vocab, merges


def pretoken_bpe(split_pattern: str, texts: tuple[str, ...] = ()) -> tuple[dict[str, int], list[str]]:
    """A GPT-2/Qwen/Llama-3 style byte-level BPE (no word-end suffix) in which every pre-token
    is one token: each word of :data:`WORDS`, bare and after a space (``"Ġcat"``), and each
    pre-token of ``texts`` as ``split_pattern`` (the tokenizer's pre-tokenizer regex) cuts them.
    Merging runs until nothing is left to merge, so a prompt template tokenizes to exactly as
    many tokens as with the real vocabulary, where its pieces are single tokens too."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(split_pattern), behavior="isolated")
    pieces = [*WORDS, *(" " + w for w in WORDS)]
    for chunk in texts:
        pieces += [piece for piece, _ in split.pre_tokenize_str(chunk)]
    return byte_level_bpe(num_merges=1 << 30, end_of_word_suffix="", words=tuple(dict.fromkeys(pieces)))


def template_bpe(
    split_pattern: str, template: str, special_tokens: tuple[str, ...]
) -> tuple[dict[str, int], list[Any]]:
    """:func:`pretoken_bpe` that also learns a pipeline's prompt ``template`` (its ``{}`` slot
    blanked, its ``special_tokens`` cut out: the caller adds those as special tokens), so the
    template tokenizes to as many tokens as with the real vocabulary and the pipeline's fixed
    crop drops exactly the template. Returns (vocab, merges as pairs, as the ``tokenizers``
    backend takes them)."""
    chunks = [template.replace("{}", " ")]
    for special in special_tokens:
        chunks = [piece for chunk in chunks for piece in chunk.split(special)]
    vocab, merges = pretoken_bpe(split_pattern, tuple(c for c in chunks if c))
    return vocab, [tuple(m.split(" ")) for m in merges]


def tiny_clip_tokenizer(model_max_length: int = 77):  # -> transformers.CLIPTokenizer
    """A ``CLIPTokenizer`` loaded from a generated ``vocab.json``/``merges.txt``
    (:func:`clip_bpe`); pads with ``<|endoftext|>`` like CLIP-L."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_bpe_files(Path(tmp), *clip_bpe())
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=model_max_length)


def write_bpe_files(folder: Path, vocab: dict[str, int], merges: list[str]) -> None:
    """Write ``vocab.json`` and ``merges.txt`` (the files slow and fast BPE tokenizers read)."""
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def t5_unigram_pieces(words: tuple[str, ...] = WORDS) -> list[tuple[str, float]]:
    """Unigram pieces with log-prob scores, T5 layout: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2,
    then ``▁``, single characters, word-initial characters and whole words (``▁cat``)."""
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    punct = ",.!?'-:;\"()"
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(c, -6.0) for c in chars + punct]
    pieces += [("▁" + c, -5.0) for c in chars]
    seen = {p for p, _ in pieces}
    for i, word in enumerate(dict.fromkeys(words)):
        if "▁" + word not in seen:
            pieces.append(("▁" + word, -2.0 - 0.001 * i))
    return pieces


def tiny_t5_tokenizer(model_max_length: int = 32):  # -> transformers.T5TokenizerFast
    """A ``T5TokenizerFast`` loaded from the ``tokenizer.json`` of a ``tokenizers`` Unigram
    model over :func:`t5_unigram_pieces` (Metaspace pre-tokenizer, ``</s>`` appended, no
    sentinel ``<extra_id_*>`` tokens, case-sensitive like T5)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]

    tok = Tokenizer(Unigram(t5_unigram_pieces(), unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    config = {
        "tokenizer_class": "T5Tokenizer",
        "model_max_length": model_max_length,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "extra_ids": 0,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        return T5TokenizerFast.from_pretrained(tmp)


def tiny_clip_text_model(
    tokenizer, *, seed: int, hidden_size: int = 32, projection_dim: int = 32, with_projection: bool
):
    """A 2-layer CLIP text encoder sized to ``tokenizer`` (``CLIPTextModelWithProjection`` for
    SD3's pooled projections, ``CLIPTextModel`` for FLUX/HunyuanVideo)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return seeded(seed, lambda: cls(config)).eval()


def tiny_t5_encoder(tokenizer, *, seed: int, d_model: int = 64, umt5: bool = False):
    """A 2-layer T5 v1.1-style (gated-gelu) encoder sized to ``tokenizer``, 4 heads of
    ``d_model / 4``: a ``T5EncoderModel`` (SD3, FLUX), or with ``umt5`` Wan's
    ``UMT5EncoderModel`` (a relative position bias per layer)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls: Any = UMT5Config if umt5 else T5Config
    model_cls: Any = UMT5EncoderModel if umt5 else T5EncoderModel
    config = config_cls(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return seeded(seed, lambda: model_cls(config)).eval()


def seeded(seed: int, build):
    """``build()`` with the global torch RNG seeded by ``seed`` (caller's RNG state restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
