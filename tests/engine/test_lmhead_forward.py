"""Forward-over-reverse Hessian products through the fused LM head (issue 27): ``torch.func.jvp`` of
``torch.func.grad`` (vmapped over vectors) and `torch.autograd.forward_ad` dual tensors through an
ordinary backward give the dense float64 Hessian, built row by row with double backward of the plain
cross-entropy, on the head alone (several chunks, a bias, ignored tokens) and on a tiny GPT-2."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD
from torch.func import functional_call, grad, jvp, vmap

from flatcli.engine import CurvatureEngine, Problem, lmhead
from tests import hf_models as H
from tests.oracles import dense_hessian

DT = torch.float64
IGNORE = -100


def test_head_forward_over_reverse_equals_dense_hessian(monkeypatch):
    monkeypatch.setattr(
        lmhead, "CHUNK_ELEMENTS", 10
    )  # 2 tokens per chunk over a vocabulary of 5: 4 chunks
    g = torch.Generator().manual_seed(0)
    T, d, V = 7, 3, 5
    labels = torch.randint(0, V, (T,), generator=g)
    keep = torch.ones(T, dtype=torch.bool)
    keep[[2, 5]] = False
    cut = [T * d, V * d, V]

    def parts(x):
        h, W, b = torch.split(x, cut)
        return h.view(T, d), W.view(V, d), b

    def fused(x):
        return lmhead.fused_loss_sum(*parts(x), labels, keep)

    def plain(x):
        h, W, b = parts(x)
        return F.cross_entropy((h @ W.T + b)[keep], labels[keep], reduction="sum")

    x = torch.randn(sum(cut), generator=g, dtype=DT)
    Hd = dense_hessian(plain, x)
    Vs = torch.randn(4, x.numel(), generator=g, dtype=DT)
    ref = Vs @ Hd
    hv = vmap(lambda v: jvp(grad(fused), (x,), (v,))[1])(Vs)
    torch.testing.assert_close(hv, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jvp(grad(fused), (x,), (Vs[0],))[1], ref[0], rtol=1e-10, atol=1e-12)
    with fwAD.dual_level():
        leaf = x.clone().requires_grad_(True)
        (gd,) = torch.autograd.grad(fused(fwAD.make_dual(leaf, Vs[1])), leaf)
        torch.testing.assert_close(fwAD.unpack_dual(gd).tangent, ref[1], rtol=1e-10, atol=1e-12)
    # the loss's own tangent (the forward-mode rule of the loss): <∇f, v>
    t = x.clone().requires_grad_(True)
    (gp,) = torch.autograd.grad(plain(t), t)
    torch.testing.assert_close(jvp(fused, (x,), (Vs[2],))[1], gp @ Vs[2], rtol=1e-10, atol=1e-12)


def gpt2():
    tf = H.transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=11, n_positions=8, n_embd=4, n_layer=1, n_head=2, attn_implementation="eager"
    )
    model = tf.GPT2LMHeadModel(cfg).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # padding: ignored tokens
    return model, {"input_ids": ids, "attention_mask": mask}


@pytest.mark.slow
def test_gpt2_forward_mode_products_equal_dense_hessian():
    model, batch = gpt2()
    names = [n for n, _ in model.named_parameters()]  # the tied head is one tensor here
    shapes = [q.shape for _, q in model.named_parameters()]
    lab = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)

    def L(flat):
        params = {
            n: c.view(s)
            for n, c, s in zip(
                names, torch.split(flat, [s.numel() for s in shapes]), shapes, strict=True
            )
        }
        z = functional_call(model, params, (), {**batch, "return_dict": True}).logits
        return F.cross_entropy(
            z[:, :-1].reshape(-1, z.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=IGNORE
        )

    p = Problem(
        model, batch, loss="causal_lm", batch_size=2, dtype=DT
    )  # two batches: shares summed
    assert p.head is not None  # the fused head is in use
    Hd = dense_hessian(L, p.theta)
    g = torch.Generator().manual_seed(2)
    V = torch.randn(3, p.num_params, generator=g, dtype=DT)
    eng = CurvatureEngine(p, hvp_mode="forward")
    torch.testing.assert_close(eng.hessian()(V), V @ Hd, rtol=1e-9, atol=1e-12)  # vmap(jvp(grad))
    torch.testing.assert_close(eng.hessian()(V[0]), Hd @ V[0], rtol=1e-9, atol=1e-12)
    assert (
        eng.counters()["fallbacks"] == 0 and eng.state.route().hessian == "forward"
    )  # no fall back to reverse mode
