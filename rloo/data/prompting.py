"""Prompts and solutions as the policy, the reward model and the evaluation see them, for one tokenizer.

Two renderings, chosen by `prompt.chat_template` (true | false | auto: true when the tokenizer has one):

- the bare template (`prompt.template`, "Question: {question}\nAnswer:"), the solution " <answer>" after
  it: base models, and the embedded default (its tokenizer has no chat template);
- the tokenizer's chat template: the optional system message (`prompt.system`) and the question as the
  user turn, rendered with the generation prompt; the solution is the assistant turn's content.

Either way the completion ends with the tokenizer's EOS; under a chat template that is the template's
end-of-turn token (`align_eos`, applied by SFT, whose tokenizer every later stage loads). SFT, the reward
model (its pairs and its scores), RLOO and the evaluation all render through `render_prompt` and
tokenize through `PromptFormat`, so that a question gets the same prompt ids in every stage.
"""

from __future__ import annotations

from collections.abc import Mapping

from rloo.data.gsm8k import format_completion, format_prompt
from rloo.errors import InputError
from rloo.settings import PromptConfig

_SENTINEL = "RLOO_ASSISTANT_CONTENT"  # stands for the assistant's content when probing a template


def uses_chat_template(tokenizer, setting: bool | str) -> bool:
    """Whether prompts go through the tokenizer's chat template (`prompt.chat_template`)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "auto":
        return has
    if setting and not has:
        raise InputError(f"prompt.chat_template is true but the tokenizer of {tokenizer.name_or_path or 'the model'} "
                         "has no chat template; set prompt.chat_template: auto or false")
    return bool(setting)


def prompt_config(prompt: PromptConfig | Mapping) -> PromptConfig:
    """The `prompt` section, typed (a config file's dict is read once, here)."""
    return prompt if isinstance(prompt, PromptConfig) else PromptConfig.from_config(prompt)


def _messages(system: str | None, question: str) -> list[dict]:
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": question}]


def render_prompt(tokenizer, prompt: PromptConfig | Mapping, question: str) -> str:
    """The prompt text of `question` under the `prompt` config: the bare template, or the chat template
    applied to [system, user] with the generation prompt (the assistant turn's opening) at its end."""
    prompt = prompt_config(prompt)
    if not uses_chat_template(tokenizer, prompt.chat_template):
        return format_prompt(question, prompt.template)
    return tokenizer.apply_chat_template(_messages(prompt.system, question), add_generation_prompt=True,
                                         tokenize=False)


def end_of_turn(tokenizer, prompt: PromptConfig | Mapping) -> str | None:
    """The special token the chat template closes an assistant turn with; None under the bare template
    or when the template writes no special token right after the assistant's content."""
    prompt = prompt_config(prompt)
    if not uses_chat_template(tokenizer, prompt.chat_template):
        return None
    turn = [*_messages(prompt.system, "?"), {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(turn, tokenize=False)
    if _SENTINEL not in text:
        return None
    ids = tokenizer(text.split(_SENTINEL, 1)[1], add_special_tokens=False)["input_ids"]
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None
    return added.content if added is not None and added.special else None


def align_eos(tokenizer, prompt: PromptConfig | Mapping) -> str | None:
    """Make the tokenizer's EOS the chat template's end-of-turn token where they differ (a base model
    shipped with a chat template: EOS <|endoftext|>, turns closed by <|im_end|>); returns the new EOS,
    or None if nothing changed. Sampling stops at the EOS and SFT ends every solution with it."""
    eot = end_of_turn(tokenizer, prompt)
    if eot is None or eot == tokenizer.eos_token:
        return None
    tokenizer.eos_token = eot
    return eot


class PromptFormat:
    """`render_prompt` and the tokenization that goes with it, for one tokenizer and `prompt` config
    (None: only the encoding of texts rendered under the bare template)."""

    def __init__(self, tokenizer, prompt: PromptConfig | Mapping | None) -> None:
        self.tokenizer = tokenizer
        self.config = None if prompt is None else prompt_config(prompt)
        self.chat = self.config is not None and uses_chat_template(tokenizer, self.config.chat_template)

    def prompt(self, question: str) -> str:
        return render_prompt(self.tokenizer, self.config, question)

    def encode(self, text: str, **kwargs) -> list[int]:
        """Token ids of a rendered text. A chat template writes its special tokens itself (a BOS too, where
        it has one): none are added. The bare template gets the tokenizer's own (a BOS, for some)."""
        if self.chat:
            kwargs["add_special_tokens"] = False
        return self.tokenizer(text, **kwargs)["input_ids"]

    def prompt_ids(self, question: str) -> list[int]:
        return self.encode(self.prompt(question))

    def solution(self, answer: str) -> str:
        """The reference completion's text: the assistant turn's content, or " <answer>" after the bare
        template (the completion a reward-model pair calls chosen)."""
        return answer if self.chat else format_completion(answer)

    def solution_ids(self, answer: str) -> list[int]:
        """SFT's target after the prompt: the solution without special tokens (no BOS mid-sequence), then EOS."""
        ids = self.tokenizer(self.solution(answer), add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]

    def scored_ids(self, text: str, max_length: int) -> list[int]:
        """A reward model's input: rendered prompt + completion text and the EOS, cut to `max_length`."""
        return self.encode(text + (self.tokenizer.eos_token or ""), truncation=True, max_length=max_length)
