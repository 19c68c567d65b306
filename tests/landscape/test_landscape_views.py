"""Trajectory PCA and mode connectivity: numpy SVD, closed forms and explicit models as references."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from flatcli.engine import Batch
from flatcli.errors import ConfigError, MeasurementError
from flatcli.landscape import (
    ConnectView,
    PCAView,
    write_connect_files,
    write_trajectory_files,
)
from flatcli.landscape.bnstats import BatchNormRecomputer
from flatcli.landscape.connect import connect_landscape, lr_factor
from flatcli.landscape.pca import (
    PATH_MARGIN,
    trajectory_landscape,
    trajectory_paths,
    trajectory_pca,
)
from tests.oracles import runner

F64 = dict(device="cpu", precision="fp64")


# ------------------------------------------------------------------ helpers
def mlp(seed=0, width=6, bn=False):
    torch.manual_seed(seed)
    layers = (
        [nn.Linear(4, width)]
        + ([nn.BatchNorm1d(width)] if bn else [])
        + [nn.Tanh(), nn.Linear(width, 3)]
    )
    return nn.Sequential(*layers).double()


def blobs(n=40, seed=0):
    """Three classes from a fixed nonlinear teacher on 4 Gaussian features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] * x[:, 2] > 0.3).long()
    return x, y


def names_of(model):
    return [n for n, _ in model.named_parameters()]


def flat(state, names):
    return np.concatenate([state[n].detach().numpy().ravel() for n in names])


def with_vector(model, vec, buffers=None):
    """A copy of ``model`` holding the parameter vector ``vec`` (and ``buffers``), in eval mode."""
    m = copy.deepcopy(model).eval()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(vec, dtype=torch.float64), m.parameters())
    if buffers:
        with torch.no_grad():
            for n, v in buffers.items():
                m.get_buffer(n).copy_(v)
    return m


@torch.no_grad()
def ce(model, data):
    x, y = data
    return float(F.cross_entropy(model.eval()(x), y))


def flip(vt):
    idx = np.argmax(np.abs(vt), axis=1)
    return vt * np.sign(vt[np.arange(len(vt)), idx])[:, None]


def trajectory_states(T=6, every=4, bn=False, seed=0):
    """State dicts of a small MLP every ``every`` full-batch Adam steps (T of them, the last θ_T)."""
    model = mlp(seed, bn=bn)
    x, y = blobs(40, 7)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    states = []
    for k in range((T - 1) * every + 1):
        if k % every == 0:
            states.append({n: v.detach().clone() for n, v in model.state_dict().items()})
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return states, model


# ------------------------------------------------------------------ PCA core
@pytest.mark.parametrize("solver", ["full", "randomized"])
@pytest.mark.parametrize("T", [5, 30])
def test_pca_directions_match_numpy_svd(solver, T):
    rng = np.random.default_rng(T)
    P = 120
    U = np.linalg.qr(rng.standard_normal((T, T)))[0]
    V = np.linalg.qr(rng.standard_normal((P, T)))[0]
    s = 10.0 * 0.3 ** np.arange(T)  # a decaying spectrum, as along a training path
    M = (U * s) @ V.T + rng.standard_normal(P)  # plus a common offset, removed by the centring
    Mc = M - M.mean(0)
    _, S, Vt = np.linalg.svd(Mc, full_matrices=False)
    work = M.copy()
    pca = trajectory_pca(work, solver=solver, seed=3)
    assert pca.solver == solver
    np.testing.assert_allclose(pca.components, flip(Vt[:2]), rtol=0, atol=1e-12)
    np.testing.assert_allclose(pca.explained_variance, S[:2] ** 2 / (T - 1), rtol=1e-12)
    np.testing.assert_allclose(pca.explained_variance_ratio, S[:2] ** 2 / (S**2).sum(), rtol=1e-12)
    np.testing.assert_allclose(pca.components @ pca.components.T, np.eye(2), rtol=0, atol=1e-13)
    np.testing.assert_allclose(work, Mc, rtol=0, atol=1e-12)  # centred in place, not copied
    np.testing.assert_allclose(pca.mean, M.mean(0), rtol=1e-13, atol=1e-14)


def test_pca_auto_solver_and_bad_input():
    m = np.random.default_rng(0).standard_normal((4, 10))
    assert trajectory_pca(m.copy()).solver == "full"
    with pytest.raises(ConfigError, match="`solver` must be one of"):
        trajectory_pca(m.copy(), solver="qr")
    with pytest.raises(ConfigError, match="at least 3 checkpoints. Got 2"):
        trajectory_pca(m[:2].copy())
    with pytest.raises(ConfigError, match="same parameters"):
        trajectory_pca(np.ones((4, 10)))


# ------------------------------------------------------------------ trajectory view
@pytest.mark.parametrize("bn", [False, True])
def test_trajectory_landscape_matches_explicit_models(bn):
    states, final = trajectory_states(T=5, bn=bn)
    if bn:  # distinct running statistics per checkpoint: the path uses each one's own
        for i, s in enumerate(states):
            s["1.running_mean"] = torch.linspace(-0.3, 0.3, 6, dtype=torch.float64) * (i + 1)
            s["1.running_var"] = torch.linspace(0.5, 1.5, 6, dtype=torch.float64) + 0.1 * i
    model = mlp(99, bn=bn)  # provides the code only
    before = copy.deepcopy(model.state_dict())
    train, test = blobs(30, 0), blobs(17, 1)
    res = trajectory_landscape(
        states,
        train,
        test,
        model=model,
        options=PCAView(steps=5, points_per_pass=4),
        batch_size=8,
        **F64,
    )
    names = names_of(model)
    th = np.stack([flat(s, names) for s in states])
    D = th - th[-1]
    _, S, Vt = np.linalg.svd(D - D.mean(0), full_matrices=False)
    V = flip(Vt[:2])
    np.testing.assert_allclose(res.components, V, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.explained_variance_ratio, S[:2] ** 2 / (S**2).sum(), rtol=1e-12)
    coords = D @ V.T
    np.testing.assert_allclose(
        np.c_[res.path["alpha"], res.path["beta"]], coords, rtol=0, atol=1e-12
    )
    assert res.path["alpha"][-1] == 0 and res.path["beta"][-1] == 0
    np.testing.assert_allclose(
        res.path["distance_to_plane"],
        np.linalg.norm(D - coords @ V, axis=1),
        rtol=1e-10,
        atol=1e-12,
    )
    # the grid covers the projected path with the margin; θ_T is on it
    a, b = res.surface.alpha, res.surface.beta
    for axis, c in ((a, coords[:, 0]), (b, coords[:, 1])):
        lo, hi = min(c.min(), 0), max(c.max(), 0)
        assert axis[0] == pytest.approx(lo - PATH_MARGIN * (hi - lo), rel=1e-12)
        assert axis[-1] == pytest.approx(hi + PATH_MARGIN * (hi - lo), rel=1e-12)
        assert 0.0 in axis
    bufs_t = {k: v for k, v in states[-1].items() if "running" in k}
    for split, data in (("train", train), ("test", test)):
        ref = [
            [ce(with_vector(model, th[-1] + ai * V[0] + bj * V[1], bufs_t), data) for bj in b]
            for ai in a
        ]
        np.testing.assert_allclose(getattr(res.surface, f"{split}_loss"), ref, rtol=1e-12)
        own = [
            ce(with_vector(model, th[i], {k: v for k, v in s.items() if "running" in k}), data)
            for i, s in enumerate(states)
        ]
        np.testing.assert_allclose(res.path[f"{split}_loss"], own, rtol=1e-12)
    plane = [ce(with_vector(model, th[-1] + c @ V, bufs_t), train) for c in coords]
    np.testing.assert_allclose(res.path["plane_train_loss"], plane, rtol=1e-12)
    assert res.summary["train_loss_center"] == pytest.approx(res.path["train_loss"][-1], rel=1e-12)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_trajectory_fixed_span_and_randomized_solver_agree():
    states, _ = trajectory_states(T=4)
    train = blobs(20, 0)
    kw = dict(model=mlp(), batch_size=8, **F64)
    full = trajectory_landscape(states, train, options=PCAView(3, (-1, 1), "full"), **kw)
    rand = trajectory_landscape(states, train, options=PCAView(3, (-1, 1), "randomized"), **kw)
    assert list(full.surface.alpha) == [-1.0, 0.0, 1.0] == list(full.surface.beta)
    np.testing.assert_allclose(rand.components, full.components, rtol=0, atol=1e-12)
    np.testing.assert_allclose(rand.surface.train_loss, full.surface.train_loss, rtol=1e-11)


def test_trajectory_paths_sort_naturally_and_check(tmp_path):
    for k in (1, 2, 10, 20):
        (tmp_path / f"step_{k}.pt").write_bytes(b"x")
    shell_order = [tmp_path / f"step_{k}.pt" for k in (1, 10, 2, 20)]  # how a shell sorts the glob
    natural = [tmp_path / f"step_{k}.pt" for k in (1, 2, 10, 20)]
    assert trajectory_paths(shell_order) == natural
    assert trajectory_paths(str(tmp_path / "step_*.pt")) == natural
    assert trajectory_paths(shell_order, sort=False) == shell_order
    with pytest.raises(ConfigError, match=r"`pca` needs at least 3 checkpoints. Got 2"):
        trajectory_paths(natural[:2])
    with pytest.raises(ConfigError, match="checkpoint not found: .*nope.pt"):
        trajectory_paths([*natural, tmp_path / "nope.pt"])
    with pytest.raises(ConfigError, match="matches no file"):
        trajectory_paths([str(tmp_path / "epoch_*.pt")])


def test_pca_grid_has_exactly_steps_points_per_axis():
    """landscape pca --steps 11 is an 11 × 11 grid (the last checkpoint, at 0, is one of its points), over
    the automatic span of the path (the new user got 12 × 12)."""
    states, _ = trajectory_states(T=4)
    res = trajectory_landscape(states, blobs(20, 0), model=mlp(), options=PCAView(11), **F64)
    for axis in (res.surface.alpha, res.surface.beta):
        assert len(axis) == 11 and 0.0 in axis and np.all(np.diff(axis) > 0)
    assert np.asarray(res.surface.train_loss).shape == (11, 11)


def test_trajectory_rejects_mismatch_nan_and_nan_loss():
    states, _ = trajectory_states(T=4)
    train = blobs(20, 0)
    wide = {n: v.clone() for n, v in mlp(1, width=7).state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=r"checkpoint 1 has a different architecture than 3: 0\.weight \(7, 4\) vs \(6, 4\)",
    ):
        trajectory_landscape([states[0], wide, *states[2:]], train, model=mlp(), **F64)
    bad = {n: v.clone() for n, v in states[1].items()}
    bad["2.weight"][0, 0] = float("nan")
    with pytest.raises(  # the one NaN message of every command (exit code 1)
        MeasurementError, match=r"the loss at checkpoint b is not finite: NaN/inf in 2\.weight"
    ):
        trajectory_landscape(
            [states[0], bad, *states[2:]], train, model=mlp(), labels="abcd", **F64
        )
    x, y = train
    x = x.clone()
    x[3, 0] = float("nan")
    with pytest.raises(MeasurementError, match="train loss on the PCA plane is NaN"):
        trajectory_landscape(states, (x, y), model=mlp(), options=PCAView(3), **F64)
    with pytest.raises(ConfigError, match="at least 3 checkpoints. Got 2"):
        trajectory_landscape(states[:2], train, model=mlp(), **F64)


# ------------------------------------------------------------------ connect: convex closed form
def least_squares_minimizers(n=4, d=7, k=2, seed=0):
    """Underdetermined least squares: L(W) = mean_i ‖W x_i − y_i‖² with n < d has an affine set of
    minimizers W_mn + N (rows of N ⟂ the data); two of them, A and B."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    Y = X @ torch.randn(k, d, generator=g, dtype=torch.float64).T
    null = torch.linalg.svd(X).Vh[n:]
    W = torch.linalg.lstsq(X, Y).solution.T
    A = W + torch.randn(k, d - n, generator=g, dtype=torch.float64) @ null
    B = W + torch.randn(k, d - n, generator=g, dtype=torch.float64) @ null
    return X, Y, A, B


def linear(W):
    m = nn.Linear(W.shape[1], W.shape[0], bias=False).double()
    with torch.no_grad():
        m.weight.copy_(W)
    return m


def curve_closed_form(X, A, B, C, ts):
    """L(φ(t)) = (2t(1 − t))² · mean_i ‖(C − (A + B)/2) x_i‖² when A and B are minimizers."""
    D = C - (A + B) / 2
    q = float(((X @ D.T) ** 2).sum(1).mean())
    return (2 * ts * (1 - ts)) ** 2 * q


@pytest.mark.parametrize("optimizer,bound", [("adam", 1e-15), ("sgd", 1e-25)])
def test_convex_line_has_no_barrier_and_the_curve_invents_none(optimizer, bound):
    """Default budget and learning rates. SGD's steps are proportional to the gradient, which is
    rounding noise on the line, so the bend does not move; Adam normalizes that noise into steps of
    order lr, which the decaying schedule takes back: what is left stays ≥ 15 orders of magnitude
    below the loss scale of the problem (a bent start climbs to > 1, see the next test)."""
    X, Y, A, B = least_squares_minimizers()
    res = connect_landscape(
        linear(A),
        linear(B),
        (X, Y),
        options=ConnectView(steps=11, bend_optimizer=optimizer, bend_batch_size=4),
        loss="mse",
        **F64,
    )
    assert res.meta["bend_steps"] == 1000
    # the line stays in the set of minimizers: L = 0 exactly (up to rounding)
    np.testing.assert_allclose(res.line.train_loss, 0.0, rtol=0, atol=1e-25)
    assert res.summary["line_train_loss_barrier"] <= 1e-25
    ref = curve_closed_form(X, A, B, res.bend["weight"], res.curve.alpha)
    assert_losses_match_to_rounding(res.curve.train_loss, ref, Y)
    assert res.summary["curve_train_loss_barrier"] <= bound


def assert_losses_match_to_rounding(loss, ref, Y):
    """L = mean_i ‖r_i‖² of float64 residuals r_i = φ x_i − y_i: √L is a norm of the residuals, so
    rounding them (each ≲ a few ε·‖y_i‖) moves √L by at most about ε·rms‖y‖ (triangle inequality),
    whatever the size of L. Compare √L with √ref to 64 ε·rms‖y‖ (the observed gap is ≈ 4 ε·rms‖y‖),
    and relatively to 1e-9 above that: no comparison of rounding noise at L ≈ 1e-19."""
    scale = float((Y**2).sum(1).mean().sqrt())
    eps = np.finfo(np.float64).eps
    np.testing.assert_allclose(np.sqrt(loss), np.sqrt(ref), rtol=1e-9, atol=64 * eps * scale)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 0.03)])
def test_convex_curve_fitting_removes_a_barrier(optimizer, lr):
    X, Y, A, B = least_squares_minimizers()
    E = torch.randn(A.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    init = (A + B) / 2 + E  # a bent start: the curve climbs to q(E)/4 at t = 1/2
    ts = np.linspace(0, 1, 11)
    start = curve_closed_form(X, A, B, (A + B) / 2 + E, ts).max()
    res = connect_landscape(
        linear(A),
        linear(B),
        (X, Y),
        options=ConnectView(
            steps=11,
            bend_steps=1000,
            bend_optimizer=optimizer,
            bend_lr=lr,
            bend_batch_size=4,
            bend_init={"weight": init},
        ),
        loss="mse",
        **F64,
    )
    ref = curve_closed_form(X, A, B, res.bend["weight"], res.curve.alpha)
    np.testing.assert_allclose(res.curve.train_loss, ref, rtol=1e-9, atol=1e-25)
    assert start > 1.0
    assert res.summary["curve_train_loss_barrier"] < 1e-6 * start
    assert res.history["loss"][0] > 1e3 * res.history["loss"][-1]


def test_lr_schedule():
    assert [lr_factor(k, 100) for k in (0, 50)] == [1.0, 1.0]
    assert lr_factor(70, 100) == pytest.approx(1 - 0.2 / 0.4 * 0.99)
    assert lr_factor(90, 100) == pytest.approx(0.01) and lr_factor(99, 100) == 0.01


# ------------------------------------------------------------------ connect: permuted copies
def permuted_pair():
    """A small trained MLP and the same network with its hidden units reversed: the same function
    (equal loss), but the straight line between them averages unrelated units."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    train = blobs(60, 3)
    opt = torch.optim.Adam(a.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(a(train[0]), train[1]).backward()
        opt.step()
    b = copy.deepcopy(a)
    perm = torch.arange(9, -1, -1)
    with torch.no_grad():
        b[0].weight.copy_(a[0].weight[perm])
        b[0].bias.copy_(a[0].bias[perm])
        b[2].weight.copy_(a[2].weight[:, perm])
    return a, b, train


def test_permuted_copies_curve_barrier_below_line_barrier():
    a, b, train = permuted_pair()
    assert ce(b, train) == pytest.approx(ce(a, train), rel=1e-12)  # same function
    res = connect_landscape(
        a,
        b,
        train,
        options=ConnectView(
            steps=11, bend_steps=600, bend_optimizer="adam", bend_lr=0.01, bend_batch_size=30
        ),
        seed=0,
        batch_size=16,
        **F64,
    )
    names = names_of(a)
    ta, tb = flat(a.state_dict(), names), flat(b.state_dict(), names)
    tc = flat(res.bend, names)
    ts = res.line.alpha
    line_ref = [ce(with_vector(a, (1 - t) * ta + t * tb), train) for t in ts]
    curve_ref = [
        ce(with_vector(a, (1 - t) ** 2 * ta + 2 * t * (1 - t) * tc + t**2 * tb), train) for t in ts
    ]
    np.testing.assert_allclose(res.line.train_loss, line_ref, rtol=1e-12)
    np.testing.assert_allclose(res.curve.train_loss, curve_ref, rtol=1e-12)
    line_barrier = max(line_ref) - max(line_ref[0], line_ref[-1])
    assert res.summary["line_train_loss_barrier"] == pytest.approx(line_barrier, rel=1e-12)
    assert line_barrier > 0.2  # the constructed pair is separated by a barrier
    assert res.summary["curve_train_loss_barrier"] < 0.5 * line_barrier


def test_bend_steps_zero_gives_the_line_and_models_untouched():
    a, b, train = permuted_pair()
    a.train()
    b.eval()
    before = copy.deepcopy(a.state_dict()), copy.deepcopy(b.state_dict())
    res = connect_landscape(a, b, train, options=ConnectView(5, 0), batch_size=16, **F64)
    np.testing.assert_allclose(res.curve.train_loss, res.line.train_loss, rtol=1e-13)
    assert a.training and not b.training  # modes restored
    for m, st in zip((a, b), before, strict=True):
        assert all(torch.equal(st[k], v) for k, v in m.state_dict().items())


# ------------------------------------------------------------------ connect: BatchNorm
def bn_net(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].weight.uniform_(0.5, 1.5)
    return m


def reference_bn_stats(W, bias, x, batch_size):
    """Sample-weighted mean of the batch means and of the unbiased batch variances of x Wᵀ + b."""
    z = x @ W.T + bias
    n = len(z)
    mean = sum(len(zb) / n * zb.mean(0) for zb in z.split(batch_size))
    var = sum(len(zb) / n * zb.var(0, unbiased=True) for zb in z.split(batch_size))
    return mean, var


def test_batchnorm_statistics_recomputed_along_both_paths():
    a, b = bn_net(0), bn_net(1)
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(11, 5, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (11,), generator=g),
    )
    res = connect_landscape(
        a,
        b,
        (x, y),
        options=ConnectView(steps=5, bend_steps=20, bend_batch_size=4, points_per_pass=3),
        batch_size=4,
        **F64,
    )  # batches of 4, 4, 3: the last one weighted by its size
    assert res.meta["bn_recomputed"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name, r in (("line", res.line), ("curve", res.curve)):
        for t, got in zip(r.alpha, r.train_loss, strict=True):
            if name == "line":
                p = {n: (1 - t) * pa[n] + t * pb[n] for n in pa}
            else:
                p = {
                    n: (1 - t) ** 2 * pa[n] + 2 * t * (1 - t) * res.bend[n] + t**2 * pb[n]
                    for n in pa
                }
            m = copy.deepcopy(a).eval()
            mean, var = reference_bn_stats(p["0.weight"], p["0.bias"], x, 4)
            with torch.no_grad():
                for n, v in p.items():
                    m.get_parameter(n).copy_(v)
                m[1].running_mean.copy_(mean)
                m[1].running_var.copy_(var)
            assert got == pytest.approx(ce(m, (x, y)), rel=1e-12), (name, t)
    # the recomputer on its own: stored statistics play no part
    rec = BatchNormRecomputer(a, "cpu", torch.float64)
    params = {n: v.detach() for n, v in a.named_parameters()}
    st = rec(params, Batch({"x": x}).split(4))
    mean, var = reference_bn_stats(params["0.weight"], params["0.bias"], x, 4)
    torch.testing.assert_close(st["1.running_mean"], mean, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(st["1.running_var"], var, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(
        mean, (x @ params["0.weight"].T + params["0.bias"]).mean(0), rtol=1e-13, atol=1e-15
    )


@pytest.mark.gpu
def test_views_on_cuda_match_cpu():
    states, _ = trajectory_states(T=4, bn=True)
    train = blobs(20, 0)
    kw = dict(
        model=mlp(bn=True),
        options=PCAView(3, points_per_pass=4),
        batch_size=8,
        dtype=torch.float64,
    )
    cpu = trajectory_landscape(states, train, device="cpu", **kw)
    gpu = trajectory_landscape(states, train, device="cuda", **kw)
    np.testing.assert_allclose(gpu.surface.train_loss, cpu.surface.train_loss, rtol=1e-10)
    np.testing.assert_allclose(gpu.path["train_loss"], cpu.path["train_loss"], rtol=1e-10)
    a, b = bn_net(0), bn_net(1)
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(11, 5, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (11,), generator=g),
    )
    view = ConnectView(steps=3, bend_steps=5, bend_batch_size=4)
    ckw = dict(options=view, batch_size=4, dtype=torch.float64)
    c_cpu = connect_landscape(a, b, (x, y), device="cpu", **ckw)
    c_gpu = connect_landscape(a, b, (x, y), device="cuda", **ckw)
    np.testing.assert_allclose(c_gpu.line.train_loss, c_cpu.line.train_loss, rtol=1e-10)
    np.testing.assert_allclose(c_gpu.curve.train_loss, c_cpu.curve.train_loss, rtol=1e-8)


# ------------------------------------------------------------------ connect: bad input
def test_connect_rejects_mismatch_nan_and_bad_options():
    train = blobs(20, 0)
    with pytest.raises(
        ConfigError,
        match=r"checkpoint B has a different architecture than A: 0\.weight \(7, 4\) vs \(6, 4\)",
    ):
        connect_landscape(mlp(0), mlp(1, width=7), train, **F64)
    bad = mlp(1)
    with torch.no_grad():
        bad[0].bias[2] = float("inf")
    with pytest.raises(
        MeasurementError, match=r"the loss at checkpoint B is not finite: NaN/inf in 0\.bias"
    ):
        connect_landscape(mlp(0), bad, train, **F64)
    x, y = train
    x = x.clone()
    x[0, 0] = float("nan")
    with pytest.raises(MeasurementError, match="bend training: the loss is nan at step 1"):
        connect_landscape(mlp(0), mlp(1), (x, y), options=ConnectView(bend_batch_size=20), **F64)
    with pytest.raises(MeasurementError, match="train loss is NaN along the line"):
        connect_landscape(mlp(0), mlp(1), (x, y), options=ConnectView(bend_steps=0), **F64)
    with pytest.raises(ConfigError, match="`bend_optimizer` must be one of adam, sgd"):
        ConnectView(bend_optimizer="lbfgs")
    with pytest.raises(
        ConfigError, match="`bend_batch_size` must be ≥ 2 for a model with BatchNorm"
    ):
        connect_landscape(
            bn_net(0),
            bn_net(1),
            (torch.randn(8, 5, dtype=torch.float64), torch.zeros(8, dtype=torch.long)),
            options=ConnectView(bend_batch_size=1),
            **F64,
        )


# ------------------------------------------------------------------ files
def test_view_files(tmp_path):
    pytest.importorskip("matplotlib")
    import pandas as pd

    states, _ = trajectory_states(T=4)
    train, test = blobs(20, 0), blobs(9, 1)
    tr = trajectory_landscape(states, train, test, model=mlp(), options=PCAView(4), **F64)
    files = write_trajectory_files(tr, tmp_path / "pca")
    grid, path = pd.read_csv(files["grid"]), pd.read_csv(files["path"])
    assert list(grid.columns) == [
        "alpha",
        "beta",
        "train_loss",
        "train_acc",
        "test_loss",
        "test_acc",
    ]
    assert len(grid) == len(tr.surface.alpha) * len(tr.surface.beta)
    assert grid["train_loss"].iloc[-1] == tr.surface.train_loss.ravel()[-1]
    assert list(path.columns) == [
        "checkpoint",
        "alpha",
        "beta",
        "distance_to_plane",
        "train_loss",
        "train_acc",
        "test_loss",
        "test_acc",
        "plane_train_loss",
    ]
    assert list(path["checkpoint"]) == [0, 1, 2, 3] and path["alpha"].iloc[-1] == 0
    cn = connect_landscape(mlp(0), mlp(1), train, test, options=ConnectView(5, 10), **F64)
    cfiles = write_connect_files(
        cn, tmp_path / "cn", checkpoint_extras={"model_kwargs": {"width": 6}}
    )
    df = pd.read_csv(cfiles["csv"])
    assert list(df.columns) == ["path", "t", "train_loss", "train_acc", "test_loss", "test_acc"]
    assert list(df["path"]) == ["line"] * 5 + ["curve"] * 5
    assert df["train_loss"].iloc[7] == cn.curve.train_loss[2]
    assert list(pd.read_csv(cfiles["fit"]).columns) == ["step", "t", "loss"]
    for p in (files["plot"], cfiles["plot"]):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    obj = torch.load(cfiles["bend"], weights_only=True)
    assert obj["model_kwargs"] == {"width": 6} and obj["curve"]["endpoints"] == ["A", "B"]
    m = mlp(5)
    m.load_state_dict(obj["state_dict"])
    assert all(torch.equal(m.get_parameter(n).detach(), cn.bend[n]) for n in cn.bend)
    import json

    meta = json.loads(files["json"].read_text())
    assert meta["kind"] == "pca" and len(meta["explained_variance_ratio"]) == 2
    meta = json.loads(cfiles["json"].read_text())
    assert meta["kind"] == "connect" and "curve_train_loss_barrier" in meta["summary"]


def test_view_files_without_matplotlib(tmp_path, monkeypatch):
    """Without matplotlib both views write their CSVs and JSON, no PNG, and say why in the JSON."""
    import json

    import flatcli.landscape.plots as plots

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    states, _ = trajectory_states(T=4)
    train = blobs(20, 0)
    tr = trajectory_landscape(states, train, model=mlp(), options=PCAView(3), **F64)
    cn = connect_landscape(mlp(0), mlp(1), train, options=ConnectView(3, 2), **F64)
    for files in (
        write_trajectory_files(tr, tmp_path / "pca"),
        write_connect_files(cn, tmp_path / "cn"),
    ):
        assert "plot" not in files and all(p.is_file() for p in files.values())
        meta = json.loads(files["json"].read_text())
        assert meta["plots"] == plots.PLOT_HINT
        assert set(meta["files"]) == set(files)
    assert not list(tmp_path.rglob("*.png"))


# ------------------------------------------------------------------ CLI end to end
def write_project(tmp, nan_data=False):
    from flatcli.demo.models import MLP

    def save(model, path, width=6):
        torch.save({"state_dict": model.state_dict(), "model_kwargs": {"width": width}}, path)

    for i, w in enumerate((6, 6, 7)):
        torch.manual_seed(i)
        save(MLP(8, w, 1, 3), tmp / f"m{i}.pt", w)
    torch.manual_seed(0)
    final = MLP(8, 6, 1, 3)
    for k, scale in ((1, 1.0), (2, 0.6), (10, 0.3), (20, 0.0)):  # a path that settles on `final`
        g = torch.Generator().manual_seed(k)
        m = copy.deepcopy(final)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(
                    scale
                    * torch.randn(p.shape, generator=g)
                    * torch.tensor([1.0, 0.5]).repeat(p.numel())[: p.numel()].view(p.shape)
                )
        save(m, tmp / f"step_{k}.pt")
    nan = copy.deepcopy(final)
    with torch.no_grad():
        nan.classifier.weight[0, 0] = float("nan")
    save(nan, tmp / "nan.pt")
    train = {"source": "synthetic", "num_samples": 30, "input_shape": [8], "num_classes": 3}
    if nan_data:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(12, 8, generator=g)
        x[2, 1] = float("nan")
        torch.save({"x": x, "y": torch.randint(0, 3, (12,), generator=g)}, tmp / "nan_data.pt")
        train = {"source": "tensors", "path": "nan_data.pt"}
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 8, "width": 6, "depth": 1, "num_classes": 3},
        },
        "checkpoints": ["m0.pt"],
        "data": {
            "train": train,
            "test": {
                "source": "synthetic",
                "num_samples": 20,
                "input_shape": [8],
                "num_classes": 3,
            },
        },
        "measure_data": {"split": "train", "num_samples": 25, "batch_size": 16, "seed": 0},
        "runtime": {"device": "cpu", "seed": 0},
    }
    name = "nan_config.yaml" if nan_data else "config.yaml"
    (tmp / name).write_text(yaml.safe_dump(cfg))
    return tmp / name


@pytest.mark.slow
def test_cli_pca_and_connect(tmp_path):
    pytest.importorskip("matplotlib")
    import pandas as pd

    from flatcli.cli import app

    cfg = write_project(tmp_path)
    shell_glob = [str(tmp_path / f"step_{k}.pt") for k in (1, 10, 2, 20)]  # as `step_*.pt` expands
    r = runner.invoke(
        app,
        [
            "landscape",
            "pca",
            *shell_glob,
            "-c",
            str(cfg),
            "-o",
            str(tmp_path / "pca"),
            "--steps",
            "4",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "explained_variance_ratio_1" in r.output and "pca.png" in r.output
    path = pd.read_csv(tmp_path / "pca" / "pca_path.csv")
    assert [p.split("_")[-1] for p in path["checkpoint"]] == ["1.pt", "2.pt", "10.pt", "20.pt"]
    assert (tmp_path / "pca" / "pca_grid.csv").is_file() and (
        tmp_path / "pca" / "pca.png"
    ).stat().st_size > 0
    # a quoted glob gives the same
    r = runner.invoke(
        app,
        [
            "landscape",
            "pca",
            str(tmp_path / "step_*.pt"),
            "-c",
            str(cfg),
            "-o",
            str(tmp_path / "pca2"),
            "--steps",
            "4",
            "--no-plots",
        ],
    )
    assert r.exit_code == 0, r.output
    assert pd.read_csv(tmp_path / "pca2" / "pca_path.csv")["checkpoint"].equals(path["checkpoint"])
    assert pd.read_csv(tmp_path / "pca2" / "pca_grid.csv").equals(
        pd.read_csv(tmp_path / "pca" / "pca_grid.csv")
    )
    r = runner.invoke(
        app,
        [
            "landscape",
            "connect",
            str(tmp_path / "m0.pt"),
            str(tmp_path / "m1.pt"),
            "-c",
            str(cfg),
            "-o",
            str(tmp_path / "cn"),
            "--steps",
            "5",
            "--bend-steps",
            "20",
            "--bend-optimizer",
            "adam",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "line_train_loss_barrier" in r.output and "curve_train_loss_barrier" in r.output
    df = pd.read_csv(tmp_path / "cn" / "connect.csv")
    assert len(df) == 10 and df["test_loss"].notna().all()
    assert len(pd.read_csv(tmp_path / "cn" / "connect_fit.csv")) == 20
    from flatcli import api

    bend, _ = api.load_model(
        api.load(cfg), tmp_path / "cn" / "bend.pt"
    )  # a checkpoint like the others
    assert bend.features[0].weight.shape == (6, 8)
    m0, m1 = str(tmp_path / "m0.pt"), str(tmp_path / "m1.pt")
    bad = [
        (["pca", m0, m1], 2, "landscape pca needs at least 3 checkpoints. Got 2"),
        (["pca", *shell_glob[:2], str(tmp_path / "m2.pt")], 2, "different architecture"),
        (
            ["pca", *shell_glob[:2], str(tmp_path / "nan.pt")],
            1,
            "is not finite: NaN/inf in classifier.weight",
        ),
        (["pca", *shell_glob, "--solver", "qr"], 2, "--solver must be one of"),
        (["connect", m0, str(tmp_path / "m2.pt")], 2, "different architecture"),
        (
            ["connect", m0, str(tmp_path / "nan.pt")],
            1,
            "is not finite: NaN/inf in classifier.weight",
        ),
        (["connect", m0, m1, str(tmp_path / "m2.pt")], 2, "Got unexpected extra argument"),
        (["connect", m0], 2, "Missing argument 'b'"),
        (["connect", m0, m1, "--span", "0,1"], 2, "No such option: --span"),
        (["connect", m0, m1, "--to", m1], 2, "No such option: --to"),
        (["connect", m0, m1, "--bend-optimizer", "lbfgs"], 2, "--bend-optimizer must be one of"),
        (["connect", m0, m1, "--bend-steps", "-1"], 2, "--bend-steps must be an int ≥ 0. Got -1"),
        (["pca", *shell_glob, "--bend-steps", "3"], 2, "No such option: --bend-steps"),
        (["contour", m0], 2, "No such command 'contour'"),
    ]
    for args, code, msg in bad:
        r = runner.invoke(app, ["landscape", *args, "-c", str(cfg), "-o", str(tmp_path / "bad")])
        assert r.exit_code == code, (args, r.output)
        assert msg in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)
    # NaN in the data is bad input, named when the data is loaded: exit code 2
    nan_cfg = write_project(tmp_path, nan_data=True)
    for args in (["connect", m0, m1], ["pca", *shell_glob]):
        r = runner.invoke(
            app,
            ["landscape", *args, "-c", str(nan_cfg), "-o", str(tmp_path / "bad"), "--steps", "3"],
        )
        assert r.exit_code == 2, (args, r.output)
        assert "nan_data.pt): 'x' holds nan at row 2 " in r.output, (args, r.output)


# ------------------------------------------------------------------ demo: opt-in trajectory
@pytest.mark.slow
def test_demo_train_trajectory_follows_the_zoo_recipe(tmp_path):
    from flatcli.demo.trajectory import train_trajectory, zoo_models
    from flatcli.training import train_model

    name = (
        "mlp_w64_wd0.0001_noise0"  # the cheapest zoo model to train (260 steps of a width-64 MLP)
    )
    paths = train_trajectory(tmp_path, name, every=40, log=lambda m: None)
    steps = [torch.load(p, weights_only=True)["step"] for p in paths]
    assert steps[:3] == [0, 40, 80] and steps == sorted(steps) and len(steps) >= 3
    assert trajectory_paths(str(tmp_path / "trajectory" / name / "step_*.pt")) == paths
    # the same model as train_zoo trains: its own task (seed, data, recipe and target)
    task = zoo_models()[name]
    rec = train_model(dataclasses.replace(task, outdir=str(tmp_path / "zoo")))
    init, final = (
        torch.load(tmp_path / "zoo" / p, weights_only=True) for p in (rec.init_checkpoint, rec.path)
    )
    first, last = (torch.load(p, weights_only=True) for p in (paths[0], paths[-1]))
    assert last["step"] == rec.result.steps and last["model_kwargs"]["width"] == 64
    assert all(torch.equal(first["state_dict"][k], v) for k, v in init["state_dict"].items())
    assert all(torch.equal(last["state_dict"][k], v) for k, v in final["state_dict"].items())
    with pytest.raises(ConfigError, match="no zoo model named"):
        train_trajectory(tmp_path, "mlp_w9")
