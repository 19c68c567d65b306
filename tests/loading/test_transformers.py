"""Hugging Face models end to end: tiny GPT-2, BERT and ViT built from configs, saved with
save_pretrained, measured through the CLI and checked against dense float64 Hessians of the
model's own loss (eval mode, padding masked, tied weights once)."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.func import functional_call

from flatcli import api
from tests import hf_models as H
from tests.helpers import measured, rel
from tests.oracles import cli_and_output as run
from tests.oracles import model_hessian

H.transformers()  # skips the module without transformers
IGNORE = -100


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Models, tokenizers and data files, built once for the module."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "root": root,
        "tok": H.save_tokenizer(root / "tok"),
        "tokbert": H.save_tokenizer(root / "tokbert", bert=True),
        "gpt2": H.save_gpt2(root / "gpt2", n_embd=4),
        "gpt2_init": H.save_gpt2(root / "gpt2_init", seed=1, n_embd=4),
        "bert": H.save_bert(root / "bert", hidden=4),
        "vit": H.save_vit(root / "vit"),
        "lm": H.write_jsonl(root / "lm.jsonl", H.text_rows()),
        "cls": H.write_jsonl(
            root / "cls.jsonl", [{**r, "pair": "the cat sat"} for r in H.text_rows(labels=True)]
        ),
        "img": H.image_tensors(root / "img.pt"),
    }


def write_config(path, **cfg):
    path.write_text(yaml.safe_dump(cfg))
    return path


def gpt2_config(hf, path, **extra):
    return write_config(
        path,
        model={"source": "huggingface", "class": "AutoModelForCausalLM"},
        checkpoints=[str(hf["gpt2"])],
        data={
            "train": {
                "source": "text",
                "path": str(hf["lm"]),
                "text_field": "text",
                "tokenizer": str(hf["tok"]),
                "max_length": 12,
            }
        },
        measure_data={"batch_size": 3},
        loss="causal_lm",
        **extra,
    )


def bert_config(hf, path, **extra):
    return write_config(
        path,
        model={"source": "huggingface", "class": "AutoModelForSequenceClassification"},
        checkpoints=[str(hf["bert"])],
        data={
            "train": {
                "source": "text",
                "path": str(hf["cls"]),
                "text_field": "text",
                "text_pair_field": "pair",
                "label_field": "label",
                "tokenizer": str(hf["tokbert"]),
                "max_length": 16,
            }
        },
        measure_data={"batch_size": 3},
        **extra,
    )


def vit_config(hf, path, **extra):
    return write_config(
        path,
        model={"source": "huggingface", "class": "AutoModelForImageClassification"},
        checkpoints=[str(hf["vit"])],
        data={"train": {"source": "tensors", "path": str(hf["img"])}},
        measure_data={"batch_size": 4},
        **extra,
    )


# ---------------------------------------------------------------- dense references
def reference_loss(kind: str, logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """The model's own loss, written out: next-token CE over every non-padded token (causal LM),
    or CE over the rows (classifiers)."""
    if kind == "causal":
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE,
        )
    return F.cross_entropy(logits, batch["labels"])


def hf_hessian(folder, cls: str, kind: str, batch: dict, include=None) -> torch.Tensor:
    """∇² of the reference loss over the (deduplicated) parameters, or those whose name contains one
    of ``include``, in float64 with eager attention in eval mode (dropout off)."""
    tf = H.transformers()
    model = getattr(tf, cls).from_pretrained(
        folder, local_files_only=True, attn_implementation="eager"
    )
    model = model.double().eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss_of(params):
        out = functional_call(model, params, (), {**inputs, "return_dict": True})
        return reference_loss(kind, out.logits, batch)

    return model_hessian(model, loss_of, include=include)


def exact_measures():
    return [
        {"hessian_lambda_max": {"tol": 1e-7, "max_steps": 300}},
        {"hessian_trace": {"method": "exact"}},
    ]


# ---------------------------------------------------------------- λmax and trace vs dense
@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit"])
def test_classifier_lambda_max_and_trace_match_hf_hessian(hf, tmp_path, name):
    """BERT (sentence pairs: token type ids, padding, dropout in the config) and ViT: λmax and the
    exact trace through the CLI equal a dense float64 Hessian of CE over the rows (eval mode)."""
    make, cls = {
        "bert": (bert_config, "AutoModelForSequenceClassification"),
        "vit": (vit_config, "AutoModelForImageClassification"),
    }[name]
    cfg = make(hf, tmp_path / "c.yaml", measures=exact_measures(), runtime={"precision": "fp64"})
    res, text = run("measure", "-c", cfg, "-o", tmp_path / "o")
    assert res.exit_code == 0, text
    row = measured(tmp_path / "o")
    assert row["model"]["attn_implementation"] == "eager"
    batch = (
        torch.load(next((tmp_path / "o" / "tokenized").glob("*.pt")))
        if name == "bert"
        else torch.load(hf["img"])
    )
    if name == "bert":
        assert {"token_type_ids", "attention_mask"} <= set(batch) and (
            batch["attention_mask"] == 0
        ).any()
    Hd = hf_hessian(hf[name], cls, "cls", batch)
    ev = torch.linalg.eigvalsh(Hd)
    assert rel(row["measures"]["hessian_lambda_max"]["value"], float(ev[-1])) < 1e-4
    assert rel(row["measures"]["hessian_trace"]["value"], float(Hd.diagonal().sum())) < 1e-4


@pytest.mark.slow
def test_gpt2_lambda_max_and_block_trace_match_hf_hessian(hf, tmp_path):
    """GPT-2 with tied lm_head/wte and padded sequences of unequal length in uneven batches: λmax of
    the whole model, and λmax and the exact trace of the attention block selected by a params glob,
    equal those of a dense float64 Hessian of next-token CE over every non-padded token."""
    full = gpt2_config(
        hf, tmp_path / "full.yaml", measures=[exact_measures()[0]], runtime={"precision": "fp64"}
    )
    res, text = run("measure", "-c", full, "-o", tmp_path / "full")
    assert res.exit_code == 0, text
    row = measured(tmp_path / "full")
    assert row["model"]["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    batch = torch.load(next((tmp_path / "full" / "tokenized").glob("*.pt")))
    assert set(batch) == {"input_ids", "attention_mask"}
    lens = batch["attention_mask"].sum(1)
    assert (
        len(set(lens.tolist())) > 2 and lens.min() < batch["input_ids"].shape[1]
    )  # padding, unequal lengths
    Hd = hf_hessian(hf["gpt2"], "AutoModelForCausalLM", "causal", batch)
    assert (
        rel(row["measures"]["hessian_lambda_max"]["value"], float(torch.linalg.eigvalsh(Hd)[-1]))
        < 1e-4
    )

    attn = gpt2_config(
        hf,
        tmp_path / "attn.yaml",
        measures=exact_measures(),
        runtime={"precision": "fp64"},
        params={"include": ["transformer.h.*.attn.*"]},
    )
    res, text = run("measure", "-c", attn, "-o", tmp_path / "attn")
    assert res.exit_code == 0, text
    row = measured(tmp_path / "attn")
    Hb = hf_hessian(hf["gpt2"], "AutoModelForCausalLM", "causal", batch, include=[".attn."])
    assert (
        rel(row["measures"]["hessian_lambda_max"]["value"], float(torch.linalg.eigvalsh(Hb)[-1]))
        < 1e-4
    )
    assert rel(row["measures"]["hessian_trace"]["value"], float(Hb.diagonal().sum())) < 1e-4


# ---------------------------------------------------------------- the whole catalogue
CHEAP = [  # every measure, with options that keep the run to seconds
    {"hessian_lambda_max": {"tol": 1e-2, "max_steps": 20}},
    {"hessian_trace": {"min_probes": 4, "max_probes": 4}},
    {"hessian_spectrum": {"top_k": 2, "slq_runs": 1, "slq_steps": 4}},
    {
        "local_entropy": {"method": "slq", "slq_runs": 2, "max_runs": 2, "slq_steps": 4}
    },  # not dense (440 HVPs on GPT-2)
    {"first_order_flatness": {"steps": 2}},
    {"keskar_sharpness": {"steps": 2}},
    {"sharpness_worst": {"adaptive": True, "steps": 2, "batch_size": 2, "eigen_starts": 0}},
    {"sharpness_average": {"adaptive": True, "samples": 2}},
    {"pacbayes_flatness": {"depth": 2, "samples": 2}},
    {"normalized_sharpness": {"max_exact": 0, "samples": 4, "check": 1}},
    {"ns_bound": {"max_exact": 0, "samples": 4, "check": 1, "mc_samples": 2}},
    {"fisher_rao_term": {"max_exact": 0, "samples": 4, "check": 1}},
    {"feature_robustness": {"samples": 2, "curve": 1}},
]
NOT_APPLICABLE = {
    "gpt2": {
        "path_norm",
        "relative_flatness",
        "feature_robustness",
        "normalized_sharpness",
        "ns_bound",
        "fisher_rao_term",
        "weightwatcher_alpha",
        "preconditioned_lambda_max",  # no optimizer state in a config's run
    },
    "bert": {"path_norm", "weightwatcher_alpha", "preconditioned_lambda_max"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_measure_all_gives_a_value_or_a_reason(hf, tmp_path, name):
    """``flatcli measure -m all``: no measure fails; the ones that do not apply say why; adaptive
    worst-case (m-)sharpness and average sharpness run."""
    make = {"gpt2": gpt2_config, "bert": bert_config}[name]
    extra = {"init_checkpoint": str(hf["gpt2_init"])} if name == "gpt2" else {}
    cfg = make(hf, tmp_path / "c.yaml", measures=CHEAP, **extra)
    res, text = run("measure", "-c", cfg, "-m", "all", "-o", tmp_path / "o")
    assert res.exit_code == 0, text
    row = measured(tmp_path / "o")
    status = {k: v["status"] for k, v in row["measures"].items()}
    if (
        name == "gpt2"
    ):  # the init checkpoint is a directory too; Conv1D projections and the tied head count once
        assert row["measures"]["distance_from_init"]["value"] == pytest.approx(
            _distance(hf), rel=1e-5
        )
    assert "error" not in status.values(), status
    na = {k for k, s in status.items() if s == "not_applicable"}
    assert na == NOT_APPLICABLE[name], status
    for k in na:
        assert row["measures"][k]["diagnostics"]["reason"], k
    for k in (
        "sharpness_worst",
        "sharpness_average",
        "hessian_lambda_max",
        "fisher_rao_norm",
    ):
        assert status[k] == "ok", (k, status[k])
    # 4 fixed probes: ok only when they meet the default tol 0.01, else not_converged
    trace = row["measures"]["hessian_trace"]
    met = trace["diagnostics"]["rel_stderr"] <= 0.01
    assert status["hessian_trace"] == ("ok" if met else "not_converged"), trace["diagnostics"]


def _distance(hf) -> float:
    """Σ ‖W − W⁰‖² over GPT-2's weight matrices: the four Conv1D projections and the head (= wte)."""
    tf = H.transformers()
    a, b = (
        tf.GPT2LMHeadModel.from_pretrained(hf[k], local_files_only=True)
        for k in ("gpt2", "gpt2_init")
    )
    sa, sb = a.state_dict(), b.state_dict()
    keys = [k for k in sa if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))] + [
        "lm_head.weight"
    ]
    assert len(keys) == 5
    return float(sum(((sa[k].double() - sb[k].double()) ** 2).sum() for k in keys))


@pytest.mark.slow
def test_dry_run_and_one_line_errors(hf, tmp_path):
    cfg = gpt2_config(hf, tmp_path / "c.yaml", measures=["hessian_lambda_max"])
    res, text = run("measure", "-c", cfg, "--dry-run")
    assert res.exit_code == 0 and "P = " in text, text
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf["gpt2"] / "config.json").read_text())
    res, text = run("measure", str(broken), "-c", cfg)
    assert res.exit_code == 2 and "model.safetensors" in text and str(broken) in text, text
    bad = write_config(
        tmp_path / "bad.yaml",
        model={"source": "huggingface", "class": "AutoModelForCausalLMM"},
        checkpoints=[str(hf["gpt2"])],
        data={"train": {"source": "tensors", "path": str(hf["img"])}},
        measures=["frobenius_norm"],
    )
    res, text = run("measure", "-c", bad)
    assert res.exit_code == 2 and "AutoModelForCausalLM'" in text, text


def test_max_length_above_the_models_positions_is_one_config_line(hf, tmp_path):
    # n_positions is 16 here; 32 tokens would index past the position table (formerly an IndexError, exit 1)
    cfg = gpt2_config(hf, tmp_path / "c.yaml", measures=["frobenius_norm"])
    d = yaml.safe_load(cfg.read_text())
    d["data"]["train"]["max_length"] = 32
    cfg.write_text(yaml.safe_dump(d))
    res, text = run("measure", "-c", cfg)
    assert (
        res.exit_code == 2 and "data.train.max_length is 32" in text and "n_positions 16" in text
    ), text
    assert "Traceback" not in text and "IndexError" not in text, text
    # without max_length, texts tokenized longer than the positions: the same line with the width
    long = H.write_jsonl(tmp_path / "long.jsonl", [{"text": " ".join(H.SENTENCES)}])
    d["data"]["train"].pop("max_length")
    d["data"]["train"]["path"] = str(long)
    cfg.write_text(yaml.safe_dump(d))
    res, text = run("measure", "-c", cfg)
    n = len(" ".join(H.SENTENCES).split())
    assert (
        res.exit_code == 2 and f"(tokenized length) is {n}" in text and "n_positions 16" in text
    ), text


def test_truncated_safetensors_is_not_a_readable_checkpoint(hf, tmp_path):
    import shutil

    for cut in (20, -100):  # inside the header; inside the tensors' bytes
        bad = tmp_path / f"cut{cut}"
        shutil.copytree(hf["gpt2"], bad)
        f = bad / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[:cut])
        cfg = gpt2_config(hf, tmp_path / "c.yaml", measures=["frobenius_norm"])
        res, text = run("measure", str(bad), "-c", cfg)
        assert res.exit_code == 2 and "not a readable checkpoint" in text and str(f) in text, text
        assert "SafetensorError" not in text and "Traceback" not in text, text


def test_params_selection_is_checked_before_the_data(hf, tmp_path):
    # the data file is missing: were the data loaded first, that would be the error reported
    cfg = gpt2_config(
        hf, tmp_path / "c.yaml", measures=["frobenius_norm"], params={"include": ["nomatch.*"]}
    )
    d = yaml.safe_load(cfg.read_text())
    d["data"]["train"]["path"] = str(tmp_path / "absent.jsonl")
    cfg.write_text(yaml.safe_dump(d))
    res, text = run("measure", "-c", cfg)
    assert res.exit_code == 2 and "'nomatch.*' matches no trainable parameter" in text, text
    assert "absent.jsonl" not in text, text


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_sdpa_and_eager_attention_give_the_same_loss(hf, name):
    """Both attention implementations compute the same function on padded batches (causal and
    bidirectional masks); under SDPA a Hessian measure fails with a message naming the fix."""
    from flatcli.api import measure_model
    from flatcli.config import DataSource
    from flatcli.engine import Batch, Problem
    from flatcli.loading.hf import load_pretrained
    from flatcli.loading.text import tokenize

    cls, data, tok, loss, fields = {
        "gpt2": ("AutoModelForCausalLM", "lm", "tok", "causal_lm", {}),
        "bert": (
            "AutoModelForSequenceClassification",
            "cls",
            "tokbert",
            "cross_entropy",
            {"label_field": "label"},
        ),
    }[name]
    src = DataSource(
        source="text", path=str(hf[data]), text_field="text", tokenizer=str(hf[tok]), **fields
    )
    batch = Batch(dict(tokenize(src, hf[data], hf[tok], "data.train").items()))
    assert (batch["attention_mask"] == 0).any()
    losses = {}
    for impl in ("eager", "sdpa"):
        model, info = load_pretrained(cls, hf[name], {"attn_implementation": impl})
        assert info["attn_implementation"] == impl
        with torch.no_grad():
            losses[impl] = float(Problem(model, batch, loss=loss).loss())
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-6)
    row = measure_model(model, batch, [{"hessian_lambda_max": {"max_steps": 3}}], loss=loss)
    if row.status != "ok":  # no double backward through the fused kernel in this torch
        assert "attn_implementation: eager" in row.errors["hessian_lambda_max"], row.errors


def test_dry_run_names_sequences_and_tokens_and_what_will_not_apply(hf, tmp_path):
    """On causal_lm the count is the sequences set (tokens beside them); measures that would end
    not_applicable say so with the run's reason instead of a cost (checked against a real run)."""
    names = ["hessian_lambda_max", "normalized_sharpness", "relative_flatness"]
    cfg = gpt2_config(hf, tmp_path / "c.yaml", measures=names)
    res, text = run("measure", "-c", cfg, "--dry-run")
    assert res.exit_code == 0, text
    m = re.search(r"n = (\d+) sequences \((\d+) scored tokens\)", text)
    assert m and int(m.group(1)) == len(H.text_rows()) and int(m.group(2)) > int(m.group(1)), text
    res, _ = run("measure", "-c", cfg, "--dry-run", "--format", "json")
    plan = {e["measure"]: e for e in json.loads(res.stdout)}
    assert (
        plan["hessian_lambda_max"]["status"] == "ok"
        and plan["hessian_lambda_max"]["seconds_high"] > 0
    )
    report = api.measure(cfg, measures="normalized_sharpness,relative_flatness")
    for lab in ("normalized_sharpness", "relative_flatness"):
        got = report.rows[0].results[lab]
        assert got.status == plan[lab]["status"] == "not_applicable", (lab, plan[lab])
        assert plan[lab]["seconds_low"] is None and "'causal_lm'" in plan[lab]["reason"]
