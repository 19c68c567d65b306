"""The docs site's generated pages: benchmark pages rendered from JSON data, the measure reference
rendered from the registry, the CLI reference rendered from the Typer app (docs/_ext/flatcli_docs.py).
The renderers are plain functions, tested without Sphinx; CI builds the site itself with -W."""

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import tomllib

from tests.oracles import runner

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "bench_fixture.json"


def _ext():
    spec = importlib.util.spec_from_file_location(
        "flatcli_docs", ROOT / "docs" / "_ext" / "flatcli_docs.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


docs = _ext()


def _data():
    return json.loads(FIXTURE.read_text())


def test_benchmark_page_has_provenance_tables_and_notes():
    page = docs.render_benchmark(_data())
    assert page.splitlines()[1] == "# Fixture: trace against a peer"
    assert "python benchmarks/bench_fixture.py --tasks mlp" in page
    for text in (
        "Test CPU 9000 (2 cores)",
        "22.5 GB",
        "2.14.1",
        "3.11.7",
        "`0123abc`",
        "2030-01-02",
    ):
        assert text in page, text
    assert "| GPU | none |" in page  # gpu null
    assert "## Trace to 1% stderr" in page and "## Second table" in page
    assert "| task | flatcli s | peer s | ratio | HVPs |" in page
    # numbers to 4 significant digits, ints with separators, pipes escaped, None and bools
    assert "| MLP \\| digits | 0.6412 | 33.6 | 0.019 | 42 |" in page
    assert "| ResNet-18 | 3.85 | 5.18 | 0.74 | 1,479 |" in page
    assert "| x | – |" in page and "| y | yes |" in page
    assert "Side by side in one process." in page
    # every table row renders with as many cells as its header
    for line in page.splitlines():
        if line.startswith("| ") and "\\|" not in line:
            assert line.count(" | ") + 1 in (2, 5), line


@pytest.mark.parametrize(
    "path",
    [
        ("benchmark",),
        ("title",),
        ("command",),
        ("machine",),
        ("commit",),
        ("date",),
        ("tables",),
        ("machine", "cpu"),
        ("machine", "cores"),
        ("machine", "memory_gb"),
        ("machine", "torch"),
        ("machine", "python"),
        ("tables", 0, "title"),
        ("tables", 0, "columns"),
        ("tables", 1, "rows"),
    ],
)
def test_benchmark_missing_key_is_named(path):
    data = copy.deepcopy(_data())
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(ValueError, match=re.escape(str(path[-1]))) as err:
        docs.render_benchmark(data, source="x.json")
    assert str(err.value).startswith("x.json")


def test_benchmark_optional_gpu_and_row_width():
    data = _data()
    del data["machine"]["gpu"]
    data["tables"][0].pop("note")
    page = docs.render_benchmark(data)
    assert "| GPU | none |" in page and "Side by side" not in page
    data["machine"]["gpu"] = "NVIDIA H100"
    assert "| GPU | NVIDIA H100 |" in docs.render_benchmark(data)
    data["tables"][1]["rows"].append(["only one cell"])
    with pytest.raises(ValueError, match=r"tables\[1\]\.rows\[2\] has 1 cells, the table 2"):
        docs.render_benchmark(data)


def _fixture_root(tmp_path):
    """A repository root holding the fixture's script (its command runs benchmarks/bench_fixture.py)."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "bench_fixture.py").write_text("")
    return root


def test_benchmark_pages_and_index(tmp_path):
    data_dir, out, root = tmp_path / "data", tmp_path / "out", _fixture_root(tmp_path)
    assert docs.write_benchmark_pages(data_dir, out, root) == []  # no data folder yet
    assert "No benchmark data yet." in (out / "index.md").read_text()
    data_dir.mkdir()
    (data_dir / "b_second.json").write_text(FIXTURE.read_text())
    other = _data()
    other["title"] = "Another"
    other["machine"]["gpu"] = "NVIDIA H200"
    other["command"], other["history"] = "", "Measured once by hand."
    (data_dir / "a_first.json").write_text(json.dumps(other))
    assert docs.write_benchmark_pages(data_dir, out, root) == ["a_first", "b_second"]
    index = (out / "index.md").read_text()
    # a table: what, where run, date, how to reproduce; then the (hidden) toctree
    assert "| page | what | where run | date | reproduce |" in index
    assert "| [a_first](a_first.md) | Another | NVIDIA H200 | 2030-01-02 | historical |" in index
    assert (
        "| [b_second](b_second.md) | Fixture: trace against a peer | Test CPU 9000, 2 cores "
        "| 2030-01-02 | `benchmarks/bench_fixture.py` |" in index
    )
    toc = index[index.index("```{toctree}") :]
    assert toc.index("a_first") < toc.index("b_second") and ":hidden:" in toc
    assert "No benchmark data yet." not in index
    assert (out / "b_second.md").read_text() == docs.render_benchmark(_data(), "b_second.json")
    historical = (out / "a_first.md").read_text()
    assert "Reproduce with" not in historical and "Measured once by hand." in historical
    (data_dir / "a_first.json").unlink()  # a removed data file loses its page
    docs.write_benchmark_pages(data_dir, out, root)
    assert not (out / "a_first.md").exists()


@pytest.mark.parametrize(
    "command",
    [
        "python benchmarks/bench_gone.py --n 3",
        "python -m benchmarks.bench_gone --n 3",
        "python -m benchmarks.bench_fixture\npython scripts/old_one.py",
        "OMP_NUM_THREADS=1 python -m tools.gone",
        "bash tools/gone.sh",
    ],
)
def test_a_command_that_runs_a_missing_script_fails_the_pages(tmp_path, command):
    data_dir, root = tmp_path / "data", _fixture_root(tmp_path)
    data_dir.mkdir()
    data = _data()
    data["command"] = command
    (data_dir / "x.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"x\.json: 'command' runs .*(gone|old_one)"):
        docs.write_benchmark_pages(data_dir, tmp_path / "out", root)
    data["command"] = "python -m benchmarks.bench_fixture --n 3"  # the script that is there
    (data_dir / "x.json").write_text(json.dumps(data))
    assert docs.write_benchmark_pages(data_dir, tmp_path / "out", root) == ["x"]


def test_a_command_must_name_a_script_or_be_history(tmp_path):
    data = _data()
    data["command"] = "make it"
    with pytest.raises(ValueError, match="names no script"):
        docs.check_reproducible(data, "x.json", _fixture_root(tmp_path))
    data["command"] = ""
    with pytest.raises(ValueError, match="'command' is empty"):
        docs.render_benchmark(data, "x.json")
    data["history"] = ""
    with pytest.raises(ValueError, match="'history' must be a non-empty string"):
        docs.render_benchmark(data, "x.json")


def test_the_shipped_data_run_scripts_that_exist():
    """Every data file in docs/benchmarks/data names scripts of this repository (or none, with
    its history), so every page's "Reproduce with" runs."""
    files = sorted((ROOT / "docs" / "benchmarks" / "data").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        docs.check_reproducible(data, path.name)
        for script in docs.command_scripts(data["command"]):
            assert (ROOT / script).is_file(), (path.name, script)
        assert bool(data["command"].strip()) != bool(data.get("history")), path.name


def test_measure_reference_covers_the_registry(tmp_path):
    from flatcli.measures import list_measures
    from flatcli.validation import option_fields

    names = docs.write_measure_pages(tmp_path)
    infos = list_measures()
    assert names == [m.name for m in infos]
    assert sorted(p.stem for p in tmp_path.glob("*.rst")) == sorted([*names, "index"])
    index = (tmp_path / "index.rst").read_text()
    for info in infos:
        page = (tmp_path / f"{info.name}.rst").read_text()
        assert f":ref:`{info.name} <measure-{info.name}>`" in index
        assert f"   {info.name}\n" in index  # in the toctree
        for section in (
            "Definition",
            "Options",
            "Cost",
            "Applicability",
            "Invariance",
            "References",
        ):
            assert f"\n{section}\n{'-' * len(section)}\n" in page, (info.name, section)
        for f in option_fields(info.options):
            assert f"``{f.name}``" in page and f"``{f.default!r}``" in page, (info.name, f.name)
        assert docs.rst_escape(info.reference) in page
        assert "Parameters (options)" not in page  # the options table replaces it


def test_every_measure_page_defines_its_measure_with_a_formula():
    """The Definition section (the measure function's docstring) holds at least one formula
    (a ``:math:`` role or a ``.. math::`` block), so a reader sees what is computed up front."""
    from flatcli.measures import list_measures

    for info in list_measures():
        page = docs.measure_page(info)
        definition = page.split("\nDefinition\n----------\n", 1)[1].split("\nOptions\n---", 1)[0]
        assert ":math:`" in definition or ".. math::" in definition, info.name


def test_measure_page_flags():
    from flatcli.measures import get_measure

    trace = docs.measure_page(get_measure("hessian_trace"))
    assert "Stops early at a cap with its estimate so far: yes" in trace
    assert "claims no invariance" in trace and "Yes: seeded" in trace
    dist = docs.measure_page(get_measure("distance_from_init"))
    assert "Needs ``init_checkpoint``" in dist
    assert "No: deterministic" in dist
    ns = docs.measure_page(get_measure("normalized_sharpness"))
    assert "Function-preserving node-wise rescaling: claims invariance" in ns


def test_rst_escape_makes_markup_literal():
    text = "|B|/n, *x*, `y`, a_ b_, [1]_"
    escaped = docs.rst_escape(text)
    assert re.sub(r"\\(.)", r"\1", escaped) == text
    assert all(escaped[i - 1] == "\\" for i, c in enumerate(escaped) if c in "|*`_[]")


def test_cli_reference_lists_every_command(tmp_path):
    import typer

    from flatcli.cli import app

    root = typer.main.get_command(app)
    out = tmp_path / "cli.md"
    docs.write_cli_reference(out)
    text = out.read_text()

    def walk(cmd, path):
        for name, sub in cmd.commands.items() if hasattr(cmd, "commands") else []:
            if not sub.hidden:
                yield f"{path} {name}", sub
                yield from walk(sub, f"{path} {name}")

    commands = list(walk(root, "flatcli"))
    assert {"flatcli measure", "flatcli landscape slice", "flatcli config show"} <= {
        p for p, _ in commands
    }
    for path, cmd in commands:
        assert f"`{path}`" in text, path
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden and p.name != "help":
                assert f"`{p.opts[0]}`" in text, (path, p.opts)
    assert "sweep-worker" not in text  # hidden


def test_benchmark_plots_from_numeric_tables(tmp_path):
    table = {"title": "t", "columns": ["size", "s", "name", "GB"], "rows": []}
    table["rows"] = [[2, 1.0, "a", 0.5], [10, 3.5, "b", 1.5], [30, 9.0, "c", None]]
    assert docs.plot_columns(table) == (0, [1])  # "name" text, "GB" has a None
    assert docs.plot_columns({**table, "rows": table["rows"][:2]}) is None  # too few points
    two = {"title": "u", "columns": ["a", "b"]}
    assert docs.plot_columns({**two, "rows": [["x", 1], ["y", 2], ["z", 3]]}) is None
    assert docs.plot_columns({**two, "rows": [[1, 1.0], [1, 2.0], [2, 3.0]]}) is None
    assert docs.plot_columns({**two, "rows": [[1, True], [2, False], [3, True]]}) is None
    assert docs.plot_columns({**two, "rows": [[1, 1.0], [2, 2.0], [3, float("nan")]]}) is None
    pytest.importorskip("matplotlib")
    data = _data()
    data["tables"].append(table)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "sizes.json").write_text(json.dumps(data))
    docs.write_benchmark_pages(data_dir, tmp_path / "out", _fixture_root(tmp_path))
    page = (tmp_path / "out" / "sizes.md").read_text()
    png = tmp_path / "out" / "plots" / "sizes_2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![t](plots/sizes_2.png)" in page
    assert page.count("![") == 1  # the fixture's tables have no numeric first column


def test_the_changelog_has_a_section_for_the_version():
    """CHANGELOG.md has a section for the version `flatcli --version` prints, dated with the
    release date it prints (raise both at a release), with breaking changes listed first; every
    release section carries an ISO date."""
    import datetime

    from flatcli.cli import app

    out = runner.invoke(app, ["--version"]).output
    match = re.fullmatch(r"flatcli (\S+) \((\d{4}-\d{2}-\d{2})\)", out.strip())
    assert match, out
    version, date = match.groups()
    text = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    section = text.split(f"## [{version}] - {date}\n", 1)
    assert len(section) == 2, f"no '## [{version}] - {date}' section in CHANGELOG.md"
    body = section[1].split("\n## [", 1)[0]
    heads = [ln for ln in body.splitlines() if ln.startswith("### ")]
    assert heads and heads[0] == "### Changed (breaking)" or "breaking" not in body.lower()
    releases = re.findall(r"^## \[(.+?)\](.*)$", text, re.M)
    for name, rest in releases:
        if name != "Unreleased":
            assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), f"## [{name}] has no date"
            datetime.date.fromisoformat(rest[3:])


def test_the_site_pastes_and_renders_offline():
    """docs/conf.py: no typographic replacement (``--dry-run`` stays two hyphens, quotes stay
    straight; neither MyST extension that would replace them is on), and MathJax is served from
    the installed sphinx-mathjax-offline package, not a CDN."""
    conf: dict = {"__file__": str(ROOT / "docs" / "conf.py")}
    path = ROOT / "docs" / "conf.py"
    exec(compile(path.read_text(), str(path), "exec"), conf)  # noqa: S102 (our own conf.py)
    assert conf["smartquotes"] is False
    assert not {"smartquotes", "replacements"} & set(conf["myst_enable_extensions"])
    assert "sphinx-mathjax-offline" in conf["extensions"]
    assert "mathjax_path" not in conf  # the extension sets the packaged copy
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("sphinx-mathjax-offline") for d in extras["docs"])
