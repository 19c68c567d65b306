"""Per-layer (per parameter tensor) Hessian traces and block λmax against dense float64 Hessians."""

from __future__ import annotations

import math

import pytest
import torch

from flatcli.api import measure_model
from flatcli.engine import Problem, linalg
from tests.helpers import TinyBN
from tests.measures.test_hessian_measures import mlp_data, saddle_data
from tests.oracles import problem_hessian

DT = torch.float64


def zero_weight_data(n=12):
    """An MLP whose first layer is all zeros (a pruned layer: its block still has curvature)."""
    model, x, y = mlp_data(n=n, seed=2)
    with torch.no_grad():
        model[0].weight.zero_()
    return model, x, y


def bn_data(n=16):
    torch.manual_seed(3)
    model = TinyBN(d=4, h=5, c=3).to(DT)
    x = torch.randn(n, 4, dtype=DT)
    with torch.no_grad():
        model.train()
        model(x)
        model.eval()
        y = model(x).argmax(1)
    return model, x, y


CASES = {
    "mlp": (mlp_data, "cross_entropy"),
    "saddle": (saddle_data, "mse"),  # indefinite: one block negative definite
    "zero_weights": (zero_weight_data, "cross_entropy"),
    "batchnorm": (bn_data, "cross_entropy"),
}


def dense_blocks(model, x, y, loss):
    """{name: H_bb} from the dense Hessian of L over the measurement set."""
    p = Problem(model.eval(), x, y, loss=loss, batch_size=4, dtype=DT)
    H = problem_hessian(p)
    return {n: H[sl, sl] for n, sl in p.param_slices().items()}, H


def run(model, x, y, loss, name, **opts):
    row = measure_model(model, (x, y), [{name: opts}], loss=loss, precision="fp64", batch_size=4)
    assert row.status == "ok", row.errors
    return row.results[name], row


@pytest.mark.parametrize("case", list(CASES))
def test_exact_per_layer_traces_are_the_block_traces(case):
    make, loss = CASES[case]
    model, x, y = make()
    blocks, H = dense_blocks(model, x, y, loss)
    r, _ = run(model, x, y, loss, "hessian_trace", method="exact")
    assert set(r.diagnostics["layers"]) == set(blocks)
    for n, Hb in blocks.items():
        assert r.diagnostics["layers"][n] == pytest.approx(
            float(torch.trace(Hb)), rel=1e-10, abs=1e-12
        )
    assert sum(r.diagnostics["layers"].values()) == pytest.approx(r.value, rel=1e-12)


@pytest.mark.parametrize("method", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("case", list(CASES))
def test_stochastic_per_layer_traces_sum_to_the_total_and_match_blocks(case, method):
    make, loss = CASES[case]
    model, x, y = make()
    blocks, _ = dense_blocks(model, x, y, loss)
    r, _ = run(model, x, y, loss, "hessian_trace", method=method, min_probes=300, max_probes=300)
    layers, ses = r.diagnostics["layers"], r.diagnostics["layers_stderr"]
    scale = sum(abs(v) for v in layers.values())
    assert abs(sum(layers.values()) - r.value) <= 1e-12 * max(scale, 1.0)  # exact split per probe
    for n, Hb in blocks.items():
        ref = float(torch.trace(Hb))
        assert abs(layers[n] - ref) <= 4 * ses[n] + 1e-10 * max(abs(ref), 1.0), (
            n,
            layers[n],
            ref,
            ses[n],
        )


def test_per_layer_stderr_shrinks_like_one_over_root_probes():
    model, x, y = mlp_data()
    few, _ = run(
        model,
        x,
        y,
        "cross_entropy",
        "hessian_trace",
        method="hutchinson",
        min_probes=25,
        max_probes=25,
    )
    many, _ = run(
        model,
        x,
        y,
        "cross_entropy",
        "hessian_trace",
        method="hutchinson",
        min_probes=400,
        max_probes=400,
    )
    for n in few.diagnostics["layers_stderr"]:
        ratio = few.diagnostics["layers_stderr"][n] / many.diagnostics["layers_stderr"][n]
        assert 2.5 < ratio < 6.5  # sqrt(400/25) = 4


def test_hutchpp_with_a_sketch_that_spans_everything_is_exact_per_block():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(9, 9, generator=g, dtype=DT)
    A = A + A.T
    blocks = [slice(0, 2), slice(2, 7), slice(7, 9)]
    r = linalg.hutchpp(
        linalg.as_operator(lambda V: V @ A, 9, dtype=DT),
        stop=linalg.ProbeStop(min_probes=30, max_probes=30),
        generator=g,
        blocks=blocks,
    )
    est, se = r.block_estimates()
    for b, e, s in zip(blocks, est, se, strict=True):
        assert e == pytest.approx(float(torch.trace(A[b, b])), abs=1e-10) and s == 0


@pytest.mark.parametrize("case", list(CASES))
def test_block_lambda_max_is_the_largest_eigenvalue_of_each_diagonal_block(case):
    make, loss = CASES[case]
    model, x, y = make()
    blocks, H = dense_blocks(model, x, y, loss)
    r, _ = run(model, x, y, loss, "hessian_lambda_max", tol=1e-8, per_layer="json")
    lam = float(torch.linalg.eigvalsh(H)[-1])
    for n, Hb in blocks.items():
        ref = float(torch.linalg.eigvalsh(Hb)[-1])  # algebraic: negative for the saddle's a-block
        got = r.diagnostics["layers"][n]
        assert got == pytest.approx(ref, rel=1e-6, abs=1e-10), (n, got, ref)
        assert got <= lam + 1e-8 * abs(lam)  # Cauchy interlacing
        assert r.diagnostics["layers_converged"][n]
    if case == "saddle":
        assert r.diagnostics["layers"]["a"] < 0 < r.diagnostics["layers"]["c"]


def test_block_lambda_max_costs_one_lanczos_per_tensor_and_nothing_by_default():
    model, x, y = mlp_data()
    plain, _ = run(model, x, y, "cross_entropy", "hessian_lambda_max")
    assert (
        "layers" not in plain.diagnostics
        and plain.diagnostics["n_hvp"] == plain.diagnostics["steps"]
    )
    per, _ = run(model, x, y, "cross_entropy", "hessian_lambda_max", per_layer="json")
    sizes = [p.numel() for p in model.parameters()]
    assert per.value == plain.value
    extra = per.diagnostics["n_hvp"] - per.diagnostics["steps"]
    assert len(sizes) * 1 <= extra <= sum(min(s, 100) for s in sizes)


@pytest.mark.parametrize("name", ["hessian_trace", "hessian_lambda_max"])
def test_columns_option_flattens_per_layer_values_into_csv_columns(name):
    model, x, y = mlp_data()
    opts = {"per_layer": "columns"}
    if name == "hessian_trace":
        opts.update(min_probes=8, max_probes=8)
    r, row = run(model, x, y, "cross_entropy", name, **opts)
    flat = row.flat()
    for n, v in r.diagnostics["layers"].items():
        assert flat[f"{name}_layer_{n}"] == v
    if name == "hessian_trace":
        assert f"{name}_layer_0.weight_stderr" in flat
    plain, row = run(
        model,
        x,
        y,
        "cross_entropy",
        name,
        **({"min_probes": 8, "max_probes": 8} if name == "hessian_trace" else {}),
    )
    assert not any(k.startswith(f"{name}_layer_") for k in row.flat())


def test_per_layer_none_skips_the_split():
    model, x, y = mlp_data()
    r, _ = run(
        model, x, y, "cross_entropy", "hessian_trace", per_layer="none", min_probes=8, max_probes=8
    )
    assert "layers" not in r.diagnostics and math.isfinite(r.value)
