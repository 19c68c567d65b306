import pytest
import torch

from flatcli.api import measure_model
from flatcli.engine import CurvatureEngine, Problem, eval_mode
from flatcli.errors import ConfigError
from tests.helpers import TinyBN, tiny_data, tiny_mlp
from tests.oracles import problem_hessian


def test_uneven_last_batch_equals_one_full_batch():
    model = tiny_mlp()
    x, y = tiny_data(n=23)
    full = CurvatureEngine(Problem(model, x, y, batch_size=23, dtype=torch.float64))
    uneven = CurvatureEngine(Problem(model, x, y, batch_size=5, dtype=torch.float64))  # 5,5,5,5,3
    assert len(uneven.problem.batches) == 5 and uneven.problem.batches[-1].rows == 3
    assert abs(full.loss() - uneven.loss()) < 1e-14
    torch.testing.assert_close(full.loss_grad()[1], uneven.loss_grad()[1], rtol=1e-12, atol=1e-14)
    V = torch.randn(3, full.problem.num_params, dtype=torch.float64)
    torch.testing.assert_close(full.hessian()(V), uneven.hessian()(V), rtol=1e-11, atol=1e-13)
    H = problem_hessian(full.problem)
    torch.testing.assert_close(uneven.hessian()(V), V @ H, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_hvp_modes_match_dense(mode):
    model = tiny_mlp()
    x, y = tiny_data()
    eng = CurvatureEngine(Problem(model, x, y, batch_size=7, dtype=torch.float64), hvp_mode=mode)
    H = problem_hessian(eng.problem)
    V = torch.randn(4, eng.problem.num_params, dtype=torch.float64)
    torch.testing.assert_close(eng.hessian()(V), V @ H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(eng.hessian()(V[0]), H @ V[0], rtol=1e-10, atol=1e-12)
    assert eng.counters()["n_hvp"] == 5


def test_mse_loss_definition():
    w = torch.nn.Linear(3, 1, bias=False).double()
    x = torch.randn(9, 3, dtype=torch.float64)
    y = torch.randn(9, dtype=torch.float64)
    p = Problem(w, x, y, loss="mse", batch_size=4)
    expected = ((x @ w.weight[0] - y) ** 2).mean()
    torch.testing.assert_close(p.loss(), expected)


def test_bn_dropout_model_measured_in_eval_mode_and_mode_restored():
    torch.manual_seed(0)
    model = TinyBN().double()
    x, y = tiny_data(n=20)
    with torch.no_grad():  # non-trivial running statistics
        model.train()
        model(x)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    row = measure_model(
        model,
        (x, y),
        ["frobenius_norm", {"hessian_trace": {"method": "exact"}}],
        precision="fp64",
        batch_size=6,
    )
    assert row.status == "ok", row.error
    assert model.training and model.bn.training and model.drop.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    # the value is the eval-mode Hessian trace (dropout off, running stats used)
    with eval_mode(model):
        p = Problem(model, x, y, batch_size=20, dtype=torch.float64)
        H = problem_hessian(p)
    assert abs(row.results["hessian_trace"].value - float(H.trace())) <= 1e-8 * abs(
        float(H.trace())
    )


def test_eval_mode_restores_mixed_modes():
    model = TinyBN()
    model.train()
    model.drop.eval()
    with eval_mode(model):
        assert not model.training and not model.bn.training
    assert model.training and model.bn.training and not model.drop.training


def test_label_outside_outputs_is_config_error():
    model = tiny_mlp(c=3)
    x, _ = tiny_data()
    y = torch.full((len(x),), 3)
    with pytest.raises(ConfigError, match=r"data.train: label 3 is outside the model's 3 outputs"):
        measure_model(model, (x, y), ["frobenius_norm"], precision="fp64")


def test_nonfinite_loss_becomes_error_row():
    model = tiny_mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    x, y = tiny_data()
    row = measure_model(model, (x, y), ["frobenius_norm"], precision="fp64")
    assert row.status == "error" and "not finite" in row.error


def test_measure_model_does_not_touch_callers_model_dtype():
    model = tiny_mlp(dtype=torch.float32)
    x, y = tiny_data(dtype=torch.float32)
    before = [p.clone() for p in model.parameters()]
    row = measure_model(model, (x, y), ["frobenius_norm"], precision="fp64")
    assert row.status == "ok"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
