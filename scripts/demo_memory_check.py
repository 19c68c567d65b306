"""A GPT-2-shaped model with random weights, the tests' word-level tokenizer, a text file and a config,
for the memory check's examples in docs/performance.md ("Will it fit?")::

    python scripts/demo_memory_check.py /tmp/fit85m 768 12 12     # 85M parameters: will not fit in 24 GB
    python scripts/demo_memory_check.py /tmp/fit7m 320 6 5        # 7.4M parameters: fits
    flatcli measure -c /tmp/fit85m/config.yaml -o /tmp/fit85m/out
    flatcli measure -c /tmp/fit7m/config.yaml --dry-run

Arguments: the folder, then n_embd, n_layer and n_head.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = """model: {source: huggingface, class: AutoModelForCausalLM, kwargs: {attn_implementation: eager}}
checkpoints: [gpt2]
data:
  train: {source: text, path: train.jsonl, text_field: text, tokenizer: tok, max_length: 16}
loss: causal_lm
measure_data: {split: train, num_samples: all, batch_size: 8, seed: 0}
measures:
  - hessian_lambda_max: {tol: 1.0e-3}
  - hessian_trace: {min_probes: 16, max_probes: 16}
  - frobenius_norm
runtime: {device: cpu, precision: fp32, seed: 0}
"""


def main() -> None:
    """Write the model (save_pretrained), tokenizer, text file and config.yaml into the folder."""
    import torch

    from tests.hf_models import save_tokenizer, text_rows, transformers, vocab_size, write_jsonl

    out = Path(sys.argv[1])
    n_embd, n_layer, n_head = (int(a) for a in sys.argv[2:5])
    tf = transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=vocab_size(),
        n_positions=16,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=3,
        eos_token_id=3,
        pad_token_id=0,
    )
    tf.GPT2LMHeadModel(cfg).save_pretrained(out / "gpt2")
    save_tokenizer(out / "tok")
    write_jsonl(out / "train.jsonl", text_rows())
    (out / "config.yaml").write_text(CONFIG)


if __name__ == "__main__":
    main()
