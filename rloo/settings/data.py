"""The `data` and `prompt` sections: where the GSM8K-format problems come from, and how a question is
put to the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rloo.settings.fields import Section, setting


@dataclass(frozen=True)
class DataFieldsConfig(Section):
    """Which field of a record (jsonl or hub) holds the question and which the answer, for GSM8K-like sets
    that name them otherwise (SVAMP's Body/Answer, a team's problem/solution). The prepared records use the
    names question and answer; every other field is kept under its own name and reaches reward functions as
    a column (docs/rewards-and-data.md)."""

    question: str = setting("question", min_length=1)
    """The field holding the question."""
    answer: str = setting("answer", min_length=1)
    """The field holding the answer (a solution ending in '#### N', or a bare number: `answer_format`)."""


@dataclass(frozen=True)
class SyntheticConfig(Section):
    """The embedded generator of GSM8K-format word problems (data.source synthetic)."""

    n_train: int = setting(20000, minimum=1)
    """Training problems generated."""
    n_test: int = setting(500, minimum=1)
    """Test problems generated (disjoint from the training ones)."""
    step_weights: tuple[float, ...] = setting([0.5, 0.3, 0.12, 0.08], min_items=1, max_items=4, item={"minimum": 0})
    """Relative frequency of problems with 1, 2, 3, 4 arithmetic steps (the difficulty mix)."""
    max_number: int = setting(30, minimum=5)
    """Largest starting quantity and largest number added or taken away."""
    max_value: int = setting(150, minimum=10)
    """No intermediate or final answer exceeds this (keeps the arithmetic grade-school)."""


@dataclass(frozen=True)
class DataConfig(Section):
    """The problems, in GSM8K's format (`question`, `answer` ending in `#### N`): generated, from the hub, or
    from local JSONL files; prepare writes train, validation and test splits and their manifest."""

    source: Literal["synthetic", "hub", "jsonl"] = "synthetic"
    """synthetic = the embedded generator; hub = datasets.load_dataset(hub_id, hub_config); jsonl = local
    GSM8K-release files."""
    hub_id: str = "openai/gsm8k"
    """The hub data set of source hub."""
    hub_config: str = "main"
    """Its configuration (load_dataset's second argument)."""
    train_file: str | None = None
    """The training split of source jsonl: a JSONL file, one record per line."""
    test_file: str | None = None
    """The test split of source jsonl."""
    max_train: int | None = setting(None, minimum=1)
    """Keep the first this many training problems; null = all."""
    val_examples: int = setting(500, minimum=1)
    """Size of the validation split (val.jsonl) that training stages evaluate on and select checkpoints by;
    disjoint from test. Generated after train and test by the embedded generator, else held out of the
    train split at random, question by question (every copy of a question on the one side: on_duplicates)."""
    max_test: int | None = setting(None, minimum=1)
    """Keep the first this many test problems; null = all."""
    on_bad_record: Literal["error", "skip"] = "error"
    """error = stop at the first bad record, naming file and line; skip = drop it and count it in the
    manifest."""
    max_record_chars: int = setting(20000, minimum=1)
    """The longest record a jsonl or hub split may hold, in characters of its JSON line, far above any real
    GSM8K record: a longer one is a broken export, or text no training stage could use that would cost
    the tokenizer and every stage's memory. `on_oversized` says what prepare does with one."""
    on_oversized: Literal["error", "drop"] = "error"
    """error = prepare stops, naming the file and line of the first record over max_record_chars and how
    many are; drop = it drops them, with their count in the log, the manifest (`oversized`) and `rloo
    summary`."""
    on_duplicates: Literal["drop", "keep", "error"] = "drop"
    """A record that repeats an earlier one of its split: the same record (exact), or the same question once
    normalised as the train/test check normalises it (case, whitespace, punctuation, number formatting).
    drop = keep the first of each question; keep = keep them all (a repeated problem weighs more in
    training or in the test accuracy); error = prepare stops, naming the file and the count. The manifest
    (`duplicates`) and prepare's last line count them either way; the validation split is held out by
    question, so no copy of a validation problem is in train whatever this says."""
    fields: DataFieldsConfig = field(default_factory=DataFieldsConfig)
    """Which field holds the question and which the answer."""
    answer_format: Literal["gsm8k", "number"] = "gsm8k"
    """gsm8k = the answer is a solution ending in '#### N'; number = the answer is a bare number (42,
    "1,000", -2.5), prepared as '#### N' so that the verifier grades against it and SFT teaches the policy
    that form."""
    allow_train_test_overlap: bool = False
    """A training problem whose question is also a test question, compared once both are normalised (case,
    whitespace, punctuation, how numbers are written: "1,000" is 1000, "3.0" is 3), stops `prepare` (naming
    the count and the first few): the held-out accuracy would be measured on problems trained on. true = a
    warning instead; the manifest, the results JSON and `rloo summary` carry the count either way."""
    ngram_overlap_words: int = setting(13, minimum=0)
    """n of the n-gram contamination check: a training question that shares a run of this many normalised
    words with a test question is counted (13: the common decontamination); 0 = no such check. Templated
    problems share runs by construction (the embedded generator's do), so it is a count unless
    `on_ngram_overlap` says otherwise."""
    on_ngram_overlap: Literal["count", "warn", "error"] = "count"
    """count = the number goes to the manifest, the results JSON and `rloo summary`; warn = also a `!!!` line
    in the log and a `!!` line of the summary; error = prepare stops, naming the count and the first few."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The embedded generator's settings."""

    def train_examples(self) -> tuple[int, str] | None:
        """(at most this many training problems in the prepared split, where that number comes from), where
        the config says: the embedded generator's count, or max_train; None for a data set whose size is
        known once prepare has read it (a JSONL file's bad records, a hub data set: the stages then refuse
        a batch larger than the rows they count, as validation does)."""
        found = [(self.synthetic.n_train, "data.synthetic.n_train")] if self.source == "synthetic" else []
        if self.max_train:
            found.append((self.max_train, "data.max_train"))
        return min(found) if found else None


@dataclass(frozen=True)
class PromptConfig(Section):
    """How a question becomes a prompt: a plain template, or the tokenizer's chat template."""

    template: str = "Question: {question}\nAnswer:"
    """The bare prompt ({question} is replaced), followed by " <solution>" and the EOS; used when the chat
    template is off."""
    chat_template: Literal[True, False, "auto"] = "auto"
    """Render prompts with the tokenizer's chat template: the system message (prompt.system) and the question
    as the user turn, with the generation prompt; the completion is the assistant turn (the solution, then
    the template's end-of-turn token as EOS). auto = true when the tokenizer has a chat template (instruct
    models), false otherwise (base models, the embedded default); true with a tokenizer that has none is an
    error. SFT, the reward model, RLOO and the evaluation render the same."""
    system: str | None = None
    """System message put before the question when the chat template is used; null = none."""
