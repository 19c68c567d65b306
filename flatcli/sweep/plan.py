"""The plan of a sweep: its units (checkpoint × measure) with their keys, written to and read
from ``OUTDIR/plan.json``."""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..config import from_dict
from ..errors import ConfigError
from ..keys import caps, content_hash, data_fingerprints, file_fingerprint, measure_hash, unit_id
from ..loading.jobs import Job
from ..measures import Dims, MeasureSpec
from ..readback import Unreadable, read_json
from ..run.results import atomic_write
from ..run.shares import least_work
from ..schema import PLAN, mismatch
from .store import PLAN_FILE, Store, dumps


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Unit:
    """One unit of work, a checkpoint × one measure: its id (the hash of ``key``), the indices of
    its checkpoint and measure in the plan, the measure's label, and ``key`` (fingerprints,
    measure hash, caps: `flatcli.keys`)."""

    id: str
    checkpoint_index: int
    label: str
    label_index: int
    key: dict[str, Any]


@dataclass
class Plan:
    """What a sweep computes; ``OUTDIR/plan.json`` (no timestamps: every shard writes the same file)."""

    config: dict[str, Any]
    base_dir: str
    config_hash: str
    version: str
    specs: list[dict[str, Any]]  # name, label, options, seed
    checkpoints: list[
        dict[str, Any]
    ]  # checkpoint, path, fingerprint, init_checkpoint, train_data, hparams
    units: list[Unit]

    @property
    def labels(self) -> list[str]:
        """The measure labels, in the configured order."""
        return [s["label"] for s in self.specs]

    def spec(self, label: str) -> MeasureSpec:
        """The `MeasureSpec` of the measure labelled ``label``."""
        s = next(s for s in self.specs if s["label"] == label)
        return MeasureSpec(
            name=s["name"],
            label=s["label"],
            options=dict(s["options"]),
            seed=s["seed"],
            max_seconds=s.get("max_seconds"),
            max_hvps=s.get("max_hvps"),
        )

    def job(self, i: int) -> Job:
        """The `Job` of checkpoint ``i`` (its resolved paths and hyperparameters)."""
        c = self.checkpoints[i]
        opt = lambda k: Path(c[k]) if c.get(k) else None  # noqa: E731
        return Job(
            c["checkpoint"],
            Path(c["path"]),
            dict(c["hparams"]),
            opt("init_checkpoint"),
            opt("train_data"),
        )

    def units_for(self, shard: tuple[int, int] | None) -> list[Unit]:
        """The units of shard ``(i, n)``, or every unit for None, in plan order. The n shards
        share the plan's units out by predicted cost (`balance` of `unit_costs`), the same in
        every task that reads this plan (the costs depend on the plan and the checkpoints' file
        sizes only), so they cover every unit exactly once."""
        if shard is None:
            return list(self.units)
        i, n = shard
        return [self.units[k] for k in balance(unit_costs(self, self.units), n)[i]]

    def cfg(self):
        """The sweep's `flatcli.config.Config`, rebuilt from the plan (no environment overrides)."""
        return from_dict(self.config, base_dir=self.base_dir, env={})

    def to_json(self) -> dict[str, Any]:
        """The content of plan.json (format 1)."""
        return {
            "format": 1,
            "version": self.version,
            "config_hash": self.config_hash,
            "base_dir": self.base_dir,
            "config": self.config,
            "measures": self.specs,
            "checkpoints": self.checkpoints,
            "units": [
                {
                    "id": u.id,
                    "checkpoint_index": u.checkpoint_index,
                    "label": u.label,
                    "label_index": u.label_index,
                    "key": u.key,
                }
                for u in self.units
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        """The plan from the content of plan.json (`to_json`)."""
        return cls(
            config=d["config"],
            base_dir=d["base_dir"],
            config_hash=d["config_hash"],
            version=d["version"],
            specs=d["measures"],
            checkpoints=d["checkpoints"],
            units=[
                Unit(u["id"], u["checkpoint_index"], u["label"], u["label_index"], u["key"])
                for u in d["units"]
            ],
        )


def build_plan(cfg, specs: list[MeasureSpec], jobs: list[Job]) -> Plan:
    """Fingerprint every checkpoint (and its init checkpoint / training set) and list the units."""
    config = cfg.to_dict()
    fps: dict[str, str | None] = {}

    def fp(p: Path | None, hasher=content_hash) -> str | None:
        if p is None:
            return None
        k = str(Path(p).resolve())
        if k not in fps:
            try:
                fps[k] = hasher(p)
            except FileNotFoundError:
                raise ConfigError(f"file not found: {p}") from None
        return fps[k]

    mh = {s.label: measure_hash(config, s) for s in specs}
    cap = {s.label: caps(config, s) for s in specs}
    data_fp = data_fingerprints(cfg)
    checkpoints, units = [], []
    for ci, job in enumerate(jobs):
        key_fp = {
            "checkpoint": fp(job.path),
            "init": fp(job.init_checkpoint),
            "train_data": fp(job.train_data, file_fingerprint),
            "data": data_fp,
        }
        checkpoints.append(
            {
                "checkpoint": job.checkpoint,
                "path": str(Path(job.path).resolve()),
                "fingerprint": key_fp["checkpoint"],
                "init_checkpoint": str(Path(job.init_checkpoint).resolve())
                if job.init_checkpoint
                else None,
                "train_data": str(Path(job.train_data).resolve()) if job.train_data else None,
                "hparams": dict(job.hparams),
            }
        )
        for li, s in enumerate(specs):
            key = {"fingerprints": key_fp, "measure_hash": mh[s.label]}
            if cap[s.label]:
                key["caps"] = cap[s.label]
            units.append(Unit(unit_id(key_fp, mh[s.label]), ci, s.label, li, key))
    ids = [u.id for u in units]
    if len(set(ids)) != len(ids):
        dup = sorted(
            {checkpoints[u.checkpoint_index]["checkpoint"] for u in units if ids.count(u.id) > 1}
        )
        raise ConfigError(
            f"the same checkpoint file is listed more than once: {', '.join(dup[:4])}"
        )
    return Plan(
        config=config,
        base_dir=str(Path(cfg.base_dir).resolve()),
        config_hash=cfg.hash(),
        version=__version__,
        specs=[
            {
                "name": s.name,
                "label": s.label,
                "options": s.options,
                "seed": s.seed,
                **{
                    k: getattr(s, k)
                    for k in ("max_seconds", "max_hvps")
                    if getattr(s, k) is not None
                },
            }
            for s in specs
        ],
        checkpoints=checkpoints,
        units=units,
    )


# ------------------------------------------------------------------ shares of an array
NOMINAL_SAMPLES = 1000  # measurement-set size for the cost proxy when num_samples is "all"


def unit_costs(plan: Plan, units: list[Unit]) -> list[float]:
    """A predicted cost of each unit, cheap and without loading anything: the least products its
    measure declares (`flatcli.run.shares.least_work`, in HVP equivalents) for a model of P
    parameters, times P (a product's cost grows with the parameters), P the checkpoint file's
    bytes ÷ 4 (float32 weights). Only the ratios matter: they share the array's units out."""
    ns = plan.config.get("measure_data", {}).get("num_samples", "all")
    n = ns if isinstance(ns, int) else NOMINAL_SAMPLES
    sizes: dict[int, int] = {}
    out = []
    for u in units:
        i = u.checkpoint_index
        if i not in sizes:
            try:
                sizes[i] = max(1, _bytes(Path(plan.checkpoints[i]["path"])) // 4)
            except OSError:
                sizes[i] = 1
        P = sizes[i]
        try:
            work = least_work(plan.spec(u.label), Dims(P=P, n=n, rows=n))
        except Exception:  # noqa: BLE001 - an estimate that needs more than P and n: weigh it 1
            work = 1.0
        out.append(work * P)
    return out


def _bytes(path: Path) -> int:
    """A checkpoint's size: the file's, or a ``save_pretrained`` folder's files together."""
    if path.is_dir():
        return sum(q.stat().st_size for q in path.iterdir() if q.is_file())
    return path.stat().st_size


def balance(costs: list[float], n: int) -> list[list[int]]:
    """Share the indices of ``costs`` out into ``n`` parts of near-equal total cost: the largest
    first, each to the part with the least so far (ties: the lower index), each part then in index
    order. Deterministic. No part exceeds the mean by more than the largest single cost (the part
    that ends largest took its last item while it was the least: at most the mean)."""
    parts: list[list[int]] = [[] for _ in range(n)]
    heap = [(0.0, i) for i in range(n)]
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        load, i = heapq.heappop(heap)
        parts[i].append(k)
        heapq.heappush(heap, (load + costs[k], i))
    return [sorted(p) for p in parts]


def write_plan(outdir: str | os.PathLike, plan: Plan) -> Path:
    """Write ``OUTDIR/plan.json`` atomically; returns its path."""
    path = Path(outdir) / PLAN_FILE
    atomic_write(path, dumps(plan.to_json()))
    Store(outdir, warn=None).clean_orphans()  # a new run: temp files of killed writers go
    return path


def load_plan(outdir: str | os.PathLike) -> Plan:
    """The plan in ``OUTDIR/plan.json``; `ConfigError` when it is missing or not a plan."""
    path = Path(outdir) / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: run 'flatcli sweep -c CONFIG -o {outdir}' first")
    try:
        d = read_json(path)
    except Unreadable as e:
        raise ConfigError(f"{path} is not a flatcli sweep plan ({e.why})") from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
    why = check_plan(d)
    if why:
        raise ConfigError(f"{path} is not a flatcli sweep plan: {why}")
    return Plan.from_json(d)


def check_plan(d: Any) -> str | None:
    """Why ``d`` is not the content of a plan.json (`flatcli.schema.PLAN`, and every unit's
    checkpoint index and label within the plan's lists), or None."""
    why = mismatch(d, PLAN)
    if why:
        return why
    labels = [m["label"] for m in d["measures"]]
    for i, u in enumerate(d["units"]):
        if not 0 <= u["checkpoint_index"] < len(d["checkpoints"]):
            return f"units[{i}].checkpoint_index {u['checkpoint_index']} is not a checkpoint's"
        if u["label"] not in labels:
            return f"units[{i}].label {u['label']!r} is not a measure's"
    return None
