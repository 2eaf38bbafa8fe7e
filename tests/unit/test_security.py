"""Secrets stay in the environment; remote code and pickled weights are never loaded by default."""

import logging
import os

import pytest
import torch

from rloo.model import models
from rloo.settings import TinyConfig
from rloo_workflow.config import load_config


def test_trust_remote_code_is_off_by_default():
    assert load_config(None)["model"]["trust_remote_code"] is False


def test_pickled_weights_are_refused(tmp_path):
    texts = ["Question: 1+1?\nAnswer: 1+1=<<1+1=2>>2\n#### 2"] * 10
    tok = models.train_tokenizer(texts, vocab_size=300)
    model = models.build_tiny_model(
        tok, TinyConfig(hidden_size=64, num_heads=2, num_layers=1, intermediate_size=64), 64, seed=0
    )
    # A folder whose weights are a pickle (pytorch_model.bin), which could run code when loaded.
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    tok.save_pretrained(tmp_path)
    with pytest.raises(OSError, match="safetensors"):
        models.load_causal_lm(tmp_path)
    models.save_pretrained(model, tok, tmp_path)
    assert isinstance(models.load_causal_lm(tmp_path), torch.nn.Module)


def test_llm_judge_key_comes_from_env_and_is_never_logged(monkeypatch, caplog):
    pytest.importorskip("openai")
    from rloo.reward.judges import LLMJudge

    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", secret)
    # A closed port: every call fails fast; failures are invalid verdicts, never losses.
    judge = LLMJudge("http://127.0.0.1:9/v1", "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=2, max_retries=0)
    assert judge.client.api_key == secret
    with caplog.at_level(logging.DEBUG):
        verdict = judge.judge("q", "#### 1", "#### 1", "#### 2")
    assert verdict is None
    assert secret not in caplog.text
    assert secret not in str(judge.description)


def test_redaction_survives_another_thread_changing_the_environment(monkeypatch):
    """MLflow's telemetry thread deletes _MLFLOW_TELEMETRY_SESSION_ID while the onstart handler
    redacts the config; os.environ.items() then raised KeyError for the key it had just listed."""
    import sys
    import threading

    from rloo_workflow.tracking.redact import REDACTED, redact

    secret = "churn-secret-value-0123456789"
    monkeypatch.setenv("RLOO_TEST_CHURN_TOKEN", secret)
    names = [f"RLOO_TEST_CHURN_{i}_TOKEN" for i in range(40)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for name in names:
                os.environ[name] = "transient-value-0123"
            for name in names:
                os.environ.pop(name, None)

    # Switch threads as often as the interpreter allows, so that a deletion lands between the
    # listing of the names and the reading of their values within a few calls.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            assert redact({"note": f"url {secret}"}) == {"note": f"url {REDACTED}"}
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        for name in names:
            os.environ.pop(name, None)
