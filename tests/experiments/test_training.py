"""flatcli.training: the one training loop of the demo and the experiments (train to a loss
target, penalties, dropout, criteria, noisy labels, checkpoints, manifest, thread independence)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flatcli.training import (
    Evaluation,
    LossTarget,
    Plateau,
    Recipe,
    TrainTask,
    _optimizer,
    model_name,
    noisy_labels,
    read_training,
    run_tasks,
    train_to_target,
    write_manifest,
)


def _tiny_problem(seed=0, n=60):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


ADAM = Recipe(optimizer="adam", lr=0.02, batch_size=16, weight_decay=1e-4, max_steps=3000)


def _eval_ce(model, x, y) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model.eval()(x), y))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ the loop
def test_train_to_target_stops_at_the_eval_mode_target_and_is_deterministic():
    x, y = _tiny_problem()
    a, b = _tiny_model(), _tiny_model()
    ra = train_to_target(a, x, y, ADAM, seed=3, criterion=LossTarget(0.05))
    rb = train_to_target(b, x, y, ADAM, seed=3, criterion=LossTarget(0.05))
    assert ra.reached_target and ra.train_loss <= 0.05 and not ra.diverged
    assert _eval_ce(a, x, y) == pytest.approx(ra.train_loss, rel=1e-6)
    assert (ra.steps, ra.train_loss) == (rb.steps, rb.train_loss)
    assert _same_weights(a.state_dict(), b.state_dict())
    assert ra.steps % 4 == 0  # checked once per epoch (60 samples / 16 → 4 steps)
    rc = train_to_target(_tiny_model(), x, y, ADAM, seed=4, criterion=LossTarget(0.05))
    assert rc.steps != ra.steps or rc.train_loss != ra.train_loss  # the seed orders the batches


def test_train_to_target_records_a_miss_and_a_divergence():
    x, y = _tiny_problem()
    r = train_to_target(
        _tiny_model(), x, y, dataclasses.replace(ADAM, max_steps=5), criterion=LossTarget(1e-4)
    )
    assert not r.reached_target and r.steps == 5 and math.isfinite(r.train_loss)
    sgd = Recipe(optimizer="sgd", lr=1e3, batch_size=16, max_steps=3000)
    r = train_to_target(_tiny_model(), x * 1e4, y, sgd, criterion=LossTarget(1e-4))
    assert not r.reached_target and r.diverged and r.steps < 3000


def test_a_criterion_object_decides_when_training_stops():
    """Any object with met(history) plugs in; here: train accuracy ≥ 90%, whatever the loss."""

    class Accuracy:
        def met(self, history):
            return history[-1].accuracy >= 0.9

    x, y = _tiny_problem()
    seen: list[list[Evaluation]] = []

    class Recording(Accuracy):
        def met(self, history):
            seen.append(list(history))
            return super().met(history)

    r = train_to_target(_tiny_model(), x, y, ADAM, criterion=Recording())
    assert r.reached_target and r.train_acc >= 0.9 and r.train_loss > 0.05
    assert seen[-1][-2].accuracy < 0.9 and [e.step for e in seen[-1]] == list(
        range(0, r.steps + 1, 4)
    )
    assert LossTarget(0.5).met([Evaluation(0, 0.5, 0.0)]) and not LossTarget(0.5).met(
        [Evaluation(0, 0.51, 1.0)]
    )


def _history(losses, accuracy=1.0):
    """Evaluations 0..len-1 (the first is the initial one, before any step)."""
    return [Evaluation(i, float(v), accuracy) for i, v in enumerate(losses)]


def test_plateau_criterion_on_histories():
    """Plateau(window 5, rtol 1%): the target alone suffices; otherwise 100% train accuracy, at
    least 2 windows after the initial evaluation, and window means that fell by < 1%."""
    c = Plateau(target=0.01, window=5, rtol=0.01)
    assert c.met(_history([2.0, 0.009], accuracy=0.5))  # the loss target, whatever the accuracy
    flat = [
        0.05
    ] * 11  # the initial evaluation is not a step of training: 2·window evaluations after it
    assert c.met(_history(flat)) and not c.met(_history(flat[:-1]))
    assert not c.met(
        _history(flat, accuracy=0.999)
    )  # a plateau below 100% train accuracy is not converged
    # geometric decay: window means fall by 1 − 0.99⁵ ≈ 4.9% (still training) vs 1 − 0.999⁵ ≈ 0.5% (plateau)
    assert not c.met(_history([2.0] + [0.1 * 0.99**k for k in range(30)]))
    assert c.met(_history([2.0] + [0.1 * 0.999**k for k in range(30)]))
    # mini-batch noise: the last value is the lowest yet, but the window means have stopped falling
    noisy = [
        2.0,
        0.05,
        0.06,
        0.055,
        0.05,
        0.06,
        0.06,
        0.05,
        0.06,
        0.057,
        0.048,
    ]  # window sums 0.275, 0.275
    assert c.met(_history(noisy))
    # a rising loss is not falling either; only the last 2 windows count (the early drop is old)
    assert c.met(_history([2.0, 1.0, 0.5, 0.2] + [0.04] * 5 + [0.045] * 5))
    assert "plateau" in c.describe() and "0.01" in c.describe()


@pytest.mark.parametrize(
    "kw", [{"window": 0}, {"rtol": 1.0}, {"min_accuracy": 0.0}, {"target": 0.0}]
)
def test_plateau_rejects_bad_settings(kw):
    from flatcli.errors import ConfigError

    with pytest.raises(ConfigError, match=f"plateau {next(iter(kw))}"):
        Plateau(**kw)


def test_strong_l2_misses_the_loss_target_but_stops_on_the_plateau():
    """An l2 penalty too strong for train CE ≤ 0.01: LossTarget runs to max_steps, Plateau stops
    earlier at 100% train accuracy, and its loss then changes by < rtol between windows."""
    x, y = _tiny_problem()
    recipe = Recipe(optimizer="adamw", lr=0.02, batch_size=16, l2=0.05, max_steps=600)
    miss = train_to_target(_tiny_model(), x, y, recipe, criterion=LossTarget(0.01))
    assert not miss.reached_target and miss.steps == 600 and miss.train_loss > 0.05
    c = Plateau(target=0.01, window=10, rtol=0.01)
    seen = []

    class Recording(Plateau):
        def met(self, history):
            seen[:] = list(history)
            return super().met(history)

    hit = train_to_target(_tiny_model(), x, y, recipe, criterion=Recording(**dataclasses.asdict(c)))
    assert hit.reached_target and hit.steps < 600 and hit.train_acc == 1.0 and hit.train_loss > 0.05
    assert c.met(seen) and not c.met(seen[:-1])  # stopped at the first evaluation that met it
    assert hit.train_loss == pytest.approx(
        miss.train_loss, rel=0.1
    )  # the plateau is where it stays


def test_weight_decay_and_l2_only_on_weights_and_adamw_decouples():
    opt = _optimizer(_tiny_model(), Recipe(optimizer="sgd", weight_decay=5e-4))
    decayed = [p.ndim for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    plain = [p.ndim for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]]
    assert decayed == [2, 2] and plain == [1, 1]
    assert (
        type(_optimizer(_tiny_model(), Recipe(optimizer="adamw", weight_decay=0.1)))
        is torch.optim.AdamW
    )
    assert (
        type(_optimizer(_tiny_model(), Recipe(optimizer="adam", weight_decay=0.1)))
        is torch.optim.Adam
    )


def test_l2_penalty_is_the_gradient_of_half_l2_norm():
    """Plain SGD: l2/2·Σ‖W‖² in the objective and the optimizer's coupled weight_decay take the same
    steps; both differ from no penalty, and the biases are not penalized."""
    x, y = _tiny_problem()
    base = Recipe(
        optimizer="sgd", lr=0.1, momentum=0.0, batch_size=16, max_steps=12, dtype="float64"
    )
    runs = {}
    for name, recipe in {"l2": dataclasses.replace(base, l2=0.5), "wd": dataclasses.replace(base, weight_decay=0.5),
                         "none": base}.items():  # fmt: skip
        m = _tiny_model()
        train_to_target(m, x, y, recipe, criterion=LossTarget(0.0))
        runs[name] = m.state_dict()
    for k in runs["l2"]:
        torch.testing.assert_close(runs["l2"][k], runs["wd"][k], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(runs["l2"]["0.weight"], runs["none"]["0.weight"], rtol=1e-3)


def test_dropout_trains_stochastically_but_every_check_is_in_eval_mode():
    from flatcli.demo.models import MLP

    x, y = _tiny_problem()
    assert list(MLP(5, 8, 2, 4).state_dict()) == list(
        MLP(5, 8, 2, 4, dropout=0.0).state_dict()
    )  # keys kept
    assert not any(isinstance(m, torch.nn.Dropout) for m in MLP(5, 8, 2, 4).modules())
    torch.manual_seed(0)
    m = MLP(5, 32, 2, 4, dropout=0.5)
    assert sum(isinstance(mod, torch.nn.Dropout) for mod in m.modules()) == 2
    r = train_to_target(m, x, y, dataclasses.replace(ADAM, max_steps=40), criterion=LossTarget(0.0))
    assert r.train_loss == pytest.approx(_eval_ce(m, x, y), rel=1e-6) and not m.training
    with torch.no_grad():
        m.train()
        assert not torch.equal(m(x), m(x))  # dropout on in training mode


def test_float64_recipe_trains_in_float64_and_returns_the_model_in_its_own_dtype():
    x, y = _tiny_problem()
    seen = []
    m = _tiny_model()
    train_to_target(m, x, y, dataclasses.replace(ADAM, max_steps=8, dtype="float64"), criterion=LossTarget(0.0),
                    on_step=lambda step, model: seen.append(next(model.parameters()).dtype))  # fmt: skip
    assert seen == [torch.float64] * 8 and next(m.parameters()).dtype == torch.float32


def test_bad_recipe_names_are_config_errors():
    from flatcli.errors import ConfigError

    with pytest.raises(
        ConfigError, match="optimizer must be one of sgd, adam, adamw. Got 'rmsprop'"
    ):
        Recipe(optimizer="rmsprop")
    with pytest.raises(ConfigError, match="dtype must be one of float32, float64. Got 'float16'"):
        Recipe(dtype="float16")


# ------------------------------------------------------------------ threads
def test_demo_weights_are_bit_identical_under_1_and_2_threads():
    """A demo model (its task: data, noisy labels, initialization, full-batch Adam) trained with the
    caller at 1 and at 2 torch threads. float32 for 20 steps: the dtype where a second thread
    changes the bits within a few steps when training is not confined to one thread."""
    from flatcli.demo.zoo import zoo_tasks
    from flatcli.training import init_model, task_data

    task = next(t for t in zoo_tasks(".") if t.name == "mlp_w64_wd0_noise0.2")
    recipe = dataclasses.replace(task.recipe, max_steps=20, dtype="float32")
    states = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x, y, _ = task_data(task)
            model = init_model(task)
            train_to_target(model, x, y, recipe, seed=task.seed, criterion=task.criterion)
            assert torch.get_num_threads() == threads  # the caller's setting is restored
            states.append(model.state_dict())
    finally:
        torch.set_num_threads(before)
    assert _same_weights(*states)


# ------------------------------------------------------------------ tasks, names, manifest
def _task(tmp_path, name, seed, noise=None, hp=None):
    return TrainTask(
        name=name, outdir=str(tmp_path), model_target="flatcli.demo.models:MLP",
        model_kwargs={"in_features": 64, "width": 8, "depth": 1, "num_classes": 10},
        data={"train": {"source": "digits"}, "test": {"source": "digits"}},
        recipe=Recipe(optimizer="adam", lr=0.01, batch_size=256, max_steps=12), hparams=hp or {"seed": seed},
        criterion=LossTarget(0.0), seed=seed, label_noise=noise,
    )  # fmt: skip


def test_tasks_give_the_same_models_in_any_order_and_process_state(tmp_path):
    """What makes `run_tasks`' worker pool give the serial results: each task seeds itself and
    trains single-threaded, whatever ran before it in the process."""
    runs = {}
    for order in ("ab", "ba"):
        folder = tmp_path / order
        tasks = {"a": _task(folder, "a", 1, noise=0.3), "b": _task(folder, "b", 2)}
        torch.manual_seed(
            123 if order == "ab" else 456
        )  # the process's own RNG state must not matter
        recs = run_tasks([tasks[k] for k in order])
        runs[order] = {r.path: r for r in recs}
    assert runs["ab"].keys() == runs["ba"].keys() == {"checkpoints/a.pt", "checkpoints/b.pt"}
    for path, rec in runs["ab"].items():
        other = runs["ba"][path]
        assert (rec.result.steps, rec.result.train_loss) == (
            other.result.steps,
            other.result.train_loss,
        )
        for kind in (path, rec.init_checkpoint, *([rec.train_data] if rec.train_data else [])):
            a, b = (torch.load(tmp_path / o / kind, weights_only=True) for o in ("ab", "ba"))
            assert _same_weights(a.get("state_dict", a), b.get("state_dict", b))
    a = runs["ab"]["checkpoints/a.pt"]
    assert a.train_data == "data/train_noise0.3_seed1.pt"
    noisy = torch.load(tmp_path / "ab" / a.train_data, weights_only=True)["y"]
    from flatcli.loading.data import digits_split

    assert torch.equal(noisy, noisy_labels(digits_split("train")[1], 0.3, 1, 10))


def test_model_names():
    hp = {"width": 64, "weight_decay": 0.0, "label_noise": 0.2}
    assert (
        model_name(
            hp, prefix="mlp", short={"width": "w", "weight_decay": "wd", "label_noise": "noise"}
        )
        == "mlp_w64_wd0_noise0.2"
    )
    assert (
        model_name({"weight_decay": 5e-4, "optimizer": "sgd", "seed": 1}, index=3)
        == "003_weight_decay0.0005_optimizersgd_seed1"
    )


def test_manifest_and_training_log_feed_a_flatcli_config(tmp_path):
    """manifest.csv lists checkpoints, their initializations, noisy-label files and hyperparameters
    (what `checkpoints: {manifest: ...}` reads); training.csv reads back into the same records."""
    from flatcli.config import from_dict
    from flatcli.loading.jobs import resolve_jobs

    hps = [
        {"optimizer": "adam", "label_noise": 0.0, "seed": 0},
        {"optimizer": "adam", "label_noise": 0.5, "seed": 1},
    ]
    recs = run_tasks(
        [
            _task(tmp_path, f"m{i}", hp["seed"], noise=hp["label_noise"], hp=hp)
            for i, hp in enumerate(hps)
        ]
    )
    manifest, training = write_manifest(tmp_path, recs, ["optimizer", "label_noise", "seed"])
    assert (
        manifest.read_text().splitlines()[0]
        == "path,init_checkpoint,train_data,optimizer,label_noise,seed"
    )
    back = read_training(training, ["optimizer", "label_noise", "seed"])
    assert [(r.path, r.init_checkpoint, r.train_data, r.hparams, r.lr) for r in back] == \
           [(r.path, r.init_checkpoint, r.train_data, r.hparams, r.lr) for r in recs]  # fmt: skip
    assert [(r.result.steps, r.result.train_loss, r.result.reached_target) for r in back] == \
           [(r.result.steps, r.result.train_loss, r.result.reached_target) for r in recs]  # fmt: skip
    cfg = from_dict({"model": {"target": "flatcli.demo.models:MLP"}, "checkpoints": {"manifest": "manifest.csv"},
                     "data": {"train": {"source": "digits"}}}, base_dir=tmp_path, env={})  # fmt: skip
    jobs = resolve_jobs(cfg)
    assert [j.hparams["label_noise"] for j in jobs] == [0.0, 0.5] and [
        j.hparams["seed"] for j in jobs
    ] == [0, 1]
    assert all(
        j.path.is_file() and j.init_checkpoint.is_file() and j.train_data.is_file() for j in jobs
    )
