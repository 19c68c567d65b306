"""`flatcli report`: the results page of a small real sweep, checked against `correlate`'s numbers,
its statuses, determinism, offline-ness, and what it says about tables it cannot fully draw."""

import itertools
import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

import flatcli
from flatcli import api
from flatcli.cli import app
from tests.helpers import cli_output, write_project

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")

LR, WD = [0.1, 0.01, 0.001], [0, 0.0001]
MEASURES = ["frobenius_norm", "path_norm", "hessian_lambda_max", "hessian_trace"]


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A finished sweep of 6 checkpoints (lr × wd) × 4 measures, λmax capped at 3 products (status
    budget, a lower bound), and one unit file removed (an unfinished unit)."""
    tmp = tmp_path_factory.mktemp("report")
    cfg = write_project(
        tmp / "p",
        n_ckpt=6,
        measures=[
            "frobenius_norm",
            "path_norm",
            {"hessian_lambda_max": {"tol": 1e-6, "max_hvps": 3}},
            {"hessian_trace": {"min_probes": 4, "max_probes": 4}},
        ],
    )
    rows = ["path,lr,wd"] + [
        f"m{i}.pt,{lr},{wd}" for i, (lr, wd) in enumerate(itertools.product(LR, WD))
    ]
    (tmp / "p" / "manifest.csv").write_text("\n".join(rows) + "\n")
    doc = yaml.safe_load(cfg.read_text())
    doc["checkpoints"] = {"manifest": "manifest.csv"}
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp / "sweep"
    api.sweep(cfg, out, log=quiet)
    # one unfinished unit: m5's path_norm
    plan = json.loads((out / "plan.json").read_text())
    unit = next(
        u
        for u in plan["units"]
        if u["label"] == "path_norm"
        and plan["checkpoints"][u["checkpoint_index"]]["checkpoint"].endswith("m5.pt")
    )
    (out / "units" / f"{unit['id']}.json").unlink()
    csv = tmp / "collected" / "results.csv"
    api.collect_report(out, csv)
    return out, csv


class Cells(HTMLParser):
    """The attributes of every element with an ``id`` or a ``data-key``, and the text of ids."""

    def __init__(self):
        super().__init__()
        self.ranking: list[dict[str, str]] = []  # the ranking table's cells
        self.figures: dict[str, dict[str, str]] = {}
        self.matrix: list[dict[str, str]] = []
        self.titles: list[str] = []
        self.text: dict[str, str] = {}
        self._in = []
        self._title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") in ("ranking-table", "status-matrix"):
            self._in.append(a["id"])
        if tag == "td" and self._in and self._in[-1] == "ranking-table":
            self.ranking.append(a)
        if tag == "td" and self._in and self._in[-1] == "status-matrix" and "title" in a:
            self.matrix.append(a)
        if tag == "figure" and a.get("class") == "scatter":
            self.figures[a["data-measure"]] = a
        if tag == "title":
            self._title = True
        if "id" in a and tag in ("pre", "p", "div"):
            self._id = a["id"]
            self.text[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "table" and self._in:
            self._in.pop()
        if tag == "title":
            self._title = False
        if tag in ("pre", "p", "div"):
            self._id = None

    def handle_data(self, data):
        if self._title:
            self.titles.append(data)
        if getattr(self, "_id", None):
            self.text[self._id] += data


def parse(html: str) -> Cells:
    p = Cells()
    p.feed(html)
    return p


def ranking_values(cells: Cells) -> list[dict[str, str]]:
    """One dict per ranking row: column key -> data-value."""
    rows, row = [], {}
    for c in cells.ranking:
        if c["data-key"] == "rank" and row:
            rows.append(row)
            row = {}
        row[c["data-key"]] = c["data-value"]
    return rows + ([row] if row else [])


def same(a: str, b) -> bool:
    if isinstance(b, float) and not math.isfinite(b):
        return a == "nan"
    return a == (repr(b) if isinstance(b, float) else str(b))


# ------------------------------------------------------------------ contents
def test_page_of_a_sweep_shows_every_measure_with_correlates_numbers(sweep, tmp_path):
    out, csv = sweep
    page = api.report(
        out, tmp_path / "r.html", by="lr,wd", bootstrap=100, run=api.RunOptions(seed=3)
    )
    ref = flatcli.correlate(csv, by="lr,wd", bootstrap=100, run=api.RunOptions(seed=3))
    cells = parse(page.html)
    got = ranking_values(cells)
    assert [r["measure"] for r in got] == list(ref["measure"])  # sorted as correlate sorts
    keys = [k for k in got[0] if k not in ("rank", "measure")]
    assert {"kendall_tau_b", "psi", "psi_lr", "psi_wd"} <= set(keys)
    for row, (_, want) in zip(got, ref.iterrows(), strict=True):
        for k in keys:
            assert same(row[k], want[k]), (row["measure"], k, row[k], want[k])
    # the bootstrap intervals are the terminal table's cells
    tau_cells = [c for c in cells.ranking if c["data-key"] == "kendall_tau_b"]
    assert len(tau_cells) == len(MEASURES)
    for m in MEASURES:
        fig = cells.figures[m]
        n = int(ref.set_index("measure").loc[m, "n"])
        assert int(fig["data-drawn"]) == n
        assert sum(f"\n{m} = " in t for t in cells.titles) == n  # one hover text per point
    assert page.path == tmp_path / "r.html" and page.path.read_text() == page.html


def test_page_names_the_unfinished_unit_and_marks_capped_values(sweep, tmp_path):
    out, _ = sweep
    page = api.report(out, tmp_path / "r.html")
    cells = parse(page.html)
    assert "m5.pt × path_norm" in cells.text["incomplete"]
    assert "23 of 24 finished" in page.html
    # λmax stopped at its product cap: status budget, its value a lower bound (hollow marker)
    lam = [t for t in cells.titles if "\nhessian_lambda_max = " in t]
    assert len(lam) == 6 and all(t.endswith("status: budget, lower bound") for t in lam)
    classes = [c["class"] for c in cells.matrix]
    assert classes.count("st-budget st-bound") == 6
    assert classes.count("st-not-run") == 1
    # the hover text names the checkpoint and its hyperparameters
    assert any(t.startswith(str(Path("m0.pt"))) or "m0.pt" in t.splitlines()[0] for t in lam)
    assert all(re.search(r"\nlr=[0-9.]+, wd=[0-9.e-]+\n", t) for t in lam)


def test_every_status_is_marked_and_unplottable_rows_are_named(sweep, tmp_path):
    _, csv = sweep
    df = pd.read_csv(csv)
    kinds = ["ok", "not_converged", "near_zero", "budget", "saturated", "error"]
    df["frobenius_norm_status"] = kinds
    df.loc[5, "frobenius_norm"] = float("nan")  # an error has no value
    df["frobenius_norm_bound"] = ["", "", "", "upper bound", "", ""]
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    page = api.report(path, tmp_path / "r.html", by="lr,wd")
    cells = parse(page.html)
    fro = [t.rsplit("status: ", 1)[1] for t in cells.titles if "\nfrobenius_norm = " in t]
    assert fro == ["ok", "budget, upper bound", "near_zero", "not_converged", "saturated"]
    svg = page.html.split('id="scatter-frobenius_norm"')[1].split("</figure>")[0]
    for label in ("budget, upper bound", "near_zero", "not_converged", "saturated"):
        assert f">{label}</text>" in svg  # in the legend, with its marker
    assert "not drawn: error: m5.pt" in svg
    matrix = {c["title"] for c in cells.matrix}
    assert {"not_converged", "near_zero", "budget, upper bound", "error", "saturated"} <= matrix


def test_compare_verdicts_are_correlates(sweep, tmp_path):
    _, csv = sweep
    page = api.report(
        csv, tmp_path / "r.html", compare="frobenius_norm,hessian_trace", bootstrap=200
    )
    ref = flatcli.compare(csv, "frobenius_norm", "hessian_trace", bootstrap=200)
    from flatcli.analysis.compare import describe

    for verdict, line in zip(ref["verdict"], describe(ref), strict=True):
        assert f'<span class="verdict">{verdict}</span> — {line}' in page.html.replace("&#39;", "'")


# ------------------------------------------------------------------ offline, deterministic
def test_the_page_loads_nothing(sweep, tmp_path):
    out, _ = sweep
    html = api.report(out, tmp_path / "r.html", bootstrap=100).html
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert not re.search(r'\b(src|href)="(?!#|data:)', html)  # only in-page ids and data: URIs


def test_same_inputs_give_the_same_bytes_apart_from_the_date(sweep, tmp_path):
    out, _ = sweep
    a = api.report(out, tmp_path / "r.html", by="lr,wd", bootstrap=100, date="day one").html
    b = api.report(out, tmp_path / "r.html", by="lr,wd", bootstrap=100, date="day two").html
    assert a != b
    strip = lambda h: re.sub(r'<p class="date">[^<]*</p>', "", h)  # noqa: E731
    assert strip(a) == strip(b)
    assert a.count('<p class="date">') == 1


def test_the_command_on_the_page_makes_the_page_again(sweep, tmp_path):
    out, _ = sweep
    runner = CliRunner()
    first = tmp_path / "first.html"
    res = runner.invoke(
        app,
        [
            "report",
            str(out),
            "-o",
            str(first),
            "--by",
            "lr,wd",
            "--bootstrap",
            "100",
            "--seed",
            "2",
        ],
    )
    assert res.exit_code == 0, cli_output(res)
    html = first.read_text()
    command = parse(html).text["command"]
    args = __import__("shlex").split(command)
    assert args[:2] == ["flatcli", "report"]
    again = runner.invoke(app, args[1:])
    assert again.exit_code == 0, cli_output(again)
    strip = lambda h: re.sub(r'<p class="date">[^<]*</p>', "", h)  # noqa: E731
    assert strip(first.read_text()) == strip(html)
    assert "--seed 2" in command and "--bootstrap 100" in command


# ------------------------------------------------------------------ tables it cannot fully draw
def _table(csv: Path, tmp: Path, change) -> Path:
    df = pd.read_csv(csv)
    df = change(df)
    path = tmp / "t.csv"
    df.to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    "change, said",
    [
        (
            lambda d: d.iloc[:1],
            "only 1 checkpoint(s) with a finite gen_gap: no correlation is defined",
        ),
        (
            lambda d: d.assign(path_norm=float("nan")),
            "path_norm: no checkpoint with a finite value",
        ),
        (
            lambda d: d.assign(gen_gap=[float("nan")] * 5 + [0.1]),
            "only 1 checkpoint(s) with a finite gen_gap",
        ),
    ],
    ids=["one checkpoint", "a measure of NaNs", "target NaN on all but one"],
)
def test_a_page_says_what_it_could_not_draw(sweep, tmp_path, change, said):
    _, csv = sweep
    path = _table(csv, tmp_path, change)
    res = CliRunner().invoke(app, ["report", str(path), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, cli_output(res)
    html = (tmp_path / "r.html").read_text()
    assert said in parse(html).text["problems"]
    assert "Traceback" not in cli_output(res)


@pytest.mark.parametrize(
    "change, said",
    [
        (
            lambda d: d.drop(
                columns=["gen_gap", "train_acc", "test_acc", "train_loss", "test_loss", "loss_gap"],
                errors="ignore",
            ),
            "--target 'gen_gap' is not a column",
        ),
        (lambda d: d[["checkpoint", "gen_gap"]], "holds no measure columns"),
    ],
    ids=["no target columns", "no measure columns"],
)
def test_a_table_it_cannot_use_is_one_line_exit_2(sweep, tmp_path, change, said):
    _, csv = sweep
    path = _table(csv, tmp_path, change)
    res = CliRunner().invoke(app, ["report", str(path), "-o", str(tmp_path / "r.html")])
    out = res.output  # stdout and stderr
    assert res.exit_code == 2, out
    assert said in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_a_folder_that_is_no_sweep_and_a_missing_file_are_one_line_errors(tmp_path):
    for arg in (tmp_path, tmp_path / "nope.csv"):
        res = CliRunner().invoke(app, ["report", str(arg)])
        out = res.output  # stdout and stderr
        assert res.exit_code == 2 and len(out.strip().splitlines()) == 1, out


# ------------------------------------------------------------------ found beside the results
def test_landscapes_and_invariance_verdicts_in_the_folder_are_shown(sweep, tmp_path):
    import shutil

    from flatcli.analysis.html_figures import _figure
    from flatcli.invariance import InvarianceReport, InvarianceResult

    out, _ = sweep
    folder = tmp_path / "sweep"
    shutil.copytree(out, folder)
    land = folder / "landscape" / "slice"
    land.mkdir(parents=True)
    (land / "landscape.json").write_text(
        json.dumps({"kind": "slice", "summary": {"sharpness": 0.25}})
    )
    fig = _figure(figsize=(1, 1))
    fig.savefig(land / "landscape_1d.png", format="png")
    rep = InvarianceReport("m0.pt", "node", 10.0, 0, 1e-6, [], 1e-15)
    rep.results = [
        InvarianceResult(
            "relative_flatness", "relative_flatness", True, 1.0, 1.0 + 1e-9, 1e-9, True
        ),
        InvarianceResult("hessian_trace", "hessian_trace", False, 2.0, 8.0, 3.0, None),
    ]
    rep.write_json(folder / "invariance.json")
    html = api.report(folder, tmp_path / "r.html").html
    assert 'alt="landscape_1d.png" src="data:image/png;base64,' in html
    assert "sharpness: 0.25" in html
    assert (
        "every claimed invariance held" in html
        and "relative_flatness" in html.split('id="invariance"')[1]
    )


def test_import_flatcli_loads_neither_jinja2_nor_matplotlib():
    code = "import sys, flatcli, flatcli.api, flatcli.cli; print(sorted(m for m in ('jinja2', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ in a browser
CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]


def _browse(page: Path, shot: Path) -> tuple[int, dict]:
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_report_browser.py"), str(page)]
        + ["--screenshot", str(shot), "--wait", "0", "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.returncode, json.loads(r.stdout)


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium")
def test_the_page_opens_offline_in_chromium_without_a_console_message(sweep, tmp_path):
    page = api.report(sweep[0], tmp_path / "r.html", by="lr,wd")
    rc, summary = _browse(page.path, tmp_path / "shot.png")
    assert rc == 0, summary
    assert summary["scatters_in_dom"] == len(MEASURES) and summary["ranking_table"]
    assert (tmp_path / "shot.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium")
def test_the_browser_check_catches_a_console_error_and_a_request(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<html><body><figure class="scatter"></figure><table id="ranking-table"></table>'
        '<img src="https://example.com/x.png"><script>console.error("boom")</script></body></html>'
    )
    rc, summary = _browse(bad, tmp_path / "shot.png")
    assert rc == 1
    assert any('"boom"' in m for m in summary["console_messages"])
    assert summary["page_requests"] == ["https://example.com/x.png"]


def test_check_invariance_output_is_shown_on_the_page(sweep, tmp_path):
    import shutil

    out, _ = sweep
    project = out.parent / "p"
    folder = tmp_path / "sweep"
    shutil.copytree(out, folder)
    res = CliRunner().invoke(
        app,
        ["check-invariance", "-c", str(project / "config.yaml"), str(project / "m0.pt")]
        + ["-m", "frobenius_norm", "-o", str(folder / "checks" / "invariance.json")],
    )
    assert res.exit_code == 0, cli_output(res)
    doc = json.loads((folder / "checks" / "invariance.json").read_text())
    assert doc["checkpoint"].endswith("m0.pt") and doc["passed"] is True
    assert [r["label"] for r in doc["results"]][0] == "frobenius_norm"
    html = api.report(folder, tmp_path / "r.html").html
    section = html.split('id="invariance"')[1]
    assert "checks/invariance.json" in section and "frobenius_norm" in section
