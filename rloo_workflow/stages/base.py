"""Stage `base`: the starting model as one local Hugging Face folder (rloo.model.base): the embedded
tiny model built from the training texts, a local folder, a hub snapshot, or a dequantised GGUF file.
Every later stage reads this folder and nothing else of `model.name_or_path` / `model.gguf`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rloo.data.gsm8k import format_completion, format_prompt, read_split
from rloo.io import atomic_dir
from rloo.model import base, models
from rloo.runtime import setup
from rloo.settings import Config
from rloo_workflow import tracking

log = logging.getLogger("rloo.base")


def embedded_builder(sections: Config, train: list[dict]) -> Callable[[Path], dict]:
    """Builds the embedded tiny model in a folder: a BPE tokenizer trained on the training texts (as
    the stages render them), a small Llama of `model.tiny`'s shape initialised from `seed`."""
    mc, template = sections.model, sections.prompt.template

    def build(out: Path) -> dict:
        texts = (format_prompt(r["question"], template) + format_completion(r["answer"]) for r in train)
        tok = models.train_tokenizer(texts, mc.tiny.vocab_size)
        model = models.build_tiny_model(tok, mc.tiny, mc.max_length, sections.seed, mc.attn_implementation)
        models.save_pretrained(model, tok, out)
        return {"parameters": models.count_parameters(model), "tiny": mc.tiny.to_config()}

    return build


def run(cfg: dict, data_dir: str | Path | None, out_dir: str | Path) -> dict:
    """Write the starting model to `out_dir` (with base.json, its record) and return the record;
    `data_dir` is read only to build the embedded model. `cfg`: the validated config, as every stage's
    `run` takes it."""
    sections = Config.from_config(cfg)
    setup(sections.threads, sections.seed)
    build = None
    if base.source(sections.model) == "embedded":  # its tokenizer learns the texts SFT trains on
        train = read_split(data_dir, "train")
        limit = sections.sft.max_train_examples
        build = embedded_builder(sections, train[:limit] if limit else train)
    with atomic_dir(out_dir) as tmp:
        record = base.resolve(sections.model, Path(tmp), build)
    # MLflow: where the model came from (its folder's md5 is tagged with every stage's outputs)
    tracking.set_tags({f"rloo.base.{k}": v for k, v in record.items() if not isinstance(v, dict)})
    log.info("base model (%s) written to %s", record["source"], out_dir)
    return record
