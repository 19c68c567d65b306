"""The curvature is the operator: one class per curvature with one per-batch product, the loop,
blocks, out-of-memory back-off, rank sum and counting in the base class, estimators taking the
curvature as it is, and a short path from an estimator to autograd."""

import sys
from pathlib import Path

import pytest
import torch

import flatcli
from flatcli.engine import CurvatureEngine, linalg
from flatcli.engine.curvatures import Curvature
from tests.oracles import mlp_problem as problem
from tests.oracles import problem_hessian

DT = torch.float64


class DoubledHessian(Curvature):
    """2·∇²L: the toy curvature of docs/architecture.md's "How to add a curvature", whole."""

    name = "doubled_hessian"

    def _matmat_batch(self, V, th, j, batch, out, accumulate):
        t = th.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(self.batch_loss(batch)(t), t, create_graph=True)
        HV = torch.stack([torch.autograd.grad(g, t, v, retain_graph=True)[0] for v in V])
        self.put(out, 2 * HV, accumulate)


def recipe_curvature():
    """The class of docs/architecture.md's "How to add a curvature", run as written."""
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    section = text[text.index("## How to add a curvature") :]
    start = section.index("```python\n") + len("```python\n")
    namespace = {"Curvature": Curvature, "torch": torch}
    exec(section[start : section.index("```", start)], namespace)
    return namespace["DoubledHessian"]


@pytest.mark.parametrize("source", ["test", "docs"])
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_a_toy_curvature_is_one_class_and_works_with_the_estimators(block_size, source):
    """A curvature added in a test (one class, one method; the same class as the docs' recipe, run
    from the docs) multiplies like 2·H over uneven batches and any block size, is counted, takes
    θ, and Lanczos and scipy's eigsh drive it as they drive the Hessian."""
    p = problem()
    eng = CurvatureEngine(p, block_size=block_size)
    H = problem_hessian(p)
    kind = DoubledHessian if source == "test" else recipe_curvature()
    op = eng.curvature(kind)
    assert op.shape == (p.num_params, p.num_params) and op.name == "doubled_hessian"
    V = torch.randn(5, p.num_params, dtype=DT, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(op(V), 2 * V @ H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op @ V[0], 2 * H @ V[0], rtol=1e-10, atol=1e-12)
    assert eng.counters()["n_hvp"] == 6 and op.n_products == 6
    torch.testing.assert_close(op.dense(), 2 * H, rtol=1e-10, atol=1e-12)
    th = p.theta + 0.05
    torch.testing.assert_close(
        eng.curvature(kind, th)(V), 2 * V @ problem_hessian(p, th), rtol=1e-10, atol=1e-12
    )
    ev = torch.linalg.eigvalsh(2 * H)
    r = linalg.lanczos(
        op,
        k=1,
        stop=linalg.KrylovStop(tol=1e-9, max_steps=p.num_params),
        generator=torch.Generator(),
    )
    assert r.eigenvalues[0] == pytest.approx(float(ev[-1]), rel=1e-8)
    from scipy.sparse.linalg import eigsh

    top = eigsh(op.to_scipy(), k=1, which="LA", tol=1e-10)[0][0]
    assert top == pytest.approx(float(ev[-1]), rel=1e-8)


def test_a_curvature_that_does_not_write_its_product_cannot_be_made():
    """``_matmat_batch`` is abstract: the error comes when the curvature is made, naming the
    hook, not at its first product."""
    eng = CurvatureEngine(problem())

    class Unfinished(Curvature):
        name = "unfinished"

    with pytest.raises(TypeError, match="Unfinished.*_matmat_batch"):
        eng.curvature(Unfinished)


def test_the_finite_difference_step_is_a_constructor_argument():
    """Two finite-difference curvatures with their own steps live side by side (nothing shared is
    mutated), each the central difference of full-set gradients with its step; the engine's
    ``hvp_mode="finite_difference"`` Hessian is the relative step ``fd_eps``; a bad step is refused
    when the curvature is made."""
    p = problem()
    eng = CurvatureEngine(p, fd_eps=2e-3)
    coarse, fine = eng.fd_hessian(eps=1e-2), eng.fd_hessian(eps=1e-4)
    v = torch.randn(p.num_params, dtype=DT, generator=torch.Generator().manual_seed(3))
    th = p.theta

    def central(e):
        return (eng.loss_grad(th + e * v)[1] - eng.loss_grad(th - e * v)[1]) / (2 * e)

    for _ in range(2):  # interleaved: each keeps its own step
        torch.testing.assert_close(coarse @ v, central(1e-2), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fine @ v, central(1e-4), rtol=1e-9, atol=1e-12)
    assert (coarse.eps, fine.eps) == (1e-2, 1e-4)
    rel_fd = CurvatureEngine(p, hvp_mode="finite_difference", fd_eps=2e-3).hessian()
    assert (rel_fd.eps, rel_fd.relative_eps, rel_fd.name) == (None, 2e-3, "hessian")
    h = 2e-3 * max(1.0, float(th.norm())) / float(v.norm())
    torch.testing.assert_close(rel_fd @ v, central(h), rtol=1e-9, atol=1e-12)
    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="eps must be a positive float"):
            eng.fd_hessian(eps=bad)


_PACKAGE = Path(flatcli.__file__).resolve().parent


def _flatcli_frames(stack):
    """The flatcli frames between the estimator (its first frame from engine/linalg/, excluded)
    and torch.autograd.grad, innermost first."""
    out = []
    for filename, func in stack:
        # paths relative to the package folder itself: the clone's folder may be named flatcli too
        try:
            f = Path(filename).resolve().relative_to(_PACKAGE).as_posix()
        except ValueError:
            continue
        if f.startswith("engine/linalg/"):
            return out
        out.append((f, func))
    raise AssertionError("no estimator frame on the stack")


@pytest.mark.parametrize(
    "settings",
    [
        {"hvp_mode": "reverse"},
        {"hvp_mode": "reverse", "cache_graphs": False, "reverse_batched": False},
        {"hvp_mode": "finite_difference"},
    ],
)
def test_a_hessian_product_reaches_autograd_through_at_most_six_flatcli_frames(
    monkeypatch, settings
):
    """From the estimator (Lanczos) to torch.autograd.grad a Hessian product passes through the
    curvature's own frames (the operator's product, the base class's loop, the per-batch product,
    the graph cache and the gradient graph, or the pull-back) and no frame of the engine facade."""
    real = torch.autograd.grad
    stacks = []

    def spy(*args, **kwargs):
        frame, stack = sys._getframe(1), []
        while frame is not None:
            stack.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        stacks.append(stack)
        return real(*args, **kwargs)

    p = problem()
    eng = CurvatureEngine(p, block_size=2, **settings)
    H = eng.hessian()
    monkeypatch.setattr(torch.autograd, "grad", spy)
    linalg.lanczos(H, k=1, stop=linalg.KrylovStop(max_steps=3), generator=torch.Generator())
    assert stacks
    paths = {tuple(_flatcli_frames(s)) for s in stacks}
    longest = max(len(f) for f in paths)
    assert longest <= 6, sorted(paths, key=len)[-1]
    assert not any(f == "engine/facade.py" for path in paths for f, _ in path), paths
    assert all(path[-1] == ("engine/operators.py", "matmat_rows") for path in paths), paths


def test_the_engine_keeps_at_most_26_public_names():
    """The engine is what measures need (curvatures for a problem, losses, gradients, per-unit
    quantities, settings through `derive`, the estimators' settings, counters): products, counters
    and the products' state are not repeated on it."""
    eng = CurvatureEngine(problem())
    names = sorted(n for n in dir(eng) if not n.startswith("_"))
    assert len(names) <= 26, names
    assert not {"hvp", "ggnvp", "fd_hvp", "n_hvp", "tally", "memory", "graphs"} & set(names)
