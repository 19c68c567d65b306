"""Pages of the flatcli docs generated at build time: the measure reference (from the registry),
the benchmark pages (from ``docs/benchmarks/data/*.json``) and the command-line reference (from the Typer app).

The renderers are plain functions of plain data (no Sphinx import at module level), so the tests
run them without Sphinx: ``render_benchmark(data)`` returns a MyST page for one benchmark file,
``measure_page(info)`` an reStructuredText page for one registry entry. `setup` writes the pages
into the source tree when a build starts (``docs/measures/``,
``docs/benchmarks/generated/``; both git-ignored).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
MACHINE_KEYS = ("cpu", "cores", "memory_gb", "torch", "python")
TOP_KEYS = ("benchmark", "title", "command", "machine", "commit", "date", "tables")


# ---------------------------------------------------------------- benchmarks (JSON -> MyST)


def validate_benchmark(data: Any, source: str = "benchmark") -> None:
    """Raise ValueError naming the first key of ``data`` that does not fit the schema."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be an object")
    for key in TOP_KEYS:
        if key not in data:
            raise ValueError(f"{source}: missing key '{key}'")
    for key in ("benchmark", "title", "command", "commit", "date"):
        if not isinstance(data[key], str):
            raise ValueError(f"{source}: '{key}' must be a string")
    _validate_history(data, source)
    if not isinstance(data["machine"], dict):
        raise ValueError(f"{source}: 'machine' must be an object")
    for key in MACHINE_KEYS:
        if key not in data["machine"]:
            raise ValueError(f"{source}: missing key 'machine.{key}'")
    if not isinstance(data["tables"], list):
        raise ValueError(f"{source}: 'tables' must be a list")
    for i, table in enumerate(data["tables"]):
        _validate_table(table, f"{source}: tables[{i}]")


# a script a command runs: `python -m benchmarks.NAME` or a path under benchmarks/, tools/, scripts/
_MODULE = re.compile(r"-m\s+((?:benchmarks|tools|flatcli)(?:\.\w+)+)")
_PATH = re.compile(r"(?<![\w/.])((?:benchmarks|tools|scripts)/[\w./-]+\.(?:py|sh))")


def command_scripts(command: str) -> list[str]:
    """The repository paths of the scripts a reproduce command runs (``python -m benchmarks.x``
    gives ``benchmarks/x.py``), in order."""
    paths = [m.replace(".", "/") + ".py" for m in _MODULE.findall(command)]
    return paths + _PATH.findall(command)


def missing_scripts(command: str, root: Path = ROOT) -> list[str]:
    """The scripts `command_scripts` finds in ``command`` that are not files under ``root``
    (a module may also be a package: ``benchmarks/x/__init__.py``)."""
    out = []
    for path in command_scripts(command):
        package = Path(path[: -len(".py")]) / "__init__.py"
        if not (root / path).is_file() and not (root / package).is_file():
            out.append(path)
    return out


def check_reproducible(data: dict, source: str, root: Path = ROOT) -> None:
    """Raise ValueError when a benchmark's command names a script that does not exist, or names
    no script at all (then it must be empty, with a ``history`` that says how the figures were made)."""
    command = data["command"]
    if not command.strip():
        return
    missing = missing_scripts(command, root)
    if missing:
        raise ValueError(
            f"{source}: 'command' runs {', '.join(missing)}, which is not in the repository "
            "(fix the command, or empty it and say in 'history' how the figures were made)"
        )
    if not command_scripts(command):
        raise ValueError(f"{source}: 'command' names no script under benchmarks/ or tools/")


def _validate_history(data: dict, source: str) -> None:
    """An empty command needs a ``history`` (how the figures were made); a history is text."""
    if "history" in data and not (isinstance(data["history"], str) and data["history"]):
        raise ValueError(f"{source}: 'history' must be a non-empty string")
    if not data["command"].strip() and "history" not in data:
        raise ValueError(
            f"{source}: 'command' is empty: name the script that reproduces the figures, or say "
            "in 'history' how they were made"
        )


def _validate_table(table: Any, where: str) -> None:
    for key in ("title", "columns", "rows"):
        if key not in table:
            raise ValueError(f"{where}: missing key '{key}'")
    width = len(table["columns"])
    for j, row in enumerate(table["rows"]):
        if len(row) != width:
            raise ValueError(f"{where}.rows[{j}] has {len(row)} cells, the table {width} columns")


def _cell(value: Any) -> str:
    """A table cell in Markdown: numbers to 4 significant digits, None as a dash, pipes escaped."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_table(columns: list, rows: list) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "|".join(" --- " for _ in columns) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_columns(table: dict) -> tuple[int, list[int]] | None:
    """(x column, y columns) when a table can be drawn as lines: a numeric first column with at
    least 3 distinct values, and the other columns that are numeric in every row; else None."""
    rows = table["rows"]
    if len(rows) < 3 or not all(_is_number(r[0]) for r in rows):
        return None
    if len({r[0] for r in rows}) < 3:
        return None
    ys = [j for j in range(1, len(table["columns"])) if all(_is_number(r[j]) for r in rows)]
    return (0, ys) if ys else None


def plot_table(table: dict, path: Path) -> bool:
    """Draw a table's numeric columns against its first (`plot_columns`) into ``path`` (PNG);
    False when the table has none or matplotlib is not installed."""
    cols = plot_columns(table)
    if cols is None:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x, ys = cols
    rows = sorted(table["rows"], key=lambda r: r[x])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for j in ys:
        ax.plot(
            [r[x] for r in rows], [r[j] for r in rows], marker="o", label=str(table["columns"][j])
        )
    ax.set_xlabel(str(table["columns"][x]))
    ax.set_title(str(table["title"]))
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def render_benchmark(
    data: dict, source: str = "benchmark", plots: dict[int, str] | None = None
) -> str:
    """One benchmark's MyST page: title, command, machine, provenance and every table (with the
    figure ``plots[i]``, a path relative to the page, under table i)."""
    validate_benchmark(data, source)
    m = data["machine"]
    name = Path(source).stem  # one page per data file (a benchmark may write several)
    out = [f"(bench-{name})=", f"# {data['title']}", ""]
    if data["command"].strip():
        out += ["Reproduce with:", "", "```bash", data["command"], "```", ""]
    if data.get("history"):
        out += [f"```{{note}}\n{data['history']}\n```", ""]
    machine = [
        ("CPU", f"{m['cpu']} ({m['cores']} cores)"),
        ("memory", f"{m['memory_gb']} GB"),
        ("GPU", m.get("gpu") or "none"),
        ("torch", m["torch"]),
        ("Python", m["python"]),
        ("commit", f"`{data['commit']}`"),
        ("date", data["date"]),
    ]
    out += _md_table(["machine", ""], machine) + [""]
    for i, table in enumerate(data["tables"]):
        out += [f"## {table['title']}", ""]
        out += _md_table(table["columns"], table["rows"]) + [""]
        if plots and i in plots:
            out += [f"![{table['title']}]({plots[i]})", ""]
        if table.get("note"):
            out += [str(table["note"]), ""]
    return "\n".join(out)


def where_run(machine: dict) -> str:
    """A machine in a few words: its GPU, else its CPU and cores."""
    return machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"


def render_benchmarks_index(entries: list[tuple[str, dict]]) -> str:
    """The benchmarks index: a table of every (page name, data) in name order, with what it
    measures, where and when it ran and how to reproduce it."""
    out = ["# Benchmarks", ""]
    out += [
        "Each page is rendered from one JSON file in `docs/benchmarks/data/`, written by the "
        "benchmark script its page names (with the machine, the commit and the date the "
        "figures come from); a page marked historical was measured once by a script that is "
        "not part of flatcli. Timings depend on the machine and its load: compare rows within "
        "one page, not across pages.",
        "",
    ]
    if not entries:
        out += ["No benchmark data yet.", ""]
        return "\n".join(out)
    out += ["| page | what | where run | date | reproduce |", "| --- | --- | --- | --- | --- |"]
    for page, data in sorted(entries):
        scripts = command_scripts(data["command"])
        how = ", ".join(f"`{s}`" for s in dict.fromkeys(scripts)) if scripts else "historical"
        title = _cell(data["title"])
        out += [
            f"| [{page}]({page}.md) | {title} | {_cell(where_run(data['machine']))} "
            f"| {data['date']} | {how} |"
        ]
    out += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", ""]
    out += [f"{page}" for page, _ in sorted(entries)]
    out += ["```", ""]
    return "\n".join(out)


def write_benchmark_pages(data_dir: Path, out_dir: Path, root: Path = ROOT) -> list[str]:
    """Render every ``data_dir/*.json`` to ``out_dir/<stem>.md`` plus ``out_dir/index.md``; a
    ValueError (the build fails) on a file off the schema or whose command runs a script that is
    not under ``root`` (`check_reproducible`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.md"):
        old.unlink()
    entries = []
    for path in sorted(Path(data_dir).glob("*.json")) if Path(data_dir).is_dir() else []:
        data = json.loads(path.read_text())
        validate_benchmark(data, path.name)
        check_reproducible(data, path.name, root)
        plots = {
            i: f"plots/{path.stem}_{i}.png"
            for i, table in enumerate(data["tables"])
            if plot_table(table, out_dir / "plots" / f"{path.stem}_{i}.png")
        }
        _write(out_dir / f"{path.stem}.md", render_benchmark(data, path.name, plots))
        entries.append((path.stem, data))
    _write(out_dir / "index.md", render_benchmarks_index(entries))
    return [page for page, _ in entries]


# ---------------------------------------------------------------- measures (registry -> reST)


def rst_escape(text: str) -> str:
    """Plain text made literal in reStructuredText (backslash before every markup character)."""
    for ch in "\\`*_|[]":
        text = text.replace(ch, "\\" + ch)
    return text


def strip_options_section(doc: str) -> str:
    """A measure's docstring without its "Parameters (options)" section: the page's options
    table, generated from the options dataclass, says the same."""
    lines = doc.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "Parameters (options)" and set(lines[i + 1].strip()) == {"-"}:
            end = i + 2
            while end < len(lines) and lines[end].strip():
                end += 1
            return "\n".join(lines[:i] + lines[end + 1 :])
    return doc


def _heading(text: str, ch: str) -> list[str]:
    return [text, ch * len(text), ""]


def _defaults(info):
    from flatcli.validation import parse_options

    return parse_options(info.options, {}, info.name)


def _flag(value, info, yes: str, no: str) -> str:
    if callable(value):
        doc = inspect.getdoc(value)
        try:
            verdict = value(_defaults(info))
        except Exception:  # a hook that needs more than the defaults
            verdict = None
        if verdict is True:
            base = f"{yes} with the default options; depends on the options"
        elif verdict is None:
            base = "depends on the options"
        else:
            base = f"{no} with the default options ({verdict})" if isinstance(verdict, str) else no
            base += "; depends on the options"
        return base + (f" ({doc})" if doc and "lambda" not in doc else "")
    return yes if value else no


def _options_section(info) -> list[str]:
    from flatcli.validation import option_fields

    lines = _heading("Options", "-")
    fields = option_fields(info.options)
    if not fields:
        return lines + ["No options of its own.", ""]
    lines += [".. list-table::", "   :header-rows: 1", "   :widths: 18 12 25 45", ""]
    lines += ["   * - option", "     - default", "     - allowed", "     - meaning"]
    for f in fields:
        lines += [f"   * - ``{f.name}``", f"     - ``{f.default!r}``"]
        lines += [f"     - {rst_escape(f.metadata['check'].describe())}"]
        lines += [f"     - {rst_escape(f.metadata.get('help', '')) or '–'}"]
    return lines + [""]


COST_SIZES = (1_000, 100_000, 10_000_000)  # the P of the measure reference's cost table


def _cost_section(info) -> list[str]:
    """The measure's declared cost: its declaration's docstring and, at the default options, the
    products, passes and vectors for a few sizes (`flatcli.engine.linalg.Cost.summary`)."""
    from flatcli.measures import Dims

    lines = _heading("Cost", "-")
    if info.declare_cost is None:
        return lines + ["Not declared.", ""]
    doc = inspect.getdoc(info.declare_cost) or ""
    lines += [
        "Declared by the measure from the declarations of the estimators it runs "
        "(`flatcli.engine.linalg.Cost`): " + doc,
        "",
        "At the default options (n = 10,000 samples, 10 outputs):",
        "",
    ]
    for P in COST_SIZES:
        dims = Dims(P=P, n=10_000, C=10, tensors=(P,), matrices=(P,), matrix_tensors=(0,))
        lines += [f"- P = {P:,}: {info.default_cost(dims).summary()}"]
    return lines + [""]


def measure_page(info) -> str:
    """The reference page (reStructuredText) of one measure, read from its class
    (`flatcli.measures.Measure`, through the registry's view `flatcli.measures.MeasureInfo`)."""
    cls = type(info.measure)
    module = sys.modules.get(cls.__module__)
    lines = [f".. _measure-{info.name}:", ""]
    lines += _heading(info.name, "=")
    lines += [f".. currentmodule:: {cls.__module__}", ""]
    lines += [rst_escape(info.description), ""]
    lines += [f"Configure it as ``- {info.name}: {{option: value}}`` under ``measures:``, or"]
    lines += [
        f"``flatcli measure -m {info.name}``; ``flatcli measures {info.name}`` prints the same"
    ]
    lines += ["options. Larger values mean sharper (a larger predicted generalization gap).", ""]
    lines += _heading("Definition", "-")
    doc = inspect.cleandoc(cls.__doc__) if cls.__doc__ else "(no docstring)"
    lines += [strip_options_section(doc), ""]
    lines += [f"Defined by the class ``{cls.__module__}.{cls.__qualname__}``.", ""]
    lines += _options_section(info)
    lines += [
        "Every measure also takes the common options ``label`` (its column name), ``seed``, "
        "``max_seconds`` and ``max_hvps`` (see :doc:`/guide/budgets`).",
        "",
    ]
    lines += _cost_section(info)
    stops = _flag(info.stops_early, info, "yes", "no")
    lines += [f"Stops early at a cap with its estimate so far: {rst_escape(stops)}.", ""]
    lines += _heading("Applicability", "-")
    app = []
    if info.needs_init:
        app.append("Needs ``init_checkpoint`` (in the config or a manifest column).")
    if info.applicable is not None:
        app.append(
            "Checked before any product: a model, loss or parameter selection it does not fit "
            "gives status ``not_applicable`` with the reason (``--dry-run`` prints it)."
        )
    else:
        app.append("No check before running; the measure itself may end ``not_applicable``.")
    lines += [" ".join(app), ""]
    lines += _heading("Invariance", "-")
    inv = _flag(info.invariant, info, "claims invariance", "claims no invariance")
    lines += [
        f"Function-preserving node-wise rescaling: {rst_escape(inv)}. "
        "``flatcli check-invariance`` tests the claim on your network "
        "(:doc:`/invariance`).",
        "",
    ]
    if info.invariance_options:
        opts = ", ".join(f"``{k}: {v!r}``" for k, v in info.invariance_options.items())
        lines += [f"The check turns on {opts} unless you set them.", ""]
    lines += _heading("Stochastic", "-")
    lines += [
        "Yes: seeded from ``runtime.seed`` or its own ``seed``, with a standard error where the "
        "estimator gives one."
        if info.stochastic
        else "No: deterministic given the checkpoint and the measurement set.",
        "",
    ]
    lines += _heading("References", "-")
    lines += [rst_escape(info.reference or "–"), ""]
    if module is not None and module.__doc__:
        lines += _heading("About its family", "-")
        lines += [f"From ``{module.__name__}``:", "", inspect.cleandoc(module.__doc__), ""]
    return "\n".join(lines)


def measures_index(infos) -> str:
    """The measure reference's index page (reST): a table and a toctree of every measure."""
    lines = [".. _measure-reference:", ""]
    lines += _heading("Measure reference", "=")
    lines += [
        "One page per measure, generated from the measure classes (``flatcli.measures.Measure``): what "
        "``flatcli measures`` lists. Every value is oriented so that larger means sharper.",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 25 75",
        "",
        "   * - measure",
        "     - what it is",
    ]
    for info in infos:
        lines += [f"   * - :ref:`{info.name} <measure-{info.name}>`"]
        lines += [f"     - {rst_escape(info.description)}"]
    lines += ["", ".. toctree::", "   :hidden:", ""]
    lines += [f"   {info.name}" for info in infos]
    return "\n".join(lines) + "\n"


def write_measure_pages(out_dir: Path) -> list[str]:
    """One page per registered measure in ``out_dir`` plus its ``index.rst``; the names."""
    from flatcli.measures import list_measures

    infos = list_measures()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.rst"):
        old.unlink()
    for info in infos:
        _write(out_dir / f"{info.name}.rst", measure_page(info))
    _write(out_dir / "index.rst", measures_index(infos))
    return [info.name for info in infos]


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:  # unchanged pages keep their mtime
        path.write_text(text)


# ---------------------------------------------------------------- CLI (Typer app -> MyST)


def _usage(path: str, cmd) -> str:
    args = []
    for p in cmd.params:
        if p.param_type_name == "argument":
            name = p.name.upper()
            args.append(f"[{name}]..." if p.nargs == -1 else name if p.required else f"[{name}]")
    sub = " COMMAND [ARGS]..." if hasattr(cmd, "commands") else ""
    return " ".join([path, "[OPTIONS]", *args]) + sub


def _default(p) -> str:
    d = p.default
    if d is None or callable(d) or (getattr(p, "is_flag", False) and not d) or d == ():
        return ""
    return f"`{getattr(d, 'value', d)}`"


def cli_reference(cmd, path: str = "flatcli", level: int = 2) -> str:
    """The reference (MyST) of a Typer/click command and its sub-commands, from their parameters:
    usage, help text, and every argument and option with its help and default."""
    out = [f"{'#' * level} `{path}`", ""]
    if cmd.help:
        out += [inspect.cleandoc(cmd.help), ""]
    out += ["```text", _usage(path, cmd), "```", ""]
    rows = []
    for p in cmd.params:
        if getattr(p, "hidden", False) or p.name == "help":
            continue
        if p.param_type_name == "argument":
            name = f"`{p.name.upper()}`"
        else:
            name = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
        helptext = " ".join((getattr(p, "help", None) or "").split())
        rows.append([name, helptext.replace("|", "\\|") or "–", _default(p)])
    if rows:
        out += ["| argument / option | meaning | default |", "| --- | --- | --- |"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        out += [""]
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not getattr(sub, "hidden", False):
            out += [cli_reference(sub, f"{path} {name}", min(level + 1, 4))]
    return "\n".join(out)


def write_cli_reference(out: Path) -> None:
    """The whole command line's reference as one MyST file (included by ``guide/cli.md``)."""
    import typer

    from flatcli.cli import app

    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, cli_reference(typer.main.get_command(app)) + "\n")


# ---------------------------------------------------------------- tables from the code (-> MyST)


def _md_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table of already formatted cells (pipes escaped)."""
    esc = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in esc]


def _config_fields(cls, prefix: str = ""):
    """(dotted key, dataclass field) of every YAML key of the config dataclass ``cls``, nested
    sections expanded (``data.train`` and ``data.test`` as ``data.<split>``)."""
    import dataclasses

    from flatcli.config import DataSource, _dataclass_of, _hints, yaml_key

    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{yaml_key(f)}"
        sub = _dataclass_of(hints[f.name])
        if sub is DataSource:
            yield from _config_fields(sub, f"{prefix}<split>.")
        elif sub is not None:
            yield from _config_fields(sub, f"{key}.")
        else:
            yield key, f, hints[f.name]


def config_keys() -> list[str]:
    """Every key a config may set, dotted (``data.<split>.path`` for the keys of a split)."""
    from flatcli.config import Config

    return list(dict.fromkeys(key for key, _, _ in _config_fields(Config)))


def _in_key(key: str) -> str:
    from flatcli.keys import NOT_IN_KEY

    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in NOT_IN_KEY:
            return "no: " + NOT_IN_KEY[".".join(parts[:i])]
    return "yes"


def _config_type(key: str, f, tp) -> tuple[str, str]:
    """(allowed values, meaning) of one key: its rule's (`flatcli.validation.SETTINGS`), its fixed
    choices (`flatcli.config.CHOICES`), else the type of its annotation."""
    from typing import Any

    from flatcli.config import CHOICES, SOURCES, _members, _type_name
    from flatcli.validation import SETTINGS

    if "setting" in f.metadata:
        rule = SETTINGS[f.metadata["setting"]]
        return rule.check.describe(), rule.help
    if key in CHOICES:
        return "one of " + ", ".join(CHOICES[key]), ""
    if key == "data.<split>.source":
        return "one of " + ", ".join(SOURCES), "the split's loader"
    if tp is Any:
        return "list or mapping", ""
    names = [_type_name(m) for m in _members(tp)]
    return " or ".join("null" if n == "NoneType" else n for n in names), ""


def _config_default(f) -> str:
    import dataclasses

    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:  # pragma: no cover - every config key has a default
        return "–"
    text = json.dumps(value, default=str)
    return f"`{text}`"


def config_reference() -> str:
    """The table of every config key (MyST): allowed values, default, whether it enters the key
    of a result (`flatcli.keys.NOT_IN_KEY`) and its rule's help."""
    from flatcli.config import Config

    rows, seen = [], set()
    for key, f, tp in _config_fields(Config):
        if key in seen:  # data.train and data.test: one row per key of a split
            continue
        seen.add(key)
        allowed, meaning = _config_type(key, f, tp)
        rows.append([f"`{key}`", allowed, _config_default(f), _in_key(key), meaning or "–"])
    header = ["key", "values", "default", "in the result key", "meaning"]
    return "\n".join(_md_rows(header, rows)) + "\n"


def _cli_envvars() -> dict[str, list[str]]:
    """Environment variable -> the command-line options that read it (``envvar=``)."""
    import typer

    from flatcli.cli import app

    found: dict[str, list[str]] = {}

    def walk(cmd):
        for p in cmd.params:
            for var in [p.envvar] if isinstance(p.envvar, str) else (p.envvar or []):
                flag = f"`{p.opts[0]}`"
                if flag not in found.setdefault(var, []):
                    found[var].append(flag)
        for _, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub)

    walk(typer.main.get_command(app))
    return found


def environment_variables() -> dict[str, str]:
    """Every FLATCLI_* environment variable with what it does: the config keys they set
    (`flatcli.config.ENV_VARS`), the options read from the environment, and the others
    (`flatcli.config.OTHER_ENV_VARS`)."""
    from flatcli.config import ENV_VARS, OTHER_ENV_VARS

    out: dict[str, str] = {}
    cli = _cli_envvars()
    for var in sorted({*ENV_VARS, *cli, *OTHER_ENV_VARS}):
        parts = []
        if var in ENV_VARS:
            parts.append(f"sets the config key `{ENV_VARS[var]}`")
        if var in cli:
            parts.append("the default of " + ", ".join(cli[var]))
        if var in OTHER_ENV_VARS:
            parts.append(OTHER_ENV_VARS[var])
        out[var] = "; ".join(parts)
    return out


def environment_reference() -> str:
    """The table of environment variables (MyST)."""
    rows = [[f"`{var}`", what] for var, what in environment_variables().items()]
    return "\n".join(_md_rows(["variable", "what it does"], rows)) + "\n"


def statuses_reference() -> str:
    """The two status tables (MyST): a measure's and a row's (`flatcli.statuses`)."""
    from flatcli.statuses import MEASURE_STATUSES, ROW_STATUSES, VALUE_STATUSES

    out = ["### A measure's status", ""]
    out += [
        "Every measure of every checkpoint has a status (`<label>_status` in results.csv, "
        "`status` in results.json). A status of a value (marked *value*) is not a failure: a "
        "row whose measures all have one is `ok`.",
        "",
    ]
    rows = [
        [f"`{s}`", "value" if s in VALUE_STATUSES else "", m] for s, m in MEASURE_STATUSES.items()
    ]
    out += _md_rows(["status", "", "meaning"], rows) + [""]
    out += ["### A row's status", "", "`status` in results.csv and results.json:", ""]
    out += _md_rows(["status", "meaning"], [[f"`{s}`", m] for s, m in ROW_STATUSES.items()])
    return "\n".join(out) + "\n"


def exit_codes_reference() -> str:
    """The exit-code tables (MyST): what each code means, then per command when it is returned
    (`flatcli.errors.EXIT_MEANINGS`, `flatcli.errors.COMMAND_EXITS`)."""
    from flatcli.errors import ALWAYS, COMMAND_EXITS, EXIT_MEANINGS, ExitCode

    out = _md_rows(["code", "meaning"], [[str(int(c)), m] for c, m in EXIT_MEANINGS.items()])
    always = ", ".join(str(int(c)) for c in ALWAYS)
    out += [
        "",
        "### By command",
        "",
        f"Every command may also exit with {always} (an unexpected error, a usage error such as "
        "an unknown option, Ctrl-C); the table says when each returns each code.",
        "",
    ]
    codes = [c for c in ExitCode if c != ExitCode.INTERRUPTED]
    rows = [
        [f"`flatcli {cmd}`", *(exits.get(c, "") for c in codes)]
        for cmd, exits in COMMAND_EXITS.items()
    ]
    out += _md_rows(["command", *(str(int(c)) for c in codes)], rows)
    return "\n".join(out) + "\n"


def write_reference_tables(out_dir: Path) -> None:
    """The generated tables the guide pages include: config keys, environment variables,
    statuses and exit codes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "config_keys.md", config_reference())
    _write(out_dir / "environment.md", environment_reference())
    _write(out_dir / "statuses.md", statuses_reference())
    _write(out_dir / "exit_codes.md", exit_codes_reference())


# ---------------------------------------------------------------- Sphinx


# ---------------------------------------------------------------- the example results page
REPORT_EXAMPLE = DOCS / "examples" / "demo"  # the demo's results.csv and results.json, committed
REPORT_OPTIONS = {
    "by": "width,weight_decay,label_noise",
    "color_by": "label_noise",
    "bootstrap": 1000,
}


def write_report_example(out: Path, source: Path = REPORT_EXAMPLE) -> Path:
    """``flatcli report`` of the demo's committed results table, written to ``out`` (copied to the
    site's root by ``html_extra_path``). Made in a scratch folder holding a copy of the table, so
    the page's header and its command name ``results.csv`` and ``report.html``, not this machine's
    paths."""
    import os
    import shutil
    import tempfile

    from flatcli.api import report

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="flatcli-docs-report-") as tmp:
        for name in ("results.csv", "results.json"):
            shutil.copy(source / name, Path(tmp) / name)
        os.chdir(tmp)
        try:
            report("results.csv", "report.html", **REPORT_OPTIONS)
        finally:
            os.chdir(cwd)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "report.html", out)
    return out


def _generate(app) -> None:
    write_measure_pages(DOCS / "measures")
    write_cli_reference(DOCS / "_generated" / "cli.md")
    write_reference_tables(DOCS / "_generated")
    write_report_example(DOCS / "_generated" / "extra" / "demo-report.html")
    write_benchmark_pages(DOCS / "benchmarks" / "data", DOCS / "benchmarks" / "generated")


def setup(app):
    """Sphinx hook: generate the pages when the builder starts."""
    app.connect("builder-inited", _generate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
