"""CUDA checks of the curvature engine (skipped without a CUDA device).

Forward-over-reverse (vmap) and double-backward HVPs must agree on the GPU, and
float64 products on the GPU must match dense float64 Hessians computed on the CPU.
"""

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.api import measure_model
from flatcli.engine import CurvatureEngine, Problem, linalg
from flatcli.engine.curvatures import Hessian
from tests.oracles import problem_hessian

pytestmark = pytest.mark.gpu

DT = torch.float64


@pytest.fixture(autouse=True)
def _strict_fp32():
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def small_convnet():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def conv_problem(dtype, device, n=20, batch_size=7):
    torch.manual_seed(0)
    model = small_convnet().eval()
    with torch.no_grad():  # non-trivial running statistics
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(n, 3, 8, 8)
    y = torch.randint(0, 5, (n,))
    return Problem(model.to(device), x, y, batch_size=batch_size, device=device, dtype=dtype)


def vecs(P, k, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, P, generator=g, dtype=dtype).to(device)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_forward_and_reverse_hvp_agree_on_cuda_fp32():
    p = conv_problem(torch.float32, "cuda")
    V = vecs(p.num_params, 6, "cuda", torch.float32)
    fwd = CurvatureEngine(p, hvp_mode="forward", block_size=6)
    rev_b = CurvatureEngine(p, hvp_mode="reverse", reverse_batched=True, cache_graphs=True)
    rev_l = CurvatureEngine(p, hvp_mode="reverse", reverse_batched=False, cache_graphs=False)
    a, b, c = fwd.hessian()(V), rev_b.hessian()(V), rev_l.hessian()(V)
    assert fwd.counters()["fallbacks"] == 0 and fwd.state.route().hessian == "forward"
    assert rel(a, c) <= 1e-4 and rel(b, c) <= 1e-4
    assert rel(fwd.hessian()(V[0]), c[0]) <= 1e-4


def test_fp64_cuda_products_match_dense_cpu_hessian():
    pc = conv_problem(DT, "cpu")
    H = problem_hessian(pc)
    pg = conv_problem(DT, "cuda")
    V = vecs(pg.num_params, 4, "cuda", DT)
    ref = V.cpu() @ H
    for mode, batched in (("forward", None), ("reverse", True), ("reverse", False), ("auto", None)):
        eng = CurvatureEngine(pg, hvp_mode=mode, reverse_batched=batched)
        torch.testing.assert_close(eng.hessian()(V).cpu(), ref, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(eng.hessian()(V[1]).cpu(), ref[1], rtol=1e-9, atol=1e-11)
    ev = torch.linalg.eigvalsh(H).numpy()
    eng = CurvatureEngine(pg)
    g = torch.Generator().manual_seed(0)
    r = linalg.lanczos(
        linalg.as_operator(eng.hessian().matmat_rows, pg.num_params, device="cuda", dtype=DT),
        stop=linalg.KrylovStop(tol=1e-6),
        generator=g,
    )
    assert abs(r.eigenvalues[0] - ev[-1]) <= 1e-4 * abs(ev[-1])
    H_op = linalg.as_operator(
        eng.hessian().matmat_rows,
        pg.num_params,
        device="cuda",
        dtype=DT,
    )
    d = linalg.exact_diagonal(H_op, settings=eng.estimator_settings)
    assert abs(float(d.sum()) - ev.sum()) <= 1e-8 * abs(ev.sum())
    t = linalg.hutchpp(
        H_op,
        stop=linalg.ProbeStop(tol=0.05, max_probes=2000),
        generator=g,
        settings=eng.estimator_settings,
    )
    assert abs(t.estimate - ev.sum()) <= 3 * t.stderr


def test_ggnvp_on_cuda_matches_cpu():
    pc, pg = conv_problem(DT, "cpu"), conv_problem(DT, "cuda")
    V = vecs(pc.num_params, 3, "cpu", DT)
    torch.testing.assert_close(
        CurvatureEngine(pg).ggn()(V.cuda()).cpu(),
        CurvatureEngine(pc).ggn()(V),
        rtol=1e-9,
        atol=1e-11,
    )


def test_block_size_from_free_memory_and_oom_backoff_on_cuda(monkeypatch):
    p = conv_problem(torch.float32, "cuda")
    eng = CurvatureEngine(p)
    assert 1 <= eng.state.route().block_size <= 32
    assert eng.state.activation_bytes() > 0
    V = vecs(p.num_params, 8, "cuda", torch.float32)
    ref = CurvatureEngine(p, hvp_mode="forward", block_size=8).hessian()(V)
    eng = CurvatureEngine(p, hvp_mode="forward", block_size=8)
    real, state = Hessian._matmat_batch, {"n": 0}

    def product(self, V, th, j, batch, out, accumulate):
        if state["n"] == 0 and V.shape[0] > 4:
            state["n"] += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, V, th, j, batch, out, accumulate)

    monkeypatch.setattr(Hessian, "_matmat_batch", product)
    assert rel(eng.hessian()(V), ref) <= 1e-6
    assert eng.counters()["oom_retries"] == 1 and eng.state.route().block_size == 4


def test_measures_on_cuda_match_cpu_fp64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x = torch.randn(30, 6, dtype=DT)
    y = torch.randint(0, 3, (30,))
    measures = [
        {"hessian_lambda_max": {"tol": 1e-6}},
        {"hessian_trace": {"min_probes": 32, "max_probes": 32}},
        {"hessian_spectrum": {"top_k": 3, "slq_runs": 4, "slq_steps": 20}},
    ]
    rows = {
        d: measure_model(model, (x, y), measures, precision="fp64", device=d, batch_size=8, seed=2)
        for d in ("cpu", "cuda")
    }
    for lab in ("hessian_lambda_max", "hessian_trace", "hessian_spectrum"):
        a, b = rows["cpu"].results[lab].value, rows["cuda"].results[lab].value
        assert a == pytest.approx(b, rel=1e-7), lab
    np.testing.assert_allclose(
        rows["cpu"].results["hessian_spectrum"].diagnostics["top_eigenvalues"],
        rows["cuda"].results["hessian_spectrum"].diagnostics["top_eigenvalues"],
        rtol=1e-6,
    )


def resnet18_problem():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().cuda()
    x = torch.randn(16, 3, 32, 32)
    y = torch.randint(0, 10, (16,))
    return model, x, y


def test_resnet18_forward_and_reverse_hvp_agree():
    model, x, y = resnet18_problem()
    p = Problem(model, x, y, batch_size=8, device="cuda", dtype=torch.float32)
    V = vecs(p.num_params, 4, "cuda", torch.float32)
    a = CurvatureEngine(p, hvp_mode="forward", block_size=4).hessian()(V)
    b = CurvatureEngine(p, hvp_mode="reverse", reverse_batched=False, cache_graphs=False).hessian()(
        V
    )
    assert rel(a, b) <= 1e-3


def test_tf32_products_differ_from_fp32_and_lambda_max_is_verified_in_fp32(monkeypatch):
    """precision auto on a tensor-core GPU: TF32 is on inside the Lanczos products (observed there),
    raw TF32 products differ from fp32 ones by far more than fp32's own run-to-run noise, and the
    fp32-verified λmax lands within 1e-4 (relative) of an fp32 run. The CPU twin with a simulated
    TF32 product is test_hessian_measures.py::test_precision_auto_runs_lanczos_in_tf32_and_verifies_in_fp32_through_the_pipeline."""
    from flatcli.engine.precision import tf32_flags
    from flatcli.run.settings import has_tensor_cores
    from tests.helpers import record_tf32_flags

    if not has_tensor_cores(torch.device("cuda")):
        pytest.skip("needs a GPU with TF32 tensor cores (compute capability ≥ 8.0)")
    model, x, y = resnet18_problem()
    p = Problem(model, x, y, batch_size=8, device="cuda", dtype=torch.float32)
    eng = CurvatureEngine(p)
    V = vecs(p.num_params, 2, "cuda", torch.float32)
    with tf32_flags(False, False):
        fp32, fp32_again = eng.hessian()(V), eng.hessian()(V)
    with tf32_flags(True, True):
        tf32 = eng.hessian()(V)
    assert rel(tf32, fp32) > max(100 * rel(fp32_again, fp32), 1e-5)

    seen = record_tf32_flags(monkeypatch)
    spec = [{"hessian_lambda_max": {"tol": 5e-5, "max_steps": 200}}]
    auto = measure_model(model, (x, y), spec, precision="auto", device="cuda", batch_size=8)
    in_auto = list(seen)
    seen.clear()
    ref = measure_model(model, (x, y), spec, precision="fp32", device="cuda", batch_size=8)
    a, r = auto.results["hessian_lambda_max"], ref.results["hessian_lambda_max"]
    assert auto.status == ref.status == "ok", (auto.errors, ref.errors)
    assert any(in_auto) and in_auto[-1] is False and not any(seen)
    assert a.diagnostics["verified"] == "fp32"
    assert abs(a.value - r.value) <= 1e-4 * abs(r.value)
