"""What `correlate` predicts: the target column, a derived gap or an expression of columns, and
the rules that depend on the loss (the default target, whether "at a minimum" means anything).

Targets
-------
* a column of the table (``gen_gap``, ``loss_gap``, ``test_loss``, any numeric column);
* a derived target, computed from the metric columns when the table lacks it (`DERIVED`):
  ``gen_gap = train_acc − test_acc``, ``loss_gap = test_loss − train_loss`` (per scored unit: per
  token for a language model), ``train_ppl = exp(train_loss)``, ``test_ppl = exp(test_loss)``;
* an arithmetic expression of columns, e.g. ``test_loss - train_loss`` or ``test_acc / train_acc``:
  column names (backquoted when they are not identifiers: ```asam_0.05` / 2``), numbers,
  ``+ - * / **``, unary minus and the functions ``log``, ``exp``, ``sqrt``, ``abs``. The expression
  is parsed with Python's ``ast`` and only these nodes are evaluated (numpy, on float columns):
  nothing else runs.

Per loss (the ``loss`` of the config in results.json; a table with perplexity columns is a per-token
loss): the default target is the accuracy gap for classifiers (``cross_entropy``) and the loss
gap for language models and regression (`CLASSIFIER_LOSSES`); the "not at a minimum" warning applies to
classification cross-entropy only (train loss ≤ 0.01, Jiang et al. 2020): a language model's loss
floor is the entropy of its text.
"""

from __future__ import annotations

import ast
import difflib

import numpy as np

from ..errors import ConfigError
from ..validation import LOSS_NAMES
from .expressions import FUNCTIONS, Columns, evaluate_arithmetic
from .table import METRICS, ResultsTable, numeric_columns

# the losses of classifiers: their default target is the accuracy gap, and the train loss under
# which a model is at a minimum; every other loss (flatcli.validation.LOSS_NAMES) predicts the
# loss gap and has no minimum rule. The loss plug-ins' `gap` and `minimum_loss`
# (flatcli.engine.losses) say the same; a test keeps them equal.
CLASSIFIER_LOSSES: dict[str, float] = {"cross_entropy": 0.01}
PER_TOKEN_LOSSES = ("causal_lm",)  # units are tokens: perplexity columns, "language models"
DERIVED: dict[str, str] = {
    "gen_gap": "train_acc - test_acc",
    "loss_gap": "test_loss - train_loss",
    "train_ppl": "exp(train_loss)",
    "test_ppl": "exp(test_loss)",
}
DESCRIBED = {
    "gen_gap": "gen_gap = train_acc − test_acc",
    "loss_gap": "loss_gap = test_loss − train_loss",
    "train_ppl": "train_ppl = exp(train_loss)",
    "test_ppl": "test_ppl = exp(test_loss)",
}


def default_target(columns: list[str], loss: str | None) -> str:
    """The target `correlate` predicts when none is named: ``gen_gap`` for a classifier's loss,
    ``loss_gap`` for any other; for a table of unknown loss ``gen_gap`` when it has or can derive
    it, else ``loss_gap``."""
    if loss in CLASSIFIER_LOSSES:
        return "gen_gap"
    if loss in LOSS_NAMES:
        return "loss_gap"
    if _derivable(columns, "gen_gap") or not _derivable(columns, "loss_gap"):
        return "gen_gap"
    return "loss_gap"


def minimum_rule(loss: str | None) -> bool:
    """Whether "not at a minimum" (train loss above a target) means anything for ``loss``:
    classification cross-entropy, and a table of unknown loss (flatcli's classifier default)."""
    return loss is None or loss in CLASSIFIER_LOSSES


def describe_target(target: str, loss: str | None, default: bool) -> str:
    """The table's caption line: the target's definition, per scored token for a per-token loss,
    and whether it is the default for this kind of model."""
    text = DESCRIBED.get(target, target)
    if target in ("loss_gap", "train_ppl", "test_ppl") and loss in PER_TOKEN_LOSSES:
        text += " (per scored token)"
    if not default:
        return f"target: {text}"
    if loss in CLASSIFIER_LOSSES:
        kind = "classifiers"
    elif loss in PER_TOKEN_LOSSES:
        kind = "language models"
    elif loss:
        kind = f"loss {loss}"
    else:
        return f"target: {text}; the default target (the table does not record its loss)"
    return f"target: {text}; the default target for {kind}"


def _derivable(columns: list[str], name: str) -> bool:
    if name in columns:
        return True
    return name in DERIVED and all(c in columns for c in _names(DERIVED[name]))


def _names(expr: str) -> list[str]:
    tree = ast.parse(expr, mode="eval")
    return [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in FUNCTIONS]


def evaluate(
    expr: str, columns: dict[str, np.ndarray], numeric: list[str], where: str
) -> np.ndarray:
    """The values of the arithmetic expression ``expr`` (module docstring) over ``columns`` (name →
    float array); a `ConfigError` starting with ``where`` for anything else: an unknown name, a
    construct outside the whitelist, a syntax error, an expression too long or too deep
    (`flatcli.analysis.expressions`; ``numeric``: the names an unknown one is matched against)."""
    n = len(next(iter(columns.values()))) if columns else 0
    cols = Columns(list(columns), columns.__getitem__, n=n, suggest=numeric, kind="numeric columns")
    return evaluate_arithmetic(expr, cols, where)


def resolve_target(table: ResultsTable, target: str | None) -> tuple[ResultsTable, str, str]:
    """``(table, column, caption line)`` for ``target`` (None: the table's default,
    `default_target`): a column as it is, else a derived target or an expression of columns added
    to a copy of the table as a column of that name. A `ConfigError` naming what is missing."""
    loss = table.loss
    default = target is None or not str(target).strip()
    name = default_target(table.columns, loss) if default else str(target).strip()
    caption = describe_target(name, loss, default)
    if name in table.columns:
        return table, name, caption
    where = f"`target` {name!r}"
    expr = DERIVED.get(name, name)
    plain = name.isidentifier() and name not in DERIVED
    if plain or (name in DERIVED and not _derivable(table.columns, name)):
        avail = ", ".join(c for c in table.columns if c in METRICS) or "none"
        need = f" (from {expr}: needs those columns)" if name in DERIVED else ""
        hint = "; gen_gap and loss_gap need test data in the config (data.test)"
        close = difflib.get_close_matches(name, table.columns, n=5, cutoff=0.6)
        near = f"; did you mean {', '.join(close)}?" if close and not need else ""
        raise ConfigError(
            f"{where} is not a column of {table.name}{need} (metric columns present: {avail})"
            + near
            + (hint if name in ("gen_gap", "loss_gap") else "")
        )
    cols = {c: table.numeric(c) for c in table.columns}
    values = evaluate(expr, cols, numeric_columns(table), where)
    frame = table.frame.copy()
    frame[name] = values
    return (
        ResultsTable(frame, table.path, table.measures, table.measures_source, table.recorded_loss),
        name,
        caption,
    )
