"""The sweep's row store: unit keys, one atomic file per finished unit, lock files, collect.

Layout of a sweep directory::

    OUTDIR/plan.json            what the sweep is (config, checkpoints, units): written by `sweep`
    OUTDIR/units/<id>.json      one finished unit (a checkpoint × one measure), written atomically
    OUTDIR/locks/<id>.lock      a unit being computed (created whole; holder's host, pid, time)
    OUTDIR/results.csv, .json   written by `collect`

A unit of work is one checkpoint × one configured measure. Its id is the result's key
(`flatcli.keys`): the checkpoint's content hash (plus those of its per-checkpoint init
checkpoint and training set), a fingerprint of every data file, and `measure_hash` (the whole
resolved configuration but a named list of keys that cannot change a value, the measure's
options *with their defaults filled in* and its revision). Changing a measure's options or
adding a measure therefore recomputes only the units it touches.

A unit file that is not UTF-8 JSON (any bytes are read safely: `flatcli.readback`), or does
not match the unit schema (`flatcli.schema.UNIT`), is treated as missing: one warning names it,
the unit is recomputed and the bad file is kept beside as ``<id>.json.bad``.

Every finished unit is one file written via temp file + fsync + ``os.replace``
(`flatcli.run.results.atomic_write`), so a reader sees either no file or a whole
one: a ``kill -9`` at any moment loses at most the units in flight, and two
workers finishing the same unit leave one file (the key determines the values).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ResultsWriteError
from ..keys import CAPPED
from ..keys import measure_hash as measure_hash  # re-exported: the sweep's keys
from ..keys import unit_id as unit_id
from ..locks import (
    DEFAULT_LOCK_TIMEOUT,
    Lock,
    break_if_stale,
    create_lock_file,
    host,
    lock_text,
    stale_reason,
)
from ..measures import MeasureResult
from ..readback import Unreadable, parse_json, read_text, set_aside
from ..run.results import Row, atomic_write, jsonable
from ..schema import UNIT, mismatch
from ..tempfiles import clean_orphans

PLAN_FILE = "plan.json"
UNITS_DIR = "units"
LOCKS_DIR = "locks"
FORMAT = 1
UNIT_BYTES = 64 * 2**20  # a unit file holds one measure's result: kilobytes


def shard_of(uid: str, count: int) -> int:
    """Deterministic shard of a unit: its id (a hex digest) modulo ``count``."""
    return int(uid, 16) % count


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"I/N"`` → (I, N) with 0 ≤ I < N."""
    if text is None:
        return None
    try:
        i, n = (int(p) for p in str(text).split("/"))
    except ValueError:
        raise ConfigError(f"`shard` must look like I/N (e.g. 0/4). Got {text!r} instead.") from None
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"`shard` I/N needs N ≥ 1 and 0 ≤ I < N. Got {text!r} instead.")
    return i, n


def dumps(obj: Any) -> str:
    """JSON of a plan or unit record with floats kept exactly (NaN/inf included)."""
    return json.dumps(jsonable(obj, exact=True), indent=1, allow_nan=True)


def check_unit(rec: Any, uid: str | None = None) -> str | None:
    """Why ``rec`` is not a unit record (`flatcli.schema.UNIT`; its ``unit`` must be ``uid``, the
    file's name), or None."""
    why = mismatch(rec, UNIT)
    if why is None and uid is not None and rec["unit"] != uid:
        why = f"unit is {rec['unit']!r}, not its file name {uid!r}"
    if why is None and rec["status"] == "ok" and rec["result"] is None and not rec["measure_error"]:
        why = "result is null in a unit whose status is ok (and no measure error)"
    return why


_WARNED: set[tuple[str, str, str | None]] = set()


def _stderr_line(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: lines of concurrent workers never interleave
    sys.stderr.flush()


class Store:
    """One sweep directory (see the module docstring)."""

    def __init__(
        self,
        outdir: str | os.PathLike,
        warn: Callable[[str], None] | None = _stderr_line,
        log: Callable[[str], None] | None = None,
    ):
        self.outdir = Path(outdir)
        self.log = log  # told why a stale lock is broken
        self.units_dir = self.outdir / UNITS_DIR
        self.locks_dir = self.outdir / LOCKS_DIR
        self.warn = warn  # called once per unit file that does not match (None: silent)
        self.problems: dict[str, str] = {}  # unit file → why it was not read

    # -------------------------------------------------------------- units
    def unit_path(self, uid: str) -> Path:
        """The path of the unit's file, ``units/<id>.json``."""
        return self.units_dir / f"{uid}.json"

    def read_unit(self, uid: str) -> dict[str, Any] | None:
        """The unit's record; None when it has no file, or the file is unreadable or does not
        match the unit schema (`check_unit`: warned about once, then recomputed)."""
        p = self.unit_path(uid)
        try:
            text = read_text(p, UNIT_BYTES)
        except FileNotFoundError:
            return None
        except Unreadable as e:
            return self._bad(p, e.why)
        except OSError as e:
            return self._bad(p, e.strerror or str(e))
        return self.check(p, text)

    def check(self, p: Path, text: str) -> dict[str, Any] | None:
        """The record in ``text`` (the file ``p``), or None (with a warning) when it is not JSON or
        does not match the unit schema."""
        try:
            rec = parse_json(text)
        except Unreadable as e:
            return self._bad(p, e.why, text)
        why = check_unit(rec, p.stem)
        return rec if why is None else self._bad(p, why, text)

    def _bad(self, p: Path, why: str, text: str | None = None) -> None:
        self.problems[str(p)] = why
        seen = (str(p), why, text)
        if self.warn is not None and seen not in _WARNED:  # once per file content and reader
            _WARNED.add(seen)
            self.warn(
                f"warning: unit file {p} is unreadable ({why}); it is recomputed, the file "
                f"kept beside it as {p.name}.bad"
            )
        return None

    def write_unit(self, record: dict[str, Any]) -> Path:
        """Write a unit record to its file atomically; returns the path."""
        path = self.unit_path(record["unit"])
        if path.exists() and self.read_unit(record["unit"]) is None:
            set_aside(path)  # an unreadable file (named when it was read) is kept, not overwritten
        try:
            atomic_write(path, dumps(record))
        except OSError as e:  # a full disk, a removed or read-only folder: named, exit code 1
            raise ResultsWriteError(self.units_dir, e) from e
        return path

    def is_done(
        self,
        uid: str,
        redo_before: float | None = None,
        retry_before: float | None = None,
        key: dict[str, Any] | None = None,
    ) -> bool:
        """A unit is done when its file exists, unless it was written before ``redo_before``
        (``--no-resume``) or is an error row written before ``retry_before`` (``--retry-failed``),
        or a cap stopped it (status ``budget``) and ``key`` (the plan's unit key) holds other
        caps than the record's."""
        rec = self.read_unit(uid)
        if rec is None:
            return False
        if (
            key is not None
            and (rec["result"] or {}).get("status") == CAPPED
            and rec["key"].get("caps") != key.get("caps")
        ):
            return False
        t = float(rec["finished_at"])
        if redo_before is not None and t < redo_before:
            return False
        if retry_before is not None and rec.get("status") == "error" and t < retry_before:
            return False
        return True

    def iter_records(self) -> Iterable[tuple[Path, dict[str, Any] | None]]:
        """Every unit file (temp files from interrupted writes are skipped); None when unreadable."""
        if not self.units_dir.is_dir():
            return
        for p in sorted(self.units_dir.glob("*.json")):
            if p.name.startswith("."):
                continue
            try:
                text = read_text(p, UNIT_BYTES)
            except Unreadable as e:
                yield p, self._bad(p, e.why)
                continue
            except OSError as e:
                yield p, self._bad(p, e.strerror or str(e))
                continue
            yield p, self.check(p, text)

    # -------------------------------------------------------------- locks
    def lock_path(self, uid: str) -> Path:
        """The path of the unit's lock file, ``locks/<id>.lock``."""
        return self.locks_dir / f"{uid}.lock"

    def claim(self, uid: str, timeout: float = DEFAULT_LOCK_TIMEOUT) -> Lock | None:
        """Take the unit's lock (created whole, `create_lock_file`); break it first when stale
        (`_break_if_stale`, which logs why). None when held."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        path = self.lock_path(uid)
        token = uuid.uuid4().hex
        info = {"host": host(), "pid": os.getpid(), "time": time.time(), "token": token}
        for _ in range(3):
            if create_lock_file(path, info):
                return Lock(path, token)
            if not self._break_if_stale(path, timeout):
                return None
        return None

    def _break_if_stale(self, path: Path, timeout: float) -> bool:
        return break_if_stale(path, timeout, self.log)

    def is_held(self, uid: str, timeout: float = DEFAULT_LOCK_TIMEOUT) -> bool:
        """Whether the unit's lock is held by a live worker (a lock that is not stale)."""
        path = self.lock_path(uid)
        try:
            text, mtime = lock_text(path), path.stat().st_mtime
        except FileNotFoundError:
            return False
        return stale_reason(text, mtime, timeout) is None

    def clear_stale_lock(self, uid: str, timeout: float = DEFAULT_LOCK_TIMEOUT) -> bool:
        """Remove the unit's lock if it is stale (a worker killed after writing the unit file but
        before releasing its lock leaves one behind). True when a lock was removed."""
        path = self.lock_path(uid)
        if not path.exists():
            return False
        return self._break_if_stale(path, timeout) and not path.exists()

    def clear_stale_locks_of_finished(self, timeout: float = DEFAULT_LOCK_TIMEOUT) -> int:
        """`clear_stale_lock` for every lock whose unit is finished; how many were removed."""
        return sum(
            self.clear_stale_lock(p.stem, timeout)
            for p in self.held_locks()
            if self.read_unit(p.stem) is not None
        )

    def clean_orphans(self) -> int:
        """Remove the temp files killed writers left in the folder, ``units/``, ``locks/`` and
        ``tokenized/`` (`flatcli.tempfiles.clean_orphans`); how many."""
        dirs = (self.outdir, self.units_dir, self.locks_dir, self.outdir / "tokenized")
        return sum(len(clean_orphans(d)) for d in dirs)

    def held_locks(self) -> list[Path]:
        """The lock files present, sorted."""
        return sorted(self.locks_dir.glob("*.lock")) if self.locks_dir.is_dir() else []


# ------------------------------------------------------------------ unit records <-> rows
def unit_record(
    *,
    uid: str,
    key: dict[str, Any],
    checkpoint: str,
    checkpoint_index: int,
    label: str,
    label_index: int,
    labels: list[str],
    row: Row,
    device: str,
    seconds: float,
    sweep_id: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The JSON stored for one finished unit (``row`` is `measure_job`'s row for this one measure;
    ``sweep_id`` the id of the sweep run that computed it, ``threads`` its worker's intra-op threads)."""
    res = row.results.get(label)
    return {
        "format": FORMAT,
        "unit": uid,
        "key": key,
        "checkpoint": checkpoint,
        "checkpoint_index": checkpoint_index,
        "label": label,
        "label_index": label_index,
        "labels": list(labels),
        "status": row.status,
        "error": row.error,
        "error_kind": row.error_kind,
        "measure_error": row.errors.get(label),
        "measure_error_kind": row.error_kinds.get(label),
        "result": None
        if res is None
        else {
            "value": res.value,
            "stderr": res.stderr,
            "status": res.status,
            "seconds": res.seconds,
            "diagnostics": res.diagnostics,
        },
        "metrics": row.metrics,
        "hparams": row.hparams,
        "worker": {"host": host(), "pid": os.getpid(), "device": device, "threads": threads},
        "sweep_id": sweep_id,
        "seconds": seconds,
        "finished_at": time.time(),
    }


def result_from(d: dict[str, Any]) -> MeasureResult:
    """The `MeasureResult` a unit file or results.json entry ``d`` holds."""
    value = d.get("value")
    return MeasureResult(
        value=float("nan") if value is None else float(value),
        stderr=None if d.get("stderr") is None else float(d["stderr"]),
        diagnostics=dict(d.get("diagnostics") or {}),
        seconds=float(d.get("seconds") or 0.0),
        status=str(d.get("status") or "ok"),
    )


def row_from_records(
    checkpoint: str, labels: list[str], records: dict[str, dict[str, Any]], hparams=None
) -> Row:
    """Rebuild the `Row` `flatcli measure` would give from the unit records of one checkpoint.

    ``records`` maps label → record. A label without a record leaves the row ``incomplete``.
    ``hparams`` (the plan's, from the manifest and path regex as the last sweep read them) win;
    a record adds only the ones read from the checkpoint at measure time (``hparams.from_keys``),
    so an edited manifest shows in ``collect`` as in ``measure --resume``.
    """
    plan_hp = dict(hparams or {})
    row = Row(checkpoint=checkpoint, labels=list(labels), hparams=dict(plan_hp))
    missing = []
    got_hparams = False
    for lab in labels:
        rec = records.get(lab)
        if rec is None:
            missing.append(lab)
            continue
        if rec.get("result") is not None:
            row.results[lab] = result_from(rec["result"])
        if rec.get("measure_error"):
            row.errors[lab] = rec["measure_error"]
            row.error_kinds[lab] = rec.get("measure_error_kind") or ""
        if rec.get("status") == "error":
            row.fail(rec.get("error") or "", rec.get("error_kind") or "")
        if not row.metrics and rec.get("metrics"):
            row.metrics = {
                k: float(v) if v is not None else math.nan for k, v in rec["metrics"].items()
            }
        if not got_hparams and rec.get("hparams") is not None:
            read = {k: v for k, v in rec["hparams"].items() if k not in plan_hp}
            row.hparams = {**plan_hp, **read}  # + hparams.from_keys read at measure time
            got_hparams = True
    if missing and row.status == "ok":
        row.status = "incomplete"
        row.error = (
            f"{len(missing)} of {len(labels)} measures not computed yet: {', '.join(missing)}"
        )
    return row
