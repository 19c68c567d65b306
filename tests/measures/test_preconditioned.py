"""preconditioned_lambda_max: λmax(P^-1/2 H P^-1/2), P = diag(√v̂ + ε) from Adam, AdamW and RMSprop
state, equals the dense float64 eigenvalue to 1e-6 relative, from a live optimizer or a saved
state dict; P is the denominator the optimizer divides its step by."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from flatcli.engine import CurvatureEngine, Problem
from flatcli.errors import ConfigError
from flatcli.measures import MeasureContext, MeasureSpec, run_measure
from flatcli.measures._preconditioner import preconditioner
from tests.oracles import model_hessian

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=3e-3, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
}


def _setup(seed: int, optim: str, steps: int = 5):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    opt = OPTIMIZERS[optim](model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, (x, y), opt


def _reference_p(opt, optim: str) -> torch.Tensor:
    """√v̂ + ε written out from the state, per PyTorch's update rules."""
    parts = []
    for group in opt.param_groups:
        for q in group["params"]:
            st = opt.state[q]
            if optim.startswith("adam"):
                v = st["max_exp_avg_sq"] if group["amsgrad"] else st["exp_avg_sq"]
                v = v / (1 - group["betas"][1] ** float(st["step"]))
            else:
                v = st["square_avg"] - (st["grad_avg"] ** 2 if group["centered"] else 0)
            parts.append((v.sqrt() + group["eps"]).reshape(-1))
    return torch.cat(parts)


def _measure(model, data, source, **options):
    problem = Problem(model, data, loss="cross_entropy", batch_size=5)
    engine = CurvatureEngine(problem, precision="fp64")
    ctx = MeasureContext(problem, engine, seed=0, optimizer=source)
    spec = MeasureSpec("preconditioned_lambda_max", "p", {"tol": 1e-10, **options})
    return run_measure(spec, ctx)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_equals_the_dense_float64_eigenvalue(seed, optim):
    model, (x, y), opt = _setup(seed, optim)
    model.eval()

    def loss_of(ps):
        return nn.functional.cross_entropy(functional_call(model, ps, (x,)), y)

    H = model_hessian(model, loss_of)
    d = _reference_p(opt, optim).rsqrt()
    want = float(torch.linalg.eigvalsh(d[:, None] * H * d[None, :])[-1])
    r = _measure(model, (x, y), opt)
    assert r.status == "ok", r.diagnostics
    assert r.value == pytest.approx(want, rel=1e-6)
    beta1 = (
        0.8 if optim == "adam" else 0.9 if optim.startswith("adam") else opt.defaults["momentum"]
    )
    lr = opt.defaults["lr"]
    thr = (2 + 2 * beta1) / ((1 - beta1) * lr) if optim.startswith("adam") else (2 + 2 * beta1) / lr
    assert r.diagnostics["threshold"] == pytest.approx(thr, rel=1e-12)


@pytest.mark.parametrize("optim", ["adam", "rmsprop"])
def test_p_is_the_denominator_of_the_optimizers_step(optim):
    """One more step of the optimizer itself: θ' − θ = −η m̂ / P (Adam) or −η g / P (RMSprop
    without momentum), P read by `preconditioner` from the state after the step."""
    make = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    }[optim]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
    opt = make(model.parameters())
    for _ in range(4):
        before = torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        g = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        opt.step()
    after = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    P = preconditioner(opt, Problem(model, (x, y))).diagonal
    if optim == "adam":
        st = [opt.state[q] for q in model.parameters()]
        m = torch.cat([s["exp_avg"].reshape(-1) for s in st]) / (1 - 0.9 ** float(st[0]["step"]))
        assert torch.allclose(after - before, -1e-2 * m / P, rtol=1e-10, atol=1e-15)
    else:
        assert torch.allclose(after - before, -1e-3 * g / P, rtol=1e-10, atol=1e-15)


def test_a_saved_state_dict_gives_the_live_value(tmp_path):
    model, data, opt = _setup(0, "adamw")
    live = _measure(model, data, opt).value
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save({"optimizer_states": [opt.state_dict()]}, tmp_path / "lightning.ckpt")
    for name in ("opt.pt", "lightning.ckpt"):
        r = _measure(model, data, None, optimizer_state=str(tmp_path / name))
        assert r.value == pytest.approx(live, rel=1e-9), name
    assert _measure(model, data, opt.state_dict()).value == pytest.approx(live, rel=1e-9)


def test_without_a_second_moment_it_does_not_apply(tmp_path):
    model, data, _ = _setup(0, "adam")
    r = _measure(model, data, None)
    assert r.status == "not_applicable" and "optimizer_state" in r.diagnostics["reason"]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    sgd.step()
    r = _measure(model, data, sgd)
    assert r.status == "not_applicable" and "no second moment" in r.diagnostics["reason"]
    fresh = torch.optim.Adam(model.parameters())
    r = _measure(model, data, fresh)
    assert (
        r.status == "not_applicable"
        and "no state for parameter 0.weight" in r.diagnostics["reason"]
    )
    with pytest.raises(ConfigError, match="optimizer_state: no file"):
        _measure(model, data, None, optimizer_state=str(tmp_path / "missing.pt"))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="holds no optimizer state dict"):
        _measure(model, data, None, optimizer_state=str(tmp_path / "w.pt"))
    other = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with pytest.raises(ConfigError, match="belongs to another model"):
        preconditioner(_setup(0, "adam")[2].state_dict(), Problem(other, data))
