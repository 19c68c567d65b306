"""Memory-lean estimators (issue 27, point 3): Lanczos, SLQ and Hutch++ with their bases offloaded
to host memory (`flatcli.engine.linalg._store.BasisStore`) give the all-on-device values to rounding,
and never hold more than ``max_device_vectors`` basis vectors on the device."""

import importlib

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.engine import CurvatureEngine, Problem, linalg
from flatcli.engine.linalg import _store
from flatcli.engine.linalg._store import BasisStore
from tests.oracles import problem_hessian

DT = torch.float64


def gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def clustered(n=240, seed=0):
    """A symmetric matrix whose top eigenvalues are clustered (1, 0.999, 0.998) over a dense bulk: Lanczos
    needs many steps and loses orthogonality without full reorthogonalization."""
    g = gen(seed)
    ev = torch.cat(
        [
            torch.tensor([1.0, 0.999, 0.998], dtype=DT),
            torch.rand(n - 3, generator=g, dtype=DT) * 0.99,
        ]
    )
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    return U @ torch.diag(ev) @ U.T, ev


class Counting:
    """A store factory that records every store made (to read their peak residency)."""

    def __init__(self):
        self.stores = []

    def __call__(self, *a, **kw):
        s = BasisStore(*a, **kw)
        self.stores.append(s)
        return s


@pytest.fixture
def counting(monkeypatch):
    c = Counting()
    for name in ("vectors",):  # the module that makes the stores
        monkeypatch.setattr(
            importlib.import_module(f"flatcli.engine.linalg.{name}"), "BasisStore", c
        )
    return c


@pytest.mark.parametrize("cap,block", [(2, 1), (7, 1), (3, 2)])
def test_lanczos_offloaded_equals_on_device_to_rounding(counting, cap, block):
    A, ev = clustered()
    kw = dict(
        k=2,
        stop=linalg.KrylovStop(tol=1e-10, max_steps=120),
        generator=gen(1),
        block=block,
        return_vectors=True,
    )
    ref = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=None),
        **kw,
    )
    kw["generator"] = gen(1)
    off = linalg.lanczos(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=cap),
        **kw,
    )
    assert off.steps == ref.steps > 40  # the hard case: many steps, every one reorthogonalized
    np.testing.assert_allclose(off.eigenvalues, ref.eigenvalues, rtol=0, atol=1e-12)
    np.testing.assert_allclose(off.residuals, ref.residuals, rtol=0, atol=1e-12)
    torch.testing.assert_close(off.ritz_vectors, ref.ritz_vectors, rtol=0, atol=1e-10)
    np.testing.assert_allclose(
        off.eigenvalues[:2], [1.0, 0.999], atol=1e-9
    )  # and right (exact eigenvalues)
    store = counting.stores[-1]
    assert store.offloaded and len(store) == off.steps
    assert off.device_vectors == store.peak_resident == max(cap, block)  # never more than the cap
    assert store.transfers > 2 * off.steps  # the basis really was streamed, pass after pass
    assert ref.device_vectors == ref.steps  # all on the device without a cap


def test_slq_offloaded_equals_on_device_to_rounding(counting):
    A, ev = clustered(120)
    kw = dict(runs=3, steps=30)
    ref = linalg.slq(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=None),
        generator=gen(2),
        **kw,
    )
    off = linalg.slq(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=4),
        generator=gen(2),
        **kw,
    )
    for a, b in zip(ref.nodes + ref.weights, off.nodes + off.weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-12)
    stores = [s for s in counting.stores if s.offloaded]
    assert len(stores) == 3 and all(len(s) == 30 and s.peak_resident == 4 for s in stores)
    est, _ = off.expect(lambda t: t)
    assert abs(est - float(ev.sum())) < 0.2 * float(
        ev.sum()
    )  # the estimator still estimates the trace


def test_hutchpp_offloaded_equals_on_device_to_rounding(counting):
    A, ev = clustered(150)
    kw = dict(stop=linalg.ProbeStop(tol=1e-3, min_probes=12, max_probes=90))
    ref = linalg.hutchpp(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=None),
        generator=gen(3),
        **kw,
    )
    off = linalg.hutchpp(
        linalg.as_operator(lambda V: V @ A, A.shape[0], dtype=DT),
        settings=linalg.EstimatorSettings(max_device_vectors=3),
        generator=gen(3),
        **kw,
    )
    assert off.sketch == ref.sketch > 3 and off.probes == ref.probes
    assert off.estimate == pytest.approx(ref.estimate, rel=1e-12)
    assert off.stderr == pytest.approx(ref.stderr, rel=1e-9)
    store = counting.stores[-1]
    assert store.offloaded and store.peak_resident == 3 and len(store) == off.sketch


def _tiny_problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT).eval()
    x = torch.randn(40, 5, dtype=DT)
    y = torch.randint(0, 3, (40,))
    return Problem(model, x, y, loss="cross_entropy", batch_size=16, dtype=DT)


def test_engine_setting_reaches_lanczos_and_model_lambda_max_is_exact(counting):
    p = _tiny_problem()
    H = problem_hessian(p)
    exact = np.linalg.eigvalsh(H.numpy())
    eng = CurvatureEngine(p, max_device_vectors=2)
    op = eng.hessian()
    assert eng.estimator_settings.max_device_vectors == 2
    res = linalg.lanczos(
        op,
        k=3,
        block=1,
        stop=linalg.KrylovStop(tol=1e-10, max_steps=p.num_params),
        generator=gen(4),
        settings=eng.estimator_settings,
    )
    assert counting.stores[-1].offloaded and res.device_vectors == 2
    np.testing.assert_allclose(res.eigenvalues[:3], exact[::-1][:3], rtol=1e-9, atol=1e-12)


def test_default_capacity_is_unbounded_on_cpu_and_bad_values_are_refused():
    assert _store.default_capacity(10**9, "cpu", torch.float32) is None
    with pytest.raises(ValueError, match="max_device_vectors"):
        BasisStore(10, "cpu", DT, capacity=0)
    with pytest.raises(ValueError, match="max_device_vectors"):
        linalg.lanczos(
            linalg.as_operator(lambda V: V, dim=10),
            settings=linalg.EstimatorSettings(max_device_vectors=-1),
        )
