"""Tool calls inside the sampling loops (issue 73; the tools: rloo/tools): when a row's completion so far
ends with an open call of a tool (its opening marker, then no closing marker, then the call's end, `<<48/2=`),
the tool's result and its closing marker (`24>>`) are the row's next tokens, forced; then sampling goes on.

Both loops (rloo/rollout/hf.py, rloo/rollout/decode.py) hand every step's tokens to `ToolCalls.override`
before they are written: a row with forced tokens queued takes the next one in place of the token it
sampled. The sampling noise is still drawn for every row at every step, so a row's samples depend on the
generator and its own logits alone, as without tools, and the same seed gives the same completions and
forced tokens, in either loop. vLLM (rloo/rollout/vllm.py) samples many steps per request: its requests
stop at the candidate tokens below (`stop_tokens`), and each stop goes through `at_stop`, the same rule
step by step; the row then goes on from its token ids.

Calls are found on the decoded text, only at a step whose token holds the last character of a call's end
(the candidate tokens: one lookup per step; text is decoded for those rows alone). A token that runs past
the call's end (`=24` in a tokenizer that merges them) is split: the text up to the end is encoded again
and, with the result and the closing marker, replaces it, so the call ends at its end and the forced tokens
start on a token boundary. Those re-encoded tokens are the environment's too (the policy sampled another
token): forced, like the result. `Rollout.policy_mask` marks the tokens the policy sampled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from rloo.tools import Tool, Toolbox


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# Each tokenizer's tokens decoded one by one (a vocabulary's worth of decodes: done once per tokenizer,
# however many runners the evaluations and the trainer build over it).
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pieces(tokenizer) -> list[str]:
    try:
        if tokenizer in _PIECES:
            return _PIECES[tokenizer]
    except TypeError:  # an object no weak reference can name: decoded again by each runner
        return tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    _PIECES[tokenizer] = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return _PIECES[tokenizer]


@dataclass
class ToolRunner:
    """The enabled tools with the policy's tokenizer: what a sampling loop needs to run them."""

    box: Toolbox
    tokenizer: object
    _candidates: torch.Tensor | None = field(default=None, repr=False)

    def candidates(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: the tokens whose text holds the last character of some tool's call end."""
        if self._candidates is None or len(self._candidates) != vocab:
            lasts = {t.end[-1] for t in self.box.tools}
            pieces = _pieces(self.tokenizer)[:vocab]
            hit = torch.zeros(vocab, dtype=torch.bool)
            hit[: len(pieces)] = torch.tensor([any(c in s for c in lasts) for s in pieces])
            self._candidates = hit
        return self._candidates.to(device)

    def start(self, rows: list[dict] | None, batch: int, max_new_tokens: int, vocab: int,
              device: torch.device) -> ToolCalls:
        """One generate call's tool state; `rows`: each prompt's data record (a tool's `**row`), or None;
        `vocab`: the width of the model's logits."""
        if rows is not None and len(rows) != batch:
            raise ValueError(f"{len(rows)} rows for {batch} prompts")
        return ToolCalls(self, rows or [{}] * batch, batch, max_new_tokens, self.candidates(vocab, device))


class ToolCalls:
    """One generate call's tool state: per row, its forced tokens still to come and its calls so far."""

    def __init__(self, runner: ToolRunner, rows: list[dict], batch: int, max_new_tokens: int,
                 candidates: torch.Tensor) -> None:
        self.runner, self.rows, self.candidates = runner, rows, candidates
        self.queue: list[list[int]] = [[] for _ in range(batch)]
        self.calls = [0] * batch
        self.errors = [0] * batch  # the calls whose result reports bad input (`Tool.erred`)
        self.forced = torch.zeros((batch, max_new_tokens), dtype=torch.bool)

    def override(self, t: int, rows: torch.Tensor, live: torch.Tensor, nxt: torch.Tensor,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step `t`'s tokens `nxt` of the batch rows `rows` (`live`: still decoding) with the forced ones in
        place of the sampled ones, and which of them are forced (None: none). `tokens`: the completions so
        far ([batch, max_new_tokens], steps < t written)."""
        hit = self.candidates[nxt] & live
        if not any(self.queue) and not bool(hit.any()):
            return nxt, None
        out, now = nxt.tolist(), [False] * len(nxt)
        live_l, hit_l = live.tolist(), hit.tolist()
        for i, b in enumerate(rows.tolist()):
            if not live_l[i]:
                continue
            queued = bool(self.queue[b])
            if not queued and hit_l[i] and self.calls[b] < self.runner.box.max_calls:
                queued = self._call(b, tokens[b, :t].tolist(), out[i])
            if queued:
                out[i], now[i] = self.queue[b].pop(0), True
                self.forced[b, t] = True
        return torch.tensor(out, dtype=nxt.dtype, device=nxt.device), torch.tensor(now, device=nxt.device)

    def _call(self, b: int, before: list[int], token: int) -> bool:
        """Queue the forced tokens of a call that `token` ends, if it ends one: the result and the closing
        marker, after the re-encoded text up to the call's end where `token` runs past it. Whether `token`
        is replaced (it runs past the end: the queue starts at this step)."""
        tok = self.runner.tokenizer
        prev, text = tok.decode(before), tok.decode([*before, token])
        n = len(prev) if text.startswith(prev) else next(
            (i for i, (a, c) in enumerate(zip(prev, text, strict=False)) if a != c), min(len(prev), len(text)))
        found = min((c for tool in self.runner.box.tools if (c := _open_call(text, n, tool)) is not None),
                    default=None, key=lambda c: c[0])
        if found is None:
            return False
        end_at, call, tool = found
        self.calls[b] += 1
        result = tool(call, self.rows[b])
        self.errors[b] += tool.erred(result)
        forced = _encode(tok, result + tool.close)
        if end_at == len(text):  # the token ends at the call's end: it is the policy's
            self.queue[b] = forced
            return False
        self.queue[b] = [*_encode(tok, text[n:end_at]), *forced]  # the text up to the end is the tool's
        return True

    def stop_tokens(self, b: int) -> list[int]:
        """The tokens at which a sampler that runs many steps per call (vLLM) must stop row `b` and hand
        its last token to `at_stop`: the candidates while the row may call a tool, else none."""
        return self.candidates.nonzero().squeeze(1).tolist() if self.calls[b] < self.runner.box.max_calls else []

    def at_stop(self, b: int, t: int, tokens: torch.Tensor) -> list[int]:
        """Row `b` of a sampler that stopped at a candidate token, `tokens[b, t]` (steps < t before it):
        the tokens of steps t, t+1, ... that `override` would have written, at most to the buffer's end:
        that token or, where it runs past a call's end, its replacement, then the queued forced ones. The
        loops' one rule, step by step; `forced` marks those that are the tool's."""
        out = []
        for step in range(t, tokens.shape[1]):
            if step > t and not self.queue[b]:
                break
            nxt, _ = self.override(step, torch.tensor([b]), torch.tensor([True]), tokens[b, step : step + 1], tokens)
            tokens[b, step] = nxt[0]
            out.append(int(nxt[0]))
        return out

    def policy_mask(self, mask: torch.Tensor, steps: int) -> torch.Tensor | None:
        """The completion tokens the policy sampled ([B, steps]); None when no token was forced."""
        forced = self.forced[:, :steps].to(mask.device)
        return mask & ~forced if bool(forced.any()) else None

    def call_counts(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.calls, dtype=torch.long, device=device)

    def error_counts(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.errors, dtype=torch.long, device=device)


def _open_call(text: str, n: int, tool: Tool) -> tuple[int, str, Tool] | None:
    """(where the call ends, the call, the tool) of the first call of `tool` whose end lies past `n`
    (the text the last token added): its opening marker before it, no closing marker between; or None."""
    pos = text.find(tool.end, max(0, n - len(tool.end) + 1))
    while pos != -1:
        opened = text.rfind(tool.open, 0, pos)
        if opened != -1 and text.find(tool.close, opened + len(tool.open), pos) == -1:
            return pos + len(tool.end), text[opened + len(tool.open) : pos], tool
        pos = text.find(tool.end, pos + 1)
    return None
