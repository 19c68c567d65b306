"""Experiment 4: reparameterization (Dinh, Pascanu, Bengio & Bengio, ICML 2017).

Trained ReLU networks are rescaled without changing their function (`flatcli.invariance`):
layer-wise (one α or 1/α per pair of consecutive layers) and node-wise (each hidden node's
incoming weights and bias × α_i, outgoing × 1/α_i, α_i log-uniform in [1/α, α]) for α over
several orders of magnitude. Every rescaled copy is saved as a checkpoint beside its original
(manifest columns ``transform`` ∈ {none, layer, node} and ``scale``) and the whole set is
measured by one ``flatcli sweep``. ``results/relative_change.csv`` then holds, per measure,
transform and α, the median and maximum over the trained networks of the relative change
``|μ(rescaled) − μ(original)| / |μ(original)|``; ``results/plots/reparameterization.png`` draws it.

The rescaled weights are stored in float32 like the originals, so a measure that is exactly
invariant still moves by float32 rounding (≈ 1e-7 relative); measurement runs in float64.
The gap is the same for every copy, so no correlation is computed here.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from .. import api
from ..analysis.table import load_results
from ..config import load_config
from ..errors import MeasurementError
from ..invariance import claims_invariance, find_rescalable_pairs, rescale
from ..loading.factory import build_model
from ..run.results import read_table, write_table
from ..training import TrainRecord
from .base import Experiment, absolute_paths, pyplot, save_figure
from .report import StudyOutcome
from .spec import Study

OUTPUT_TOL = 1e-9  # relative change of the float64 output a rescaling may cause


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "–"
    return "0" if v == 0 else f"{v:.1e}"


class Reparameterization(Experiment):
    """Experiment 4: rescaled copies of every trained network, measured beside the originals."""

    def prepare_checkpoints(self, study: Study, sd: Path, records: list[TrainRecord]) -> None:
        """Add the rescaled copies of every trained network to the checkpoints and the manifest."""
        rs = self.spec.rescale or {
            "transforms": ["layer", "node"],
            "scales": [10.0, 100.0, 1000.0],
            "seed": 0,
        }
        flat = absolute_paths(study.flatcli, self.spec.path.parent)
        cfg = api.load({**flat, "checkpoints": []})
        x = api.DataCache(cfg).get("train")["x"]
        x64 = x[:256].double()
        keys = list(study.grid)
        rows = []
        for b, rec in enumerate(records):
            hp = {k: rec.hparams[k] for k in keys}
            rows.append(
                {
                    "path": rec.path,
                    "init_checkpoint": rec.init_checkpoint,
                    **hp,
                    "base": b,
                    "transform": "none",
                    "scale": 1.0,
                }
            )
            obj = torch.load(sd / rec.path, map_location="cpu", weights_only=True)
            model = build_model(flat["model"]["target"], obj["model_kwargs"], self.spec.path.parent)
            model.load_state_dict(obj["state_dict"])
            m64 = model.double().eval()
            pairs = find_rescalable_pairs(m64, x64, seed=rs["seed"])
            if not pairs:
                raise MeasurementError(f"{rec.path}: no function-preserving rescaling found")
            with torch.no_grad():
                base_out = m64(x64)
            for t in rs["transforms"]:
                for a in rs["scales"]:
                    r = rescale(m64, pairs, t, a, seed=rs["seed"] + b).eval()
                    with torch.no_grad():
                        change = float((r(x64) - base_out).abs().max() / base_out.abs().max())
                    if change > OUTPUT_TOL:
                        raise MeasurementError(
                            f"rescaling {t} ×{a:g} changed the output by {change:.2g}: not function-preserving"
                        )
                    name = Path(rec.path).stem + f"_{t}{a:g}"
                    path = f"checkpoints/{name}.pt"
                    sd32 = {k: v.float() for k, v in r.state_dict().items()}
                    if not (sd / path).is_file() or not _same(sd / path, sd32):
                        torch.save({"state_dict": sd32, "model_kwargs": obj["model_kwargs"],
                                    "hparams": {**hp, "transform": t, "scale": a}}, sd / path)  # fmt: skip
                    rows.append(
                        {
                            "path": path,
                            "init_checkpoint": "",
                            **hp,
                            "base": b,
                            "transform": t,
                            "scale": a,
                        }
                    )
        write_table(
            sd / "manifest.csv",
            rows,
            ["path", "init_checkpoint", *keys, "base", "transform", "scale"],
        )
        (sd / "rescale.json").write_text(
            json.dumps({**rs, "pairs": [p.producer + "->" + p.consumer for p in pairs]})
        )

    def analyze(
        self, study: Study, sd: Path, results: Path, records: list[TrainRecord]
    ) -> StudyOutcome:
        """The table of relative changes (no correlation: every copy has its original's gap)."""
        _, unconv, _ = self.keep_converged(results)
        # the criterion is about the trained networks: a rescaled copy computes its original's function
        # (same loss), so the counts are over the originals, not over originals + copies
        _, rows = read_table(results)
        originals = [r for r in rows if str(r.get("hp_transform", "none")) == "none"]
        kept = sum(1 for r in originals if self.is_converged(r))
        outcome = StudyOutcome(
            study.name, sd, models=len(originals), converged=kept, unconverged=unconv
        )
        outcome.extra["checkpoints"] = len(rows)
        table = relative_changes(results)
        outcome.files["relative_change"] = write_table(
            sd / "results" / "relative_change.csv", table
        )
        outcome.extra["table"] = table
        if self.plots and table:
            fig = change_figure(
                table, sd / "results" / "plots" / "reparameterization.png", study.title
            )
            outcome.extra["figures"] = [fig]
            outcome.files["figure"] = fig
        return outcome

    def summary_sections(self, study: Study, o: StudyOutcome) -> list[str]:
        """Median relative change per measure, transform and α."""
        table = o.extra.get("table") or []
        if not table:
            return ["No measurements.", ""]
        cols = sorted({(r["transform"], r["scale"]) for r in table}, key=lambda c: (c[0], c[1]))
        head = ["measure", "claims invariance"] + [f"{t} ×{a:g}" for t, a in cols]
        lines = [f"{o.models} trained network(s), measured with their rescaled copies ({o.extra.get('checkpoints', '?')} "
                 "checkpoints in all).", "",
                 "Median over the trained networks of the relative change |μ′ − μ| / |μ| (float32 weights: "
                 "≈ 1e-7 is exact invariance):", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
        measures = list(dict.fromkeys(r["measure"] for r in table))
        for m in measures:
            cell = {(r["transform"], r["scale"]): r for r in table if r["measure"] == m}
            claim = next(r["claims_invariance"] for r in table if r["measure"] == m)
            lines.append(
                "| "
                + " | ".join(
                    [f"`{m}`", claim]
                    + [_fmt(cell[c]["median"]) if c in cell else "–" for c in cols]
                )
                + " |"
            )
        lines.append("")
        if "figure" in o.files:
            lines += [f"Figure: `{o.files['figure'].relative_to(self.outdir)}`.", ""]
        return lines


def _same(path: Path, sd: dict[str, torch.Tensor]) -> bool:
    try:
        old = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    except Exception:
        return False
    return old.keys() == sd.keys() and all(torch.equal(old[k], sd[k]) for k in sd)


def relative_changes(results: Path) -> list[dict[str, Any]]:
    """Per measure × transform × scale: median and max over base networks of the relative change."""
    table = load_results(results)
    claims: dict[str, str] = {}
    cfg_path = results.parent.parent / "config.yaml"
    if cfg_path.is_file():
        for s in load_config(cfg_path).measure_specs():
            claims[s.label] = "yes" if claims_invariance(s) else "no"
    _, rows = read_table(results)
    base_val: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.get("hp_transform") == "none":
            for m in table.measures:
                base_val[(m, r["hp_base"])] = _float(r.get(m))
    groups: dict[tuple[str, str, float], list[float]] = {}
    for r in rows:
        t = r.get("hp_transform")
        if t in (None, "", "none"):
            continue
        for m in table.measures:
            b = base_val.get((m, r["hp_base"]), math.nan)
            v = _float(r.get(m))
            rel = (
                abs(v - b) / abs(b)
                if math.isfinite(b) and math.isfinite(v) and b != 0
                else (0.0 if v == b else math.nan)
            )
            groups.setdefault((m, t, float(r["hp_scale"])), []).append(rel)
    out = []
    for (m, t, a), rels in groups.items():
        fin = [x for x in rels if math.isfinite(x)]
        out.append({"measure": m, "claims_invariance": claims.get(m, ""), "transform": t, "scale": a,
                    "median": statistics.median(fin) if fin else math.nan, "max": max(fin) if fin else math.nan,
                    "n": len(fin)})  # fmt: skip
    order = {m: i for i, m in enumerate(table.measures)}
    return sorted(out, key=lambda r: (order[r["measure"]], r["transform"], r["scale"]))


def _float(v: str | None) -> float:
    try:
        return float(v) if v not in (None, "") else math.nan
    except ValueError:
        return math.nan


def change_figure(table: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Median relative change against α, one line per measure; layer-wise and node-wise panels."""
    plt = pyplot()
    transforms = sorted({r["transform"] for r in table})
    measures = list(dict.fromkeys(r["measure"] for r in table))
    fig, axes = plt.subplots(
        1,
        len(transforms),
        figsize=(5.2 * len(transforms), 4.2),
        dpi=110,
        squeeze=False,
        sharey=True,
    )
    cmap = plt.get_cmap("tab20", max(2, len(measures)))
    for ax, t in zip(axes.flat, transforms, strict=True):
        for i, m in enumerate(measures):
            pts = sorted(
                (r["scale"], r["median"])
                for r in table
                if r["measure"] == m and r["transform"] == t
            )
            xs = [p[0] for p in pts]
            ys = [max(p[1], 1e-12) if math.isfinite(p[1]) else math.nan for p in pts]
            ax.plot(xs, ys, marker="o", ms=3, lw=1, color=cmap(i), label=m,
                    ls="-" if next(r["claims_invariance"] for r in table if r["measure"] == m) != "yes" else "--")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{t}-wise rescaling", fontsize=9)
        ax.set_xlabel("α (node-wise: α_i log-uniform in [1/α, α])", fontsize=8)
        ax.axhline(1e-6, color="0.6", lw=0.6, ls=":")
        ax.tick_params(labelsize=7)
    axes.flat[0].set_ylabel("median relative change |μ′ − μ| / |μ|", fontsize=8)
    axes.flat[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(
        f"{title}: measures under function-preserving rescalings (dashed: claims invariance)",
        fontsize=9,
    )
    return save_figure(fig, path)
