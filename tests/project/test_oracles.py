"""The shared exact references (tests/oracles.py) against closed forms and finite differences."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatcli.engine import Problem
from tests import oracles as O

DT = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("seed", range(20))
def test_quadratic_form_gives_its_symmetric_part(seed, chunk):
    """½ xᵀAx has the Hessian (A + Aᵀ)/2 at every x, to rounding: A itself when A is symmetric."""
    n = 1 + seed % 9
    A = torch.randn(n, n, generator=gen(seed), dtype=DT)
    x = torch.randn(n, generator=gen(seed + 100), dtype=DT)
    H = O.dense_hessian(lambda t: 0.5 * t @ A @ t, x, chunk=chunk)
    torch.testing.assert_close(H, (A + A.T) / 2, rtol=0, atol=1e-14)
    S = A + A.T
    torch.testing.assert_close(O.dense_hessian(lambda t: 0.5 * t @ S @ t, x), S, rtol=0, atol=1e-14)


def test_a_diagonal_quadratic_is_not_transposed_or_shifted():
    """Rows are rows: an upper-triangular A with distinct entries is told apart from Aᵀ."""
    A = torch.triu(torch.arange(1.0, 17.0, dtype=DT).reshape(4, 4))
    H = O.dense_hessian(lambda t: t @ A @ t, torch.zeros(4, dtype=DT))
    assert torch.equal(H, A + A.T)
    assert torch.equal(O.dense_hessian(lambda t: t @ A @ t, torch.ones(4, dtype=DT), chunk=3), H)


@pytest.mark.parametrize("seed", range(20))
def test_linear_regression_mse_is_xtx_over_n(seed):
    """Least squares: 1/(2n)‖Xw + b − y‖² has ∇²_w = XᵀX/n; flatcli's mse (mean over rows of
    Σ_j (f_j − y_j)²) through a `Problem` has [X 1]ᵀ[X 1]·2/n over (w, b)."""
    n, d = 5 + seed, 1 + seed % 4
    X = torch.randn(n, d, generator=gen(seed), dtype=DT)
    y = torch.randn(n, 1, generator=gen(seed + 1), dtype=DT)
    model = nn.Linear(d, 1).to(DT)
    H = O.model_hessian(
        model, lambda ps: ((O.call(model, ps, X) - y) ** 2).sum() / (2 * n), include="weight"
    )
    torch.testing.assert_close(H, X.T @ X / n, rtol=1e-13, atol=1e-14)
    Xb = torch.cat([X, torch.ones(n, 1, dtype=DT)], 1)
    p = Problem(model, X, y, loss="mse", batch_size=3, dtype=DT)  # uneven batches
    torch.testing.assert_close(O.problem_hessian(p), 2 * Xb.T @ Xb / n, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_tiny_mlp_rows_match_finite_differences_of_the_gradient(seed):
    """A tanh MLP under cross-entropy: H e_i ≈ (∇L(θ + h e_i) − ∇L(θ − h e_i)) / 2h (O(h²))."""
    model = O.tiny_mlp(d=4, h=3, c=3, seed=seed)
    x, y = O.tiny_data(n=9, d=4, c=3, seed=seed)
    chosen, _ = O.selected_parameters(model)
    theta = torch.cat([q.reshape(-1) for _, q in chosen])

    def loss_of(ps):
        return F.cross_entropy(O.call(model, ps, x), y)

    H = O.model_hessian(model, loss_of)
    p = Problem(model, x, y, batch_size=4, dtype=DT)
    torch.testing.assert_close(O.problem_hessian(p), H, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        O.problem_hessian(p, chunk=5, symmetrize=True), H, rtol=1e-12, atol=1e-14
    )

    def grad(t):
        t = t.clone().requires_grad_(True)
        return torch.autograd.grad(p.loss(p.unflatten(t)), t)[0]

    h = 1e-5
    eye = torch.eye(theta.numel(), dtype=DT)
    fd = torch.stack([(grad(theta + h * e) - grad(theta - h * e)) / (2 * h) for e in eye])
    assert (fd - H).abs().max() < 1e-8 * max(1.0, float(H.abs().max()))
    assert float(H.abs().max()) > 0.05  # not a vanishing Hessian


def test_products_and_selection_and_dtype():
    """V·H by products equals V times the dense H; a selection is the sub-block; float32 refused."""
    model = O.tiny_mlp(d=3, h=4, c=2, seed=1)
    x, y = O.tiny_data(n=7, d=3, c=2, seed=1)
    p = Problem(model, x, y, batch_size=7, dtype=DT)
    H = O.problem_hessian(p)
    V = torch.randn(3, p.num_params, generator=gen(2), dtype=DT)
    torch.testing.assert_close(
        O.hessian_products(lambda t: p.loss(p.unflatten(t)), p.theta, V),
        V @ H,
        rtol=1e-12,
        atol=1e-14,
    )
    sl = p.param_slices()["2.weight"]
    sub = O.model_hessian(
        model, lambda ps: F.cross_entropy(O.call(model, ps, x), y), include=["2.weight"]
    )
    torch.testing.assert_close(sub, H[sl, sl], rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="float64"):
        O.dense_hessian(lambda t: (t**2).sum(), torch.ones(2))


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("seed", range(5))
def test_ggn_of_a_linear_model_is_its_hessian(seed, loss):
    """A model linear in θ has no second-order term: G = H exactly (to rounding), and G ⪰ 0."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 4).to(DT)
    g = gen(seed)
    x = torch.randn(6, 3, generator=g, dtype=DT)
    y = (
        torch.randint(0, 4, (6,), generator=g)
        if loss == "cross_entropy"
        else torch.randn(6, 4, generator=g, dtype=DT)
    )
    p = Problem(model, x, y, loss=loss, batch_size=4, dtype=DT)
    G = O.dense_ggn(p)
    torch.testing.assert_close(G, O.problem_hessian(p), rtol=1e-12, atol=1e-14)
    assert float(torch.linalg.eigvalsh(G)[0]) > -1e-12


def test_ggn_of_a_tanh_mlp_differs_from_its_hessian_and_is_psd():
    """With a nonlinearity the GGN drops the curvature of the network: PSD, and not H."""
    model = O.tiny_mlp(d=3, h=4, c=3, seed=0)
    x, y = O.tiny_data(n=8, d=3, c=3, seed=0)
    p = Problem(model, x, y, batch_size=8, dtype=DT)
    G, H = O.dense_ggn(p), O.problem_hessian(p)
    assert float(torch.linalg.eigvalsh(G)[0]) > -1e-12
    assert float((G - H).abs().max()) > 1e-3
    torch.testing.assert_close(G, G.T, rtol=0, atol=1e-14)


def test_the_cli_runner_runs_flatcli():
    res, text = O.cli_and_output("--version")
    assert res.exit_code == 0 and "flatcli" in text.lower()
    assert O.cli("measure", "--no-such-option").exit_code == 2
