"""Checkpoints in their own dtype (``model.dtype``) and bfloat16 products (``runtime.precision: bf16``):
tiny GPT-2 and BERT saved in bfloat16 with save_pretrained, measured in bf16 and checked against dense
Hessians of the same bfloat16 weights upcast to float64, built row by row with double backward."""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.func import functional_call

from flatcli.api import load
from flatcli.engine import CurvatureEngine, Problem
from flatcli.errors import ConfigError
from flatcli.loading.load import load_model
from tests import hf_models as H
from tests.helpers import measured, rel
from tests.oracles import cli_and_output as run
from tests.oracles import model_hessian

H.transformers()  # skips the module without transformers
IGNORE = -100
CLASSES = {"gpt2": "AutoModelForCausalLM", "bert": "AutoModelForSequenceClassification"}


def resave(src, dst, cls, dtype):
    """The save_pretrained directory ``src`` written again in ``dtype``."""
    tf = H.transformers()
    getattr(tf, cls).from_pretrained(src, local_files_only=True).to(dtype).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """bfloat16 and float32 tiny GPT-2 and BERT, tokenizers and text, built once for the module."""
    root = tmp_path_factory.mktemp("hf16")
    out = {
        "tok": H.save_tokenizer(root / "tok"),
        "tokbert": H.save_tokenizer(root / "tokbert", bert=True),
        "gpt2_32": H.save_gpt2(root / "gpt2_32", n_embd=4),
        "bert_32": H.save_bert(root / "bert_32", hidden=4),
        "lm": H.write_jsonl(root / "lm.jsonl", H.text_rows()[:5]),
        "cls": H.write_jsonl(
            root / "cls.jsonl", [{**r, "pair": "the cat sat"} for r in H.text_rows(labels=True)[:5]]
        ),
    }
    for name in ("gpt2", "bert"):
        out[name] = resave(out[f"{name}_32"], root / name, CLASSES[name], torch.bfloat16)
    return out


def config(hf, path, name, model=None, **extra):
    """A measure config for the ``name`` checkpoint (gpt2, bert, gpt2_32, bert_32)."""
    kind = name.split("_")[0]
    if kind == "gpt2":
        data = {
            "source": "text",
            "path": str(hf["lm"]),
            "text_field": "text",
            "tokenizer": str(hf["tok"]),
            "max_length": 12,
        }
        extra.setdefault("loss", "causal_lm")
    else:
        data = {
            "source": "text",
            "path": str(hf["cls"]),
            "text_field": "text",
            "text_pair_field": "pair",
            "label_field": "label",
            "tokenizer": str(hf["tokbert"]),
            "max_length": 16,
        }
    cfg = {
        "model": {"source": "huggingface", "class": CLASSES[kind], **(model or {})},
        "checkpoints": [str(hf[name])],
        "data": {"train": data},
        "measure_data": {"batch_size": 3},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------- dense reference
def hf_hessian(folder, kind: str, batch: dict) -> torch.Tensor:
    """∇² of the model's own loss (next-token CE over non-padded tokens, or CE over rows) over the
    deduplicated parameters, in float64 of the stored (bfloat16) weights upcast, eval mode: built row
    by row, each row the gradient of one gradient coordinate (double backward, rows batched with
    ``is_grads_batched``; not ``torch.func.hessian``, whose LayerNorm rows were wrong, issue 27)."""
    tf = H.transformers()
    model = getattr(tf, CLASSES[kind]).from_pretrained(
        folder, local_files_only=True, attn_implementation="eager", dtype="auto"
    )
    assert (
        next(model.parameters()).dtype == torch.bfloat16
    )  # the reference is of the stored bf16 weights
    model = model.double().eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss_of(params):
        logits = functional_call(model, params, (), {**inputs, "return_dict": True}).logits
        if kind == "gpt2":
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
            return F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE,
            )
        return F.cross_entropy(logits, batch["labels"])

    return model_hessian(model, loss_of, chunk=64)  # 64 rows per batched backward


# ---------------------------------------------------------------- model.dtype
@pytest.mark.slow
def test_model_dtype_auto_keeps_the_stored_type_and_an_override_wins(hf, tmp_path):
    """auto: a bf16 save_pretrained directory loads in bfloat16, a float32 one in float32; an explicit
    model.dtype converts; a bad value is a one-line config error naming model.dtype."""
    for name, want in (
        ("gpt2", torch.bfloat16),
        ("gpt2_32", torch.float32),
        ("bert", torch.bfloat16),
    ):
        model, extras = load_model(load(config(hf, tmp_path / f"{name}.yaml", name)), hf[name])
        assert {q.dtype for q in model.parameters()} == {want}, name
        assert extras["model_info"]["dtype"] == str(want).removeprefix("torch.")
    for setting, want in (("float32", torch.float32), ("float16", torch.float16)):
        cfg = load(config(hf, tmp_path / f"o_{setting}.yaml", "gpt2", model={"dtype": setting}))
        model, extras = load_model(cfg, hf["gpt2"])
        assert {q.dtype for q in model.parameters()} == {want}
    up = load(config(hf, tmp_path / "up.yaml", "gpt2_32", model={"dtype": "bfloat16"}))
    assert {q.dtype for q in load_model(up, hf["gpt2_32"])[0].parameters()} == {torch.bfloat16}
    with pytest.raises(
        ConfigError,
        match=r"^config key 'model.dtype' must be one of auto, float32, bfloat16, "
        r"float16. Got 'bf16' instead\.$",
    ):
        load(config(hf, tmp_path / "bad.yaml", "gpt2", model={"dtype": "bf16"}))
    res, text = run(
        "measure", "-c", config(hf, tmp_path / "bad.yaml", "gpt2", model={"dtype": "half"})
    )
    assert res.exit_code == 2 and "model.dtype" in text and "Traceback" not in text
    res, text = run("config", "show", "-c", config(hf, tmp_path / "show.yaml", "gpt2"))
    assert (
        res.exit_code == 0 and "  dtype: auto\n" in text and "#   model.dtype: default" in text
    ), text


def test_model_dtype_of_python_models_safetensors_and_torch_save(tmp_path):
    """A Python model: a bfloat16 .safetensors file loads in bfloat16 under auto, a torch.save file of
    the same bfloat16 tensors in float32 (as before), and model.dtype overrides both."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = {k: v.to(torch.bfloat16) for k, v in torch.nn.Linear(3, 2).state_dict().items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "m.pt")
    base = {
        "model": {"target": "torch.nn:Linear", "kwargs": {"in_features": 3, "out_features": 2}},
        "data": {
            "train": {"source": "synthetic", "num_samples": 4, "input_shape": [3], "num_classes": 2}
        },
    }
    cases = [
        ("m.safetensors", "auto", torch.bfloat16),
        ("m.pt", "auto", torch.float32),
        ("m.safetensors", "float32", torch.float32),
        ("m.pt", "bfloat16", torch.bfloat16),
    ]
    for f, setting, want in cases:
        cfg = load(
            {
                **base,
                "model": {**base["model"], "dtype": setting},
                "checkpoints": [str(tmp_path / f)],
            }
        )
        model, extras = load_model(cfg, tmp_path / f)
        assert model.weight.dtype == want, (f, setting)
        assert extras["model_info"] == {
            "source": "python",
            "dtype": str(want).removeprefix("torch."),
        }
        assert torch.equal(model.weight.float(), sd["weight"].float())  # bf16 values, exactly


# ---------------------------------------------------------------- bf16 products
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_bf16_lambda_max_matches_the_dense_hessian_of_the_bf16_weights(hf, tmp_path, name):
    """``precision: bf16`` on a bfloat16 checkpoint: the bf16 Lanczos value is within 1e-2 of the dense
    float64 λmax of the stored weights, the fp32-verified value within 1e-4; the control difference
    is reported and is not zero (the products really ran in bfloat16); results.json records the
    dtype; the dry run names it."""
    lam_opts = {"hessian_lambda_max": {"tol": 1e-4, "max_steps": 100}}
    cfg = config(hf, tmp_path / "c.yaml", name, measures=[lam_opts], runtime={"precision": "bf16"})
    res, text = run("measure", "-c", cfg, "-o", tmp_path / "o")
    assert res.exit_code == 0, text
    row = measured(tmp_path / "o")
    assert row["model"]["dtype"] == "bfloat16"
    m = row["measures"]["hessian_lambda_max"]
    d = m["diagnostics"]
    batch = torch.load(next((tmp_path / "o" / "tokenized").glob("*.pt")))
    lam = float(torch.linalg.eigvalsh(hf_hessian(hf[name], name, batch))[-1])
    assert rel(d["bf16_value"], lam) < 1e-2
    assert rel(m["value"], lam) < 1e-4 and d["verified"] == "fp32"
    # bfloat16 arithmetic (unit roundoff 3.9e-3) moves the value by far more than float32's would (the
    # Ritz value and the Rayleigh quotient of its vector agree to ~tol² in one precision), but less than 1e-2
    assert 1e-5 < d["fp32_control_rel_diff"] < 1e-2
    res, text = run("measure", "-c", cfg, "--dry-run")
    assert (
        res.exit_code == 0 and "model dtype: bfloat16 (model.dtype: auto); products: bf16" in text
    ), text


def test_bf16_trace_reports_the_paired_control(hf, tmp_path):
    """A bf16 Hutchinson trace carries the paired fp32 control (diagnostics and status rule)."""
    opts = {"hessian_trace": {"min_probes": 8, "max_probes": 8, "per_layer": "none"}}
    cfg = config(hf, tmp_path / "c.yaml", "gpt2", measures=[opts], runtime={"precision": "bf16"})
    res, text = run("measure", "-c", cfg, "-o", tmp_path / "o")
    assert res.exit_code == 0, text
    m = json.loads((tmp_path / "o" / "results.json").read_text())["rows"][0]["measures"][
        "hessian_trace"
    ]
    d = m["diagnostics"]
    assert d["fp32_control_probes"] == 8 and 0 < d["fp32_control_rel_diff"] < 5e-2
    met = d["rel_stderr"] <= 0.01  # the default tol: a fixed count is ok only when it meets it
    assert m["status"] == (
        "precision_warning"
        if abs(d["fp32_control_diff"]) > m["stderr"]
        else "ok"
        if met
        else "not_converged"
    )


def test_bf16_products_are_float32_vectors_computed_in_bfloat16(hf):
    """The engine's bf16 Hessian products on a float32 GPT-2: float32 results within 2e-2 of the
    float32 products (relative norm), not equal to them; the problem's θ stays float32."""
    tf = H.transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(
        hf["gpt2"], local_files_only=True, attn_implementation="eager"
    )
    model = model.float().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, H.vocab_size(), (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    data = {"input_ids": ids, "attention_mask": mask}
    out = {}
    for prec in ("fp32", "bf16"):
        p = Problem(model, data, loss="causal_lm", batch_size=2)
        eng = CurvatureEngine(p, precision=prec)
        V = torch.randn(2, p.num_params, generator=torch.Generator().manual_seed(1))
        out[prec] = eng.hessian()(V)
        assert p.theta.dtype == torch.float32 and out[prec].dtype == torch.float32
        assert p.compute_dtype == (torch.bfloat16 if prec == "bf16" else torch.float32)
    err = float((out["bf16"] - out["fp32"]).norm() / out["fp32"].norm())
    assert 0 < err < 2e-2, err


def test_fp16_and_bf16_finite_differences_are_refused_in_one_line(hf, tmp_path):
    """fp16 is not offered (range), and bf16 finite-difference products are unsound: one-line config
    errors, exit code 2, before any checkpoint is loaded."""
    cases = [
        ({"precision": "fp16"}, "'runtime.precision': fp16 is not offered"),
        (
            {"precision": "bf16", "hvp_mode": "finite_difference"},
            "finite_difference with runtime.precision: bf16",
        ),
    ]
    for rt, msg in cases:
        cfg = config(hf, tmp_path / "c.yaml", "gpt2", measures=["hessian_lambda_max"], runtime=rt)
        res, text = run("measure", "-c", cfg, "-o", tmp_path / "o")
        assert res.exit_code == 2 and msg in text and "Traceback" not in text, text
        assert not (tmp_path / "o" / "results.json").exists()


def test_bf16_leaves_the_other_measures_and_the_metrics_in_float32(hf, tmp_path):
    """Under bf16 only the verified Hessian estimators run bfloat16 products; a loss-difference measure
    (first-order flatness) and the train metrics give the float32 run's values, marked ``products: fp32``."""
    rows = {}
    for prec in ("fp32", "bf16"):
        cfg = config(
            hf,
            tmp_path / f"{prec}.yaml",
            "gpt2",
            measures=[{"first_order_flatness": {"steps": 2}}],
            runtime={"precision": prec},
        )
        res, text = run("measure", "-c", cfg, "-o", tmp_path / prec)
        assert res.exit_code == 0, text
        rows[prec] = measured(tmp_path / prec)
    a, b = (rows[p]["measures"]["first_order_flatness"] for p in ("fp32", "bf16"))
    assert (
        b["value"] == pytest.approx(a["value"], rel=1e-9) and b["diagnostics"]["products"] == "fp32"
    )
    assert rows["bf16"]["metrics"]["train_loss"] == pytest.approx(
        rows["fp32"]["metrics"]["train_loss"], rel=1e-9
    )
