"""The reference tables of the docs site are generated from the code (docs/_ext/flatcli_docs.py)
and checked against it: exit codes (`flatcli.errors.ExitCode`, `COMMAND_EXITS`), statuses
(`flatcli.statuses`), config keys (`flatcli.config`), environment variables; and what the
hand-written pages name (a flag, a config key, an environment variable) exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer

from flatcli.cli import app
from flatcli.errors import ALWAYS, COMMAND_EXITS, EXIT_MEANINGS, ExitCode
from flatcli.statuses import MEASURE_STATUSES, ROW_STATUSES, VALUE_STATUSES
from tests.oracles import runner
from tests.project.test_docs import docs

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "flatcli"
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
PAGES = [p for p in PAGES if "_generated" not in p.parts and "generated" not in p.parts]


def _name(page: Path) -> str:
    """A page's path relative to the repository (its file name when it is elsewhere)."""
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def _commands() -> dict[str, object]:
    """Every visible leaf command of the CLI, by its path without ``flatcli``."""
    out = {}

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            if sub.hidden:
                continue
            if hasattr(sub, "commands"):
                walk(sub, f"{path} {name}".strip())
            else:
                out[f"{path} {name}".strip()] = sub

    walk(typer.main.get_command(app), "")
    return out


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("-")}


# ---------------------------------------------------------------- exit codes


def test_every_command_declares_its_exit_codes():
    """`COMMAND_EXITS` has an entry for every command (and for a flag that changes the codes, a
    flag the command has), each with code 0 and only codes of `ExitCode`."""
    commands = _commands()
    declared = {}
    for entry, exits in COMMAND_EXITS.items():
        cmd, *flags = entry.split(" --")
        assert cmd in commands, f"COMMAND_EXITS names '{cmd}', which is no command"
        assert {f"--{f}" for f in flags} <= _options(commands[cmd]), entry
        assert ExitCode.OK in exits and set(exits) <= set(ExitCode), entry
        declared.setdefault(cmd, entry)
    assert set(commands) == set(declared), set(commands) ^ set(declared)
    assert set(EXIT_MEANINGS) == set(ExitCode) and set(ALWAYS) <= set(ExitCode)


def _exit_calls(tree: ast.AST):
    """The first argument of every ``sys.exit``, ``os._exit``, ``typer.Exit``, ``SystemExit`` and
    ``_fail(e, code, ...)`` call, and every value returned by an ``exit_code`` function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("sys.exit", "os._exit", "typer.Exit", "SystemExit", "Exit") and node.args:
                yield name, node.args[0]
            elif name == "_fail" and len(node.args) > 1:
                yield name, node.args[1]
        elif isinstance(node, ast.FunctionDef) and node.name == "exit_code":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    yield "return of exit_code", ret.value


def _int_literals(tree: ast.AST) -> list[int]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is int]


def literal_exit_codes(root: Path) -> dict[str, list[str]]:
    """Exit codes written as numbers under ``root`` (module -> the calls), not as `ExitCode`."""
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for name, arg in _exit_calls(ast.parse(path.read_text())):
            if _int_literals(arg):
                out.setdefault(path.relative_to(root.parent).as_posix(), []).append(
                    f"{name}({ast.unparse(arg)})"
                )
    return out


def test_the_code_exits_only_with_declared_codes():
    """No exit code is written as a number: every command exits with a member of `ExitCode`
    (directly or through a report's ``exit_code``), the one declaration the docs are made from."""
    assert literal_exit_codes(PKG) == {}


def test_the_scan_finds_a_numeric_exit_code(tmp_path):
    pkg = tmp_path / "flatcli"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import sys, typer\n"
        "def f(x):\n    sys.exit(2)\n"
        "def g(x):\n    raise typer.Exit(ExitCode.USAGE if x else 1)\n"
        "def h(x):\n    raise typer.Exit(x.exit_code)\n"
        "class R:\n    def exit_code(self):\n        return 0 if self.ok else ExitCode.FAILED\n"
    )
    found = literal_exit_codes(pkg)
    assert sorted(found["flatcli/a.py"]) == [
        "return of exit_code(0 if self.ok else ExitCode.FAILED)",
        "sys.exit(2)",
        "typer.Exit(ExitCode.USAGE if x else 1)",
    ]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--version"], ExitCode.OK),
        (["measures", "hessian_trace"], ExitCode.OK),
        (["measures", "no_such_measure"], ExitCode.USAGE),
        (["measure", "--no-such-option"], ExitCode.USAGE),
        (["correlate", "/nonexistent/results.csv"], ExitCode.USAGE),
        (["config", "show", "-c", "/nonexistent.yaml"], ExitCode.USAGE),
    ],
)
def test_commands_exit_with_the_declared_codes(args, code):
    """A few cheap cases of `COMMAND_EXITS`, run through the CLI."""
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output


def test_the_exit_code_page_is_the_declaration():
    page = docs.exit_codes_reference()
    for code, meaning in EXIT_MEANINGS.items():
        assert f"| {int(code)} | {meaning} |" in page
    for entry, exits in COMMAND_EXITS.items():
        row = next(ln for ln in page.splitlines() if ln.startswith(f"| `flatcli {entry}` |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        codes = [c for c in ExitCode if c != ExitCode.INTERRUPTED]  # 130: every command (ALWAYS)
        assert len(cells) == 1 + len(codes), row  # command, then 0, 1, 2, 3, 4
        for i, code in enumerate(codes):
            assert cells[1 + i] == exits.get(code, ""), (entry, code)


# ---------------------------------------------------------------- statuses


def _values(node) -> set[str]:
    """The status words an expression can take: a string literal, either branch of ``a if c
    else b``, the operands of ``or``/``and``, the items of a literal tuple, list or set."""
    if isinstance(node, ast.Constant) and type(node.value) is str:
        return {node.value} if re.fullmatch(r"[a-z][a-z_]*", node.value) else set()
    if isinstance(node, ast.IfExp):
        return _values(node.body) | _values(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_values(v) for v in node.values))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *(_values(v) for v in node.elts))
    return set()


def _is_status(node) -> bool:
    """A name, attribute or key named ``status`` (``r.status``, ``rec["status"]``)."""
    text = ast.unparse(node)
    return bool(re.fullmatch(r"(\w+\.)*status|\w+\[['\"]status['\"]\]", text))


def _status_words(tree: ast.AST) -> set[str]:
    """String literals the code writes or compares as a status: ``status=...`` arguments,
    assignments to and comparisons with a name, attribute or key named ``status``, and what a
    function named ``*status*`` returns."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "status":
            found |= _values(node.value)
        elif isinstance(node, ast.Assign) and any(_is_status(t) for t in node.targets):
            found |= _values(node.value)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_status(s) for s in sides):
                found |= set().union(*(_values(s) for s in sides if not _is_status(s)))
        elif isinstance(node, ast.FunctionDef) and "status" in node.name:
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    found |= _values(ret.value)
    return found


def written_statuses(root: Path) -> dict[str, set[str]]:
    """Status word -> the modules under ``root`` that write or test it."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "statuses.py":
            continue
        for word in _status_words(ast.parse(path.read_text())):
            out.setdefault(word, set()).add(path.relative_to(root.parent).as_posix())
    return out


def test_every_status_the_code_writes_is_declared_and_every_declared_one_is_written():
    written = written_statuses(PKG)
    declared = set(MEASURE_STATUSES) | set(ROW_STATUSES)
    undeclared = {w: sorted(m) for w, m in written.items() if w not in declared}
    assert not undeclared, f"statuses missing from flatcli/statuses.py: {undeclared}"
    assert declared - set(written) == set(), "declared statuses the code never writes"
    assert VALUE_STATUSES <= set(MEASURE_STATUSES)


def test_the_status_scan_finds_status_words(tmp_path):
    pkg = tmp_path / "flatcli"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f(r, rec):\n"
        "    r.status = 'a' if r.x else 'b'\n"
        "    if rec['status'] == 'c': pass\n"
        "    return R(value=1, status='d' if rec['bound'] else f'{x}_status')\n"
        "def _status(x):\n    return 'e' if x else 'f'\n"
        "def other(x):\n    label = 'not_a_status'\n"
    )
    assert set(written_statuses(pkg)) == {"a", "b", "c", "d", "e", "f"}


def test_the_status_page_is_the_declaration():
    page = docs.statuses_reference()
    for status, meaning in MEASURE_STATUSES.items():
        value = "value" if status in VALUE_STATUSES else ""
        assert f"| `{status}` | {value} | {meaning} |" in page
    for status, meaning in ROW_STATUSES.items():
        assert f"| `{status}` | {meaning} |" in page


# ---------------------------------------------------------------- config keys


def _flat_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in ("kwargs", "normalize"):
            out |= _flat_keys(v, f"{key}.")
        else:
            out.add(key)
    return out


def test_the_config_reference_lists_every_key_config_show_prints():
    """The documented keys are the keys of ``config show`` (`Config.to_dict` with defaults), a
    split's keys once as ``data.<split>.KEY``."""
    from flatcli.config import from_dict

    cfg = from_dict({"data": {"train": {"source": "digits"}, "test": {"source": "digits"}}})
    shown = _flat_keys(cfg.to_dict(defaults=True))
    shown = {re.sub(r"^data\.(train|test)\.", "data.<split>.", k) for k in shown}
    page = set(re.findall(r"^\| `([^`]+)` \|", docs.config_reference(), re.M))
    assert page == shown, page ^ shown
    assert "runtime.cache_graphs" in page


def _nested(key: str, value) -> dict:
    out: dict = value
    for part in reversed(key.replace("<split>", "train").split(".")):
        out = {part: out}
    return out


def _loaded(cfg, key: str):
    """The value of dotted ``key`` in a loaded config (``data.<split>`` read as ``data.train``)."""
    value = cfg
    for part in key.replace("<split>", "train").split("."):
        value = getattr(value, "class_" if part == "class" else part)
    return value


def test_every_documented_key_exists_with_its_documented_default():
    """Each key of the reference is one the loader accepts (set to the page's default, it is no
    unknown key), and the page's default is what a config that leaves the key out loads."""
    import json

    from flatcli.config import ConfigError, from_dict

    page = docs.config_reference()
    base = {"data": {"train": {"source": "digits"}}}
    plain = from_dict(base)
    for key in docs.config_keys():
        row = next(ln for ln in page.splitlines() if ln.startswith(f"| `{key}` |"))
        default = json.loads(row.split(" | ")[2].strip("`"))
        raw = _nested(key, default)
        raw.setdefault("data", {}).setdefault("train", {}).setdefault("source", "digits")
        if key == "data.<split>.source":
            raw["data"]["train"]["source"] = "digits"
        else:
            loaded = json.loads(json.dumps(_loaded(plain, key), default=str))
            assert loaded == default, (key, loaded, default)
        try:
            from_dict(raw)
        except ConfigError as e:  # a default valid only beside other keys (the text source's)
            assert "Unknown config key" not in str(e), (key, str(e))


def test_a_key_that_does_not_enter_the_result_key_says_why():
    from flatcli.keys import NOT_IN_KEY

    page = docs.config_reference()
    for key, why in NOT_IN_KEY.items():
        row = next(ln for ln in page.splitlines() if ln.startswith(f"| `{key}` |"))
        assert f"| no: {why} |" in row, key
    assert "| `runtime.precision` |" in page and "| yes |" in page


# ---------------------------------------------------------------- environment variables


def _string_constants(root: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and type(n.value) is str:
                out.setdefault(n.value, set()).add(path.name)
    return out


def test_every_environment_variable_is_documented_and_read():
    documented = docs.environment_variables()
    constants = _string_constants(PKG)
    in_code = {s for s in constants if re.fullmatch(r"FLATCLI_[A-Z0-9_]+", s)}
    assert in_code == set(documented), in_code ^ set(documented)
    from flatcli.config import OTHER_ENV_VARS

    for var in OTHER_ENV_VARS:  # read somewhere besides its declaration
        assert constants[var] - {"config.py"}, var


# ---------------------------------------------------------------- what hand-written pages name


FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1\s*$", re.M | re.S)


def _inline_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown page (a span may run over a line break), fenced
    blocks left out."""
    prose = FENCE.sub("", text)
    return [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]


def _spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks of a Markdown page."""
    blocks = [ln.strip() for m in FENCE.finditer(text) for ln in m.group(0).splitlines()[1:-1]]
    return _inline_spans(text) + blocks


# flags of other programs the pages show (pip, pytest, sphinx-build, torchrun, sbatch, ruff, git)
OTHER_FLAGS = {
    "--pdb",
    "--flag",  # "a `--flag`": the architecture page's word for any flag
    "--index-url",
    "--extra-index-url",
    "--no-deps",
    "--upgrade",
    "--random-order-bucket",
    "--random-order-seed",
    "--doctest-modules",
    "--keep-going",
    "--nproc-per-node",
    "--nproc_per_node",
    "--nnodes",
    "--array",
    "--gres",
    "--cpus-per-task",
    "--gpus-per-node",  # sbatch
    "--time",
    "--check",
    "--fix",
    "--mem",
    "--partition",
    "--job-name",
    "--ntasks",
    "--output",
    "--version",
    "--help",
    "--quiet",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--standalone",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
    "--no-sandbox",
    "--durations",
}


def _script_flags() -> set[str]:
    flags = set()
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py")]:
        flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", path.read_text()))
    return flags


def unknown_flags(pages: list[Path]) -> dict[str, set[str]]:
    """Flags (``--name``) the pages show in code that no flatcli command, benchmark or tool
    script has (nor the other programs of `OTHER_FLAGS`)."""
    known = set().union(*(_options(c) for c in _commands().values()))
    known |= _options(typer.main.get_command(app)) | _script_flags() | OTHER_FLAGS
    out: dict[str, set[str]] = {}
    for page in pages:
        for span in _spans(page.read_text()):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", span):
                if flag not in known:
                    out.setdefault(_name(page), set()).add(flag)
    return out


def test_every_flag_the_pages_show_exists():
    assert unknown_flags(PAGES) == {}


def test_the_flag_check_finds_a_flag_that_does_not_exist(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `flatcli measure --dry-runn` or\n```bash\nflatcli sweep --wokers 2\n```\n")
    assert unknown_flags([page]) == {"p.md": {"--dry-runn", "--wokers"}}


# dotted names in the pages that look like config keys and are not: files and results.json fields
NOT_KEYS = {"model.safetensors", "model.tied"}
SECTIONS = ("model", "data", "measure_data", "runtime", "output", "params", "hparams")


def unknown_keys(pages: list[Path]) -> dict[str, set[str]]:
    """Config keys (``runtime.x``, ``data.train.y``, ...) the pages name that the config has not."""
    keys = set(docs.config_keys())
    prefixes = {k.rsplit(".", i)[0] for k in keys for i in range(k.count(".") + 1)}
    out: dict[str, set[str]] = {}
    pattern = re.compile(rf"^(?:{'|'.join(SECTIONS)})\.[a-z_.<>]*[a-z_>]$")
    for page in pages:
        for span in _inline_spans(page.read_text()):
            if not pattern.match(span) or span in NOT_KEYS:
                continue
            key = re.sub(r"^data\.(train|test)(?=\.|$)", "data.<split>", span)
            if key not in prefixes and key != "data.<split>":
                out.setdefault(_name(page), set()).add(span)
    return out


def test_every_config_key_the_pages_name_exists():
    assert unknown_keys(PAGES) == {}


def test_the_key_check_finds_a_key_that_does_not_exist(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("`runtime.cache_graph`, `runtime.cache_graphs`, `data.train.path`, `data.x`")
    assert unknown_keys([page]) == {"p.md": {"runtime.cache_graph", "data.x"}}


def test_every_environment_variable_the_pages_name_exists():
    documented = set(docs.environment_variables())
    ci = set(re.findall(r"FLATCLI_[A-Z0-9_]+", (ROOT / ".ci" / "run").read_text()))
    named = {
        (page.relative_to(ROOT).as_posix(), var)
        for page in PAGES
        for var in re.findall(r"FLATCLI_[A-Z0-9_]*[A-Z0-9]", page.read_text())
    }
    assert {(p, v) for p, v in named if v not in documented | ci} == set()
