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


@pytest.mark.parametrize("value", ["sk-SECRET5abc", "sk_live_4eC39HqLyjWDarjtT1", "hf_" + "a" * 30, "ghp_" + "b" * 36,
                                   "AKIA" + "C" * 16, "aB3dEfGhIjKlMnOpQrStUvWx9z", "Bearer abc", "1KEY", "KEY\n"])
def test_a_key_pasted_into_an_env_key_is_refused_and_not_repeated(value):
    """Issue 71: every `*_env` key of the typed settings holds a variable's name, never the key itself;
    the refusal names the key, not the value."""
    from rloo_workflow.config import ConfigError
    from rloo_workflow.config.checks import env_keys

    keys = env_keys()
    assert {"reward.http.api_key_env", "evaluate.llm_judge.api_key_env"} <= set(keys)
    for key in keys:
        section, leaf = key.rsplit(".", 1)
        tree: dict = {leaf: value}
        for part in reversed(section.split(".")):
            tree = {part: tree}
        with pytest.raises(ConfigError) as e:
            load_config(None, tree)
        assert f"key '{key}': must name an environment variable" in str(e.value)
        assert value.strip() not in str(e.value)
        with pytest.raises(ConfigError) as e:  # a sweep's value is checked as the config's own, not repeated either
            load_config(None, {"sweeps": {"keys": {key: ["OPENAI_API_KEY", value]}}})
        assert f"key 'sweeps.keys.{key}'" in str(e.value) and value.strip() not in str(e.value)


def test_the_variable_an_env_key_names_is_redacted_whatever_its_name(monkeypatch):
    """A valid name (no api_key, no token in it): once a config naming it is validated, its value is
    replaced in any text the logs, messages and MLflow get (rloo_workflow.tracking.redact)."""
    from rloo_workflow.tracking.redact import REDACTED, redact_text

    monkeypatch.setenv("RLOO_TEST_SCORER_CRED", "SECRET-xyz")
    line = "reward server: HTTP 401: bad key Bearer SECRET-xyz"
    assert redact_text(line) == line  # not known as a secret until a config names it
    load_config(None, {"reward": {"source": "http", "http": {"url": "http://127.0.0.1:9/score",
                                                              "api_key_env": "RLOO_TEST_SCORER_CRED"}}})
    assert redact_text(line) == f"reward server: HTTP 401: bad key Bearer {REDACTED}"


def test_a_figure_whose_name_holds_token_is_logged_and_a_token_is_not():
    """Free text (a log line) keeps a metric named like a secret (`mismatch_k3_token: 2.15e-06`, a dict's
    repr in the RLOO stage's last line), and still replaces a token or a password assigned there."""
    from rloo_workflow.tracking.redact import REDACTED, redact_text

    figures = "{'mismatch_k3_token': 2.1510e-06, 'tokens_per_s': 1234.5, 'mismatch_k3_seq': 3.96e-05}"
    assert redact_text(figures) == figures
    for secret in ("hf_token=abcdef123456", "'access_token': 'q8Zr1xYw0'", "password: 12345678"):
        assert REDACTED in redact_text(secret) and secret.split(":")[-1].split("=")[-1].strip(" '") not in redact_text(secret)
