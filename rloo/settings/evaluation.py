"""The `evaluate` section: the held-out evaluation of every policy and its pairwise judge (the verifier, or
an LLM at an OpenAI-compatible address that the judge job may serve itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rloo.settings.fields import Section, setting
from rloo.settings.training import completion_room

# The vLLM flags that give the tensor-parallel size.
TP_FLAGS = ("--tensor-parallel-size", "-tp")


def tensor_parallel(args: tuple[str, ...] | list[str]) -> int | None:
    """The tensor-parallel size given among vLLM `args` (`--tensor-parallel-size N`, `-tp N`, `--...=N`)."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in TP_FLAGS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return int(value)
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class ServeConfig(Section):
    """The judge as a model the judge job serves itself (and the comparison job, when it judges): `vllm
    serve MODEL` on a free port of 127.0.0.1, healthy before the first call, stopped when the stage ends
    (success, error or SIGTERM); its output in the stage's log folder (<paths.logs>/evaluate_<estimator>.judge.log
    under Snakemake). It is served under the name evaluate.llm_judge.model, and base_url is not used. null:
    the judge at base_url, started by someone else."""

    model: str = setting()
    """A hub id or a local folder vLLM loads (the judge's weights)."""
    args: tuple[str, ...] = ()
    """Extra `vllm serve` flags, e.g. [--max-model-len, "4096", --gpu-memory-utilization, "0.9"]. --host,
    --port and --served-model-name are set by the stage."""
    gpus: int = setting(1, minimum=0)
    """GPUs of the judge, beside the one of the policies being evaluated: the evaluate rule asks for 1 + gpus
    (the comparison rule for gpus) and the server sees the job's last `gpus` devices; above 1 it runs
    tensor-parallel over them (--tensor-parallel-size gpus unless args give it, which must then equal gpus).
    0 = share the policies' GPU (set a low --gpu-memory-utilization). Ignored on a machine without GPUs
    (vLLM's CPU build)."""
    startup_timeout_s: float = setting(900, exclusive_minimum=0)
    """Seconds the server may take to answer GET /health (loading a 7B model from the hub takes minutes)."""
    stop_grace_s: float = setting(30, minimum=0)
    """Seconds between SIGTERM and SIGKILL to the server's process group when the stage ends."""
    command: tuple[str, ...] | None = None
    """Another OpenAI-compatible server instead of vLLM: its command line, with {model}, {name}, {host} and
    {port} filled in; it must answer GET /health with 200 once ready. null = vLLM (`vllm serve`, or its
    OpenAI server module where the vllm CLI is broken)."""

    def problems(self, reward_source: str, judge: str) -> list[str]:
        out = []
        tp = tensor_parallel(self.args)
        if tp is not None and self.gpus and tp != self.gpus:
            out.append(f"key 'evaluate.llm_judge.serve.args': --tensor-parallel-size {tp} but serve.gpus is "
                       f"{self.gpus} (the GPUs the judge job gets for the judge): make them equal")
        owned = sorted({a.split("=", 1)[0] for a in self.args} & {"--host", "--port", "--api-key"})
        if owned:
            out.append(f"key 'evaluate.llm_judge.serve.args': {', '.join(owned)} are set by the judge job (a "
                       "free local port, a key of this run only); leave them out")
        if reward_source == "judge" and judge == "llm":
            out.append("key 'evaluate.llm_judge.serve': the judge is served by the judge job only, but "
                       "reward.source: judge scores RLOO with it too; give RLOO a running judge "
                       "(evaluate.llm_judge.base_url, serve: null) or another reward.source")
        return out


@dataclass(frozen=True)
class LlmJudgeConfig(Section):
    """The LLM judge of evaluate.judge llm: an OpenAI-compatible chat endpoint asked which of two
    completions is better, in both orders (a disagreement is a tie)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The judge's OpenAI-compatible address (not used when `serve` starts one); no credential in it."""
    model: str = "judge"
    """The model name the requests ask for (the served name under `serve`)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the judge's API key."""
    timeout_s: float = setting(60, exclusive_minimum=0)
    """Seconds one call may take; until the judge has answered once, a call that times out twice stops the
    stage (a dead judge fails within about two minutes)."""
    max_retries: int = setting(3, minimum=0)
    """Retries of a failed call."""
    max_failed_share: float = setting(0.01, minimum=0, maximum=1)
    """The share of judge calls that may still fail after their retries (each counts as an invalid verdict);
    more fails the evaluate stage. Recorded in the results either way."""
    structured_verdict: Literal[True, False, "auto"] = "auto"
    """Constrain the judge's reply to A, B or tie with vLLM's structured outputs (a request field only a vLLM
    server knows). auto = on for a judge served by vLLM (serve set, serve.command null), off for an external
    base_url."""
    serve: ServeConfig | None = None
    """The judge as a model the judge job serves itself; null: the judge at base_url."""


@dataclass(frozen=True)
class EvaluateConfig(Section):
    """The held-out evaluation of the base, SFT and trained policies, and the pairwise judge of their
    completions."""

    examples: int = setting(500, minimum=1)
    """Held-out problems (the first this many of the test split)."""
    samples_per_prompt: int = setting(4, minimum=1)
    """Independent T = 1 draws per problem; sampled accuracy is their mean (one draw on 500 problems moves by
    about 2 points between sampling seeds). The pairwise judge sees the first."""
    max_new_tokens: int = setting(96, minimum=1)
    """Longest completion (tokens)."""
    batch_size: int = setting(128, minimum=1)
    """Rows per decoding call (it decides each row's sampling noise)."""
    judge: Literal["verifier", "llm"] = "verifier"
    """The pairwise judge of the win rates: the verifier (right beats wrong) or an LLM (`llm_judge`)."""
    win_rate_decoding: Literal["sampled", "greedy"] = "sampled"
    """Which completions the pairwise judge compares; sampled (T = 1) is how RLOO trains the policy to
    answer."""
    llm_judge: LlmJudgeConfig = field(default_factory=LlmJudgeConfig)
    """The LLM judge of judge: llm."""

    def problems(self, max_length: int, reward_source: str) -> list[str]:
        serve = self.llm_judge.serve
        return (completion_room("evaluate.max_new_tokens", self.max_new_tokens, max_length)
                + (serve.problems(reward_source, self.judge) if serve else []))
