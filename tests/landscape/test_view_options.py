"""The landscape views' option objects: their defaults are the values the views used before they took
objects (so a call without options gives the same numbers as one with those values spelled out),
each value is checked when the object is built, and every field reaches the computation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from flatcli.errors import ConfigError
from flatcli.landscape import (
    ConnectView,
    InterpolateView,
    PCAView,
    SliceView,
    connect_landscape,
    interpolation_landscape,
    slice_landscape,
    trajectory_landscape,
)
from tests.helpers import tiny_data, tiny_mlp

F64 = dict(device="cpu", precision="fp64")
# each view's defaults as the views' keyword arguments had them
TODAY = {
    SliceView: dict(dims=1, steps=25, span=None, bias_bn="zero"),
    InterpolateView: dict(steps=25, span=None),
    PCAView: dict(steps=25, span=None, solver="auto", sort=True),
    ConnectView: dict(
        steps=25, bend_steps=1000, bend_lr=None, bend_optimizer="adam", bend_batch_size=128
    ),
}
EVALUATION = dict(points_per_pass=None, on_progress=None)


def bn_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
    return m.eval()


def arrays(res) -> list[np.ndarray]:
    names = ("train_loss", "train_acc", "test_loss", "test_acc", "alpha", "beta")
    return [np.asarray(getattr(res, n)) for n in names if getattr(res, n, None) is not None]


def assert_identical(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)  # bit for bit (NaN equal to NaN)


def test_defaults_are_todays_values():
    for cls, values in TODAY.items():
        default = cls()
        fields = {f.name: getattr(default, f.name) for f in dataclasses.fields(cls)}
        fields.pop(
            "bend_init", None
        )  # a tensor mapping, not a setting (default None: the midpoint)
        assert fields == {**values, **EVALUATION}, cls.__name__
        assert cls(**values, **EVALUATION) == default


CASES = [(seed, bn) for seed in range(3) for bn in (False, True)]


@pytest.mark.parametrize("seed,bn", CASES)
def test_slice_and_interpolate_at_defaults_equal_the_explicit_values(seed, bn):
    make = bn_mlp if bn else (lambda s: tiny_mlp(seed=s).eval())
    a, b = make(seed), make(seed + 10)
    train, test = tiny_data(31, seed=seed), tiny_data(13, seed=seed + 1)
    kw = dict(seed=seed, batch_size=8, **F64)
    for fn, models, cls in (
        (slice_landscape, (a,), SliceView),
        (interpolation_landscape, (a, b), InterpolateView),
    ):
        bare = fn(*models, train, test, **kw)
        spelled = fn(*models, train, test, options=cls(**TODAY[cls], **EVALUATION), **kw)
        assert_identical(arrays(bare), arrays(spelled))
        assert bare.meta.keys() == spelled.meta.keys()
        assert {k: v for k, v in bare.meta.items() if k != "evaluator"} == {
            k: v for k, v in spelled.meta.items() if k != "evaluator"
        }


@pytest.mark.parametrize("seed,bn", CASES)
def test_pca_at_defaults_equals_the_explicit_values(seed, bn):
    make = bn_mlp if bn else (lambda s: tiny_mlp(seed=s).eval())
    states = [make(seed + k).state_dict() for k in range(4)]
    train = tiny_data(29, seed=seed)
    kw = dict(model=make(99), seed=seed, batch_size=8, **F64)
    bare = trajectory_landscape(states, train, **kw)
    spelled = trajectory_landscape(
        states, train, options=PCAView(**TODAY[PCAView], **EVALUATION), **kw
    )
    assert_identical(arrays(bare.surface), arrays(spelled.surface))
    np.testing.assert_array_equal(bare.components, spelled.components)
    np.testing.assert_array_equal(bare.path["train_loss"], spelled.path["train_loss"])


@pytest.mark.parametrize("seed,bn", [(0, False), (1, True), (2, False)])
def test_connect_at_defaults_equals_the_explicit_values(seed, bn):
    """The default bend training (1000 Adam steps at 1e-3 on minibatches of 128) and 25 points."""
    make = bn_mlp if bn else (lambda s: tiny_mlp(seed=s).eval())
    a, b = make(seed), make(seed + 10)
    train = tiny_data(37, seed=seed)
    kw = dict(seed=seed, batch_size=16, **F64)
    bare = connect_landscape(a, b, train, **kw)
    spelled = connect_landscape(
        a, b, train, options=ConnectView(**TODAY[ConnectView], **EVALUATION), **kw
    )
    assert_identical(
        arrays(bare.line) + arrays(bare.curve) + [bare.history["loss"], bare.history["t"]],
        arrays(spelled.line)
        + arrays(spelled.curve)
        + [spelled.history["loss"], spelled.history["t"]],
    )
    assert all(torch.equal(bare.bend[n], spelled.bend[n]) for n in bare.bend)
    assert bare.meta == spelled.meta and bare.meta["bend_steps"] == 1000
    assert bare.meta["bend_lr"] == 1e-3 and bare.meta["bend_optimizer"] == "adam"


def test_every_field_reaches_the_view():
    """A non-default value of each field changes what the view computes or records."""
    a, b, train = tiny_mlp(seed=0).eval(), tiny_mlp(seed=1).eval(), tiny_data(20)
    kw = dict(batch_size=8, **F64)
    s = slice_landscape(a, train, options=SliceView(2, 5, "-2,2", "keep"), **kw)
    assert s.kind == "2d" and len(s.alpha) == 5 and s.meta["span"] == [-2.0, 2.0]
    assert s.meta["bias_bn"] == "keep"
    i = interpolation_landscape(a, b, train, options=InterpolateView(3, (0, 1)), **kw)
    assert list(i.alpha) == [0.0, 0.5, 1.0]
    seen = []
    c = connect_landscape(
        a,
        b,
        train,
        options=ConnectView(
            4, 6, 0.05, "sgd", 5, points_per_pass=1, on_progress=lambda d, t: seen.append(d)
        ),
        **kw,
    )
    assert len(c.line.alpha) == 4 and len(c.history["loss"]) == 6
    assert (c.meta["bend_lr"], c.meta["bend_optimizer"], c.meta["bend_batch_size"]) == (
        0.05,
        "sgd",
        5,
    )
    assert c.line.meta["evaluator"]["train"]["points_per_pass"] == 1 and seen


@pytest.mark.parametrize(
    "cls,field,value,words",
    [
        (SliceView, "dims", 3, "`dims` must be one of 1, 2. Got 3"),
        (SliceView, "steps", 1, "`steps` must be an int ≥ 2. Got 1"),
        (SliceView, "bias_bn", "drop", "`bias_bn` must be one of zero, keep. Got 'drop'"),
        (SliceView, "span", "1,0", "span must satisfy a < b"),
        (InterpolateView, "points_per_pass", 0, "`points_per_pass` must be an int ≥ 1 or null"),
        (PCAView, "solver", "qr", "`solver` must be one of auto, full, randomized. Got 'qr'"),
        (ConnectView, "bend_steps", -1, "`bend_steps` must be an int ≥ 0. Got -1"),
        (ConnectView, "bend_lr", 0.0, "`bend_lr` must be a float > 0 or null. Got 0.0"),
        (ConnectView, "bend_optimizer", "lbfgs", "`bend_optimizer` must be one of adam, sgd"),
        (ConnectView, "bend_batch_size", 0, "`bend_batch_size` must be an int ≥ 1. Got 0"),
        (ConnectView, "on_progress", 3, "`on_progress` must be a callable or null. Got 3"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(cls, field, value, words):
    with pytest.raises(ConfigError) as e:
        cls(**{field: value})
    assert words in str(e.value) and "\n" not in str(e.value)
