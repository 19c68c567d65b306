"""`measure --resume`: the earlier results.json read back (checked against its schema), which
measures are reused and which recomputed (and why), and the earlier results of another
configuration kept beside the new ones (results.prev.json / results.prev.csv)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, parse_measures
from ..errors import ConfigError
from ..keys import (
    CAPPED,
    caps,
    caps_hash,
    config_in_key,
    data_fingerprints,
    job_fingerprints,
    measure_hash,
    spec_in_key,
    unit_id,
)
from ..loading.jobs import Job
from ..measures import MeasureSpec
from ..readback import Unreadable, read_json
from ..run.results import atomic_write, settle_pair
from ..schema import RESULTS, mismatch
from ..sweep import result_from

REUSABLE = frozenset({"ok", "not_converged", "saturated", "not_applicable", "near_zero", "budget"})
PREV = "results.prev"  # the stem the earlier results of another configuration are kept under


def measure_keys(
    cfg: Config,
    job: Job,
    specs: Sequence[MeasureSpec],
    data: dict[str, str | None] | None = None,
) -> dict[str, str]:
    """Label → the key of one checkpoint × measure (`flatcli.keys`: the sweep's unit id of the
    checkpoint's and data files' fingerprints and the measure's configuration and revision).
    ``data``: `flatcli.keys.data_fingerprints` when known. Empty when a file cannot be read
    (nothing is reused then)."""
    try:
        fps = job_fingerprints(job, data_fingerprints(cfg) if data is None else data)
    except OSError:
        return {}
    config = cfg.to_dict()
    return {s.label: unit_id(fps, measure_hash(config, s)) for s in specs}


def stored_key(key: str, status: str, cap: dict[str, Any] | None) -> str:
    """The key a result is stored under: a result a cap stopped (status ``budget``) carries a
    hash of its caps too, so that only a run under the same caps reuses it."""
    return f"{key}~{caps_hash(cap)}" if status == CAPPED else key


def _json_float(v: Any) -> float:
    """A value as results.json writes it (null for NaN, "inf"/"-inf") back as a float."""
    return float("nan") if v is None else float(v)


@dataclass
class Previous:
    """An output folder's earlier results.json: the finished results by stored key, every
    (checkpoint, label) entry's status, its configuration; ``problem`` when it could not be used."""

    path: Path
    exists: bool = False
    results: dict[str, Any] = field(default_factory=dict)  # stored key → MeasureResult
    entries: dict[tuple[str, str], str] = field(default_factory=dict)  # (ckpt, label) → status
    unkeyed: int = 0  # finished entries without a key (written by collect or an old version)
    config: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # the data files' fingerprints then
    problem: str = ""


def read_previous(outdir: str | Path) -> Previous:
    """OUTDIR/results.json as `Previous`. A missing file gives nothing; an unreadable one, or one
    that does not match the results schema (`flatcli.schema.RESULTS`), gives nothing and names
    the problem."""
    settle_pair(Path(outdir) / "results.csv")  # finish a pair write a kill cut after its commit
    prev = Previous(Path(outdir) / "results.json")
    try:
        d = read_json(prev.path)
    except FileNotFoundError:
        return prev
    except Unreadable as e:
        prev.exists, prev.problem = True, e.why
        return prev
    except OSError as e:
        prev.exists, prev.problem = True, e.strerror or str(e)
        return prev
    prev.exists = True
    why = mismatch(d, RESULTS)
    if why:
        prev.problem = f"does not match the results schema: {why}"
        return prev
    prev.config = d.get("config") or {}
    prev.data = d.get("data_fingerprints") if isinstance(d.get("data_fingerprints"), dict) else {}
    for r in d["rows"]:
        keys = r.get("keys") or {}
        for lab, m in r["measures"].items():
            prev.entries[(r["checkpoint"], lab)] = m["status"]
            if m["status"] not in REUSABLE:
                continue
            if lab not in keys:
                prev.unkeyed += 1
                continue
            prev.results[keys[lab]] = result_from(
                {
                    **m,
                    "value": _json_float(m["value"]),
                    "stderr": None if m.get("stderr") is None else _json_float(m["stderr"]),
                }
            )
    return prev


def previous_results(outdir: str | Path) -> dict[str, Any]:
    """Key → `MeasureResult` of every finished measure in OUTDIR/results.json (``measure
    --resume``); measures ``interrupted`` or in ``error`` are not finished. An unreadable or
    missing file, or one that does not match the results schema, gives nothing."""
    return read_previous(outdir).results


@dataclass
class Resume:
    """What a run into a folder does with the results there: the keys of every checkpoint, the
    results reused, the line that says so (``note``) and where earlier results were kept."""

    prev: Previous
    reuse_ok: bool
    keys: list[dict[str, str]] = field(default_factory=list)  # per job: label → key
    kept: Path | None = None
    note: str = ""

    def reuse(self, keys: dict[str, str], specs: Sequence[MeasureSpec], config) -> dict[str, Any]:
        """Label → the earlier result to reuse for one checkpoint's ``keys``."""
        if not self.reuse_ok:
            return {}
        out = {}
        for s in specs:
            k = keys.get(s.label)
            if k is None:
                continue
            got = self.prev.results.get(k)
            got = got or self.prev.results.get(stored_key(k, CAPPED, caps(config, s)))
            if got is not None:
                out[s.label] = got
        return out


def prepare_resume(
    cfg: Config,
    jobs: Sequence[Job],
    specs: Sequence[MeasureSpec],
    folder: Path | None,
    resume: bool,
    data: dict[str, str | None],
    write: bool,
) -> Resume:
    """Read the folder's earlier results; with ``write``, keep them as results.prev.json/.csv when
    this run would drop finished results that are not its own (another configuration, other
    checkpoint or data contents, or a file that does not match), and say what happens."""
    if folder is None:
        return Resume(Previous(Path("results.json")), False)
    prev = read_previous(folder) if (resume or write) else Previous(folder / "results.json")
    res = Resume(prev, resume)
    if not prev.exists:
        return res
    config = cfg.to_dict()
    res.keys = [measure_keys(cfg, j, specs, data) for j in jobs]
    ours = {
        stored_key(k[s.label], st, caps(config, s))
        for k in res.keys
        for s in specs
        if s.label in k
        for st in ("ok", CAPPED)
    }
    dropped = prev.unkeyed + sum(k not in ours for k in prev.results)
    if write and (dropped or prev.problem):
        res.kept = _keep_beside(folder)
    res.note = _note(res, cfg, jobs, specs, dropped, data)
    return res


def _keep_beside(folder: Path) -> Path:
    """Copy results.json/.csv to results.prev.json/.csv (replacing earlier copies)."""
    for suffix in (".json", ".csv"):
        src = folder / f"results{suffix}"
        if src.is_file():
            atomic_write(folder / f"{PREV}{suffix}", src.read_bytes())  # as it is, bad bytes too
    return folder / f"{PREV}.json"


def _note(res: Resume, cfg: Config, jobs, specs, dropped: int, data: dict) -> str:
    """The one line: "3 reused; 2 recomputed: params.include changed; 5 results of another
    configuration kept in results.prev.json" (or only the last part without ``--resume``)."""
    prev = res.prev
    parts = []
    if prev.problem:
        parts.append(f"{prev.path} is unreadable ({prev.problem}); every measure is computed")
    elif res.reuse_ok:
        config = cfg.to_dict()
        why: dict[str, int] = {}
        reused = 0
        for job, keys in zip(jobs, res.keys, strict=True):
            got = res.reuse(keys, specs, config)
            reused += len(got)
            for s in specs:
                if s.label not in got:
                    r = _why(prev, job.checkpoint, s, config, data)
                    why[r] = why.get(r, 0) + 1
        n = sum(why.values())
        parts.append(f"{reused} reused; {n} recomputed" + (f": {', '.join(why)}" if why else ""))
    if res.kept is not None:
        what = (
            "the unreadable results"
            if prev.problem
            else f"{dropped} result{'s' if dropped != 1 else ''} of another configuration"
        )
        parts.append(f"{what} kept in {res.kept}")
    return "; ".join(parts)


def _why(
    prev: Previous, checkpoint: str, spec: MeasureSpec, config: dict[str, Any], data: dict
) -> str:
    """Why a measure of one checkpoint is not reused, in a few words."""
    status = prev.entries.get((checkpoint, spec.label))
    if status is None:
        return "not in the earlier results"
    if status not in REUSABLE:
        return f"{status} before"
    changed = changed_keys(prev.config, config)
    if changed:
        return f"{', '.join(changed)} changed"
    old = _old_spec(prev.config, spec.label)
    if old is not None and spec_in_key(old) != spec_in_key(spec):
        return f"options of {spec.label} changed"
    if status == CAPPED:
        return "caps changed"
    files = [k for k in sorted(set(data) | set(prev.data)) if data.get(k) != prev.data.get(k)]
    if files:
        return f"contents of {', '.join(files)} changed"
    return "checkpoint or measure revision changed"


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keyed config sections that differ (`flatcli.keys.config_in_key`), two levels deep
    (``params.include``, ``runtime.precision``)."""
    a, b = config_in_key(old), config_in_key(new)
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{k}.{j}" for j in sorted(set(x) | set(y)) if x.get(j) != y.get(j)]
        else:
            out.append(k)
    return out


def _old_spec(config: dict[str, Any], label: str) -> MeasureSpec | None:

    try:
        specs = parse_measures(config.get("measures"))
    except (ConfigError, TypeError, ValueError):
        return None
    return next((s for s in specs if s.label == label), None)
