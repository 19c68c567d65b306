"""Benchmark flatcli's curvature engine against PyHessian and curvlinops.

In one process, on one device, with the same model and the same data (same
batches), for each task:

* ``lambda_max``: flatcli's Lanczos to relative Ritz residual 1e-4; PyHessian's
  default power iteration (``eigenvalues()``: 100 iterations, stop on 1e-3
  relative change); curvlinops' route, scipy ``eigsh(k=1, which="LA",
  tol=1e-4)`` over ``HessianLinearOperator.to_scipy()``.
* ``trace``: flatcli's Hutchinson (and Hutch++) to 1% relative stderr;
  PyHessian's default ``trace()`` and PyHessian with flatcli's probe count
  (equal accuracy); curvlinops' ``hutchinson_trace`` with flatcli's probe count.

Each row: wall time (set-up included, CUDA synchronized), number of HVPs, the
relative error against a high-accuracy reference (flatcli Lanczos to 1e-7, or a
long Hutch++ run whose own stderr is printed), the relative Ritz residual of the
returned vector where there is one, and the ratio of flatcli's time to the peer's
(< 1: flatcli is faster).

Tasks: ``mlp``: MLP 64-256-256-10 trained on scikit-learn digits (train split,
1,257 samples); ``resnet``: torchvision ``resnet18(num_classes=10)`` at random
initialization in eval mode on N random CIFAR-10-shaped inputs. ``process``
(CPU): the whole ``flatcli measure`` process (``hessian_trace`` with a fixed
probe count) against a PyHessian script computing the same trace with the same
probe count, both as fresh Python processes. ``bar`` (CPU): the engine bar, ``flatcli measure``
(200-probe Hutchinson ``hessian_trace``, ``threads: auto``) against a PyHessian script on an MLP
over 8,192 rows as whole processes, alternated three times, each launched right after this
process trained the model (``--bar-*`` options; `bench_bar`); the ratio of the medians is the bar
(at most 0.7). Its JSON goes to docs/benchmarks/data/engine-process-<samples>.json.

Needs ``pip install pyhessian curvlinops-for-pytorch`` (the ``bench`` extra).

Examples::

    OMP_NUM_THREADS=2 python -m benchmarks.bench_engine --tasks mlp,process --device cpu
    python -m benchmarks.bench_engine --tasks bar --device cpu   # the engine bar, on an idle machine
    python -m benchmarks.bench_engine --tasks resnet --device cuda --n 5000 --batch-size 500
    python -m benchmarks.bench_engine --tasks resnet --device cpu --n 64 --batch-size 32   # smoke run

The result goes to docs/benchmarks/data/engine.json (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks._common import DATA, device_name, json_arg, sync, timed, write_json
from benchmarks._common import table as json_table
from flatcli.engine import CurvatureEngine, Problem, linalg


# ---------------------------------------------------------------------------- helpers
@dataclass
class Row:
    task: str
    quantity: str
    tool: str
    seconds: float
    n_hvp: int
    value: float
    rel_error: float = math.nan
    residual: float = math.nan
    note: str = ""
    ratio: float = math.nan
    # the flatcli row this peer is compared with ("first": the group's first flatcli row)
    vs: str | None = "first"
    extra: dict | None = None  # the engine bar's cells (`bar_cells`)

    def __post_init__(self):  # progress, so that a run cut short still shows its rows
        print(
            f"  {self.task} {self.quantity}: {self.tool}: {self.seconds:.2f} s, {self.n_hvp} HVPs, value {self.value:.6g}, rel. error {self.rel_error:.1e}, {self.note}",
            flush=True,
        )


def rel_residual(eng: CurvatureEngine, v: torch.Tensor, lam: float) -> float:
    v = v.to(eng.problem.device, eng.problem.dtype).reshape(-1)
    v = v / v.norm()
    n0 = eng.state.tally.n_hvp
    r = float((eng.hessian()(v) - lam * v).norm()) / abs(lam)
    eng.state.tally.n_hvp = n0  # the check is not the method's cost
    return r


def best_of(dev, fn, repeats: int):
    """The result of the first run and the fastest wall time of ``repeats`` runs (others share the CPU)."""
    out, best = timed(dev, fn)
    for _ in range(repeats - 1):
        best = min(best, timed(dev, fn)[1])
    return out, best


# ---------------------------------------------------------------------------- tasks
@dataclass
class Task:
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    device: torch.device
    ref_dtype: torch.dtype

    @property
    def batches(self):
        return [
            (self.x[i : i + self.batch_size], self.y[i : i + self.batch_size])
            for i in range(0, len(self.x), self.batch_size)
        ]


def mlp_task(dev, batch_size, ref_dtype, train_steps=1500) -> Task:
    import dataclasses

    from flatcli.demo.models import MLP
    from flatcli.demo.zoo import RECIPE
    from flatcli.loading.data import digits_split
    from flatcli.training import LossTarget, train_to_target

    torch.manual_seed(0)
    x, y = digits_split("train")
    model = MLP(64, 256, 2, 10)
    recipe = dataclasses.replace(
        RECIPE, max_steps=train_steps, dtype="float32"
    )  # the demo's recipe, float32 for speed
    train_to_target(model, x, y, recipe, criterion=LossTarget(0.05))
    model.eval().to(dev)
    return Task("mlp-digits", model, x.to(dev), y.to(dev), batch_size or len(x), dev, ref_dtype)


def resnet_task(dev, n, batch_size, ref_dtype) -> Task:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().to(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (n,), generator=g).to(dev)
    return Task(f"resnet18-{n}", model, x, y, batch_size or min(n, 500), dev, ref_dtype)


def warm_up(task: Task) -> None:
    """One gradient and one HVP before timing (CUDA context, kernels, allocator)."""
    eng = flatcli_engine(task, cache_graphs=False)
    eng.loss_grad()[1]
    eng.hessian()(torch.ones(2, eng.problem.num_params, device=task.device))
    sync(task.device)


def flatcli_engine(task: Task, dtype=torch.float32, **kw) -> CurvatureEngine:
    p = Problem(
        task.model,
        task.x,
        task.y,
        loss="cross_entropy",
        batch_size=task.batch_size,
        device=task.device,
        dtype=dtype,
    )
    return CurvatureEngine(p, **kw)


def curvlinops_hessian(task: Task, crit):
    """Curvlinops' Hessian operator over the task's batches (the same data as flatcli's)."""
    from curvlinops import HessianLinearOperator

    params = [p for p in task.model.parameters() if p.requires_grad]
    return HessianLinearOperator(
        task.model, crit, params, task.batches, check_deterministic=False, num_data=len(task.x)
    )


# ---------------------------------------------------------------------------- λmax
def bench_lambda(
    task: Task, tol: float, log, repeats: int = 1, tight_iters: int = 1000, ref_steps: int = 400
) -> list[Row]:
    dev = task.device
    rows: list[Row] = []
    crit = nn.CrossEntropyLoss()

    # reference: Lanczos to 1e-7 in ref_dtype (float64 where affordable)
    def ref():
        eng = flatcli_engine(task, task.ref_dtype)
        g = torch.Generator().manual_seed(123)
        rtol = (
            1e-7 if task.ref_dtype == torch.float64 else 1e-6
        )  # float32 products are good to ~1e-6
        return linalg.lanczos(
            linalg.as_operator(
                eng.hessian().matmat_rows, eng.problem.num_params, device=dev, dtype=task.ref_dtype
            ),
            stop=linalg.KrylovStop(tol=rtol, min_steps=20, max_steps=ref_steps),
            generator=g,
        )

    r, dt = timed(dev, ref)
    lam_ref = float(r.eigenvalues[0])
    log(
        f"[{task.name}] λmax reference {lam_ref:.8g} (residual {r.residuals[0] / abs(lam_ref):.1e}, {r.steps} HVPs, {dt:.1f}s, {task.ref_dtype})"
    )
    check = flatcli_engine(task)

    def flat():
        eng = flatcli_engine(task)
        g = torch.Generator().manual_seed(0)
        res = linalg.lanczos(
            linalg.as_operator(eng.hessian().matmat_rows, eng.problem.num_params, device=dev),
            stop=linalg.KrylovStop(tol=tol, min_steps=20, max_steps=300),
            generator=g,
            return_vectors=True,
        )
        return res, eng

    (res, eng), dt = best_of(dev, flat, repeats)
    lam = float(res.eigenvalues[0])
    rows.append(
        Row(
            task.name,
            "lambda_max",
            "flatcli lanczos",
            dt,
            eng.counters()["n_hvp"],
            lam,
            abs(lam - lam_ref) / abs(lam_ref),
            rel_residual(check, res.ritz_vectors[0], lam),
            f"tol {tol:g}",
        )
    )

    try:
        from pyhessian import hessian as pyh
    except ImportError:
        log("pyhessian not installed: skipped")
        pyh = None
    if pyh is not None:
        for mode, kwargs in (
            ("data", {}),
            ("dataloader", {}),
            ("data", {"maxIter": tight_iters, "tol": tol**2}),
        ):
            if (
                mode == "data"
                and len(task.batches) > 1
                and task.device.type != "cuda"
                and len(task.x) > 4096
            ):
                continue

            def run(mode=mode, kwargs=kwargs):
                torch.manual_seed(0)
                ph = sys.modules["pyhessian.hessian"]

                count = [0]
                h = (
                    pyh(task.model, crit, data=(task.x, task.y), cuda=dev.type == "cuda")
                    if mode == "data"
                    else pyh(task.model, crit, dataloader=task.batches, cuda=dev.type == "cuda")
                )
                if mode == "data":
                    orig = ph.hessian_vector_product

                    def hv(*a):
                        count[0] += 1
                        return orig(*a)

                    ph.hessian_vector_product = hv
                    try:
                        ev, vecs = h.eigenvalues(**kwargs)
                    finally:
                        ph.hessian_vector_product = orig
                else:
                    orig = h.dataloader_hv_product

                    def dhv(w, orig=orig):
                        count[0] += 1
                        return orig(w)

                    h.dataloader_hv_product = dhv
                    ev, vecs = h.eigenvalues(**kwargs)
                return ev[0], vecs[0], count[0]

            try:
                (lam_p, pvec, n), dt = best_of(dev, run, repeats)
            except torch.cuda.OutOfMemoryError:
                log(f"pyhessian ({mode}) out of memory: skipped")
                torch.cuda.empty_cache()
                continue
            v = torch.cat([t.reshape(-1) for t in pvec])
            note = "default: 1e-3 rel. change" if not kwargs else f"rel. change {kwargs['tol']:g}"
            rows.append(
                Row(
                    task.name,
                    "lambda_max",
                    f"pyhessian power ({mode})",
                    dt,
                    n,
                    lam_p,
                    abs(lam_p - lam_ref) / abs(lam_ref),
                    rel_residual(check, v, lam_p),
                    note,
                )
            )
            _zero_grads(task.model)

    try:
        from curvlinops import HessianLinearOperator
    except ImportError:
        log("curvlinops not installed: skipped")
        HessianLinearOperator = None
    if HessianLinearOperator is not None:
        from scipy.sparse.linalg import LinearOperator, eigsh

        def run_cl():
            Hs = curvlinops_hessian(task, crit).to_scipy()
            count = [0]

            def mv(v):
                count[0] += 1
                return Hs @ v

            op = LinearOperator(Hs.shape, matvec=mv, dtype=Hs.dtype)
            rng = np.random.default_rng(0)
            w, vec = eigsh(
                op, k=1, which="LA", tol=tol, v0=rng.standard_normal(Hs.shape[0]).astype(Hs.dtype)
            )
            return float(w[0]), torch.from_numpy(vec[:, 0].copy()), count[0]

        (lam_c, vec, n), dt = best_of(dev, run_cl, repeats)
        rows.append(
            Row(
                task.name,
                "lambda_max",
                "curvlinops eigsh",
                dt,
                n,
                lam_c,
                abs(lam_c - lam_ref) / abs(lam_ref),
                rel_residual(check, vec, lam_c),
                f"scipy eigsh tol {tol:g}",
            )
        )
    return rows


def _zero_grads(model):
    for p in model.parameters():
        p.grad = None


# ---------------------------------------------------------------------------- trace
def bench_trace(
    task: Task, tol: float, ref_probes: int, max_probes: int, log, full: bool = False
) -> list[Row]:
    """Trace to ``tol`` relative stderr; peers at flatcli's probe count (equal accuracy)."""
    dev = task.device
    rows: list[Row] = []
    crit = nn.CrossEntropyLoss()

    def ref():
        eng = flatcli_engine(task)
        g = torch.Generator().manual_seed(321)
        return linalg.hutchpp(
            linalg.as_operator(
                eng.hessian().matmat_rows,
                eng.problem.num_params,
                device=dev,
            ),
            stop=linalg.ProbeStop(tol=1e-6, min_probes=ref_probes, max_probes=ref_probes),
            generator=g,
            settings=linalg.EstimatorSettings(block_size=eng.state.route().block_size),
        )

    r, dt = timed(dev, ref)
    tr_ref, se_ref = r.estimate, r.stderr
    log(
        f"[{task.name}] trace reference {tr_ref:.6g} ± {se_ref:.2g} ({se_ref / abs(tr_ref):.2%}; Hutch++ {r.probes} HVPs, sketch {r.sketch}, {dt:.1f}s, float32)"
    )
    note_ref = f"ref ± {se_ref / abs(tr_ref):.2%}"

    probes = {}
    for method in ("hutchinson", "hutchpp"):

        def flat(method=method):
            eng = flatcli_engine(task)
            g = torch.Generator().manual_seed(0)
            f = getattr(linalg, method)
            return f(
                linalg.as_operator(
                    eng.hessian().matmat_rows,
                    eng.problem.num_params,
                    device=dev,
                ),
                stop=linalg.ProbeStop(tol=tol, min_probes=16, max_probes=max_probes),
                generator=g,
                settings=linalg.EstimatorSettings(block_size=eng.state.route().block_size),
            ), eng

        (res, eng), dt = timed(dev, flat)
        probes[method] = res.probes
        rows.append(
            Row(
                task.name,
                "trace",
                f"flatcli {method}",
                dt,
                eng.counters()["n_hvp"],
                res.estimate,
                abs(res.estimate - tr_ref) / abs(tr_ref),
                note=f"stderr {res.stderr / abs(res.estimate):.2%}; {note_ref}; block {eng.state.route().block_size}",
            )
        )
    m, m_pp = probes["hutchinson"], probes["hutchpp"]

    try:
        from pyhessian import hessian as pyh
    except ImportError:
        pyh = None
    if pyh is not None:
        modes = (
            ["data"]
            if len(task.batches) == 1
            else (["data", "dataloader"] if dev.type == "cuda" else ["dataloader"])
        )
        runs = [(modes[0], "default", {})] + [
            (mode, f"{m} probes", {"maxIter": m, "tol": 0.0}) for mode in modes
        ]
        for mode, label, kwargs in runs:

            def run(mode=mode, kwargs=kwargs):
                torch.manual_seed(0)
                h = (
                    pyh(task.model, crit, data=(task.x, task.y), cuda=dev.type == "cuda")
                    if mode == "data"
                    else pyh(task.model, crit, dataloader=task.batches, cuda=dev.type == "cuda")
                )
                return h.trace(**kwargs)

            try:
                vals, dt = timed(dev, run)
            except torch.cuda.OutOfMemoryError:
                log(f"pyhessian trace ({mode}) out of memory: skipped")
                _zero_grads(task.model)
                torch.cuda.empty_cache()
                continue
            est = float(np.mean(vals))
            se = float(np.std(vals, ddof=1) / math.sqrt(len(vals)))
            rows.append(
                Row(
                    task.name,
                    "trace",
                    f"pyhessian ({mode}, {label})",
                    dt,
                    len(vals),
                    est,
                    abs(est - tr_ref) / abs(tr_ref),
                    note=f"stderr {se / abs(est):.2%}",
                    vs="flatcli hutchinson",
                )
            )
            _zero_grads(task.model)

    try:
        from curvlinops import HessianLinearOperator, hutchinson_trace, hutchpp_trace
    except ImportError:
        HessianLinearOperator = None
    if HessianLinearOperator is not None:
        chunk = flatcli_engine(task).state.route().block_size

        def operator():
            return curvlinops_hessian(task, crit)

        def run_pp():
            torch.manual_seed(0)
            return float(hutchpp_trace(operator(), 3 * math.ceil(m_pp / 3)))

        def run_h():
            torch.manual_seed(0)
            H = operator()
            total, done = 0.0, 0
            while done < m:
                k = min(chunk, m - done)
                total += float(hutchinson_trace(H, k)) * k
                done += k
            return total / m

        todo = [
            (
                "curvlinops hutchpp",
                run_pp,
                3 * math.ceil(m_pp / 3),
                "flatcli hutchpp",
                "all products at once",
            )
        ]
        if full:
            todo.append(
                (
                    f"curvlinops hutchinson ({m} probes)",
                    run_h,
                    m,
                    "flatcli hutchinson",
                    f"in chunks of {chunk}",
                )
            )
        for name, fn, n, vs, note in todo:
            try:
                est, dt = timed(dev, fn)
            except torch.cuda.OutOfMemoryError:
                log(f"{name}: out of memory: skipped")
                torch.cuda.empty_cache()
                continue
            rows.append(
                Row(
                    task.name,
                    "trace",
                    name,
                    dt,
                    n,
                    est,
                    abs(est - tr_ref) / abs(tr_ref),
                    note=note,
                    vs=vs,
                )
            )
    return rows


# ---------------------------------------------------------------------------- whole process (CPU)
PYHESSIAN_SCRIPT = """
import sys, torch, numpy as np
from pyhessian import hessian
from flatcli.demo.models import MLP
from flatcli.loading.data import digits_split
torch.manual_seed(0)
x, y = digits_split("train")
model = MLP(64, 256, 2, 10)
model.load_state_dict(torch.load(sys.argv[1]))
model.eval()
bs = int(sys.argv[3])
if bs >= len(x):
    h = hessian(model, torch.nn.CrossEntropyLoss(), data=(x, y), cuda=False)
else:
    loader = [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]
    h = hessian(model, torch.nn.CrossEntropyLoss(), dataloader=loader, cuda=False)
vals = h.trace(maxIter=int(sys.argv[2]), tol=0.0)
print(len(vals), float(np.mean(vals)))
"""

FLATCLI_CONFIG = """
model: {{target: "flatcli.demo.models:MLP", kwargs: {{in_features: 64, width: 256, depth: 2, num_classes: 10}}}}
data: {{train: {{source: digits}}}}
measure_data: {{split: train, num_samples: all, batch_size: {batch_size}}}
measures:
  - hessian_trace: {options}
runtime: {{device: cpu, precision: fp32, seed: 0}}
"""


def bench_process(
    task: Task,
    probes: int,
    accurate_probes: int,
    tol: float,
    batch_size: int,
    log,
    repeats: int = 2,
    pause: float = 0.0,
) -> list[Row]:
    """`flatcli measure` (a fresh process: imports, config, checkpoint, data, trace) vs PyHessian scripts.

    The processes alternate, so each flatcli run starts right after a PyHessian job has ended (the
    case ``threads: auto`` must not mistake for a busy machine); ``pause`` seconds of idle before
    each flatcli run give the idle case to compare with. flatcli runs with ``OMP_NUM_THREADS``
    unset (``threads: auto``); the threads it chose are in each row's note.

    Same probe count: flatcli (Hutchinson, ``probes``, batches of ``batch_size``)
    vs PyHessian on the whole set as one batch (graph reused) and with a
    dataloader of ``batch_size``. Equal accuracy: flatcli Hutch++ to ``tol``
    relative stderr vs PyHessian (one batch) with ``accurate_probes`` probes,
    the Hutchinson count that reached ``tol`` in-process.
    """
    tmp = Path(tempfile.mkdtemp(prefix="flatcli-bench-"))
    ck = tmp / "mlp.pt"
    torch.save({k: v.cpu() for k, v in task.model.state_dict().items()}, ck)
    n = len(task.x)
    cfgs = {
        "hutchinson-all": (n, f"{{min_probes: {probes}, max_probes: {probes}}}"),
        "hutchinson-batched": (batch_size, f"{{min_probes: {probes}, max_probes: {probes}}}"),
        "hutchpp-all": (n, f"{{method: hutchpp, tol: {tol}, max_probes: 5000}}"),
    }
    for k, (bs, opts) in cfgs.items():
        (tmp / f"{k}.yaml").write_text(FLATCLI_CONFIG.format(batch_size=bs, options=opts))
    script = tmp / "pyhessian_trace.py"
    script.write_text(PYHESSIAN_SCRIPT)
    env = dict(os.environ)  # the child imports the installed flatcli (pip install -e .)
    flat_env = {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "FLATCLI_THREADS")}

    def flat(cfg):
        return [
            sys.executable,
            "-m",
            "flatcli.cli",
            "measure",
            str(ck),
            "-c",
            str(tmp / cfg),
            "-o",
            str(tmp / ("out-" + cfg)),
            "--format",
            "csv",
        ]

    fa = f"flatcli measure, hutchinson ({probes} probes, one batch)"
    fb = f"flatcli measure, hutchinson ({probes} probes, batch {batch_size})"
    fp = f"flatcli measure, hutchpp (to {tol:.0%} stderr, one batch)"
    runs = [
        (fa, flat("hutchinson-all.yaml"), probes, None),
        (
            f"pyhessian script ({probes} probes, one batch)",
            [sys.executable, str(script), str(ck), str(probes), str(n)],
            probes,
            fa,
        ),
        (fb, flat("hutchinson-batched.yaml"), probes, None),
        (
            f"pyhessian script ({probes} probes, batch {batch_size})",
            [sys.executable, str(script), str(ck), str(probes), str(batch_size)],
            probes,
            fb,
        ),
        (fp, flat("hutchpp-all.yaml"), None, None),
        (
            f"pyhessian script ({accurate_probes} probes = {tol:.0%} stderr, one batch)",
            [sys.executable, str(script), str(ck), str(accurate_probes), str(n)],
            accurate_probes,
            fp,
        ),
    ]
    best: dict[str, float] = {}
    outs = {}
    threads_seen: dict[str, list[str]] = {}
    for i in range(repeats):
        for name, cmd, _, _ in runs:
            if (
                i > 0
                and name.startswith("pyhessian script (" + str(accurate_probes))
                and accurate_probes > 4 * probes
            ):
                continue  # long run: once is enough
            is_flat = name.startswith("flatcli")
            if is_flat and pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            out = subprocess.run(
                cmd, env=flat_env if is_flat else env, capture_output=True, text=True, cwd=tmp
            )
            dt = time.perf_counter() - t0
            if out.returncode != 0:
                log(f"{name} failed ({out.returncode}): {out.stderr[-2000:]}")
                continue
            if is_flat:
                chose = [ln for ln in out.stderr.splitlines() if ln.startswith("threads")]
                log(f"{name}: {dt:.1f}s; {chose[-1] if chose else 'threads: not reported'}")
                threads_seen.setdefault(name, []).append(chose[-1] if chose else "?")
            best[name] = min(best.get(name, math.inf), dt)
            outs[name] = out
    rows = []
    import csv

    for name, cmd, nprobes, vs in runs:
        if name not in outs:
            continue
        note = ""
        if name.startswith("flatcli"):
            outdir = Path(cmd[cmd.index("-o") + 1])
            with open(outdir / "results.csv") as f:
                row = next(csv.DictReader(f))
            value = float(row["hessian_trace"])
            nprobes = int(
                float(row.get("hessian_trace_probes") or row.get("hessian_trace_n_hvp") or 0)
            )
            se = row.get("hessian_trace_stderr")
            note = f"stderr {float(se) / abs(value):.2%}" if se else ""
            chosen = sorted({t.split(" per worker")[0] for t in threads_seen.get(name, [])})
            note = "; ".join([n for n in [note, ", ".join(chosen)] if n])
        else:
            value = float(outs[name].stdout.split()[-1])
        rows.append(
            Row(
                task.name,
                "trace (whole process)",
                name,
                best[name],
                nprobes,
                value,
                note=note,
                vs=vs,
            )
        )
    return rows


# ---------------------------------------------------------------------------- the engine bar
BAR_MODEL = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features=64, width=256, depth=2, num_classes=10):
        super().__init__()
        layers, d = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.net = nn.Sequential(*layers, nn.Linear(d, num_classes))

    def forward(self, x):
        return self.net(x)
"""

BAR_PYHESSIAN = """
import sys, time, torch, numpy as np
t0 = time.perf_counter()
from pyhessian import hessian
from model import MLP
model = MLP(**eval(sys.argv[3]))
model.load_state_dict(torch.load(sys.argv[1]))
model.eval()
d = torch.load("data.pt")
h = hessian(model, torch.nn.CrossEntropyLoss(), data=(d["x"], d["y"]), cuda=False)
t1 = time.perf_counter()
vals = h.trace(maxIter=int(sys.argv[2]), tol=0.0)
print(len(vals), float(np.mean(vals)), time.perf_counter() - t1, torch.get_num_threads())
"""

BAR_CONFIG = """
model: {{target: "model.py:MLP", kwargs: {kwargs}}}
data: {{train: {{source: tensors, path: data.pt}}}}
measure_data: {{split: train, num_samples: all, batch_size: {batch_size}}}
measures:
  - hessian_trace: {{method: hutchinson, min_probes: {probes}, max_probes: {probes}}}
runtime: {{device: cpu, precision: fp32, seed: 0, threads: auto}}
"""


@dataclass
class BarSetup:
    """The engine bar's scenario: an MLP over ``samples`` rows of 64 features (labels from a
    random linear teacher), trained in this process; ``probes`` Hutchinson probes."""

    samples: int = 8192
    probes: int = 200
    width: int = 256
    depth: int = 2
    train_steps: int = 300
    parent_seconds: float = 2.0
    batch_size: int = 0  # flatcli's measure_data.batch_size (0: all rows, PyHessian's one batch)

    @property
    def kwargs(self) -> dict:
        return {"in_features": 64, "width": self.width, "depth": self.depth, "num_classes": 10}


def _bar_files(setup: BarSetup, log):
    """The scenario's files in a fresh folder (model.py, data.pt, mlp.pt, the config and the
    PyHessian script) and the parent's training step (the torch work before each launch)."""
    tmp = Path(tempfile.mkdtemp(prefix="flatcli-bar-"))
    (tmp / "model.py").write_text(BAR_MODEL)
    (tmp / "pyhessian_trace.py").write_text(BAR_PYHESSIAN)
    bs = setup.batch_size or setup.samples
    (tmp / "cfg.yaml").write_text(
        BAR_CONFIG.format(kwargs=setup.kwargs, batch_size=bs, probes=setup.probes)
    )
    import importlib.util

    spec = importlib.util.spec_from_file_location("bar_model", tmp / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the users' model file, beside the config
    MLP = mod.MLP
    g = torch.Generator().manual_seed(0)
    x = torch.randn(setup.samples, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(1)
    torch.save({"x": x, "y": y}, tmp / "data.pt")
    torch.manual_seed(0)
    model = MLP(**setup.kwargs)
    opt = torch.optim.Adam(model.parameters(), 1e-3)

    def step():
        idx = torch.randint(0, setup.samples, (256,))
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    t0 = time.perf_counter()
    for _ in range(setup.train_steps):
        loss = step()
    log(
        f"[bar] trained the MLP: {setup.train_steps} steps, loss {loss:.3f}, {time.perf_counter() - t0:.1f}s"
    )
    torch.save(model.state_dict(), tmp / "mlp.pt")
    return tmp, step


def _parent_work(step, seconds: float) -> None:
    """Training steps for ``seconds`` in this process (its thread pool then spins as after any job)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        step()


def _child(
    cmd: list[str], env: dict, cwd: Path
) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd``; its result, wall seconds and CPU seconds (user + system, all its threads)."""

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    return out, time.perf_counter() - t0, cpu() - c0


def _bar_flatcli(tmp: Path, env: dict, run: int) -> dict:
    out_dir = tmp / f"out-{run}"
    cmd = [sys.executable, "-m", "flatcli", "measure", "mlp.pt", "-c", "cfg.yaml"]
    cmd += ["-o", str(out_dir), "--format", "csv"]
    out, wall, cpu = _child(cmd, env, tmp)
    if out.returncode != 0:
        raise RuntimeError(f"flatcli measure failed ({out.returncode}): {out.stderr[-2000:]}")
    import csv

    with open(out_dir / "results.csv") as f:
        row = next(csv.DictReader(f))
    chose = [ln for ln in out.stderr.splitlines() if ln.startswith("threads")]
    return {
        "seconds": wall,
        "cpu": cpu,
        "measure": float(row["hessian_trace_seconds"]),
        "value": float(row["hessian_trace"]),
        "n_hvp": int(float(row["hessian_trace_n_hvp"])),
        "threads": chose[-1].split(" per worker")[0] if chose else "threads: not reported",
        "detail": chose[-1] if chose else "",
    }


def _bar_pyhessian(tmp: Path, env: dict, setup: BarSetup) -> dict:
    cmd = [sys.executable, "pyhessian_trace.py", "mlp.pt", str(setup.probes), repr(setup.kwargs)]
    out, wall, cpu = _child(cmd, env, tmp)
    if out.returncode != 0:
        raise RuntimeError(f"PyHessian script failed ({out.returncode}): {out.stderr[-2000:]}")
    n, value, trace_s, nthreads = out.stdout.split()[-4:]
    return {
        "seconds": wall,
        "cpu": cpu,
        "measure": float(trace_s),
        "value": float(value),
        "n_hvp": int(n),
        "threads": f"threads: {nthreads} (torch default)",
        "detail": "",
    }


def bench_bar(setup: BarSetup, repeats: int, log) -> list[Row]:
    """The engine bar: ``flatcli measure`` (``hessian_trace``, Hutchinson, ``setup.probes`` probes,
    ``threads: auto``) against a PyHessian script (``hessian(...).trace(maxIter=probes, tol=0)``
    on the same model file, checkpoint and data as one batch, torch's default threads), both as
    fresh processes, alternated ``repeats`` times, each launched right after this process did
    ``setup.parent_seconds`` of training steps (its own thread pool spinning after the job, as a
    training script that launches a measurement). Neither child imports the other's package.
    Rows: each run (wall time; the trace's own seconds and the rest in the note), then the median
    of each tool and its ratio (the bar: at most 0.7)."""
    tmp, step = _bar_files(setup, log)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FLATCLI_THREADS")}
    name = f"mlp-{setup.samples}"
    rows: list[Row] = []
    runs: dict[str, list[dict]] = {"flatcli": [], "pyhessian": []}
    for i in range(1, repeats + 1):
        for tool in ("flatcli", "pyhessian"):
            _parent_work(step, setup.parent_seconds)
            r = _bar_flatcli(tmp, env, i) if tool == "flatcli" else _bar_pyhessian(tmp, env, setup)
            runs[tool].append(r)
            label = (
                f"flatcli measure, run {i}" if tool == "flatcli" else f"pyhessian script, run {i}"
            )
            rest = r["seconds"] - r["measure"]
            rows.append(
                Row(
                    name,
                    f"trace, {setup.probes} probes (whole process)",
                    label,
                    r["seconds"],
                    r["n_hvp"],
                    r["value"],
                    note=f"trace {r['measure']:.2f} s, rest of the process {rest:.2f} s; "
                    f"CPU {r['cpu']:.1f} s; {r['threads']}",
                    vs=f"flatcli measure, run {i}" if tool == "pyhessian" else None,
                    extra={"cpu": r["cpu"], "trace": r["measure"], "threads": r["threads"]},
                )
            )
            log(
                f"[bar] {label}: {r['seconds']:.2f}s (trace {r['measure']:.2f}s); {r['detail'] or r['threads']}"
            )
    med = {t: sorted(r["seconds"] for r in rs)[len(rs) // 2] for t, rs in runs.items()}
    med_trace = {t: sorted(r["measure"] for r in rs)[len(rs) // 2] for t, rs in runs.items()}
    for tool, label in (("flatcli", "flatcli measure"), ("pyhessian", "pyhessian script")):
        rows.append(
            Row(
                name,
                f"trace, {setup.probes} probes (whole process)",
                f"{label}, median of {repeats}",
                med[tool],
                runs[tool][0]["n_hvp"],
                runs[tool][0]["value"],
                note=f"trace {med_trace[tool]:.2f} s (median)",
                vs=f"flatcli measure, median of {repeats}" if tool == "pyhessian" else None,
                extra={
                    "cpu": sorted(r["cpu"] for r in runs[tool])[len(runs[tool]) // 2],
                    "trace": med_trace[tool],
                    "threads": "",
                },
            )
        )
    return rows


BAR_COLUMNS = [
    "tool",
    "time (s)",
    "CPU (s)",
    "trace (s)",
    "rest of the process (s)",
    "HVPs",
    "value",
    "threads",
    "flatcli / PyHessian time",
]


def bar_cells(r: Row) -> list[str]:
    """A row of the engine bar's table (`BAR_COLUMNS`); medians: CPU is the median run's."""
    e = r.extra or {}
    return [
        r.tool,
        f"{r.seconds:.2f}",
        f"{e.get('cpu', math.nan):.1f}",
        f"{e.get('trace', math.nan):.2f}",
        f"{r.seconds - e.get('trace', math.nan):.2f}",
        str(r.n_hvp),
        f"{r.value:.6g}",
        e.get("threads", ""),
        _fmt(r.ratio, ".2f"),
    ]


def bar_summary(rows: list[Row], bar: float = 0.7) -> str:
    """The median ratio in words, against ``bar`` where the rows are the bar's scenario (200
    probes over 8,192 rows); other sizes only say the ratio."""
    peer = next((r for r in rows if r.tool.startswith("pyhessian script, median")), None)
    if peer is None or math.isnan(peer.ratio):
        return ""
    scenario = peer.task == "mlp-8192" and peer.quantity.startswith("trace, 200 probes")
    verdict = (
        f" ({'within' if peer.ratio <= bar else 'above'} the bar of {bar})"
        if scenario
        else " (not the bar's scenario, 200 probes over 8,192 rows: no verdict)"
    )
    per_run = ", ".join(
        f"{r.ratio:.2f}" for r in rows if r.tool.startswith("pyhessian script, run")
    )
    return (
        f"flatcli / PyHessian whole-process time, median of the runs: {peer.ratio:.2f}{verdict}; "
        f"per run: {per_run}"
    )


# ---------------------------------------------------------------------------- HVP variants
def bench_variants(task: Task, log, reps: int = 3) -> list[str]:
    """Per-probe cost of each HVP variant, in gradients, for K = 1 and K = block."""
    variants = {
        "reverse, fresh graph, loop": dict(
            hvp_mode="reverse", reverse_batched=False, cache_graphs=False
        ),
        "reverse, cached graph, loop": dict(
            hvp_mode="reverse", reverse_batched=False, cache_graphs=True
        ),
        "reverse, cached graph, is_grads_batched": dict(
            hvp_mode="reverse", reverse_batched=True, cache_graphs=True
        ),
        "forward (vmap jvp grad)": dict(hvp_mode="forward", cache_graphs=False),
    }
    dev = task.device
    base = flatcli_engine(task)
    K = base.state.route().block_size
    best = {}
    engs = {}
    for name, kw in variants.items():
        try:
            engs[name] = flatcli_engine(task, block_size=K, **kw)
        except RuntimeError as e:
            log(f"{name}: {e}")
    P = base.problem.num_params
    g = torch.Generator().manual_seed(0)
    hessians = {name: e.hessian() for name, e in engs.items()}
    for k in (1, K):
        V = torch.randn(k, P, generator=g).to(dev)
        for name, H in hessians.items():
            try:
                H(V)
            except torch.cuda.OutOfMemoryError:
                best[(name, k)] = math.nan
        for _ in range(reps):
            for name, H in hessians.items():
                if (name, k) in best and math.isnan(best[(name, k)]):
                    continue
                _, dt = timed(dev, lambda H=H, V=V: H(V))
                best[(name, k)] = min(best.get((name, k), math.inf), dt / k)
            _, dt = timed(dev, base.loss_grad)
            best["grad"] = min(best.get("grad", math.inf), dt)
    tg = best["grad"]
    lines = [
        f"HVP variants on {task.name} (P = {P:,}, batch {task.batch_size}), per-probe cost in gradients (gradient {tg * 1e3:.1f} ms):",
        "",
        f"| variant | K = 1 | K = {K} |",
        "|---|---|---|",
    ]
    for name in engs:
        lines.append(f"| {name} | {best[(name, 1)] / tg:.2f} | {best[(name, K)] / tg:.2f} |")
    return lines


# ---------------------------------------------------------------------------- report
def add_ratios(rows: list[Row]) -> None:
    """Ratio = flatcli time / peer time for every peer row (< 1: flatcli is faster)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.task, r.quantity), []).append(r)
    for grp in groups.values():
        mine = [r for r in grp if r.tool.startswith("flatcli")]
        for r in grp:
            if r.tool.startswith("flatcli") or not mine or r.vs is None:
                continue
            ref = (
                mine[0]
                if r.vs == "first"
                else next((f for f in mine if f.tool.startswith(r.vs)), None)
            )
            if ref is not None and r.seconds > 0:
                r.ratio = ref.seconds / r.seconds
                r.vs = ref.tool


def _fmt(v, fmt: str) -> str:
    return "" if (v is None or (isinstance(v, float) and math.isnan(v))) else format(v, fmt)


COLUMNS = [
    "task",
    "quantity",
    "tool",
    "time (s)",
    "HVPs",
    "value",
    "rel. error",
    "rel. residual",
    "flatcli / peer time",
    "compared with",
    "note",
]


def cells(r: Row) -> list[str]:
    f = _fmt
    return [
        r.task,
        r.quantity,
        r.tool,
        f"{r.seconds:.2f}",
        str(r.n_hvp),
        f"{r.value:.6g}",
        f(r.rel_error, ".1e"),
        f(r.residual, ".1e"),
        f(r.ratio, ".2f"),
        r.vs if not math.isnan(r.ratio) else "",
        r.note,
    ]


def table(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(out)


def variant_table(lines: list[str]) -> dict:
    """The HVP-variant lines (`bench_variants`: a caption, then a Markdown table) as a JSON table."""
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    return json_table(lines[0].rstrip(":"), rows[0], rows[1:]) if rows else {}


def summary(rows: list[Row]) -> str:
    """Equal-accuracy comparisons in words."""
    out = []
    for task in dict.fromkeys(r.task for r in rows):
        rs = {r.tool: r for r in rows if r.task == task}
        hpp = rs.get("flatcli hutchpp")
        hut = rs.get("flatcli hutchinson")
        for r in rs.values():
            if (
                hpp
                and hut
                and r.quantity == "trace"
                and r.tool.startswith("pyhessian")
                and r.n_hvp == hut.n_hvp
            ):
                out.append(
                    f"- {task}, trace at equal accuracy ({r.note}): flatcli Hutch++ {hpp.seconds:.2f} s / {hpp.n_hvp} HVPs vs "
                    f"{r.tool} {r.seconds:.2f} s / {r.n_hvp} HVPs: flatcli/peer time {hpp.seconds / r.seconds:.2f}"
                )
    return "\n".join(out)


def bar_args(ap) -> None:
    """The engine bar's options (task ``bar``)."""
    d = BarSetup()
    ap.add_argument("--bar-samples", type=int, default=d.samples, help="rows of the MLP's data")
    ap.add_argument("--bar-probes", type=int, default=d.probes, help="Hutchinson probes")
    ap.add_argument("--bar-width", type=int, default=d.width, help="the MLP's hidden width")
    ap.add_argument(
        "--bar-repeats", type=int, default=3, help="flatcli / PyHessian pairs, alternated"
    )
    ap.add_argument(
        "--bar-train-steps", type=int, default=d.train_steps, help="Adam steps training the MLP"
    )
    ap.add_argument(
        "--bar-parent-seconds",
        type=float,
        default=d.parent_seconds,
        help="seconds of training steps in this process right before each launch",
    )
    ap.add_argument(
        "--bar-batch-size",
        type=int,
        default=d.batch_size,
        help="flatcli's measure_data.batch_size (default: all rows, PyHessian's one batch)",
    )


def bar_setup(args) -> BarSetup:
    return BarSetup(
        samples=args.bar_samples,
        probes=args.bar_probes,
        width=args.bar_width,
        train_steps=args.bar_train_steps,
        parent_seconds=args.bar_parent_seconds,
        batch_size=args.bar_batch_size,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tasks",
        default="mlp,process",
        help="comma list of mlp, process, variants, resnet (= resnet-variants, resnet-lambda, "
        "resnet-trace), bar (the engine bar: whole processes on an MLP, --bar-* options)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=5000, help="ResNet-18 inputs")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="batch size (default: all for mlp, 500 for resnet)",
    )
    ap.add_argument("--lambda-tol", type=float, default=1e-4)
    ap.add_argument("--trace-tol", type=float, default=0.01)
    ap.add_argument(
        "--ref-probes",
        type=int,
        default=0,
        help="Hutch++ HVPs for the trace reference (default by task)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="λmax runs per tool; the fastest wall time is reported",
    )
    ap.add_argument(
        "--process-probes",
        type=int,
        default=256,
        help="probes of the whole-process trace comparison",
    )
    ap.add_argument(
        "--process-accurate-probes",
        type=int,
        default=2560,
        help="PyHessian probes for 1%% stderr when the mlp task did not run",
    )
    ap.add_argument(
        "--process-batch-size",
        type=int,
        default=256,
        help="flatcli's measure_data.batch_size and PyHessian's dataloader batch",
    )
    ap.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds of idle before each flatcli process of the process task (default 0: right "
        "after the previous job)",
    )
    ap.add_argument(
        "--max-probes", type=int, default=5000, help="most probes of flatcli's trace estimators"
    )
    ap.add_argument(
        "--ref-steps", type=int, default=400, help="most Lanczos steps of the λmax reference"
    )
    ap.add_argument(
        "--pyhessian-tight-iters",
        type=int,
        default=1000,
        help="maxIter of PyHessian's power iteration at tol = lambda_tol²",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="also curvlinops Hutchinson at flatcli's probe count (slow)",
    )
    ap.add_argument(
        "--ref-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="reference precision (default fp64 on CPU, fp32 on CUDA)",
    )
    bar_args(ap)
    json_arg(ap, "engine")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_dtype = {"fp32": torch.float32, "fp64": torch.float64}[
        args.ref_dtype or ("fp32" if dev.type == "cuda" else "fp64")
    ]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    lines: list[str] = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    log(
        f"device: {device_name(dev)}; torch {torch.__version__}; python {platform.python_version()}"
    )
    rows: list[Row] = []
    variant_lines: list[str] = []
    mlp = resnet = None
    for t in tasks:
        t0 = time.perf_counter()
        if t in ("mlp", "process", "variants") and mlp is None:
            mlp = mlp_task(
                dev if t != "process" else torch.device("cpu"), args.batch_size, ref_dtype
            )
        if t == "mlp":
            rows += bench_lambda(
                mlp, args.lambda_tol, log, args.repeats, args.pyhessian_tight_iters, args.ref_steps
            )
            rows += bench_trace(
                mlp, args.trace_tol, args.ref_probes or 600, args.max_probes, log, args.full
            )
        elif t.startswith("resnet"):
            if resnet is None:
                resnet = resnet_task(dev, args.n, args.batch_size, ref_dtype)
                warm_up(resnet)
            if t in ("resnet", "resnet-variants"):
                variant_lines += bench_variants(resnet, log)
                log("\n".join(variant_lines))
            if t in ("resnet", "resnet-lambda"):
                rows += bench_lambda(
                    resnet,
                    args.lambda_tol,
                    log,
                    args.repeats,
                    args.pyhessian_tight_iters,
                    args.ref_steps,
                )
            if t in ("resnet", "resnet-trace"):
                rows += bench_trace(
                    resnet, args.trace_tol, args.ref_probes or 600, args.max_probes, log, args.full
                )
        elif t == "process":
            acc = next(
                (r.n_hvp for r in rows if r.tool == "flatcli hutchinson" and r.task == mlp.name),
                args.process_accurate_probes,
            )
            rows += bench_process(
                mlp,
                args.process_probes,
                acc,
                args.trace_tol,
                args.process_batch_size,
                log,
                max(1, min(args.repeats, 2)),
                args.pause,
            )
        elif t == "variants":
            variant_lines += bench_variants(mlp, log)
        elif t == "bar":
            rows += bench_bar(bar_setup(args), args.bar_repeats, log)
        else:
            ap.error(f"unknown task {t!r}")
        log(f"[{t}] done in {time.perf_counter() - t0:.1f}s")
    add_ratios(rows)
    md = table(rows) + "\n\n" + summary(rows) + "\n" + bar_summary(rows)
    print()
    print(md)
    if variant_lines:
        print()
        print("\n".join(variant_lines))
    bar_rows = [r for r in rows if r.extra is not None]
    rows = [r for r in rows if r.extra is None]
    tables = (
        [
            json_table(
                "flatcli vs PyHessian and curvlinops",
                COLUMNS,
                [cells(r) for r in rows],
                summary(rows),
            )
        ]
        if rows
        else []
    )
    if bar_rows:
        title = f"{bar_rows[0].task}: {bar_rows[0].quantity}"
        tables.append(
            json_table(title, BAR_COLUMNS, [bar_cells(r) for r in bar_rows], bar_summary(bar_rows))
        )
    if tasks == ["bar"] and args.json == DATA / "engine.json":
        args.json = DATA / f"engine-process-{args.bar_samples}.json"
    tables += [t for t in [variant_table(variant_lines)] if t]
    title = (
        "The engine bar: flatcli against PyHessian as whole processes"
        if tasks == ["bar"]
        else "Curvature engine: flatcli vs PyHessian and curvlinops"
    )
    print(f"wrote {write_json('engine', title, tables, args.json, dev=dev)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
