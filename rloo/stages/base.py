"""Stage `base`: the starting model as one local Hugging Face folder (rloo.model.base): the embedded
tiny model built from the training texts, a local folder, a hub snapshot, or a dequantised GGUF file.
Every later stage reads this folder and nothing else of `model.name_or_path` / `model.gguf`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rloo import tracking
from rloo.data.gsm8k import format_completion, format_prompt, read_split
from rloo.io import atomic_dir
from rloo.model import base, models
from rloo.runtime import setup

log = logging.getLogger("rloo.base")


def embedded_builder(cfg: dict, train: list[dict]) -> Callable[[Path], dict]:
    """Builds the embedded tiny model in a folder: a BPE tokenizer trained on the training texts (as
    the stages render them), a small Llama of `model.tiny`'s shape initialised from `seed`."""
    mcfg = cfg["model"]

    def build(out: Path) -> dict:
        texts = (format_prompt(r["question"], cfg["prompt"]["template"]) + format_completion(r["answer"]) for r in train)
        tok = models.train_tokenizer(texts, mcfg["tiny"]["vocab_size"])
        model = models.build_tiny_model(tok, mcfg["tiny"], mcfg["max_length"], cfg["seed"], mcfg["attn_implementation"])
        models.save_pretrained(model, tok, out)
        return {"parameters": models.count_parameters(model), "tiny": dict(mcfg["tiny"])}

    return build


def run(cfg: dict, data_dir: str | Path | None, out_dir: str | Path) -> dict:
    """Write the starting model to `out_dir` (with base.json, its record) and return the record;
    `data_dir` is read only to build the embedded model."""
    setup(cfg["threads"], cfg["seed"])
    build = None
    if base.source(cfg["model"]) == "embedded":  # its tokenizer learns the texts SFT trains on
        train = read_split(data_dir, "train")
        build = embedded_builder(cfg, train[: cfg["sft"]["max_train_examples"]] if cfg["sft"]["max_train_examples"] else train)
    with atomic_dir(out_dir) as tmp:
        record = base.resolve(cfg["model"], Path(tmp), build)
    # MLflow: where the model came from (its folder's md5 is tagged with every stage's outputs)
    tracking.set_tags({f"rloo.base.{k}": v for k, v in record.items() if not isinstance(v, dict)})
    log.info("base model (%s) written to %s", record["source"], out_dir)
    return record
