"""Collecting a sweep: every unit's row file grouped back into one row per checkpoint
(results.csv/json), with the plan or without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import INCOMPLETE, ConfigError, ExitCode, exit_code
from ..run.measuring import versions
from ..run.results import Row, to_frame, write_pair
from .plan import Plan, load_plan
from .store import (
    PLAN_FILE,
    Store,
    row_from_records,
)

RESULTS_CSV = "results.csv"  # the name `flatcli measure` writes in its output folder


# ------------------------------------------------------------------ collect
@dataclass
class CollectReport:
    """The collected table: its rows and measure labels, the files written, the units not
    finished, stale and unreadable unit files, run times by label and the devices used."""

    rows: list[Row]
    labels: list[str]
    csv_path: Path
    json_path: Path
    missing: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, label) not finished
    stale: int = 0  # unit files not in the current plan (older configs)
    unreadable: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # unreadable file → why (plan.json too)
    seconds_by_label: dict[str, list[float]] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)

    def to_pandas(self):
        """The collected table as a DataFrame: the columns of results.csv, dtypes as documented
        in `flatcli.run.results` (equal to ``flatcli.run.results.read_results(self.csv_path)``)."""
        return to_frame(self.rows)

    @property
    def exit_code(self) -> int:
        """`flatcli.errors.exit_code` over the collected rows when a unit failed (2 for bad input,
        else 1); else `INCOMPLETE` (3) when units are not finished; 0 when every unit is ok."""
        return exit_code(self.rows) or (INCOMPLETE if self.missing else ExitCode.OK)


def output_csv(outdir: str | os.PathLike, output: str | os.PathLike | None) -> tuple[Path, bool]:
    """Where collect writes its CSV, and whether ``output`` is the old form.

    ``output`` is a folder, as every command's ``-o``: ``output/results.csv`` (default ``outdir``).
    The old form, a CSV path (a name ending in ``.csv`` that is not a folder, or an existing file),
    is itself the CSV path (True: accepted for one release, with a deprecation warning)."""
    if output is None:
        return Path(outdir) / RESULTS_CSV, False
    path = Path(output).expanduser()
    if path.is_file() or (path.suffix.lower() == ".csv" and not path.is_dir()):
        return path, True
    return path / RESULTS_CSV, False


def old_output_warning(output: str | os.PathLike) -> str:
    """The deprecation warning of a CSV path given as collect's output."""
    return (
        f"a CSV path as collect's output ({output}) is deprecated and accepted until the next "
        "release: -o/--output is a folder, as in every command; use `flatcli collect OUTDIR -o "
        "FOLDER` (`collect_report(outdir, FOLDER)`), which writes FOLDER/results.csv and "
        "FOLDER/results.json"
    )


def collect(outdir: str | os.PathLike, csv_path: str | os.PathLike | None = None) -> CollectReport:
    """Merge the unit files of ``outdir`` into ``csv_path`` (default ``outdir/results.csv``; its
    ``.json`` beside it).

    Rows follow the plan's checkpoint order and have the same columns as ``flatcli measure``'s.
    Units missing from the plan's list are reported; unit files of older plans are ignored.
    """
    outdir = Path(outdir)
    if not outdir.is_dir():
        raise ConfigError(f"collect: {outdir} is not a directory")
    store = Store(outdir, warn=None)  # the unreadable files are reported, with their reasons
    store.clean_orphans()
    records, unreadable = _read_records(store)
    plan, plan_problem = _plan_or_problem(outdir)
    if plan is not None:
        grouped = _group_by_plan(plan, records)
    else:
        grouped = _group_without_plan(outdir, records)
    labels, by_ckpt = grouped.labels, grouped.by_ckpt
    rows = [row_from_records(c, labels, by_ckpt[i], hp) for i, (c, hp) in enumerate(grouped.order)]
    seconds, devices = _seconds_and_devices(by_ckpt, labels)
    csv_path = Path(csv_path) if csv_path is not None else outdir / RESULTS_CSV
    json_path = csv_path.with_suffix(".json")
    meta_cfg = grouped.meta_cfg
    meta = {
        **meta_cfg,
        "labels": labels,
        "versions": versions(),
        "device": ", ".join(sorted(d for d in devices if d)),
        "measure_data": meta_cfg.get("config", {}).get("measure_data"),
        "sweep": {
            "dir": str(outdir),
            "missing_units": len(grouped.missing),
            "stale_unit_files": grouped.stale,
        },
    }
    write_pair(csv_path, rows, meta)
    return CollectReport(
        rows=rows,
        labels=labels,
        csv_path=csv_path,
        json_path=json_path,
        missing=grouped.missing,
        stale=grouped.stale,
        unreadable=unreadable,
        reasons={**store.problems, **plan_problem},
        seconds_by_label=seconds,
        devices=sorted(d for d in devices if d),
    )


def _plan_or_problem(outdir: Path) -> tuple[Plan | None, dict[str, str]]:
    """The plan, or None with ``{plan.json: why}`` when plan.json is unreadable or does not match
    its schema (the unit files are then grouped without it); ({}) when there is none."""
    path = outdir / PLAN_FILE
    if not path.is_file():
        return None, {}
    try:
        return load_plan(outdir), {}
    except ConfigError as e:
        return None, {str(path): str(e)}


def _read_records(store: Store) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every readable unit record by unit id, and the paths of the unreadable unit files."""
    records: dict[str, dict[str, Any]] = {}
    unreadable = []
    for p, rec in store.iter_records():
        if rec is None or "unit" not in rec:
            unreadable.append(str(p))
        else:
            records[rec["unit"]] = rec
    return records, unreadable


@dataclass
class _Grouped:
    """Unit records grouped by checkpoint: the measure labels, the checkpoints in order with their
    hyperparameters, each checkpoint's records by label, the (checkpoint, label) pairs without a
    record, the number of stale records (not in the plan) and the plan's config for results.json."""

    labels: list[str]
    order: list[tuple[str, dict[str, Any]]]
    by_ckpt: list[dict[str, dict[str, Any]]]
    missing: list[tuple[str, str]]
    stale: int
    meta_cfg: dict[str, Any]


def _group_by_plan(plan: Plan, records: dict[str, dict[str, Any]]) -> _Grouped:
    """The records of the plan's units, in the plan's order; records of other units are stale."""
    by_ckpt: list[dict[str, dict]] = [{} for _ in plan.checkpoints]
    missing = []
    for u in plan.units:
        rec = records.pop(u.id, None)
        if rec is None:
            missing.append((plan.checkpoints[u.checkpoint_index]["checkpoint"], u.label))
        else:
            by_ckpt[u.checkpoint_index][u.label] = rec
    return _Grouped(
        labels=plan.labels,
        order=[(c["checkpoint"], c["hparams"]) for c in plan.checkpoints],
        by_ckpt=by_ckpt,
        missing=missing,
        stale=len(records),
        meta_cfg={"config": plan.config, "config_hash": plan.config_hash},
    )


def _group_without_plan(outdir: Path, records: dict[str, dict[str, Any]]) -> _Grouped:
    """The records alone (no plan.json): checkpoints and labels in the order the records give
    (their indices); `ConfigError` when there is none."""
    if not records:
        raise ConfigError(
            f"collect: {outdir} holds no {PLAN_FILE} and no unit files; is it a sweep directory?"
        )
    recs = sorted(
        records.values(), key=lambda r: (r.get("checkpoint_index", 0), r.get("label_index", 0))
    )
    labels = list(recs[0].get("labels") or [])
    for r in recs:
        if r["label"] not in labels:
            labels.append(r["label"])
    ckpts: dict[str, dict[str, dict]] = {}
    for r in recs:
        ckpts.setdefault(r["checkpoint"], {})[r["label"]] = r
    return _Grouped(
        labels=labels,
        order=[(c, {}) for c in ckpts],
        by_ckpt=list(ckpts.values()),
        missing=[(c, lab) for c, recs_c in ckpts.items() for lab in labels if lab not in recs_c],
        stale=0,
        meta_cfg={},
    )


def _seconds_and_devices(
    by_ckpt: list[dict[str, dict[str, Any]]], labels: list[str]
) -> tuple[dict[str, list[float]], set[str]]:
    """Each label's unit run times (units with a result) and the devices the units ran on."""
    seconds: dict[str, list[float]] = {lab: [] for lab in labels}
    devices = set()
    for recs_c in by_ckpt:
        for lab, rec in recs_c.items():
            if rec.get("result") is not None:
                seconds.setdefault(lab, []).append(float(rec["result"].get("seconds") or 0.0))
            devices.add(str(rec.get("worker", {}).get("device", "")))
    return seconds, devices
