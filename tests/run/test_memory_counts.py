"""Counted memory: the P-vectors a run holds against those the prediction counts
(`flatcli.run.memory.vectors_kept`, `flatcli.run.predict.predict`), on tiny GPT-2 shapes."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from flatcli.config import parse_measures
from flatcli.engine.curvatures import Hessian
from flatcli.engine.recompute import PRODUCT_VECTORS
from flatcli.run.measuring import measure_model, problem_dims
from flatcli.run.memory import vectors_kept
from flatcli.run.settings import Settings
from tests.hf_models import transformers


def tiny_gpt2(width: int, layers: int, rows: int = 8, length: int = 16):
    """(model, batch): a random GPT-2 LM head model and random tokens."""
    tf = transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=64,
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = tf.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def live_storages(P: int, element: int = 4) -> dict[int, int]:
    """data pointer → bytes of the distinct live storages whose size is a whole number of
    P-vectors of ``element`` bytes (θ, gradients, probes, products, bases)."""
    found = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
            s = o.untyped_storage()
            if s.nbytes() >= P * element and s.nbytes() % (P * element) == 0:
                found[s.data_ptr()] = s.nbytes()
    return found


def live_vectors(P: int, before: dict[int, int], element: int = 4) -> float:
    """P-vectors held now by storages that were not alive ``before`` the run (a test process
    may hold other tests' tensors of such sizes)."""
    now = live_storages(P, element)
    return sum(n for ptr, n in now.items() if ptr not in before) / (P * element)


def held_at_products(monkeypatch, model, batch, spec: dict, **fields) -> tuple[float, int]:
    """(most P-vectors live when a Hessian product starts, P) over one run of ``spec``."""
    P = sum(p.numel() for p in model.parameters())
    most = [0.0]
    product = Hessian._matmat_batch

    def counted(self, *a, **k):
        most[0] = max(most[0], live_vectors(P, before))
        return product(self, *a, **k)

    monkeypatch.setattr(Hessian, "_matmat_batch", counted)
    gc.collect()  # the previous run's cycles
    before = live_storages(P)
    measure_model(model, batch, [spec], loss="causal_lm", **fields)
    return most[0], P


@pytest.mark.slow  # a Krylov run on a tiny GPT-2 with memory counted: tens of seconds
@pytest.mark.parametrize("width,layers", [(16, 1), (24, 1)])
def test_a_traces_predicted_vectors_grow_with_the_probes_it_holds(monkeypatch, width, layers):
    """The first block of a Hutchinson trace holds min_probes probes and their products, and the
    near-zero floor's SLQ runs beside them: the predicted P-vectors (θ, gradient, declared, one
    product input, the product's own; the floor's only when it may run) are never below those
    counted live at a product, the probes and their products alone never half above them (the
    live count misses tensors the collector does not track), and grow with the probes."""
    model, batch = tiny_gpt2(width, layers)
    st = Settings.build(None, loss="causal_lm", block_size=2)
    dims = problem_dims(model, batch, st)
    most = []
    for m in (4, 8, 16):
        spec = {"hessian_trace": {"min_probes": m, "max_probes": m}}
        held, P = held_at_products(monkeypatch, model, batch, spec, block_size=2)
        parsed = parse_measures([spec])[0]
        declared, inputs = vectors_kept(parsed, dims, 2)
        fixed = 2 + inputs + PRODUCT_VECTORS  # θ, gradient, one product's input and its own
        least = parsed.estimate(dims)["vectors"][0]  # the probes and products, without the floor
        most.append(fixed + declared)
        assert least <= 1.5 * held and held <= most[-1], (m, least, held, most[-1])
    assert all(b - a >= 2 * 4 for a, b in zip(most, most[1:], strict=False)), most


@pytest.mark.slow  # a Krylov run on a tiny GPT-2 with memory counted: tens of seconds
def test_the_near_zero_floors_counted_vectors_follow_its_runs_in_lockstep(monkeypatch):
    """The near-zero floor's SLQ runs its 4 runs in lockstep groups (`slq_group_size`: as many
    as host room allows, one at a time on a large model). With the room set for groups of 1, 2
    and 4 runs and the floor computed (a tiny GPT-2's trace cancels: the live count grows with
    the group), the predicted P-vectors are
    never below those counted live at a product, and what each further run in lockstep adds to
    the prediction is within a quarter of what it adds to the live count."""
    slq_module = sys.modules["flatcli.engine.linalg.slq"]  # the package exports the function
    model, batch = tiny_gpt2(16, 1)
    P = sum(p.numel() for p in model.parameters())
    # Hutchinson named (auto would run Hutch++ at this P): the floor's runs beside its probes
    spec = {"hessian_trace": {"method": "hutchinson", "min_probes": 8, "max_probes": 64}}
    held, most = {}, {}
    for group in (1, 2, 4):
        monkeypatch.setattr(slq_module, "HOST_ROOM", group * 10 * P * 4)
        held[group], _ = held_at_products(monkeypatch, model, batch, spec, block_size=2)
        dims = problem_dims(model, batch, Settings.build(None, loss="causal_lm", block_size=2))
        declared, inputs = vectors_kept(parse_measures([spec])[0], dims, 2)
        most[group] = 2 + inputs + PRODUCT_VECTORS + declared
        assert held[group] <= most[group], (group, held, most)
    for group in (2, 4):
        grew, counted = most[group] - most[1], held[group] - held[1]
        assert counted > 0 and abs(grew - counted) <= 0.25 * counted, (group, held, most)


def test_a_near_zero_traces_counted_products_stay_within_its_declared_range():
    """A tiny GPT-2's trace cancels, so the near-zero floor's SLQ runs beside the probes (with a
    fixed count too, when the count is out of reach): over adaptive and fixed probe counts, the
    products the run counts lie within the least and most its estimate declares."""
    model, batch = tiny_gpt2(16, 1)
    dims = problem_dims(model, batch, Settings.build(None, loss="causal_lm", block_size=2))
    floors = 0
    for probes in ({"min_probes": 8, "max_probes": 64}, {"min_probes": 4, "max_probes": 4}):
        spec = {"hessian_trace": {"method": "hutchinson", **probes}}
        res = measure_model(model, batch, [spec], loss="causal_lm", block_size=2)
        r = res.results["hessian_trace"]
        floors += r.diagnostics.get("abs_trace") is not None
        lo, hi = parse_measures([spec])[0].estimate(dims)["n_hvp"]
        assert lo <= r.diagnostics["n_hvp"] <= hi, (probes, r.diagnostics["n_hvp"], (lo, hi))
    assert floors >= 1  # the floor ran: the case the range must cover


@pytest.mark.slow  # a Krylov run on a tiny GPT-2 with memory counted: tens of seconds
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lambda_maxs_predicted_vectors_cover_its_basis_and_working_vectors(monkeypatch, precision):
    """λmax holds its Krylov basis and Lanczos's own working vectors (the float64 start, the
    product, the next vector) beside θ, the gradient and one product: over 6 to 24 steps, the
    predicted P-vectors are never below those counted live at a product, and at most a quarter
    above them."""
    model, batch = tiny_gpt2(16, 1)
    st = Settings.build(None, loss="causal_lm", block_size=2, precision=precision)
    dims = problem_dims(model, batch, st)
    for steps in (6, 12, 24):
        spec = {"hessian_lambda_max": {"min_steps": steps, "max_steps": steps, "tol": 1e-12}}
        held, _ = held_at_products(
            monkeypatch, model, batch, spec, block_size=2, precision=precision
        )
        declared, inputs = vectors_kept(parse_measures([spec])[0], dims, 2)
        most = 2 + inputs + PRODUCT_VECTORS + declared
        assert held <= most <= 1.25 * held, (steps, held, most)
