"""Per-unit overhead of a language-model sweep: 4 character-level GPT-2s × 7 measures.

Builds the study in a scratch folder: train/test splits of a local text corpus (the license
texts in /usr/share/common-licenses, else Python's LICENSE.txt; or ``--corpus``), a
character-level tokenizer (``tokenizers``) saved beside each model, and four GPT-2s (width 32 or
64 × weight decay 0 or 0.1, 2 layers) trained from random weights for ``--steps`` steps. Then
runs ``flatcli sweep`` over them with one CPU worker and reads the unit files: a unit's
overhead is its time minus its measure's time (loading the checkpoint, the data, the checks,
the train/test metrics, writing the unit). Prints the overhead as a fraction of the sweep's unit
time and writes docs/benchmarks/data/lm_sweep.json.

``--fresh`` also runs the same sweep with every unit loading its checkpoint and computing its
metrics afresh (what a worker did before it kept them per checkpoint), into another folder,
side by side on the same machine, and checks that both give the same unit records.

    python -m benchmarks.bench_lm_sweep                 # ~2 min on 2 cores (training included)
    python -m benchmarks.bench_lm_sweep --fresh         # and the per-unit reload, side by side
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import json_arg, table, write_json

MEASURES = [
    {"hessian_lambda_max": {"tol": 1.0e-3}},
    {"hessian_trace": {"tol": 0.05}},
    "fisher_rao_norm",
    {"sharpness_average": {"rho": 0.05}},
    "spectral_norm",
    "frobenius_norm",
    {"sharpness_worst": {"rho": 0.05}},
]
LENGTH = 64


def corpus_text(path: str | None) -> str:
    """The corpus: ``path``, else the license texts of the machine, else Python's LICENSE.txt."""
    if path:
        return Path(path).read_text(errors="ignore")
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        return "".join(p.read_text(errors="ignore") for p in sorted(lic.iterdir()) if p.is_file())
    return (
        Path(sys.base_prefix)
        / "lib"
        / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        / "LICENSE.txt"
    ).read_text()


def build_study(folder: Path, text: str, steps: int) -> Path:
    """Splits, tokenizer and four trained GPT-2s in ``folder``; returns the sweep config."""
    import torch
    import transformers
    import yaml
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    lines = text.splitlines(keepends=True)
    (folder / "test.txt").write_text("".join(lines[4::5]))
    (folder / "train.txt").write_text("".join(ln for i, ln in enumerate(lines) if i % 5 != 4))
    chars = sorted(set(text))
    vocab = {c: i for i, c in enumerate(["[PAD]", "[UNK]", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]"
    )
    ids = torch.tensor(fast((folder / "train.txt").read_text())["input_ids"])
    windows = ids[: len(ids) // LENGTH * LENGTH].view(-1, LENGTH)
    for width in (32, 64):
        for wd in (0.0, 0.1):
            torch.manual_seed(0)
            cfg = transformers.GPT2Config(
                vocab_size=len(fast),
                n_positions=LENGTH,
                n_embd=width,
                n_layer=2,
                n_head=2,
                bos_token_id=0,
                eos_token_id=0,
            )
            model = transformers.GPT2LMHeadModel(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=wd)
            for _ in range(steps):
                batch = windows[torch.randint(len(windows), (16,))]
                loss = model(input_ids=batch, labels=batch).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
            out = folder / "models" / f"w{width}_wd{wd}"
            model.save_pretrained(out)
            fast.save_pretrained(out)
    split = {"source": "text", "text_split": "windows", "max_length": LENGTH}
    config = {
        "model": {"source": "huggingface", "class": "AutoModelForCausalLM"},
        "checkpoints": ["models/*"],
        "hparams": {"from_path": r"w(?P<width>\d+)_wd(?P<wd>[0-9.]+)"},
        "data": {
            "train": {**split, "path": "train.txt"},
            "test": {**split, "path": "test.txt"},
        },
        "loss": "causal_lm",
        "measure_data": {"num_samples": 64, "batch_size": 16},
        "measures": MEASURES,
        "runtime": {"device": "cpu", "seed": 0},
    }
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@contextlib.contextmanager
def _reload_per_unit():
    """Every unit loads and evaluates its checkpoint afresh (what a worker did before it kept
    the checkpoint between units); imported here so the benchmark also runs on code without it."""
    import flatcli.run.kept as reuse

    class Fresh(reuse.CheckpointCache):
        def model(self, cfg, job):
            if self.metrics is not None:  # the previous unit finished: load and evaluate afresh
                self._key = None
            return super().model(cfg, job)

    saved = reuse.CheckpointCache
    reuse.CheckpointCache = Fresh
    try:
        yield
    finally:
        reuse.CheckpointCache = saved


def run_sweep(config: Path, outdir: Path, fresh: bool) -> dict:
    """One sweep into ``outdir`` (``fresh``: every unit reloads and re-evaluates); its unit
    records, wall time and what it printed to stderr."""
    from flatcli import api

    err = io.StringIO()
    lines: list[str] = []
    with _reload_per_unit() if fresh else contextlib.nullcontext():
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err):
            rep = api.sweep(config, outdir, log=lines.append)
    wall = time.perf_counter() - t0
    recs = [json.loads(p.read_text()) for p in sorted((outdir / "units").rglob("*.json"))]
    assert rep.errors == 0 and len(recs) == 4 * len(MEASURES), rep.summary()
    return {"records": recs, "wall": wall, "stderr": err.getvalue() + "\n".join(lines)}


def summary(name: str, run: dict) -> tuple[list, float]:
    """The table row of one sweep and its overhead fraction."""
    unit = sum(r["seconds"] for r in run["records"])
    measure = sum(r["result"]["seconds"] for r in run["records"])
    frac = (unit - measure) / unit
    return [
        name,
        len(run["records"]),
        round(run["wall"], 2),
        round(unit, 2),
        round(measure, 2),
        round(unit - measure, 2),
        round(frac, 3),
    ], frac


def comparable(recs: list[dict]) -> dict:
    """Unit id → record without what differs between runs (times, run id, worker)."""
    out = {}
    for r in recs:
        r = {k: v for k, v in r.items() if k not in ("run", "finished_at", "seconds", "worker")}
        r["result"] = {k: v for k, v in r["result"].items() if k != "seconds"}
        out[r["unit"]] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per model")
    ap.add_argument("--corpus", help="a .txt file (default: the machine's license texts)")
    ap.add_argument("--fresh", action="store_true", help="also run with a reload per unit")
    json_arg(ap, "lm_sweep")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flatcli-lm-sweep-") as tmp:
        folder = Path(tmp)
        config = build_study(folder, corpus_text(args.corpus), args.steps)
        runs = {"kept per checkpoint": run_sweep(config, folder / "runs" / "kept", False)}
        if args.fresh:
            runs["reloaded per unit"] = run_sweep(config, folder / "runs" / "fresh", True)
        rows = []
        for name, run in runs.items():
            row, frac = summary(name, run)
            rows.append(row)
            print(f"{name}: overhead (unit − measure) {frac:.1%} of {row[3]:.2f} s of unit time")
        same = len(runs) == 1 or comparable(runs["kept per checkpoint"]["records"]) == comparable(
            runs["reloaded per unit"]["records"]
        )
        logs = "\n".join(r["stderr"] for r in runs.values())
        bars = logs.count("Loading weights")
        nan_warnings = sum(
            "nan" in ln.lower() for ln in logs.splitlines() if "warning" in ln.lower()
        )
    note = (
        "4 GPT-2s (2 layers, width 32/64 × weight decay 0/0.1, character-level, "
        f"{LENGTH}-character windows, {args.steps} training steps) × 7 measures = 28 units, one "
        "CPU worker; unit = the unit file's seconds, measure = its result's seconds. "
        f"Identical unit records across runs: {same}. 'Loading weights' bars in the logs: {bars}; "
        f"warnings with nan: {nan_warnings}."
    )
    print(note)
    cols = ["sweep", "units", "wall_s", "unit_s", "measure_s", "overhead_s", "overhead_fraction"]
    out = write_json(
        "lm_sweep",
        "Per-unit overhead of a language-model sweep (4 checkpoints × 7 measures)",
        [table("sweep time and per-unit overhead", cols, rows, note)],
        args.json,
    )
    print(f"wrote {out}")
    if not same:
        sys.exit("the two sweeps' unit records differ")


if __name__ == "__main__":
    main()
