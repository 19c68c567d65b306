"""Loss-landscape views: directions, slices (closed form), interpolation, vmap vs loop, plots, CLI."""

from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from flatcli.engine import Problem
from flatcli.landscape import (
    InterpolateView,
    PointEvaluator,
    SliceView,
    axis_grid,
    filter_norms,
    interpolation_landscape,
    parse_span,
    random_direction,
    slice_landscape,
    write_files,
)
from flatcli.landscape.slices import direction_chunks
from tests.oracles import runner

F64 = dict(device="cpu", precision="fp64")  # settings of a landscape view
P64 = dict(device="cpu", dtype=torch.float64)  # the same for a Problem


class ConvBN(nn.Module):
    """Conv + BatchNorm + Linear: filters of every kind, 1-D parameters, running statistics."""

    def __init__(self, c=3):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, c)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def convbn(seed=0):
    torch.manual_seed(seed)
    m = ConvBN().double()
    with torch.no_grad():  # non-trivial BN state
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.2, 0.2)
    return m


def img_data(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def vec_data(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ directions
def test_directions_are_filter_normalized_and_bias_bn_zeroed():
    m = convbn()
    params = dict(m.named_parameters())
    d = random_direction(params, torch.Generator().manual_seed(3))
    for n, w in params.items():
        assert d[n].shape == w.shape and d[n].dtype == w.dtype
        if w.ndim >= 2:  # conv output channels, Linear rows
            torch.testing.assert_close(filter_norms(d[n]), filter_norms(w), rtol=1e-12, atol=0)
            assert not torch.allclose(d[n], w)  # random, not the weight itself
        else:  # biases, BN weight and bias
            assert torch.count_nonzero(d[n]) == 0
    # filter = first dimension: conv filter j is weight[j] (in × kh × kw)
    torch.testing.assert_close(
        d["conv.weight"][2].norm(), params["conv.weight"][2].detach().norm(), rtol=1e-12, atol=0
    )
    # seeded
    d2 = random_direction(params, torch.Generator().manual_seed(3))
    assert all(torch.equal(d[n], d2[n]) for n in d)
    d3 = random_direction(params, torch.Generator().manual_seed(4))
    assert not torch.equal(d["fc.weight"], d3["fc.weight"])


def test_directions_keep_bias_bn():
    m = convbn()
    params = dict(m.named_parameters())
    d = random_direction(params, torch.Generator().manual_seed(0), bias_bn="keep")
    for n, w in params.items():
        if w.ndim <= 1:  # each entry its own filter: |d_k| = |w_k|, random sign
            torch.testing.assert_close(d[n].abs(), w.detach().abs(), rtol=0, atol=0)
        else:
            torch.testing.assert_close(filter_norms(d[n]), filter_norms(w), rtol=1e-12, atol=0)
    signs = torch.cat(
        [torch.sign(d[n]) * torch.sign(params[n].detach()) for n in ("bn.weight", "conv.bias")]
    )
    assert (signs < 0).any() and (signs > 0).any()


# ------------------------------------------------------------------ grid
def test_axis_grid_contains_special_points():
    g = axis_grid((-0.5, 1.5), 25, include=(0.0, 1.0))
    assert len(g) == 25 and 0.0 in g and 1.0 in g
    g = axis_grid(
        (-1, 1), 4
    )  # 0 not on linspace(-1, 1, 4): the interior point nearest to it moves there
    assert len(g) == 4 and 0.0 in g and np.all(np.diff(g) > 0) and (g[0], g[-1]) == (-1, 1)
    g = axis_grid((-1, 1), 11)  # 0 on the linspace already: the linspace itself
    np.testing.assert_array_equal(
        g, np.where(np.isclose(np.linspace(-1, 1, 11), 0), 0, np.linspace(-1, 1, 11))
    )
    assert parse_span("-2, 3", (0, 1)) == (-2.0, 3.0)
    from flatcli.errors import ConfigError

    for bad in ("1,1", "a,b", "1", "2,1"):
        with pytest.raises(ConfigError, match="span"):
            parse_span(bad, (0, 1))


# ------------------------------------------------------------------ slices: closed form
def quadratic_problem(seed=0, n=13, d=4, k=2):
    """Bias-free linear model with mse: L(W) = mean_i ||W x_i − y_i||², exactly quadratic in W."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, k, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    model = nn.Linear(d, k, bias=False).double()
    return model, x, y


def quad_loss(W, x, y):
    r = x @ W.T - y
    return float((r * r).sum(1).mean())


def test_slice_1d_and_2d_match_closed_form():
    model, x, y = quadratic_problem()
    W = model.weight.detach().clone()
    res1 = slice_landscape(
        model,
        (x, y),
        options=SliceView(dims=1, steps=9, span=(-2, 2), points_per_pass=3),
        seed=5,
        loss="mse",
        batch_size=5,
        **F64,
    )
    gen = torch.Generator().manual_seed(5)
    D = random_direction({"weight": W}, gen)["weight"]
    E = random_direction({"weight": W}, gen)["weight"]
    # closed form along the line: L(W + αD) = L0 + 2α·mean(r·u) + α²·mean(|u|²), r = Wx − y, u = Dx
    r, u, v = x @ W.T - y, x @ D.T, x @ E.T
    L0, g1, h11 = quad_loss(W, x, y), float((r * u).sum(1).mean()), float((u * u).sum(1).mean())
    expect = [L0 + 2 * a * g1 + a * a * h11 for a in res1.alpha]
    np.testing.assert_allclose(res1.train_loss, expect, rtol=1e-12, atol=1e-14)
    assert np.all(np.isnan(res1.train_acc))  # regression targets: no accuracy
    res2 = slice_landscape(
        model,
        (x, y),
        options=SliceView(dims=2, steps=5, span=(-1, 1), points_per_pass=4),
        seed=5,
        loss="mse",
        batch_size=5,
        **F64,
    )
    g2, h22, h12 = (
        float((r * v).sum(1).mean()),
        float((v * v).sum(1).mean()),
        float((u * v).sum(1).mean()),
    )
    A, B = np.meshgrid(res2.alpha, res2.beta, indexing="ij")
    expect2 = L0 + 2 * A * g1 + 2 * B * g2 + A * A * h11 + 2 * A * B * h12 + B * B * h22
    np.testing.assert_allclose(res2.train_loss, expect2, rtol=1e-12, atol=1e-14)
    assert res2.summary["train_loss_center"] == pytest.approx(L0, rel=1e-13)
    assert res2.meta["direction_cosine"] == pytest.approx(
        float((D * E).sum() / (D.norm() * E.norm())), rel=1e-10
    )


def test_interpolation_of_quadratic_matches_closed_form_and_barrier():
    model_a, x, y = quadratic_problem(seed=0)
    model_b, _, _ = quadratic_problem(seed=1)
    view = InterpolateView(steps=9, span=(-0.5, 1.5))
    res = interpolation_landscape(
        model_a, model_b, (x, y), options=view, loss="mse", batch_size=4, **F64
    )
    Wa, Wb = model_a.weight.detach(), model_b.weight.detach()
    expect = [quad_loss((1 - t) * Wa + t * Wb, x, y) for t in res.alpha]
    np.testing.assert_allclose(res.train_loss, expect, rtol=1e-12, atol=1e-14)
    inside = (res.alpha >= 0) & (res.alpha <= 1)
    la, lb = quad_loss(Wa, x, y), quad_loss(Wb, x, y)
    assert res.summary["train_loss_barrier"] == pytest.approx(
        np.max(res.train_loss[inside]) - max(la, lb), rel=1e-12
    )
    assert res.summary["train_loss_barrier"] >= 0


# ------------------------------------------------------------------ interpolation endpoints
@pytest.mark.parametrize("ppp", [1, 4])
def test_interpolation_endpoints_reproduce_both_checkpoints(ppp):
    a, b = convbn(0), convbn(1)
    train, test = img_data(10, 0), img_data(7, 1)
    before = snapshot(a), snapshot(b)
    view = InterpolateView(steps=5, span=(-0.5, 1.5), points_per_pass=ppp)
    res = interpolation_landscape(a, b, train, test, options=view, batch_size=4, **F64)
    i0, i1 = list(res.alpha).index(0.0), list(res.alpha).index(1.0)
    for m, i in ((a, i0), (b, i1)):
        for split, data in (("train", train), ("test", test)):
            loss, acc = Problem(m.eval(), *data, batch_size=4, **P64).evaluate()
            got = getattr(res, f"{split}_loss")[i]
            if ppp == 1:  # the same computation: bit for bit
                assert got == loss
            else:
                assert got == pytest.approx(loss, rel=1e-13, abs=0)
            assert getattr(res, f"{split}_acc")[i] == acc
    assert res.meta["interpolated_buffers"] == ["bn.running_mean", "bn.running_var"]
    assert all(torch.equal(before[0][k], v) for k, v in a.state_dict().items())
    assert all(torch.equal(before[1][k], v) for k, v in b.state_dict().items())


def test_interpolation_rejects_different_architectures():
    from flatcli.errors import ConfigError

    other = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    with pytest.raises(ConfigError, match="different architectures"):
        interpolation_landscape(mlp(), other, vec_data(), options=InterpolateView(steps=3), **F64)


# ------------------------------------------------------------------ vmap vs loop; model untouched
def test_vmap_batched_equals_loop_and_model_untouched():
    m = convbn()
    m.train()  # the user's mode is restored afterwards
    before = snapshot(m)
    train, test = img_data(9, 0), img_data(6, 1)
    view = SliceView(dims=2, steps=3, span=(-1, 1), bias_bn="keep")
    kw = dict(seed=1, batch_size=4, **F64)
    loop = slice_landscape(m, train, test, options=replace(view, points_per_pass=1), **kw)
    batched = slice_landscape(m, train, test, options=replace(view, points_per_pass=4), **kw)
    assert (
        batched.meta["evaluator"]["train"]["vmap"] and not loop.meta["evaluator"]["train"]["vmap"]
    )
    for name in ("train_loss", "train_acc", "test_loss", "test_acc"):
        np.testing.assert_allclose(getattr(batched, name), getattr(loop, name), rtol=1e-13, atol=0)
    assert m.training and m.bn.training
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the centre is the checkpoint itself
    with torch.no_grad():
        center, _ = Problem(m.eval(), *train, batch_size=4, **P64).evaluate()
    assert loop.summary["train_loss_center"] == center


@pytest.mark.gpu
def test_vmap_equals_loop_on_cuda():
    m = convbn()
    train = img_data(9, 0)
    kw = dict(seed=1, batch_size=4, precision="fp64")
    one, four = SliceView(2, 3, points_per_pass=1), SliceView(2, 3, points_per_pass=4)
    loop = slice_landscape(m, train, options=one, device="cuda", **kw)
    batched = slice_landscape(m, train, options=four, device="cuda", **kw)
    assert batched.meta["evaluator"]["train"]["vmap"]
    np.testing.assert_allclose(batched.train_loss, loop.train_loss, rtol=1e-12, atol=0)
    cpu = slice_landscape(m, train, options=four, device="cpu", **kw)
    np.testing.assert_allclose(batched.train_loss, cpu.train_loss, rtol=1e-10, atol=0)


def test_auto_points_per_pass_loops_for_conv_nets():
    from flatcli.landscape.evaluate import AUTO_POINTS_PER_PASS

    three = SliceView(steps=3)
    conv = slice_landscape(convbn(), img_data(5), options=three, **F64).meta["evaluator"]["train"]
    dense = slice_landscape(mlp(), vec_data(), options=three, **F64).meta["evaluator"]["train"]
    assert conv["points_per_pass_auto"] and conv["points_per_pass"] == 1 and not conv["vmap"]
    assert dense["points_per_pass"] == AUTO_POINTS_PER_PASS and dense["vmap"]


class ItemModel(nn.Module):
    """A forward that calls .item(): no vmap batching rule, so the evaluator must loop."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) * (1.0 + 0.0 * self.fc.weight.sum().item())


def test_vmap_falls_back_to_loop():
    torch.manual_seed(0)
    m = ItemModel().double()
    kw = dict(seed=0, batch_size=4, **F64)
    res = slice_landscape(m, vec_data(), options=SliceView(1, 5, points_per_pass=4), **kw)
    ref = slice_landscape(m, vec_data(), options=SliceView(1, 5, points_per_pass=1), **kw)
    ev = res.meta["evaluator"]["train"]
    assert not ev["vmap"] and ev["vmap_fallback"]
    np.testing.assert_array_equal(res.train_loss, ref.train_loss)


def test_out_of_memory_halves_points_per_pass():
    m = mlp()
    prob = Problem(m.eval(), *vec_data(), batch_size=4, **P64)
    d = random_direction(prob.params, torch.Generator().manual_seed(0))
    coeffs = np.linspace(-1, 1, 7)[:, None]
    inner = direction_chunks(prob.params, [d], coeffs)

    def chunk(first, stop):
        if stop - first > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return inner(first, stop)

    ev = PointEvaluator(prob, points_per_pass=8)
    loss, _ = ev.run(chunk, len(coeffs))
    ref, _ = PointEvaluator(prob, 1).run(inner, len(coeffs))
    assert ev.points_per_pass == 2
    np.testing.assert_allclose(loss, ref, rtol=1e-13, atol=0)


# ------------------------------------------------------------------ files and plots
@pytest.mark.parametrize("kind", ["1d", "2d", "interpolation"])
def test_files_and_headless_plots(tmp_path, kind):
    pytest.importorskip("matplotlib")
    m, train, test = mlp(0), vec_data(11, 0), vec_data(7, 1)
    kw = dict(batch_size=8, **F64)
    if kind == "interpolation":
        res = interpolation_landscape(m, mlp(1), train, test, options=InterpolateView(4), **kw)
    else:
        res = slice_landscape(m, train, test, options=SliceView(int(kind[0]), 4), **kw)
    files = write_files(res, tmp_path)
    pngs = [p for k, p in files.items() if k not in ("csv", "json")]
    assert len(pngs) == (2 if kind == "2d" else 1)
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    rows = list(csv.DictReader(open(files["csv"])))
    cols = (
        ["alpha"]
        + (["beta"] if kind == "2d" else [])
        + ["train_loss", "train_acc", "test_loss", "test_acc"]
    )
    assert list(rows[0]) == cols
    n = len(res.alpha)
    assert len(rows) == (n * n if kind == "2d" else n)
    assert float(rows[-1]["train_loss"]) == res.train_loss.ravel()[-1]


# ------------------------------------------------------------------ CLI end to end
def write_project(tmp, manifest=False):
    from flatcli.demo.models import MLP

    for i, w in enumerate((6, 6, 7)):
        torch.manual_seed(i)
        torch.save(
            {"state_dict": MLP(8, w, 1, 3).state_dict(), "model_kwargs": {"width": w}},
            tmp / f"m{i}.pt",
        )
    cfg = {
        "model": {
            "target": "flatcli.demo.models:MLP",
            "kwargs": {"in_features": 8, "width": 6, "depth": 1, "num_classes": 3},
        },
        "checkpoints": ["m0.pt"],
        "data": {
            "train": {
                "source": "synthetic",
                "num_samples": 30,
                "input_shape": [8],
                "num_classes": 3,
            },
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
    if manifest:
        g = torch.Generator().manual_seed(0)
        torch.save(
            {"x": torch.randn(12, 8, generator=g), "y": torch.randint(0, 3, (12,), generator=g)},
            tmp / "own.pt",
        )
        (tmp / "manifest.csv").write_text("path,train_data\nm0.pt,own.pt\n")
        cfg["checkpoints"] = {"manifest": "manifest.csv"}
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "config.yaml"


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")

    from flatcli.cli import app

    cfg = write_project(tmp_path)
    before = torch.load(tmp_path / "m0.pt")["state_dict"]
    r = runner.invoke(
        app,
        [
            "landscape",
            "slice",
            "-c",
            str(cfg),
            str(tmp_path / "m0.pt"),
            "-o",
            str(tmp_path / "o1"),
            "--steps",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "train_loss_rise" in r.output and "slice_1d.png" in r.output
    rows = list(csv.DictReader(open(tmp_path / "o1" / "landscape.csv")))
    assert len(rows) == 5 and rows[0]["test_loss"] != ""
    r = runner.invoke(
        app,
        [
            "landscape",
            "slice",
            "-c",
            str(cfg),
            str(tmp_path / "m0.pt"),
            "-o",
            str(tmp_path / "o2"),
            "--dims",
            "2",
            "--steps",
            "3",
            "--span",
            "-0.5,0.5",
            "--seed",
            "7",
            "--no-plots",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(tmp_path / "o2" / "landscape.csv")))
    assert len(rows) == 9 and {float(x["beta"]) for x in rows} == {-0.5, 0.0, 0.5}
    assert not (tmp_path / "o2" / "slice_2d_contour.png").exists()
    r = runner.invoke(
        app,
        [
            "landscape",
            "interpolate",
            "-c",
            str(cfg),
            str(tmp_path / "m0.pt"),
            str(tmp_path / "m1.pt"),
            "-o",
            str(tmp_path / "o3"),
            "--steps",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert (
        "train_loss_barrier" in r.output
        and (tmp_path / "o3" / "interpolation.png").stat().st_size > 0
    )
    after = torch.load(tmp_path / "m0.pt")["state_dict"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    # bad input: exit code 2 with a one-line message
    m1, m2 = str(tmp_path / "m1.pt"), str(tmp_path / "m2.pt")
    for args, msg in (
        (["slice", "--dims", "3"], "--dims must be an int ≤ 2. Got 3 instead."),  # 1 ≤ dims ≤ 2
        (["slice", "--span", "1,0"], "span"),
        (["slice", "--bias-bn", "nope"], "--bias-bn"),
        (["interpolate", m2], "different architectures"),
        (
            ["interpolate", m1, "--dims", "2"],
            "No such option: --dims",
        ),  # not an option of this view
        (["slice", m1], "Got unexpected extra argument"),
    ):
        r = runner.invoke(
            app,
            [
                "landscape",
                args[0],
                "-c",
                str(cfg),
                str(tmp_path / "m0.pt"),
                "-o",
                str(tmp_path / "bad"),
                *args[1:],
            ],
        )
        assert r.exit_code == 2, (args, r.output)
        assert msg in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)


def test_api_uses_manifest_train_data(tmp_path):
    from flatcli import api

    cfg = write_project(tmp_path, manifest=True)
    res = api.landscape(cfg, tmp_path / "m0.pt", steps=3)
    assert res.meta["n_train"] == 12 and res.meta["n_test"] == 20
    assert res.files == {}
