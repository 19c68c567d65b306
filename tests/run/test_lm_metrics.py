"""Per-token metrics of a language model: train/test loss per scored token, the loss gap and the
perplexities, against a brute-force loop over every scored token; classifiers get loss_gap only."""

from __future__ import annotations

import math

import pytest
import torch

from flatcli.run.measuring import measure_model
from flatcli.run.results import METRICS, to_frame
from tests.helpers import tiny_data, tiny_mlp
from tests.token_models import TinyLM, padded_tokens


def brute_loss(model, ids, mask) -> float:
    """Mean next-token cross-entropy over the scored tokens, one token at a time, in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    for r in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if mask[r, t + 1]:
                total -= float(torch.log_softmax(logits[r, t], -1)[ids[r, t + 1]])
                count += 1
    return total / count


@pytest.mark.parametrize("seed", range(5))
def test_causal_lm_loss_gap_and_perplexities_are_the_models_own(seed):
    torch.manual_seed(seed)
    model = TinyLM(vocab=7, dim=4).double()
    tr = padded_tokens(9, 6, 7, seed=seed)
    te = padded_tokens(7, 6, 7, seed=100 + seed)
    as_batch = lambda t: {"input_ids": t[0], "attention_mask": t[1]}  # noqa: E731
    row = measure_model(
        model,
        as_batch(tr),
        ["frobenius_norm"],
        test=as_batch(te),
        loss="causal_lm",
        precision="fp64",
        batch_size=4,
    )
    m = row.metrics
    train, test = brute_loss(model, *tr), brute_loss(model, *te)
    assert m["train_loss"] == pytest.approx(train, abs=1e-12)
    assert m["test_loss"] == pytest.approx(test, abs=1e-12)
    assert m["loss_gap"] == pytest.approx(test - train, abs=1e-12)
    assert m["train_ppl"] == pytest.approx(math.exp(train), rel=1e-12)
    assert m["test_ppl"] == pytest.approx(math.exp(test), rel=1e-12)
    df = to_frame([row])
    assert [c for c in df.columns if c in METRICS] == list(METRICS)  # every metric, in order


def test_classifiers_get_the_loss_gap_but_no_perplexity():
    x, y = tiny_data()
    xt, yt = tiny_data(seed=1)
    row = measure_model(tiny_mlp(), (x, y), ["frobenius_norm"], test=(xt, yt), precision="fp64")
    m = row.metrics
    assert m["loss_gap"] == m["test_loss"] - m["train_loss"]
    assert "train_ppl" not in m and "test_ppl" not in m
    no_test = measure_model(tiny_mlp(), (x, y), ["frobenius_norm"], precision="fp64").metrics
    assert "loss_gap" not in no_test and "gen_gap" not in no_test
