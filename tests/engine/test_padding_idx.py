"""Padding rows are frozen coordinates (`flatcli.engine.problem`'s docstring): with an
``nn.Embedding(padding_idx=k)`` whose row k is read by the inputs, PyTorch masks that row's gradient;
before the convention, forward-over-reverse gave M·H·v, double backward M·H·M·v, the Gauss-Newton
product M·G·v, and with a tied head none of these. The engine takes every curvature as M·A·M.
Checked on a tiny float64 BERT (pad token 0 present) and a hand-made embedding model (tied and
untied head) against dense references built by double backward from a copy of the model whose
embedding has no ``padding_idx`` (its gradient is not masked: the true Hessian of L), with M applied
on both sides."""

import copy

import pytest
import torch
from torch import nn
from torch.func import grad, jvp

from flatcli.engine import CurvatureEngine, Problem
from tests import hf_models as H
from tests.oracles import dense_ggn, problem_hessian

DT = torch.float64


class Tiny(nn.Module):
    """Tokens → embedding (padding row 2, set nonzero) → tanh → mean → linear head (or the tied
    embedding as the head)."""

    def __init__(self, tied: bool, padding_idx: int | None = 2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 3, padding_idx=padding_idx)
        self.mix = nn.Linear(3, 3)
        self.head = None if tied else nn.Linear(3, 4)
        with torch.no_grad():
            self.emb.weight[2] = torch.tensor(
                [0.3, -0.5, 0.7]
            )  # a trained-looking pad row, not zero

    def forward(self, x):
        h = torch.tanh(self.mix(torch.tanh(self.emb(x)))).mean(1)
        return h @ self.emb.weight.T if self.head is None else self.head(h)


def tiny(tied=False, padding_idx=2):
    model = Tiny(tied, padding_idx).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 6, (5, 4), generator=g)
    x[0, 1] = x[3, 0] = 2  # the padding token is read
    y = torch.randint(0, 6 if tied else 4, (5,), generator=g)
    return model, {"x": x, "y": y}, "cross_entropy", model.emb


def bert():
    tf = H.transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,
        attn_implementation="eager",
    )
    model = tf.BertForSequenceClassification(cfg).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    ids[0, 5] = ids[1, 4] = 0  # BERT's pad token (padding_idx = pad_token_id = 0)
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": (torch.arange(6) >= 3).long().expand(4, 6),
        "labels": torch.tensor([0, 1, 1, 0]),
    }
    return model, batch, "cross_entropy", model.bert.embeddings.word_embeddings


CASES = {"tiny": tiny, "tiny_tied": lambda: tiny(tied=True), "bert": bert}


def unmasked(model, emb_of):
    """A copy of ``model`` whose padding embedding has no ``padding_idx``: the same function, gradient not masked."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    return ref


def mask_matrix(p: Problem) -> torch.Tensor:
    m = torch.ones(p.num_params, dtype=DT)
    m[p.padding_index] = 0
    return torch.diag(m)


def setup(name):
    model, batch, loss, emb = CASES[name]()
    p = Problem(
        model, batch, loss=loss, batch_size=2, dtype=DT
    )  # two or three batches: shares summed
    ref = Problem(unmasked(model, emb), batch, loss=loss, batch_size=2, dtype=DT)
    g = torch.Generator().manual_seed(2)
    theta = p.theta + 0.05 * torch.randn(
        p.num_params, generator=g, dtype=DT
    )  # away from the model's θ
    return p, ref, theta, g


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(CASES))
def test_padding_rows_found(name):
    p, ref, _, _ = setup(name)
    emb = p.param_slices()[
        "bert.embeddings.word_embeddings.weight" if name == "bert" else "emb.weight"
    ]
    k, d = (0, 8) if name == "bert" else (2, 3)
    assert p.padding_index.tolist() == list(range(emb.start + k * d, emb.start + (k + 1) * d))
    assert ref.padding_index is None
    assert (
        Problem(
            CASES[name]()[0],
            CASES[name]()[1],
            loss="cross_entropy",
            dtype=DT,
            params={"exclude": ["*emb*"]},
        ).padding_index
        is None
    )  # the row is not selected: nothing


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_hessian_modes_agree_symmetric_and_equal_masked_dense(name):
    p, ref, theta, g = setup(name)
    V = torch.randn(3, p.num_params, generator=g, dtype=DT)
    M = mask_matrix(p)
    Hd = problem_hessian(ref, theta)
    assert torch.allclose(
        Hd, Hd.T, rtol=0, atol=1e-12 * float(Hd.abs().max())
    )  # the reference is symmetric
    want = V @ (M @ Hd @ M)  # rows of M H M v (M H M is symmetric)
    assert rel(M @ Hd @ V.T, (Hd @ M @ V.T)) > 1e-4  # the case is hard: H M v and M H v differ
    got = {}
    for mode in ("reverse", "forward"):
        for batched in (True, False):
            e = CurvatureEngine(p, hvp_mode=mode, reverse_batched=batched, cache_graphs=False)
            got[mode, batched] = e.hessian(theta)(V)
            assert rel(got[mode, batched], want) < 1e-10, (mode, batched)
            one = e.hessian(theta)(V[0])
            assert rel(one, want[0]) < 1e-10
    assert rel(got["reverse", True], got["forward", True]) < 1e-10
    got["recompute", True] = CurvatureEngine(p, recompute=True).hessian(theta)(
        V
    )  # BERT: per-block products
    assert rel(got["recompute", True], want) < 1e-10
    # symmetric operator: uᵀ(Hv) = vᵀ(Hu)
    for key, HV in got.items():
        assert abs(float(V[0] @ HV[1] - V[1] @ HV[0])) < 1e-10 * float(HV.norm()) * float(
            V.norm()
        ), key


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_finite_difference_and_gradient_masked(name):
    p, ref, theta, g = setup(name)
    V = torch.randn(2, p.num_params, generator=g, dtype=DT)
    M = mask_matrix(p)
    Hd = problem_hessian(ref, theta)
    e = CurvatureEngine(p, hvp_mode="reverse")
    fd = e.fd_hessian(theta, eps=2e-6)(V)
    assert rel(fd, V @ (M @ Hd @ M)) < 1e-7  # O(eps²) central differences of the masked gradient
    assert fd[:, p.padding_index].abs().max() == 0
    t = theta.clone().requires_grad_(True)
    (g_true,) = torch.autograd.grad(ref.loss(t), t)
    for got in (
        e.loss_grad(theta)[1],
        e.loss_grad(theta, keep_graph=True)[1],
        e.batch_loss_grad(p.batch, theta)[1],
    ):
        assert rel(got, M @ g_true) < 1e-12 and got[p.padding_index].abs().max() == 0
    if (
        name == "tiny_tied"
    ):  # the head's gradient reaches the pad row: PyTorch alone leaves it there
        assert g_true[p.padding_index].abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_ggn_symmetric_and_equal_masked_dense(name):
    """The JVP carries the pad row's tangent, the VJP masks it: unmasked, the product would be M G v."""
    p, ref, theta, g = setup(name)
    V = torch.randn(3, p.num_params, generator=g, dtype=DT)
    M = mask_matrix(p)
    Gd = dense_ggn(ref, theta)
    assert rel(M @ Gd @ V.T, Gd @ M @ V.T) > 1e-4  # M G and G M differ here
    e = CurvatureEngine(p)
    GV = e.ggn(theta)(V)
    assert rel(GV, V @ (M @ Gd @ M)) < 1e-10
    assert abs(float(V[0] @ GV[1] - V[1] @ GV[0])) < 1e-10 * float(GV.norm()) * float(V.norm())
    if name != "bert":  # the exact GGN diagonal: rows are units
        assert rel(e.ggn_diagonal(theta), torch.diagonal(M @ Gd @ M)) < 1e-10


@pytest.mark.parametrize(
    "make", [lambda: tiny(padding_idx=None), lambda: tiny(tied=True, padding_idx=None)]
)
def test_no_padding_idx_no_change(make):
    """Without a padding row nothing is masked: the engine's product is bitwise the plain double backward."""
    model, batch, loss, _ = make()
    p = Problem(model, batch, loss=loss, batch_size=8, dtype=DT)  # one batch
    assert p.padding_index is None
    x = torch.randn(p.num_params, dtype=DT)
    assert p.mask(x) is x
    v = torch.randn(p.num_params, generator=torch.Generator().manual_seed(3), dtype=DT)
    got = CurvatureEngine(p, hvp_mode="reverse").hessian()(v)
    t = p.theta.requires_grad_(True)
    (gr,) = torch.autograd.grad(
        p.batch_loss_sum(p.unflatten(t), p.batches[0]) / p.n, t, create_graph=True
    )
    (want,) = torch.autograd.grad(gr, t, v)
    assert torch.equal(got, want)
    got = CurvatureEngine(p, hvp_mode="forward").hessian()(v)
    want = jvp(
        grad(lambda t: p.batch_loss_sum(p.unflatten(t), p.batches[0]) / p.n), (p.theta,), (v,)
    )[1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny", "bert"])
def test_per_unit_directional_masked_in_both_modes(name, monkeypatch):
    """⟨M v, ∇ℓ_u⟩ by forward mode and by the double-backward fallback (whose VJP masks the row)."""
    p, ref, theta, g = setup(name)
    v = torch.randn(p.num_params, generator=g, dtype=DT)
    vm = mask_matrix(p) @ v
    t = theta.clone().requires_grad_(True)
    Z = ref.forward(t, ref.batch)
    ell = torch.nn.functional.cross_entropy(
        Z, ref.batch["labels" if name == "bert" else "y"], reduction="none"
    )
    want = torch.stack(
        [torch.autograd.grad(ell[i], t, retain_graph=True)[0] @ vm for i in range(len(ell))]
    )
    e = CurvatureEngine(p)
    assert rel(e.per_unit_directional(v, theta), want) < 1e-12
    from flatcli.engine import facade as engine_module

    def no_forward_mode(*a, **k):
        raise NotImplementedError("no forward-mode rule")

    monkeypatch.setattr(engine_module, "jvp", no_forward_mode)
    assert rel(e.per_unit_directional(v, theta), want) < 1e-12
    assert e.counters()["fallbacks"] >= 1


class TiedLM(nn.Module):
    """Tokens → embedding (vocabulary 16, pad row 0, set nonzero) → tanh → mean → a head whose
    weight *is* the embedding (``head.weight = emb.weight``, as BERT's MLM decoder): the head's
    gradient trains the pad row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 4, padding_idx=0)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight[0] = torch.tensor([0.3, -0.5, 0.7, 0.2])

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x))).mean(1))


def test_tied_padding_row_is_trained_so_not_masked():
    """The pad row is tied to the head: the products are the true Hessian, that of a copy without
    ``padding_idx``, in every mode (before: masked, trace and λmax of M·H·M, the row's curvature
    lost); the model's ``padding_idx`` is left as it was."""
    model = TiedLM().to(DT)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 16, (6, 5), generator=g)
    x[:, -1] = 0  # the pad token is read
    batch = {"x": x, "y": torch.randint(0, 16, (6,), generator=g)}
    p = Problem(model, batch, loss="cross_entropy", batch_size=4, dtype=DT)
    ref = Problem(unmasked(model, model.emb), batch, loss="cross_entropy", batch_size=4, dtype=DT)
    assert p.padding_index is None and model.emb.padding_idx == 0
    theta = p.theta + 0.05 * torch.randn(p.num_params, generator=g, dtype=DT)
    Hd = problem_hessian(ref, theta)
    pad = slice(0, 4)  # emb.weight comes first: row 0
    assert Hd[pad].abs().max() > 1e-3  # the row has curvature
    V = torch.randn(3, p.num_params, generator=g, dtype=DT)
    for mode in ("reverse", "forward"):
        got = CurvatureEngine(p, hvp_mode=mode).hessian(theta)(V)
        assert rel(got, V @ Hd) < 1e-10, mode
    assert model.emb.padding_idx == 0
