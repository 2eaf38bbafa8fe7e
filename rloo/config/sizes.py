"""Sizes checked before any stage runs (part of validation, so `snakemake -n` refuses them too): each
generation's length against the model's context, the batch sizes against the training data where the
config says how much there is, and, for a CPU run, the predicted peak host memory of every stage
(rloo/host_memory.py) against the machine's. Each problem names the key to lower."""

from __future__ import annotations

from rloo.errors import UserError

# Every stage that generates, and the key of its completion length.
GENERATION_KEYS = ("sft.eval_max_new_tokens", "reward.max_new_tokens", "rloo.max_new_tokens", "evaluate.max_new_tokens")


def size_checks(cfg: dict) -> list[str]:
    """The size problems of `cfg`; the memory check only once the sizes themselves are sane."""
    problems = _lengths(cfg) + _batches(cfg)
    return problems or _host_memory(cfg)


def _get(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _lengths(cfg: dict) -> list[str]:
    """A completion of max_new_tokens needs a prompt beside it within model.max_length tokens."""
    context = cfg["model"]["max_length"]
    return [f"key '{key}': {n} new tokens leave no room for a prompt within model.max_length={context} (prompt + "
            f"completion); lower {key} below {context}"
            for key in GENERATION_KEYS if (n := _get(cfg, key)) >= context]


def train_examples(cfg: dict) -> tuple[int, str] | None:
    """(at most this many training problems in the prepared split, where that number comes from), where
    the config says: the embedded generator's count, or data.max_train; None for a data set whose size
    is known once prepare has read it (a JSONL file's bad records, a hub data set: the stages then warn
    once where a batch is cut to the data)."""
    d = cfg["data"]
    found = [(d["synthetic"]["n_train"], "data.synthetic.n_train")] if d["source"] == "synthetic" else []
    if d["max_train"]:
        found.append((d["max_train"], "data.max_train"))
    return min(found) if found else None


def _batches(cfg: dict) -> list[str]:
    """A batch larger than the data would be cut to it in silence (every step then takes all of it)."""
    found = train_examples(cfg)
    if found is None or found[0] < 1:
        return []
    n, where = found
    sft_n, sft_where = n, where
    if (cap := cfg["sft"]["max_train_examples"]) and cap < n:
        sft_n, sft_where = cap, "sft.max_train_examples"
    problems = []
    for key, have, source in (("sft.batch_size", sft_n, sft_where), ("rloo.prompts_per_step", n, where)):
        if (size := _get(cfg, key)) > have:
            problems.append(f"key '{key}': {size} is more than the {have} training problems ({source}); "
                            f"lower {key} to at most {have}")
    return problems


def _host_memory(cfg: dict) -> list[str]:
    from rloo.host_memory import cpu_run, problem
    from rloo.model_shape import model_shape

    if not cpu_run(cfg):
        return []
    try:
        shape, _ = model_shape(cfg)
    except UserError:  # no shape to plan with: `rloo plan` names model.shape when asked
        return []
    found = problem(cfg, shape)
    return [found] if found else []
