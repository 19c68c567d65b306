"""The one grammar of every option that takes an expression of columns: ``--target`` (arithmetic)
and ``--where`` (a row filter). Nothing is handed to ``eval``, ``DataFrame.query`` or numexpr:
the text is parsed with Python's ``ast`` and only the nodes below are evaluated (numpy, on the
table's columns); anything else is a `ConfigError` naming the construct.

Arithmetic (``--target``, and each side of a comparison)
    column names (backquoted when they are not identifiers: ```asam_0.05` / 2``), numbers,
    ``+ - * / **``, unary ``-``/``+`` and the functions ``log``, ``exp``, ``sqrt``, ``abs``.

Conditions (``--where``)
    comparisons ``== != < <= > >=`` (chained: ``0.1 <= hp_lr < 1``) of arithmetic, text in quotes
    or ``True``/``False``; ``in`` / ``not in`` a list, tuple or set of those literals
    (``hp_opt in ['sgd', 'adam']``); ``and``, ``or``, ``not`` (and ``&``, ``|``, ``~`` between
    parenthesised conditions); a column of booleans on its own. A missing value compares unequal
    to everything.

Limits: at most `MAX_CHARS` characters and `MAX_DEPTH` levels of nesting (a deeper expression is
refused before anything recurses over it).
"""

from __future__ import annotations

import ast
import difflib
import operator
import re
from collections.abc import Callable

import numpy as np

from ..errors import ConfigError

MAX_CHARS = 2000
MAX_DEPTH = 64
MAX_LISTED = 12  # an unknown name lists the columns when there are this few, else the nearest
FUNCTIONS = {"log": np.log, "exp": np.exp, "sqrt": np.sqrt, "abs": np.abs}
_BINARY = {
    ast.Add: np.add,
    ast.Sub: np.subtract,
    ast.Mult: np.multiply,
    ast.Div: np.divide,
    ast.Pow: np.power,
}
_UNARY = {ast.USub: np.negative, ast.UAdd: np.positive}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_LITERALS = (int, float, str, bool)
_BACKQUOTED = re.compile(r"`([^`]*)`")
ARITHMETIC = "columns, numbers, + - * / **, " + ", ".join(FUNCTIONS)
CONDITIONS = "comparisons of columns, numbers and quoted text, in [...] lists, and, or, not, & | ~"


def nearest(name: str, candidates: list[str], kind: str = "columns") -> str:
    """What to say after "no column X": every candidate when there are few, else the nearest
    names (difflib) or how many there are: one short clause either way."""
    if len(candidates) <= MAX_LISTED:
        return f"{kind}: {', '.join(candidates) or 'none'}"
    close = difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
    if close:
        return f"did you mean {', '.join(close)}? ({len(candidates)} {kind})"
    return f"none close among {len(candidates)} {kind}"


class Parsed:
    """An expression parsed under the limits: its tree and the backquoted names it holds."""

    def __init__(self, expr: str, where: str):
        self.where = where
        text = str(expr).strip()
        if len(text) > MAX_CHARS:
            raise ConfigError(f"{where}: longer than {MAX_CHARS} characters")
        self.names: dict[str, str] = {}
        text = _BACKQUOTED.sub(self._quote, text)
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise ConfigError(f"{where}: not an expression of columns ({e.msg})") from None
        except (RecursionError, MemoryError, ValueError) as e:
            raise ConfigError(
                f"{where}: not an expression of columns ({type(e).__name__})"
            ) from None
        _check_depth(self.tree, where)

    def _quote(self, m: re.Match) -> str:
        key = f"__col{len(self.names)}"
        self.names[key] = m.group(1)
        return key

    def column(self, node: ast.Name) -> str:
        """The column a name stands for (a backquoted one by its text)."""
        return self.names.get(node.id, node.id)

    def refuse(self, node: ast.AST, allowed: str) -> ConfigError:
        """The error for a construct outside the grammar, naming it."""
        text = ast.unparse(node)
        for key, col in self.names.items():
            text = text.replace(key, f"`{col}`")
        kind = type(node).__name__
        if isinstance(node, ast.Constant):
            kind = type(node.value).__name__
        return ConfigError(f"{self.where}: {text!r} ({kind}) is not allowed ({allowed})")


def _check_depth(tree: ast.AST, where: str) -> None:
    """A `ConfigError` when ``tree`` nests deeper than `MAX_DEPTH` or holds an integer no float
    holds (walked without recursion)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) > 2**1023:
            raise ConfigError(f"{where}: the number {str(node.value)[:20]}... is too large")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


class Columns:
    """What names evaluate to: ``numbers(col)`` (float64, for arithmetic) and ``values(col)`` (the
    column as stored, for comparisons with text); ``known``: the column names, ``n`` the rows;
    ``suggest``/``kind``: the names an unknown one is matched against, and what they are called."""

    def __init__(
        self,
        known: list[str],
        numbers: Callable[[str], np.ndarray],
        values: Callable[[str], np.ndarray] | None = None,
        n: int = 0,
        suggest: list[str] | None = None,
        kind: str = "columns",
    ):
        self.known, self._numbers, self._values, self.n = known, numbers, values, n
        self.suggest, self.kind = (known if suggest is None else suggest), kind

    def check(self, col: str, p: Parsed) -> None:
        """A `ConfigError` for a name that is no column (naming the nearest of ``suggest``)."""
        if col not in self.known:
            hint = nearest(col, list(self.suggest), self.kind)
            raise ConfigError(f"{p.where}: no column {col!r} ({hint})")

    def numbers(self, col: str, p: Parsed) -> np.ndarray:
        """The column as float64."""
        self.check(col, p)
        return self._numbers(col)

    def values(self, col: str, p: Parsed) -> np.ndarray:
        """The column as stored (numbers as float64, anything else as objects)."""
        self.check(col, p)
        return (self._values or self._numbers)(col)


def arithmetic(p: Parsed, node: ast.AST, cols: Columns):
    """The float values of an arithmetic node (a number or an array)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return cols.numbers(p.column(node), p)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](
            arithmetic(p, node.left, cols), arithmetic(p, node.right, cols)
        )
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](arithmetic(p, node.operand, cols))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in FUNCTIONS
        and len(node.args) == 1
        and not node.keywords
    ):
        return FUNCTIONS[node.func.id](arithmetic(p, node.args[0], cols))
    raise p.refuse(node, ARITHMETIC)


def evaluate_arithmetic(expr: str, cols: Columns, where: str) -> np.ndarray:
    """The float64 values (one per row) of the arithmetic expression ``expr``."""
    p = Parsed(expr, where)
    with np.errstate(all="ignore"):  # a log of 0, a division by 0: inf/NaN, left out as missing
        out = arithmetic(p, p.tree, cols)
    return np.broadcast_to(np.asarray(out, dtype="float64"), (cols.n,)).copy()


# ------------------------------------------------------------------ conditions
def _operand(p: Parsed, node: ast.AST, cols: Columns):
    """One side of a comparison: a column as stored, a literal, a list of literals (``in``), or
    arithmetic."""
    if isinstance(node, ast.Name) and node.id not in ("True", "False"):
        return cols.values(p.column(node), p)
    if isinstance(node, ast.Constant) and type(node.value) in _LITERALS:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(p, e) for e in node.elts]
    return arithmetic(p, node, cols)


def _literal(p: Parsed, node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in _LITERALS:
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value
    raise p.refuse(node, "a list holds numbers, quoted text, True or False")


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _elementwise(p: Parsed, op, a, b, n: int) -> np.ndarray:
    """``op(a, b)`` row by row (text, numbers or both); a missing value is unequal to everything."""
    a = a if isinstance(a, np.ndarray) else [a] * n
    b = b if isinstance(b, np.ndarray) else [b] * n
    out = np.zeros(n, dtype=bool)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if _missing(x) or _missing(y):
            out[i] = op is operator.ne
            continue
        try:
            out[i] = bool(op(x, y))
        except TypeError:
            raise ConfigError(
                f"{p.where}: cannot compare {x!r} with {y!r} (text with a number?)"
            ) from None
    return out


def _compare(p: Parsed, op: ast.cmpop, a, b, n: int) -> np.ndarray:
    if isinstance(op, (ast.In, ast.NotIn)) or isinstance(b, list):
        if not isinstance(b, list):
            raise p.refuse(op, "`in` takes a list: col in [1, 2]")
        hit = np.zeros(n, dtype=bool)
        for v in b:
            hit |= _elementwise(p, operator.eq, a, v, n)
        return ~hit if isinstance(op, (ast.NotIn, ast.NotEq)) else hit
    if type(op) not in _COMPARE:
        raise p.refuse(op, CONDITIONS)
    if isinstance(a, list):
        raise ConfigError(f"{p.where}: a list can only be on the right of in")
    fn = _COMPARE[type(op)]
    numeric = all(
        (isinstance(x, (int, float)) and not isinstance(x, bool))
        or (isinstance(x, np.ndarray) and x.dtype.kind in "fiu")
        for x in (a, b)
    )
    if numeric:
        with np.errstate(invalid="ignore"):
            out = fn(np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64"))
        return np.broadcast_to(out, (n,)).copy()
    return _elementwise(p, fn, a, b, n)


def condition(p: Parsed, node: ast.AST, cols: Columns) -> np.ndarray:
    """The boolean mask (one per row) of a condition node."""
    n = cols.n
    if isinstance(node, ast.BoolOp):
        masks = [condition(p, v, cols) for v in node.values]
        combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
        return combine.reduce(masks)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
        return ~condition(p, node.operand, cols)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
        combine = np.logical_and if isinstance(node.op, ast.BitAnd) else np.logical_or
        return combine(condition(p, node.left, cols), condition(p, node.right, cols))
    if isinstance(node, ast.Compare):
        out = np.ones(n, dtype=bool)
        left = _operand(p, node.left, cols)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _operand(p, right_node, cols)
            with np.errstate(all="ignore"):
                out &= _compare(p, op, left, right, n)
            left = right
        return out
    if isinstance(node, ast.Name) and node.id not in ("True", "False"):
        return _boolean_column(p, cols.values(p.column(node), p), node)
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return np.full(n, node.value)
    raise p.refuse(node, CONDITIONS)


def _boolean_column(p: Parsed, values: np.ndarray, node: ast.Name) -> np.ndarray:
    if values.dtype == bool:
        return values.copy()
    ok = all(v in (True, False) or _missing(v) for v in values.tolist())
    if not ok:
        raise ConfigError(
            f"{p.where}: column {p.column(node)!r} is not true/false; compare it: "
            f"{p.column(node)} == 1"
        )
    return np.array([v is True or v == 1 for v in values.tolist()], dtype=bool)


def evaluate_condition(expr: str, cols: Columns, where: str) -> np.ndarray:
    """The rows (a boolean mask) the condition ``expr`` keeps."""
    p = Parsed(expr, where)
    return condition(p, p.tree, cols)


class _AnyColumns(Columns):
    """Every name is a column of no rows: the grammar checked before a table exists."""

    def __init__(self):
        super().__init__([], lambda col: np.empty(0), n=0)

    def check(self, col: str, p: Parsed) -> None:
        """Any name is accepted."""


def check_condition(expr: str, where: str) -> None:
    """A `ConfigError` when ``expr`` is not a condition of the grammar (names are not checked)."""
    evaluate_condition(expr, _AnyColumns(), where)
