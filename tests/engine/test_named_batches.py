"""Engine 2 on named-tensor batches: token inputs, the causal_lm loss weighted by tokens, and
parameter subsets, each against a dense float64 Hessian of the quantity it must equal."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.func import functional_call

from flatcli.api import measure, measure_model
from flatcli.engine import Batch, CurvatureEngine, ParamSelection, Problem, get_loss
from flatcli.errors import ConfigError
from tests.oracles import dense_hessian, runner
from tests.token_models import TinyLM, TokenClassifier, padded_tokens

DT = torch.float64


def flat_fn(model, names, fn):
    """θ (the parameters ``names``, flat) ↦ fn(model with θ), other parameters fixed."""
    shapes = [dict(model.named_parameters())[n].shape for n in names]
    sizes = [s.numel() for s in shapes]

    def f(theta):
        parts = torch.split(theta, sizes)
        params = {n: p.view(s) for n, p, s in zip(names, parts, shapes, strict=True)}
        return fn(lambda **kw: functional_call(model, params, (), kw))

    theta = torch.cat([dict(model.named_parameters())[n].detach().reshape(-1) for n in names])
    return f, theta


def lm_loss_all_tokens(call, ids, mask):
    """Next-token CE averaged over every scored token of the whole set (the reference)."""
    logits = call(input_ids=ids, attention_mask=mask).logits
    labels = ids.masked_fill(mask == 0, -100)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def lm_setup(tie=False, rows=6, length=6, vocab=7, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, tie=tie).to(DT).eval()
    ids, mask = padded_tokens(rows, length, vocab, seed)
    return model, ids, mask


def test_causal_lm_loss_weighs_every_token_once_not_batch_means():
    model, ids, mask = lm_setup(rows=5)
    data = {"input_ids": ids, "attention_mask": mask}
    p = Problem(model, data, loss="causal_lm", batch_size=2, dtype=DT)  # batches of 2, 2, 1 rows
    units = [p.units(b) for b in p.batches]
    assert len(set(units)) > 1  # the batches hold different numbers of scored tokens
    with torch.no_grad():
        ref = float(lm_loss_all_tokens(lambda **kw: model(**kw), ids, mask))
    eng = CurvatureEngine(p)
    assert eng.loss() == pytest.approx(ref, rel=1e-12)
    batch_means = (
        sum(float(p.batch_loss_sum(p.params, b)) / u for b, u in zip(p.batches, units, strict=True))
        / 3
    )
    assert abs(batch_means - ref) > 1e-3  # the mean of batch means is a different number
    assert p.n == int((mask[:, 1:] == 1).sum())


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_causal_lm_hessian_products_match_the_dense_token_weighted_hessian(tie, fused):
    model, ids, mask = lm_setup(tie=tie)
    names = [n for n, _ in model.named_parameters()]
    assert ("head.weight" in names) != tie  # tied: one parameter
    f, theta = flat_fn(model, names, lambda call: lm_loss_all_tokens(call, ids, mask))
    H = dense_hessian(f, theta)
    p = Problem(
        model,
        {"input_ids": ids, "attention_mask": mask},
        loss="causal_lm",
        batch_size=4,
        dtype=DT,
        fused_head=fused,
    )
    assert p.num_params == theta.numel() and p.head == ("head" if fused else None)
    eng = CurvatureEngine(p, block_size=2)
    V = torch.randn(3, p.num_params, dtype=DT, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(eng.hessian()(V), V @ H, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(
        eng.hessian()(V[0]), H @ V[0], rtol=1e-9, atol=1e-11
    )  # again, cached graphs


def test_causal_lm_gauss_newton_matches_the_dense_ggn():
    model, ids, mask = lm_setup()
    names = [n for n, _ in model.named_parameters()]
    theta = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    sizes = [q.numel() for q in model.parameters()]
    shapes = [q.shape for q in model.parameters()]

    def logits(t):
        params = {
            n: x.view(s) for n, x, s in zip(names, torch.split(t, sizes), shapes, strict=True)
        }
        return functional_call(model, params, (), {"input_ids": ids, "attention_mask": mask}).logits

    J = torch.func.jacrev(logits)(theta).reshape(-1, ids.shape[1], 7, theta.numel())  # (B, T, V, P)
    z = logits(theta).detach()
    scored = mask[:, 1:] == 1
    G = torch.zeros(theta.numel(), theta.numel(), dtype=DT)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if scored[b, t]:
                pr = torch.softmax(z[b, t], 0)
                Jt = J[b, t]
                G += Jt.T @ (torch.diag(pr) - torch.outer(pr, pr)) @ Jt
    G /= int(scored.sum())
    p = Problem(
        model, {"input_ids": ids, "attention_mask": mask}, loss="causal_lm", batch_size=4, dtype=DT
    )
    V = torch.randn(3, p.num_params, dtype=DT, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(CurvatureEngine(p).ggn()(V), V @ G, rtol=1e-9, atol=1e-11)


def _write_lm_config(tmp_path, ids, mask, model, extra=None):
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "tokens.pt")
    torch.save(model.state_dict(), tmp_path / "lm.pt")
    cfg = {
        "model": {"target": f"{Path(__file__).resolve().parents[1] / 'token_models.py'}:TinyLM"},
        "checkpoints": ["lm.pt"],
        "data": {
            "train": {"source": "tensors", "path": "tokens.pt"},
            "test": {"source": "tensors", "path": "tokens.pt"},
        },
        "measure_data": {"batch_size": 4},
        "loss": "causal_lm",
        "runtime": {"device": "cpu", "precision": "fp64"},
        **(extra or {}),
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "cfg.yaml"


def test_causal_lm_from_a_tensors_file_through_the_api_with_token_metrics(tmp_path):
    model, ids, mask = lm_setup()
    cfg = _write_lm_config(tmp_path, ids, mask, model)
    rep = measure(
        cfg,
        measures=[{"hessian_lambda_max": {"tol": 1e-8}}, {"hessian_trace": {"method": "exact"}}],
        outdir=tmp_path / "out",
    )
    row = rep.rows[0]
    assert row.status == "ok", row.errors
    names = [n for n, _ in model.named_parameters()]
    f, theta = flat_fn(model, names, lambda call: lm_loss_all_tokens(call, ids, mask))
    ev = torch.linalg.eigvalsh(dense_hessian(f, theta))
    assert row.results["hessian_lambda_max"].value == pytest.approx(float(ev[-1]), rel=1e-4)
    assert row.results["hessian_trace"].value == pytest.approx(float(ev.sum()), rel=1e-8)
    with torch.no_grad():  # token-level loss and next-token accuracy
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    scored = mask[:, 1:] == 1
    acc = float((logits.argmax(-1) == ids[:, 1:])[scored].double().mean())
    assert row.metrics["train_loss"] == pytest.approx(float(f(theta)), rel=1e-10)
    assert row.metrics["train_acc"] == pytest.approx(acc, abs=1e-12)


def test_named_tensors_file_with_labels_and_an_embedding_classifier(tmp_path):
    torch.manual_seed(3)
    model = TokenClassifier().to(DT).eval()
    ids, mask = padded_tokens(8, 5, 9, seed=3)
    labels = torch.arange(8) % 3
    x = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    names = [n for n, _ in model.named_parameters()]
    f, theta = flat_fn(
        model, names, lambda call: F.cross_entropy(call(input_ids=ids, attention_mask=mask), labels)
    )
    lam = float(torch.linalg.eigvalsh(dense_hessian(f, theta))[-1])
    row = measure_model(
        model, x, [{"hessian_lambda_max": {"tol": 1e-8}}], precision="fp64", batch_size=3
    )
    assert row.status == "ok", row.errors
    assert row.results["hessian_lambda_max"].value == pytest.approx(lam, rel=1e-4)
    torch.save(x, tmp_path / "d.pt")  # and from a file, through load_split
    from flatcli.config import DataSource
    from flatcli.loading.data import load_split

    b = load_split(DataSource(source="tensors", path="d.pt"), "train", tmp_path)
    assert set(b) == {"input_ids", "attention_mask", "labels"} and b.target is b["labels"]
    args, kwargs = b.model_inputs()
    assert args == () and set(kwargs) == {
        "input_ids",
        "attention_mask",
    }  # the target is never passed


def test_params_include_restricts_lambda_max_to_the_head_block(tmp_path):
    model, ids, mask = lm_setup()
    names = [n for n, _ in model.named_parameters()]
    f, theta = flat_fn(model, names, lambda call: lm_loss_all_tokens(call, ids, mask))
    H = dense_hessian(f, theta)
    sizes = {n: q.numel() for n, q in model.named_parameters()}
    start = sum(sizes[n] for n in names[: names.index("head.weight")])
    block = H[start : start + sizes["head.weight"], start : start + sizes["head.weight"]]
    lam_head = float(torch.linalg.eigvalsh(block)[-1])
    assert abs(lam_head - float(torch.linalg.eigvalsh(H)[-1])) > 1e-3 * abs(
        lam_head
    )  # a different number
    cfg = _write_lm_config(tmp_path, ids, mask, model, {"params": {"include": ["head.*"]}})
    rep = measure(
        cfg,
        measures=[{"hessian_lambda_max": {"tol": 1e-8}}, "frobenius_norm"],
        outdir=tmp_path / "out",
    )
    row = rep.rows[0]
    assert row.results["hessian_lambda_max"].value == pytest.approx(lam_head, rel=1e-4)
    assert row.results["frobenius_norm"].value == pytest.approx(
        float((model.head.weight.detach() ** 2).sum()), rel=1e-12
    )
    sel = json.loads((tmp_path / "out" / "results.json").read_text())["rows"][0]["params"]
    assert sel["names"] == ["head.weight"] and sel["count"] == sizes["head.weight"]


def test_parameter_selection_globs_tied_weights_and_errors():
    model = TinyLM(tie=True)
    assert ParamSelection.of({"include": ["head.weight"]}).select(model) == [
        "emb.weight"
    ]  # one tensor, two names
    assert ParamSelection.of({"exclude": ["emb.*"]}).select(model) == ["mix.weight", "mix.bias"]
    with pytest.raises(
        ConfigError,
        match=r"params: the pattern 'attn\.\*' matches no trainable parameter; "
        r"the model has emb.weight, mix.weight, mix.bias",
    ):
        ParamSelection.of({"include": ["attn.*"]}).select(model)
    with pytest.raises(ConfigError, match="Unknown config key 'params.inclde'"):
        ParamSelection.of({"inclde": ["x"]})


def test_batch_contract_and_model_outputs():
    b = Batch({"x": torch.zeros(3, 2), "y": torch.ones(3), "mask": torch.ones(3, 4)})
    args, kwargs = b.model_inputs()
    assert len(args) == 1 and list(kwargs) == ["mask"] and b.rows == 3
    assert b.select([2, 0]).rows == 2 and [c.rows for c in b.split(2)] == [2, 1]
    with pytest.raises(
        ConfigError, match=r"the tensors differ in their first dimension \(x: 3, y: 2\)"
    ):
        Batch({"x": torch.zeros(3, 2), "y": torch.ones(2)})
    loss = get_loss("causal_lm")
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    mask = (ids > 0).long()
    assert loss.units(Batch({"input_ids": ids, "attention_mask": mask})).tolist() == [2.0, 1.0]
    with pytest.raises(
        ConfigError,
        match=r"^loss must be one of cross_entropy, mse, causal_lm\. Got .ctc. instead\.$",
    ):
        get_loss("ctc")


def test_dry_run_prints_the_parameter_selection(tmp_path):

    from flatcli.cli import app

    model, ids, mask = lm_setup()
    cfg = _write_lm_config(
        tmp_path,
        ids,
        mask,
        model,
        {"params": {"include": ["head.*", "mix.*"], "exclude": ["*.bias"]}},
    )
    res = runner.invoke(app, ["measure", "-c", str(cfg), "-m", "hessian_trace", "--dry-run"])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert (
        first
        == "params: include head.*, mix.*; exclude *.bias → 2 tensor(s), 60 parameters: mix.weight, head.weight"
    )
