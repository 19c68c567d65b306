"""Data-parallel measurement on torch.distributed: 2 CPU ranks (gloo) split the work, equal one
process, write one results file; a failure on one rank ends every rank with one error."""

import csv
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from flatcli.api import measure
from flatcli.engine.dist import Dist

MEASURES = [
    {"hessian_lambda_max": {"tol": 1e-6}},
    {"hessian_trace": {"min_probes": 32, "max_probes": 32}},
    "normalized_sharpness",
    {"sharpness_worst": {"rho": 0.05, "batch_size": 10, "steps": 10}},  # 4 m-batches: 2 per rank
]

LOGGED = textwrap.dedent('''
    import os
    import torch
    from torch import nn

    class Logged(nn.Module):
        """A small MLP that appends the rows of every forward pass to a file per rank."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

        def forward(self, x):
            with open(os.path.join(os.environ["SEEN_DIR"], f"seen_{os.environ.get('RANK', 'one')}.txt"), "a") as f:
                f.write(f"{x.shape[0]}\\n")
            return self.net(x)

    class _FailsOnRank1(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if os.environ.get("RANK") == "1":
                raise RuntimeError("boom in backward on rank 1")
            return g

    class Fails(Logged):
        """Forward passes work everywhere; a backward pass fails on rank 1 only."""

        def forward(self, x):
            return _FailsOnRank1.apply(self.net(x))
''')


def _setup(tmp_path, target: str, measures) -> str:
    (tmp_path / "models.py").write_text(LOGGED)
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        import models

        importlib.reload(models)
        torch.manual_seed(0)
        torch.save(getattr(models, target)().state_dict(), tmp_path / "ck.pt")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("models", None)
    g = torch.Generator().manual_seed(1)
    torch.save(
        {"x": torch.randn(40, 6, generator=g), "y": torch.randint(0, 3, (40,), generator=g)},
        tmp_path / "data.pt",
    )
    cfg = {
        "model": {"target": f"models.py:{target}"},
        "checkpoints": ["ck.pt"],
        "data": {"train": {"source": "tensors", "path": "data.pt"}},
        "measure_data": {"batch_size": 8},
        "measures": measures,
        "runtime": {"device": "cpu", "precision": "fp64"},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows_seen(path) -> int:
    return sum(int(line) for line in open(path))


def test_shards_cover_the_rows_once_in_order():
    for rows in (1, 7, 40):
        parts = [Dist(rank=r, world=3).shard(rows) for r in range(3)]
        assert [i for s in parts for i in range(s.start, s.stop)] == list(range(rows))
        assert max(s.stop - s.start for s in parts) - min(s.stop - s.start for s in parts) <= 1


def _two_ranks_then_one(cfg: str, tmp_path):
    """``flatcli measure`` under torchrun with 2 ranks (results in tmp_path/two), then the same
    config in this process: (torchrun's completed process, its results row, rows each rank
    forwarded, the one-process row, rows one process forwarded)."""
    env = {**os.environ, "SEEN_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "flatcli",
            "measure",
            "-c",
            cfg,
            "-o",
            str(tmp_path / "two"),
            "--format",
            "csv",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "two" / "results.csv") as f:
        (two,) = list(csv.DictReader(f))
    seen = [_rows_seen(tmp_path / f"seen_{r}.txt") for r in (0, 1)]
    os.environ["SEEN_DIR"] = str(tmp_path)
    try:
        (one,) = measure(cfg, outdir=tmp_path / "one").rows
    finally:
        del os.environ["SEEN_DIR"]
    return run, two, seen, one, _rows_seen(tmp_path / "seen_one.txt")


@pytest.mark.slow
def test_torchrun_two_ranks_split_the_work_and_equal_one_process(tmp_path):
    cfg = _setup(tmp_path, "Logged", MEASURES)
    run, two, seen, one, alone = _two_ranks_then_one(cfg, tmp_path)
    assert "terminate called" not in run.stderr  # each rank destroyed its process group before exit
    assert run.stdout.count("ck.pt,ok") == 1  # one table, from rank 0
    for r in seen:  # each rank forwards about half of what one process does
        assert 0.45 * alone <= r <= 0.55 * alone, (seen, alone)
    for lab in ("hessian_lambda_max", "normalized_sharpness", "sharpness_worst"):
        assert float(two[lab]) == pytest.approx(one.results[lab].value, rel=1e-5), lab
    assert float(two["hessian_trace"]) == pytest.approx(
        one.results["hessian_trace"].value, rel=1e-3
    )
    assert float(two["train_loss"]) == pytest.approx(one.metrics["train_loss"], rel=1e-12)


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_every_rank_with_one_error(tmp_path):
    """Two ranks started as any launcher starts them (RANK, WORLD_SIZE...): rank 1 fails inside a
    product while rank 0 waits for its share; both end, and only rank 1 says why."""
    cfg = _setup(tmp_path, "Fails", ["hessian_trace"])
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "SEEN_DIR": str(tmp_path),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flatcli",
                    "measure",
                    "-c",
                    cfg,
                    "-o",
                    str(tmp_path / "out"),
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    errors = [line for _, err in outs for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1: hessian_trace: RuntimeError: boom in backward on rank 1"], (
        outs
    )
    assert not (tmp_path / "out" / "results.csv").exists()


def test_flatcli_destroys_the_process_group_it_created_and_only_that(monkeypatch):
    """A rank that ends with its gloo group alive can abort at interpreter exit (SIGABRT in CI):
    `leave` destroys the group `init_from_env` created, and leaves a group the caller created."""
    import torch.distributed as td

    from flatcli.engine import dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(
        dist, "launched", lambda: True
    )  # one rank: a group without a second process
    world, _ = dist.init_from_env(torch.device("cpu"))
    assert td.is_initialized()
    dist.leave(world)
    assert not td.is_initialized()
    td.init_process_group("gloo", rank=0, world_size=1)  # the caller's own group
    try:
        world, _ = dist.init_from_env(torch.device("cpu"))
        dist.leave(world)
        assert td.is_initialized()
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_one_m_batch_is_split_over_the_ranks_and_time_caps_stop_every_rank_together(tmp_path):
    """sharpness_worst with a single m-batch (batch_size ≥ the 40 rows) on 2 ranks: each rank forwards
    about half of the rows one process forwards (before, rank 0 took the whole batch and rank 1
    idled), and the value equals one process's. The trace under a time cap already spent decides
    on both ranks at once (they agree through a collective), so the run ends instead of hanging."""
    cfg = _setup(
        tmp_path,
        "Logged",
        [
            {"sharpness_worst": {"rho": 0.05, "batch_size": 64, "steps": 10}},
            {"hessian_trace": {"max_seconds": 1e-6, "tol": 1e-9}},
        ],
    )
    _, two, seen, one, alone = _two_ranks_then_one(cfg, tmp_path)
    for r in seen:
        assert 0.45 * alone <= r <= 0.55 * alone, (seen, alone)
    assert int(two["sharpness_worst_batches"]) == 1
    assert float(two["sharpness_worst"]) == pytest.approx(
        one.results["sharpness_worst"].value, rel=1e-9
    )
    assert two["hessian_trace_status"] == "budget" and two["hessian_trace_probes"] == "2"


@pytest.mark.slow
def test_ranks_that_see_different_free_memory_agree_on_the_lanczos_basis_cap(tmp_path):
    """``runtime.max_basis_vectors: auto`` on 2 ranks, rank 1 seeing room for 12 basis vectors and
    rank 0 for thousands: both must run the same Lanczos (its products are collectives), so the cap
    is the least over the ranks and λmax equals one process's (which restarts or not: the value
    is the same to the tolerance); a rank-local cap desynchronizes the products."""
    cfg = _setup(tmp_path, "Logged", [{"hessian_lambda_max": {"tol": 1e-8, "max_steps": 80}}])
    (tmp_path / "models.py").write_text(
        LOGGED
        + textwrap.dedent("""
        import flatcli.engine.recompute as _recompute

        if os.environ.get("RANK") == "1":  # room for 12 float64 vectors of the 83 parameters, twice
            _recompute.free_bytes = lambda device: 2 * 12 * 83 * 8
    """)
    )
    run, two, _, one, _ = _two_ranks_then_one(cfg, tmp_path)
    assert float(two["hessian_lambda_max"]) == pytest.approx(
        one.results["hessian_lambda_max"].value, rel=1e-7
    )
    assert two["hessian_lambda_max_restarts"] not in ("", "0"), two["hessian_lambda_max_restarts"]
