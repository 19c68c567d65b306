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
import re

import numpy as np

from ..errors import ConfigError
from ..validation import LOSS_NAMES
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
FUNCTIONS = {"log": np.log, "exp": np.exp, "sqrt": np.sqrt, "abs": np.abs}
_BINARY = {
    ast.Add: np.add,
    ast.Sub: np.subtract,
    ast.Mult: np.multiply,
    ast.Div: np.divide,
    ast.Pow: np.power,
}
_UNARY = {ast.USub: np.negative, ast.UAdd: np.positive}
_BACKQUOTED = re.compile(r"`([^`]*)`")


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
    construct outside the whitelist, a syntax error (``numeric``: the columns named in it)."""
    names: dict[str, str] = {}

    def quote(m: re.Match) -> str:
        key = f"__col{len(names)}"
        names[key] = m.group(1)
        return key

    text = _BACKQUOTED.sub(quote, expr.strip())
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ConfigError(f"{where}: not an expression of columns ({e.msg})") from None

    def value(n: ast.AST):
        if isinstance(n, ast.Expression):
            return value(n.body)
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return float(n.value)
        if isinstance(n, ast.Name):
            col = names.get(n.id, n.id)
            if col not in columns:
                raise ConfigError(
                    f"{where}: no column {col!r} (numeric columns: {', '.join(numeric) or 'none'})"
                )
            return columns[col]
        if isinstance(n, ast.BinOp) and type(n.op) in _BINARY:
            return _BINARY[type(n.op)](value(n.left), value(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _UNARY:
            return _UNARY[type(n.op)](value(n.operand))
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in FUNCTIONS
            and len(n.args) == 1
            and not n.keywords
        ):
            return FUNCTIONS[n.func.id](value(n.args[0]))
        raise ConfigError(
            f"{where}: {ast.unparse(n)!r} is not allowed (columns, numbers, + - * / **, "
            f"{', '.join(FUNCTIONS)})"
        )

    with np.errstate(all="ignore"):  # a log of 0, a division by 0: inf/NaN, left out as missing
        out = value(tree)
    n = len(next(iter(columns.values()))) if columns else 0
    return np.broadcast_to(np.asarray(out, dtype="float64"), (n,)).copy()


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
        raise ConfigError(
            f"{where} is not a column of {table.name}{need} (metric columns present: {avail})"
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
