"""The id of a sweep run in its unit files (``sweep_id``): written by every worker, and unit files of
older versions, which stored it as ``run``, are still read (collected, and finished for resume)."""

from __future__ import annotations

import json

from flatcli import api
from flatcli.sweep.plan import load_plan
from flatcli.sweep.store import Store, check_unit
from tests.helpers import write_project


def test_unit_files_hold_the_sweep_id_and_older_ones_are_still_read(tmp_path):
    cfg = write_project(tmp_path / "p", measures=["frobenius_norm"], n_ckpt=1)
    out = tmp_path / "s"
    assert api.sweep(cfg, out, log=None).computed == 1
    (u,) = load_plan(out).units
    path = Store(out).unit_path(u.id)
    rec = json.loads(path.read_text())
    assert isinstance(rec["sweep_id"], str) and len(rec["sweep_id"]) == 12
    assert "run" not in rec
    old = {k: v for k, v in rec.items() if k != "sweep_id"} | {"run": rec["sweep_id"]}
    assert check_unit(old) is None
    path.write_text(json.dumps(old))
    again = api.sweep(cfg, out, log=None)
    assert (again.computed, again.already_done) == (0, 1)
    assert api.collect_report(out).rows[0].results["frobenius_norm"].status == "ok"
