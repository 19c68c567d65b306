"""How far apart forward-over-reverse and double-backward Hessian products are on a tiny float64 BERT
whose word embedding has ``padding_idx`` 0 (the numbers in docs/architecture.md, "Padding rows").

Three inputs: random ids with the pad token 0 attended (tests/engine/test_padding_idx.py's ``bert()``), a
tokenizer's padding (the pad token only where ``attention_mask`` is 0) and the same with one pad token
attended. Prints the relative difference ‖H_rev V − H_fwd V‖ / ‖H_rev V‖ for two random vectors. Run it
against any checkout: ``PYTHONPATH=/path/to/checkout python scripts/padding_modes.py``.
"""

from __future__ import annotations

import torch
import transformers as tf

import flatcli
from flatcli.engine import CurvatureEngine, Problem

DT = torch.float64


def model():
    """tests/engine/test_padding_idx.py's tiny BERT: one layer, hidden 8, vocabulary 20, random weights."""
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
    return tf.BertForSequenceClassification(cfg).to(DT).eval()


def inputs():
    """(name, input_ids, attention_mask) of the three cases."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    ids[0, 5] = ids[1, 4] = 0
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    padded = torch.randint(1, 20, (4, 6), generator=g)
    pmask = torch.ones_like(padded)
    pmask[2, 4:] = 0
    pmask[0, 5:] = 0
    padded[pmask == 0] = 0
    attended = padded.clone()
    attended[1, 3] = 0
    return [
        ("random ids, pad token attended", ids, mask),
        ("tokenizer padding", padded, pmask),
        ("tokenizer padding + one attended pad token", attended, pmask),
    ]


def main() -> None:
    """Print each case's relative difference between the two product modes."""
    m = model()
    print(f"flatcli from {flatcli.__file__}, torch {torch.__version__}")
    for name, ids, mask in inputs():
        p = Problem(
            m,
            {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])},
            loss="cross_entropy",
            batch_size=2,
            dtype=DT,
        )
        V = torch.randn(2, p.num_params, generator=torch.Generator().manual_seed(2), dtype=DT)
        r = CurvatureEngine(p, hvp_mode="reverse").hessian()(V)
        f = CurvatureEngine(p, hvp_mode="forward").hessian()(V)
        print(f"{name}: forward vs reverse {float((r - f).norm() / r.norm()):.2e}")


if __name__ == "__main__":
    main()
