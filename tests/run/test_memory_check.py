"""The memory check (``runtime.check_memory``, `flatcli.run.memory`, issue 27): a run that will not fit in
the device's free memory fails its checkpoint before the data is loaded, with a one-line reason and
the settings that make it fit; the predicted bytes against a hand count. The free memory is
monkeypatched (`flatcli.run.memory.free_bytes`), so nothing here allocates much."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import flatcli.loading.load as load
import flatcli.run.memory as memory
from flatcli.cli import app
from flatcli.demo.models import MLP
from flatcli.engine import Batch, Problem
from flatcli.engine.curvatures import Curvature
from flatcli.engine.linalg import LANCZOS_WORK_VECTORS
from flatcli.measures import MeasureSpec
from flatcli.run.settings import Settings
from tests.helpers import write_project
from tests.oracles import runner

LAMBDA = {"hessian_lambda_max": {"tol": 1e-3, "max_steps": 20}}
MEASURES = [LAMBDA, "frobenius_norm"]


def P_of(width: int) -> int:
    """Parameters of MLP(16, width, depth 1, 4), counted by hand: 16·w + w + w·4 + 4."""
    return 16 * width + width + width * 4 + 4


def free(monkeypatch, nbytes):
    monkeypatch.setattr(memory, "free_bytes", lambda device: nbytes)


def project(tmp_path: Path, widths=(8,), measures=MEASURES, runtime=None) -> Path:
    """A config whose checkpoints m0.pt, m1.pt, ... have the given widths (model_kwargs stored)."""
    cfg = write_project(
        tmp_path,
        n_ckpt=0,
        measures=measures,
        extra={"runtime": {"device": "cpu", "seed": 0, **(runtime or {})}},
    )
    for i, w in enumerate(widths):
        torch.manual_seed(i)
        torch.save(
            {"state_dict": MLP(16, w, 1, 4).state_dict(), "model_kwargs": {"width": w}},
            tmp_path / f"m{i}.pt",
        )
    raw = yaml.safe_load(cfg.read_text())
    raw["checkpoints"] = [f"m{i}.pt" for i in range(len(widths))]
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    return cfg


def rows(outdir: Path) -> list[dict]:
    return json.loads((outdir / "results.json").read_text())["rows"]


def test_a_run_that_will_not_fit_fails_before_the_data_with_a_suggestion(tmp_path, monkeypatch):
    """(a) exit code 1, one line naming the measure that needs the most and the settings that fit;
    (b) before any data is loaded."""
    loads = []
    real = load.load_split
    monkeypatch.setattr(load, "load_split", lambda *a, **k: loads.append(a) or real(*a, **k))
    P = P_of(8)
    need = (
        4 * P * (2 + 20 + 1)
    )  # θ and gradient, the 20-vector Lanczos basis, one product input (fp32)
    free(monkeypatch, need - 1)
    cfg = project(tmp_path)
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o")])
    assert res.exit_code == 1, res.output
    assert loads == []  # refused before any split was loaded
    (row,) = rows(tmp_path / "o")
    assert row["status"] == "error" and row["error_kind"] == "MeasurementError"
    msg = row["error"]
    assert "\n" not in msg and msg.startswith("will not fit")
    assert "(hessian_lambda_max)" in msg and f"{need - 1} B available" not in msg  # bytes in words
    assert "params: include/exclude" in msg and "leaving out hessian_lambda_max" in msg
    assert "runtime.max_device_vectors" not in msg  # on CPU host and device are one memory: no help
    assert "runtime.check_memory: false" in msg
    assert f"error: m0.pt: {msg}" in res.output


def test_only_the_checkpoint_that_does_not_fit_fails(tmp_path, monkeypatch):
    """(c) width 8 fits, width 64 does not: the first row keeps its results, equal to an unchecked run (d)."""
    free(monkeypatch, 4 * P_of(8) * 23 + 100_000)  # far below width 64's 4·1348·23 = 124 kB
    cfg = project(tmp_path / "c", widths=(8, 64))
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "c" / "o")])
    assert res.exit_code == 1, res.output
    ok, bad = rows(tmp_path / "c" / "o")
    assert ok["status"] == "ok" and bad["status"] == "error" and "will not fit" in bad["error"]
    off = project(tmp_path / "off", widths=(8, 64), runtime={"check_memory": False})
    assert (
        runner.invoke(app, ["measure", "-c", str(off), "-o", str(tmp_path / "off" / "o")]).exit_code
        == 0
    )
    ref = rows(tmp_path / "off" / "o")[0]["measures"]
    for m in ("hessian_lambda_max", "frobenius_norm"):
        assert ok["measures"][m]["value"] == ref[m]["value"]


def test_with_ample_memory_the_results_are_those_of_an_unchecked_run(tmp_path, monkeypatch):
    """(d) free memory large: the same values as with ``check_memory: false``; the counting pass is
    skipped (free ≥ 1000 × the P-vectors and one batch)."""
    calls = []
    monkeypatch.setattr(memory, "predicted_product_bytes", lambda *a: calls.append(a) or (0, None))
    free(monkeypatch, 10**12)
    out = {}
    for name, rt in (("on", {}), ("off", {"check_memory": False})):
        cfg = project(tmp_path / name, runtime=rt)
        assert (
            runner.invoke(
                app, ["measure", "-c", str(cfg), "-o", str(tmp_path / name / "o")]
            ).exit_code
            == 0
        )
        out[name] = rows(tmp_path / name / "o")[0]["measures"]
    assert calls == []
    assert {m: r["value"] for m, r in out["on"].items()} == {
        m: r["value"] for m, r in out["off"].items()
    }


def test_the_check_off_runs(tmp_path, monkeypatch):
    """(e) ``runtime.check_memory: false``: the same too-small free memory, and the run goes on."""
    free(monkeypatch, 1000)
    cfg = project(tmp_path, runtime={"check_memory": False})
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert rows(tmp_path / "o")[0]["status"] == "ok"


def test_config_show_and_a_bad_value(tmp_path):
    cfg = write_project(tmp_path, n_ckpt=1)
    res = runner.invoke(app, ["config", "show", "-c", str(cfg)])
    assert res.exit_code == 0 and "check_memory: true" in res.stdout
    from flatcli.config import from_dict
    from flatcli.errors import ConfigError

    assert (
        "check_memory" not in from_dict({}).to_dict()["runtime"]
    )  # configs that do not set it hash as before
    with pytest.raises(ConfigError, match="'runtime.check_memory' must be a bool"):
        from_dict({"runtime": {"check_memory": "maybe"}})


# ------------------------------------------------------------------ the counted bytes by hand
@pytest.mark.parametrize("precision,element,copy", [("fp32", 4, False), ("fp64", 8, True)])
def test_predicted_bytes_against_a_hand_count(monkeypatch, precision, element, copy):
    """P × element × (θ, gradient, the largest measure's vectors and one input) + the working copy's
    weights: the float32 model is used as it is under fp32 (no copy on CPU) and copied to float64
    under fp64 (every parameter, 8 bytes)."""
    free(monkeypatch, 10**12)
    model = MLP(16, 8, 1, 4)
    P = P_of(8)
    specs = [
        MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 20}),
        MeasureSpec("hessian_trace", "tr", {"method": "hutchpp", "max_probes": 30}),  # sketch of 10
        MeasureSpec("frobenius_norm", "frob"),
    ]
    v = memory.check_model(model, specs, Settings(precision=precision))
    weights = P * element if copy else 0
    held = 10 + 2 * 16 + 1  # the sketch, the first block's 16 probes and their products, one input
    assert v.need == weights + P * element * (2 + held)
    assert v.parts == {
        "weights": weights,
        "theta_gradient": 2 * P * element,
        "vectors": held * P * element,
    }
    assert v.measures == ("tr",) and v.fits
    alone = memory.check_model(model, specs[:1], Settings(precision=precision))
    work = LANCZOS_WORK_VECTORS  # Lanczos's own vectors beside its basis
    assert alone.need == weights + P * element * (2 + 20 + work + 1) and alone.measures == ("lam",)


def test_on_cuda_the_basis_beyond_max_device_vectors_is_not_counted_and_is_suggested(monkeypatch):
    """A CUDA device's count (no GPU needed: nothing is allocated): the working copy's weights, and
    at most ``max_device_vectors`` basis rows; when the basis does not fit, a K that fits is suggested."""
    model, P = MLP(16, 8, 1, 4), P_of(8)
    spec = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 20})]
    cuda = torch.device("cuda:0")
    free(monkeypatch, 10**12)
    capped = memory.check_model(model, spec, Settings(device=cuda, max_device_vectors=5))
    assert capped.need == 4 * P + 4 * P * (2 + 5 + 1)
    free(
        monkeypatch, 4 * P * (1 + 2 + 1 + 7)
    )  # weights, θ and gradient, one input, and room for 7 rows
    v = memory.check_model(model, spec, Settings(device=cuda, max_device_vectors=None))
    assert not v.fits and "runtime.max_device_vectors: 7 " in v.line()


# ------------------------------------------------------------------ 2. the product's activations
def test_a_product_that_will_not_fit_fails_after_the_data_and_suggests_a_batch_size(
    tmp_path, monkeypatch
):
    """The model's part fits, one product's predicted peak does not: the checkpoint fails before the
    first product with a smaller ``measure_data.batch_size`` (activations ∝ rows); bf16 is offered
    only where halving the activations would fit; no recompute for a model without blocks."""
    product = 10**6
    monkeypatch.setattr(memory, "predicted_product_bytes", lambda *a: (product, None))
    hvps = []
    monkeypatch.setattr(Curvature, "_matmat", lambda *a, **k: hvps.append(1))
    P = P_of(8)
    base = 4 * P * 6 + 4 * P * (
        20 - 1
    )  # the product's own six P-vectors, and the rest of the 20-row basis
    act = product + 4 * P * (20 - 1) - base  # what the batch's rows scale
    for nbytes, bf16 in ((500_000, False), (600_000, True)):
        free(monkeypatch, nbytes)
        cfg = project(tmp_path / str(nbytes))
        res = runner.invoke(
            app, ["measure", "-c", str(cfg), "-o", str(tmp_path / str(nbytes) / "o")]
        )
        assert res.exit_code == 1, res.output
        msg = rows(tmp_path / str(nbytes) / "o")[0]["error"]
        assert msg.startswith("will not fit") and "one product" in msg
        assert f"measure_data.batch_size: {int(16 * (nbytes - base) / act)} " in msg
        assert ("runtime.precision: bf16" in msg) is bf16
        assert "recompute" not in msg
    assert hvps == []  # refused before the first product


class Blocks(nn.Module):
    """Two Linear+tanh blocks in a ModuleList (what `find_blocks` recomputes), then a head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("recompute,fits", [("auto", True), ("true", True), ("false", False)])
def test_a_run_auto_recompute_makes_fit_is_not_refused(monkeypatch, recompute, fits):
    """A model with blocks whose product is predicted above 80% of free memory: ``recompute: auto``
    turns recomputation on (engine/products.py plans the route), so only the vectors are checked and the run goes on;
    with ``false`` it is refused and ``runtime.recompute: true`` is suggested."""
    from flatcli.run.measuring import problem_dims

    monkeypatch.setattr(memory, "predicted_product_bytes", lambda *a: (10**6, None))
    free(monkeypatch, 500_000)
    torch.manual_seed(0)
    model = Blocks().double()
    data = Batch.of((torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))))
    st = Settings(precision="fp64", recompute=recompute, batch_size=10)
    problem = Problem(model, data, loss="cross_entropy", batch_size=10, dtype=torch.float64)
    specs = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 20})]
    v = memory.check_products(problem, specs, problem_dims(model, data, st), st)
    assert v.fits is fits
    if not fits:
        assert "runtime.recompute: true" in v.line()
        assert "runtime.precision: bf16" not in v.line()  # fp64 is an exact reference: not lowered


def test_the_dry_run_prints_the_verdict(tmp_path, monkeypatch):
    """``--dry-run``: the verdict and the free memory compared against; JSON carries the fields; a
    checkpoint that will not fit is not timed."""
    P = P_of(8)
    need = 4 * P * (23 + LANCZOS_WORK_VECTORS)  # θ, gradient, 20 basis vectors, work, an input
    free(monkeypatch, need - 1)
    cfg = project(tmp_path)
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--dry-run"])
    assert res.exit_code == 1, res.output  # it cannot time the run: no "about 0 s", exit 0
    assert "cannot time" in res.output and "about 0" not in res.output
    assert "memory (model): will not fit" in res.output and f"{need - 1:,}" not in res.output
    assert "not timed" in res.output and "measured: forward" not in res.output
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--dry-run", "--format", "json"])
    entry = json.loads(res.stdout)[0]
    assert entry["status"] == "will_not_fit"
    (mem,) = entry["memory"]
    assert (mem["stage"], mem["fits"], mem["need_bytes"], mem["free_bytes"]) == (
        "model",
        False,
        need,
        need - 1,
    )
    free(monkeypatch, 10**12)
    res = runner.invoke(app, ["measure", "-c", str(cfg), "--dry-run", "--format", "json"])
    entry = json.loads(res.stdout)[0]
    assert entry["status"] == "ok" and [m["fits"] for m in entry["memory"]] == [True, True]


def test_a_sweep_unit_that_will_not_fit_fails_before_the_data(tmp_path, monkeypatch):
    """The sweep path: each unit (checkpoint × measure) is checked in `measure_job`; the runner loads
    the data up front only when the first checkpoint fits, so a sweep that will not fit loads none;
    the unit of a measure that fits (the Frobenius norm) still runs."""
    loads = []
    real = load.load_split
    monkeypatch.setattr(load, "load_split", lambda *a, **k: loads.append(a) or real(*a, **k))
    free(monkeypatch, 4 * P_of(8) * 23 - 1)
    cfg = project(tmp_path, measures=[LAMBDA])
    res = runner.invoke(app, ["sweep", "-c", str(cfg), "-o", str(tmp_path / "s")])
    assert res.exit_code == 1, res.output
    assert loads == [] and "will not fit" in res.output
    free(
        monkeypatch, 4 * P_of(8) * 2 + 2_000
    )  # θ and gradient: the norm fits, the data is loaded for it
    cfg = project(tmp_path / "b", measures=["frobenius_norm"])
    res = runner.invoke(app, ["sweep", "-c", str(cfg), "-o", str(tmp_path / "b" / "s")])
    assert res.exit_code == 0, res.output
    assert loads


def test_ranks_fail_a_checkpoint_together():
    """Under torchrun a rank whose own verdict fits still fails when another rank's does not (their
    collectives stay in step); one process fails only on its own verdict."""

    class Ranks:
        def __init__(self, active, other):
            self.active, self.other = active, other

        def any(self, flag):
            return flag or self.other

    fits = memory.MemoryVerdict("model", need=1, free=2)
    memory.refuse(fits, Ranks(False, True))  # one process: nothing else counts
    with pytest.raises(memory.MeasurementError, match="will not fit on another rank"):
        memory.refuse(fits, Ranks(True, True))
    with pytest.raises(memory.MeasurementError, match="^will not fit: needs at least 3 B"):
        memory.refuse(memory.MemoryVerdict("model", need=3, free=2), Ranks(True, False))


def test_a_product_that_cannot_be_predicted_or_is_a_finite_difference_checks_the_vectors_only(
    tmp_path, monkeypatch
):
    """The counting pass raising (a model without a double backward) never fails a checkpoint: the
    measures run and say why themselves; finite-difference products (two gradients, no graph) are not
    predicted with a create_graph pass."""
    calls = []

    def broken(*a):
        calls.append(1)
        raise RuntimeError("derivative for _scaled_dot_product_attention is not implemented")

    monkeypatch.setattr(memory, "predicted_product_bytes", broken)
    free(monkeypatch, 500_000)
    cfg = project(tmp_path / "a")
    assert (
        runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "a" / "o")]).exit_code
        == 0
    )
    assert calls == [1]
    cfg = project(tmp_path / "b", runtime={"hvp_mode": "finite_difference"})
    assert (
        runner.invoke(app, ["measure", "-c", str(cfg), "-o", str(tmp_path / "b" / "o")]).exit_code
        == 0
    )
    assert calls == [1]


class ChainBlocks(nn.Module):
    """Two Linear+tanh blocks in a ModuleList, each taking the previous one's output: a chain
    (`flatcli.engine.segments.BlockChain`), so ``recompute: true`` takes products block by block."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("chain_bytes", [10**5, 10**6])
def test_a_chain_is_predicted_block_by_block_and_recompute_is_suggested_only_when_it_fits(
    monkeypatch, chain_bytes
):
    """On a chain of blocks the product of ``recompute: true`` is predicted by its own rule
    (``by_blocks``), not skipped; ``recompute: false`` that does not fit suggests ``recompute: true``
    only when that prediction fits."""
    from flatcli.run.measuring import problem_dims

    seen = []

    def predicted(*a, by_blocks=0):
        seen.append(by_blocks)
        return (chain_bytes if by_blocks else 10**6), None

    monkeypatch.setattr(memory, "predicted_product_bytes", predicted)
    free(monkeypatch, 500_000)
    torch.manual_seed(0)
    model = ChainBlocks().double()
    data = Batch.of((torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))))
    problem = Problem(model, data, loss="cross_entropy", batch_size=10, dtype=torch.float64)
    specs = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 20})]
    verdicts = {}
    for rec in ("true", "false"):
        st = Settings(precision="fp64", recompute=rec, batch_size=10)
        verdicts[rec] = memory.check_products(problem, specs, problem_dims(model, data, st), st)
    assert 2 in seen  # the chain's two blocks
    on, off = verdicts["true"], verdicts["false"]
    assert not on.skipped and on.parts["product"] == chain_bytes
    assert on.fits is (chain_bytes == 10**5) and not off.fits
    assert ("runtime.recompute: true" in off.line()) is (chain_bytes == 10**5)


def test_on_cpu_an_unbounded_basis_that_does_not_fit_suggests_max_basis_vectors(
    tmp_path, monkeypatch
):
    """With ``runtime.max_basis_vectors: null`` a 60-step Lanczos basis is counted whole; when only a
    smaller basis fits, the cap that fits (above the certified step count) is suggested, and with
    that cap the same check passes."""
    from flatcli.engine.linalg import certified_min_steps

    P = P_of(8)
    spec = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 60})]
    model = MLP(16, 8, 1, 4)
    work = LANCZOS_WORK_VECTORS
    free(
        monkeypatch, 4 * P * (2 + 30 + work + 1)
    )  # θ and gradient, one product input, Lanczos's work and 30 basis vectors
    v = memory.check_model(model, spec, Settings(max_basis_vectors=None))
    assert not v.fits and v.parts["vectors"] == 4 * P * (60 + work + 1)
    assert certified_min_steps(P) < 30
    assert "runtime.max_basis_vectors: 30 (Lanczos restarts beyond it)" in v.line()
    ok = memory.check_model(model, spec, Settings(max_basis_vectors=30))
    assert ok.fits and ok.parts["vectors"] == 4 * P * (30 + work + 1)


def test_a_basis_cap_below_the_certified_floor_is_suggested_with_min_steps(tmp_path, monkeypatch):
    """When only a basis smaller than the certified step count fits, the suggestion lowers
    ``min_steps`` with the cap (the cap alone would keep the floor's vectors), and with both the
    same check passes."""
    from flatcli.engine.linalg import certified_min_steps

    P = P_of(8)
    spec = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 60})]
    model = MLP(16, 8, 1, 4)
    k = certified_min_steps(P) - 3
    free(monkeypatch, 4 * P * (2 + k + LANCZOS_WORK_VECTORS + 1))
    v = memory.check_model(model, spec, Settings(max_basis_vectors=None))
    assert not v.fits
    assert f"runtime.max_basis_vectors: {k} with lam: min_steps: {k}" in v.line()
    lowered = [MeasureSpec("hessian_lambda_max", "lam", {"max_steps": 60, "min_steps": k})]
    assert memory.check_model(model, lowered, Settings(max_basis_vectors=k)).fits
