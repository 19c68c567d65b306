"""Hessian products block by block (issue 27, point 4: `flatcli.engine.segments`, the product of
``runtime.recompute: true`` on a chain of blocks): equal to a double backward of the loss written
out (no flatcli) on tiny GPT-2, BERT and ViT models in float64, with parameter subsets, two batches
and θ away from the model's own; models that are not chains fall back to the checkpointed double
backward with the reason kept; and a product really keeps less memory than the double backward."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.segments import BlockChain
from tests import hf_models as H
from tests.engine.test_recompute import bert, gpt2, reference_hvp
from tests.oracles import hessian_products

DT = torch.float64


def bert_without_pad_tokens():
    """`bert` with token ids from 1: the padding row (id 0) is not looked up, so the product of a
    double backward is the symmetric Hessian's (the padding row's convention has its own tests)."""
    model, batch, loss = bert()
    batch["input_ids"] = batch["input_ids"].clamp(min=1)
    return model, batch, loss


def vit():
    tf = H.transformers()
    torch.manual_seed(0)
    cfg = tf.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        num_labels=3,
        attn_implementation="eager",
    )
    model = tf.ViTForImageClassification(cfg).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    return (
        model,
        {
            "pixel_values": torch.randn(5, 1, 8, 8, generator=g, dtype=DT),
            "labels": torch.tensor([0, 1, 2, 1, 0]),
        },
        "cross_entropy",
    )


def _setup(make, **kw):
    model, batch, loss = make()
    p = Problem(
        model, batch, loss=loss, batch_size=2, dtype=DT, **kw
    )  # two or three batches: shares summed
    g = torch.Generator().manual_seed(2)
    V = torch.randn(3, p.num_params, generator=g, dtype=DT)
    theta = p.theta + 0.05 * torch.randn(p.num_params, generator=g, dtype=DT)
    return model, batch, loss, p, V, theta


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, bert_without_pad_tokens, vit])
def test_block_by_block_products_equal_double_backward(make, monkeypatch):
    real_softmax = torch.nn.functional.softmax

    def softmax(
        x, dim=None, dtype=None, **kw
    ):  # ViT's eager attention rounds its softmax to float32
        return real_softmax(x, dim=dim, dtype=None if x.dtype == DT else dtype, **kw)

    monkeypatch.setattr(
        torch.nn.functional, "softmax", softmax
    )  # (forward mode would differ by 1e-9 there)
    model, batch, loss, p, V, theta = _setup(make)
    eng = CurvatureEngine(p, recompute=True)
    assert eng.state.route().recompute and eng.state.chain is not None, eng.state.chain_reason
    assert len(eng.state.chain.blocks) == 2
    for th in (None, theta):
        ref = reference_hvp(model, batch, loss, p.theta if th is None else th, V)
        torch.testing.assert_close(eng.hessian(th)(V), ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(eng.hessian(th)(V[0]), ref[0], rtol=1e-9, atol=1e-12)
    u, w = V[0], V[1]  # a symmetric operator: uᵀ(Hw) = wᵀ(Hu)
    assert torch.isclose(u @ eng.hessian(theta)(w), w @ eng.hessian(theta)(u), rtol=1e-10)


@pytest.mark.parametrize(
    "include",
    [["transformer.h.1.*", "transformer.ln_f.*"], ["transformer.h.0.mlp.*"], ["transformer.wte.*"]],
)
def test_parameter_subsets_and_tied_weights(include):
    """Only some blocks' parameters, no parameter outside the blocks, or only the tied embedding
    (GPT-2's head and input embedding: its product is the prefix's share plus the suffix's)."""
    model, batch, loss, p, V, theta = _setup(gpt2, params={"include": include})
    on, off = (
        CurvatureEngine(p, recompute=True),
        CurvatureEngine(p, recompute=False, hvp_mode="reverse"),
    )
    hv = on.hessian(theta)(V)
    assert on.state.chain is not None
    torch.testing.assert_close(hv, off.hessian(theta)(V), rtol=1e-9, atol=1e-12)
    assert float(hv.norm()) > 0


def test_bf16_products_block_by_block():
    """``runtime.precision: bf16``: the blocks run in bfloat16 (θ, vectors and the loss's sum in
    float32); within bf16 rounding of the float32 product, and as close to it as the double
    backward's bf16 product is."""
    tf = H.transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_implementation="eager"
    )
    model = tf.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    p = Problem(
        model,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        loss="causal_lm",
        batch_size=4,
    )
    v = torch.randn(p.num_params, generator=torch.Generator().manual_seed(2))
    ref = CurvatureEngine(p, precision="fp32", hvp_mode="reverse").hessian()(v)
    low_chain = CurvatureEngine(p, precision="bf16", recompute=True)
    hv = low_chain.hessian()(v)
    assert low_chain.state.chain is not None and p.compute_dtype == torch.bfloat16
    low_rev = CurvatureEngine(p, precision="bf16", recompute=False, hvp_mode="reverse").hessian()(v)
    err, err_rev = float((hv - ref).norm() / ref.norm()), float((low_rev - ref).norm() / ref.norm())
    assert 1e-5 < err < 5e-2  # bf16 rounding is there (not a float32 product), and small
    assert err < 3 * err_rev + 1e-3


class _Parallel(nn.Module):
    """Two blocks applied to the same input and summed: not a chain."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(sum(torch.tanh(b(h)) for b in self.blocks))


class _Scaled(nn.Module):
    """A chain whose blocks also receive a θ-dependent scale: not a chain of hidden states alone."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h, scale):
            return torch.tanh(self.lin(h)) * scale

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.alpha = nn.Parameter(torch.tensor(1.3))
        self.blocks = nn.ModuleList([self.Block(), self.Block()])
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h, self.alpha * 2)
        return self.out(h)


class _Chain(_Scaled):
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h, scale=torch.tensor(0.9, dtype=h.dtype))
        return self.out(h) * self.alpha


@pytest.mark.parametrize(
    ("cls", "why"),
    [(_Parallel, "not the previous block's output"), (_Scaled, "depends on θ"), (_Chain, None)],
)
def test_models_that_are_not_chains_fall_back(cls, why):
    torch.manual_seed(0)
    model = cls().to(DT).eval()
    x = torch.randn(6, 3, dtype=DT)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    p = Problem(model, x, y, batch_size=4, dtype=DT)
    chain, reason = BlockChain.find(p)
    assert (chain is None) == (why is not None)
    if why:
        assert why in reason
    eng = CurvatureEngine(p, recompute=True)
    V = torch.randn(2, p.num_params, generator=torch.Generator().manual_seed(3), dtype=DT)
    ref = hessian_products(lambda t: p.loss(p.unflatten(t)), p.theta, V)
    torch.testing.assert_close(eng.hessian()(V), ref, rtol=1e-9, atol=1e-12)
    assert eng.state.route().recompute and (eng.state.chain is None) == (why is not None)


PEAK_CHILD = r"""
import json, sys
from pathlib import Path
import torch
import transformers
from flatcli.engine import CurvatureEngine, Problem
from flatcli.engine.recompute import predicted_product_bytes

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

torch.set_num_threads(1)
torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=64, n_layer=8, n_head=4,
                              attn_implementation="eager")
model = transformers.GPT2LMHeadModel(cfg).eval()
ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1))
p = Problem(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, loss="causal_lm", batch_size=8)
v = torch.randn(1, p.num_params, generator=torch.Generator().manual_seed(2))
runs = {}
for mode in ("off", "on", "off"):  # the double backward measured before and after: the allocator's state
    eng = CurvatureEngine(p, cache_graphs=False, recompute=mode == "on", hvp_mode="reverse")
    eng.hessian()(v)  # warm-up: lazy initialisation out of the measured product
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM)
    before = status("VmRSS")
    hv = eng.hessian()(v)
    measured = status("VmHWM") - before
    runs[mode] = {"measured": min(measured, runs.get(mode, {}).get("measured", measured)),
                  "chain": eng.state.chain is not None, "vHv": float(v[0] @ hv[0]),
                  "predicted": predicted_product_bytes(p, p.batch, 1, p.device, by_blocks=8 * (mode == "on"))[0]}
    if mode == "on":  # a row of a block of 4 vectors (a trace's probes)
        V = torch.randn(4, p.num_params, generator=torch.Generator().manual_seed(3))
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
        eng.hessian()(V[:1])
        runs["row"] = {"measured": status("VmHWM") - before}
    del eng, hv
print(json.dumps(runs))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak RSS"
)
def test_a_block_by_block_product_keeps_less_memory():
    """One product's peak resident set over the resident set before it (one process, large blocks
    returned to the system), an 8-block GPT-2 where activations dominate (P = 0.4M, 8 × 64 tokens):
    block by block at most 0.6× the double backward's (measured: 21 vs 82 MB), and each within
    ×1.5 of its predicted bytes (`flatcli.engine.recompute.predicted_product_bytes`)."""
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD], env=env, capture_output=True, text=True, check=True
    )
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["on"]["chain"] and not runs["off"]["chain"]
    assert runs["on"]["vHv"] == pytest.approx(runs["off"]["vHv"], rel=1e-4)
    assert runs["off"]["measured"] > 20e6
    assert runs["on"]["measured"] <= 0.6 * runs["off"]["measured"], runs
    for mode in (
        "on",
        "off",
    ):  # the two rules of predicted_product_bytes, within ×1.5 of what was measured
        r = runs[mode]
        assert r["measured"] / 1.5 <= r["predicted"] <= 1.5 * r["measured"], runs
    # a row of a (K, P) block costs what a vector of its own does (plus its one copy), not K-sized
    # copies of every tangent's base (forward AD's layout rule, segments.BlockChain.hvp)
    assert runs["row"]["measured"] <= 1.3 * runs["on"]["measured"], runs


def test_products_read_theta_without_a_copy():
    """θ is one flat storage with the parameters as views of it (`Problem.theta_flat`), and the
    products read it there: no P-vector copied per product (10M GPT-2: 325 → 285 MB own memory of a
    block-by-block product); `Problem.theta` stays a copy."""
    model, batch, loss, p, V, theta = _setup(gpt2)
    base = p.theta_flat.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in p.params.values())
    eng = CurvatureEngine(p, recompute=True)
    assert eng.state.theta_of(None).data_ptr() == p.theta_flat.data_ptr()
    copy = p.theta
    assert copy.data_ptr() != p.theta_flat.data_ptr() and torch.equal(copy, p.theta_flat)
    ref = reference_hvp(model, batch, loss, copy, V[:1])
    torch.testing.assert_close(eng.hessian()(V[:1]), ref, rtol=1e-9, atol=1e-12)
