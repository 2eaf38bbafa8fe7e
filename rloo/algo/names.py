"""The advantage estimators' names and what k they need, without torch: the config checks read them before
any stage runs."""

import ast
from pathlib import Path

TABLE = "ESTIMATOR_TABLE"  # rloo/algo/estimators.py's {name: function}, the one list of the estimators


def _table_names() -> tuple[str, ...]:
    """The keys of estimators.ESTIMATOR_TABLE, read from its source: its functions need torch, and the
    settings that offer these names load where Snakemake reads the workflow, without it."""
    path = Path(__file__).with_name("estimators.py")
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [TABLE]
                and isinstance(node.value, ast.Dict)):
            return tuple(ast.literal_eval(k) for k in node.value.keys if k is not None)
    raise ImportError(f"{path}: no literal {TABLE} = {{name: function}}")


ESTIMATORS: tuple[str, ...] = _table_names()

# Estimators whose baseline is built from the other samples of the same group, so k >= 2 is required.
GROUP_ESTIMATORS: tuple[str, ...] = ("rloo", "grpo", "grpo_std")


def k_problems(estimator: str, k: int, dynamic_sampling: bool = False) -> list[str]:
    """What `k` samples per prompt are too few for: a group estimator's baseline is built from a prompt's
    other samples, and dynamic sampling keeps the groups whose rewards differ (the config checks, the
    trainer and the estimators all ask here)."""
    out = []
    if estimator in GROUP_ESTIMATORS and k < 2:
        out.append(f"the {estimator} estimator needs k >= 2 samples per prompt")
    if dynamic_sampling and k < 2:
        out.append("rloo.dynamic_sampling keeps groups whose rewards differ; needs k >= 2")
    return out
