"""Hugging Face architectures from ``config.json`` alone: base-model prefix and tied weights, no transformers.

A ``config.json`` beside a checkpoint names its class (``"architectures": ["LlamaForCausalLM"]``).  Two
things follow from the class, and both used to need ``import transformers`` (14-35 s, 343 MiB):

* its **base-model prefix** (``base_model_prefix``: ``model`` for Llama/OPT/BART, ``transformer`` for
  GPT-2/T5): ``model.layers.0...`` is the model's own name, not Lightning's ``model.`` wrapper, so it is
  never stripped by default;
* its **tied weights** (``_tied_weights_keys``: ``{"lm_head.weight": "model.embed_tokens.weight"}``):
  of a tied group, convert stores the name transformers does not re-tie after loading.

:data:`ARCHITECTURES` is a checked-in table for the common classes; ``tests/test_hfarch.py`` compares
every entry with the installed transformers' own attributes.  An architecture not in it gives no
prefix and no tie rule (the state-dict order decides, which is what ``save_pretrained`` keeps).
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptfix.files import pins


@dataclass(frozen=True)
class Arch:
    """One architecture class.

    Attributes:
        prefix: its ``base_model_prefix``.
        tied: its own ``_tied_weights_keys`` (dropped name -> the name it is tied to), as transformers 5 writes it.
        base: the class it holds under ``prefix`` whose ties apply too (BART's ``BartModel``), or None.
    """

    prefix: str
    tied: dict[str, str] = field(default_factory=dict)
    base: str | None = None


_LM = {"lm_head.weight": "model.embed_tokens.weight"}

#: class name -> :class:`Arch`, checked against transformers 5.23 (tests/test_hfarch.py)
ARCHITECTURES: dict[str, Arch] = {
    "GPT2Model": Arch("transformer"),
    "GPT2LMHeadModel": Arch("transformer", {"lm_head.weight": "transformer.wte.weight"}),
    "GPTJForCausalLM": Arch("transformer", {"lm_head.weight": "transformer.wte.weight"}),
    "GPTNeoForCausalLM": Arch("transformer", {"lm_head.weight": "transformer.wte.weight"}),
    "GPTNeoXForCausalLM": Arch("gpt_neox", {"lm_head.weight": "gpt_neox.embed_in.weight"}),
    "BloomForCausalLM": Arch("transformer", {"lm_head.weight": "transformer.word_embeddings.weight"}),
    "FalconForCausalLM": Arch("transformer", {"lm_head.weight": "transformer.word_embeddings.weight"}),
    "LlamaModel": Arch("model"),
    "LlamaForCausalLM": Arch("model", _LM),
    "MistralForCausalLM": Arch("model", _LM),
    "MixtralForCausalLM": Arch("model", _LM),
    "Qwen2ForCausalLM": Arch("model", _LM),
    "Qwen3ForCausalLM": Arch("model", _LM),
    "GemmaForCausalLM": Arch("model", _LM),
    "Gemma2ForCausalLM": Arch("model", _LM),
    "PhiForCausalLM": Arch("model", _LM),
    "Phi3ForCausalLM": Arch("model", _LM),
    "OlmoForCausalLM": Arch("model", _LM),
    "StableLmForCausalLM": Arch("model", _LM),
    "OPTForCausalLM": Arch("model", {"lm_head.weight": "model.decoder.embed_tokens.weight"}),
    "BartModel": Arch(
        "model", {"decoder.embed_tokens.weight": "shared.weight", "encoder.embed_tokens.weight": "shared.weight"}
    ),
    "BartForConditionalGeneration": Arch("model", {"lm_head.weight": "model.shared.weight"}, base="BartModel"),
    "MBartForConditionalGeneration": Arch("model", {"lm_head.weight": "model.shared.weight"}, base="BartModel"),
    "T5ForConditionalGeneration": Arch(
        "transformer",
        {
            "encoder.embed_tokens.weight": "shared.weight",
            "decoder.embed_tokens.weight": "shared.weight",
            "lm_head.weight": "shared.weight",
        },
    ),
    "T5EncoderModel": Arch("transformer", {"encoder.embed_tokens.weight": "shared.weight"}),
    "BertModel": Arch("bert"),
    "BertForSequenceClassification": Arch("bert"),
    "BertForMaskedLM": Arch(
        "bert",
        {
            "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias",
        },
    ),
    "RobertaForMaskedLM": Arch(
        "roberta",
        {
            "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
            "lm_head.decoder.bias": "lm_head.bias",
        },
    ),
    "DistilBertForMaskedLM": Arch(
        "distilbert", {"vocab_projector.weight": "distilbert.embeddings.word_embeddings.weight"}
    ),
    "WhisperForConditionalGeneration": Arch("model", {"proj_out.weight": "model.decoder.embed_tokens.weight"}),
}

#: the largest config.json read (real ones are a few KiB)
MAX_CONFIG_BYTES = 1 << 20


def read_config(src: str | os.PathLike) -> dict[str, Any] | None:
    """The ``config.json`` in ``src``'s folder (or in ``src`` itself, a folder).

    Args:
        src: a checkpoint file, index or folder.

    Returns:
        The parsed object, or None when there is none, it is over 1 MiB, or not a JSON object.
    """
    s = os.fspath(src)
    d = s if os.path.isdir(s) else os.path.dirname(os.path.abspath(s))
    cfg = os.path.join(d, "config.json")
    try:
        if not os.path.isfile(cfg) or pins.fstat(cfg).st_size > MAX_CONFIG_BYTES:
            return None
        import json  # here, not at the top: start-up of inspect/scan

        with open(pins.path_for(cfg), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
        return None
    return doc if isinstance(doc, dict) else None


def architectures(src: str | os.PathLike) -> list[tuple[str, Arch]]:
    """The known architectures the ``config.json`` beside ``src`` names.

    Args:
        src: a checkpoint file, index or folder.

    Returns:
        ``(class name, Arch)`` for each name in ``architectures`` that :data:`ARCHITECTURES` holds.
    """
    cfg = read_config(src)
    archs = cfg.get("architectures") if cfg else None
    if not isinstance(archs, list):
        return []
    return [(a, ARCHITECTURES[a]) for a in archs if isinstance(a, str) and a in ARCHITECTURES]


def own_prefixes(src: str | os.PathLike) -> dict[str, str]:
    """The leading prefixes that are the model's own (its base-model prefix), per the ``config.json`` beside ``src``.

    Args:
        src: a checkpoint file, index or folder.

    Returns:
        ``{"model.": "LlamaForCausalLM"}``: prefix (with its dot) -> the class it belongs to; empty when
        there is no ``config.json`` naming a known architecture.
    """
    return {arch.prefix + ".": name for name, arch in architectures(src)}


def tied_drop(src: str | os.PathLike) -> tuple[list[str], str] | None:
    """The tied names transformers re-ties after loading (so convert need not store them), from ``config.json``.

    Args:
        src: a checkpoint file, index or folder.

    Returns:
        ``(names, source)``: the dropped names (the class's ``_tied_weights_keys`` keys, and those of
        its base model under its prefix), and a description for the report; None when there is no
        ``config.json`` naming a known architecture, or it says ``"tie_word_embeddings": false``.
    """
    cfg = read_config(src)
    found = architectures(src)
    if not found or cfg is None or cfg.get("tie_word_embeddings") is False:
        return None
    names: list[str] = []
    for _, arch in found:
        names += list(arch.tied)
        base = ARCHITECTURES.get(arch.base) if arch.base else None
        if base is not None:
            names += [f"{arch.prefix}.{k}" for k in base.tied]
    return names, f"config.json {', '.join(n for n, _ in found)} (transformers' _tied_weights_keys, ckptfix's table)"


def tied_pairs(src: str | os.PathLike) -> tuple[dict[str, str], str] | None:
    """``{dropped name: the name it is tied to}`` for the model ``config.json`` beside ``src`` describes.

    transformers' ``save_pretrained`` (and a Trainer's ``checkpoint-N/``) stores a tied group once: GPT-2's
    ``lm_head.weight`` is left out of ``model.safetensors`` and re-tied to ``transformer.wte.weight`` when
    the model is built, while ``model.state_dict()`` gives both names.  transformers 5 decides the tie from
    the class's ``_tied_weights_keys`` (``{dropped: source}``) and the config's ``tie_word_embeddings``
    (True unless the config says false); this table stands for the former.

    Args:
        src: a checkpoint file, index or folder.

    Returns:
        ``(pairs, source)``, the pairs of the class and of its base model (under its prefix), and a description
        for reports; None when there is no ``config.json`` naming a known architecture, or it unties.
    """
    cfg = read_config(src)
    found = architectures(src)
    if not found or cfg is None or cfg.get("tie_word_embeddings") is False:
        return None
    pairs: dict[str, str] = {}
    for _, arch in found:
        pairs.update(arch.tied)
        base = ARCHITECTURES.get(arch.base) if arch.base else None
        if base is not None:
            pairs.update({f"{arch.prefix}.{k}": f"{arch.prefix}.{v}" for k, v in base.tied.items()})
    names = ", ".join(n for n, _ in found)
    return pairs, f"config.json {names}: tie_word_embeddings (transformers' _tied_weights_keys, ckptfix's table)"


def missing_ties(src: str | os.PathLike, names: Any) -> tuple[dict[str, str], str]:
    """The tied names a state dict read from ``src`` lacks while holding what they are tied to.

    Args:
        src: the checkpoint file or folder (its ``config.json`` decides).
        names: the state dict's names (a container supporting ``in``).

    Returns:
        ``({dropped: target}, source)``, the pairs empty when nothing is missing.
    """
    got = tied_pairs(src)
    if got is None:
        return {}, ""
    pairs, why = got
    missing = {a: t for a, t in pairs.items() if a not in names and t in names}
    return missing, why
