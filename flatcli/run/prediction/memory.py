"""Peak memory predicted and checked before a run (``runtime.check_memory``).

Two checks, each against the free memory of the device (`flatcli.engine.recompute.free_bytes`:
CUDA's free bytes, ``torch.cuda.mem_get_info``; on CPU the host's ``MemAvailable``):

1. **Before the data** (`check_model`, in `flatcli.run.measuring.measure_job` after the model is loaded
   and its parameter selection checked, before any split is loaded or tokenized). From the model
   alone it counts the *least* memory the run will add:

   * the weights of the working copy the measures run on, when one is made (`copies_model`: the
     model is not already on the device in θ's or the forward's type; every parameter and buffer
     in θ's type). On CPU a model that is used as loaded adds nothing: it is already resident, so
     ``MemAvailable`` has it;
   * θ and its gradient: 2 P-vectors of the selected parameters (P) in θ's type (float32 under
     ``auto``, ``fp32``, ``tf32`` and ``bf16``, whose vectors and reductions stay float32; float64
     under ``fp64``), as ``--dry-run``'s peak (`flatcli.run.prediction.predict.predict`) counts them;
   * the P-vectors the measure that keeps the most declares (its registry ``estimate``'s
     ``vectors``: a Lanczos or SLQ basis, a Hutch++ sketch) plus one product input when it takes
     Hessian products (`vectors_kept`; a block of the engine's block size counts as one vector:
     the engine shrinks its blocks to the memory there is). On CUDA the bases are bounded by
     ``runtime.max_device_vectors`` (``auto``: a quarter of free memory,
     `flatcli.engine.linalg._store.default_capacity`); the rows beyond live in host memory and
     are not counted. On CPU host and device are one memory and every row counts.

   Not counted: activations (saved tensors of the forward and backward passes), which depend on
   the data, the data itself, and dense matrices a measure builds for tiny models without
   declaring them. So the figure is a lower bound: a run it refuses cannot fit.

2. **Before the first product** (`check_products`, in `flatcli.run.measuring.measure_model` once the
   measurement set is on the device; only when a chosen measure takes Hessian products): the
   activations. `flatcli.engine.recompute.predicted_product_bytes` (the rule of
   ``runtime.recompute: auto``: one forward and one ``create_graph`` backward over the first batch
   with saved-tensor counting hooks, plus five P-vectors) gives one product's peak; the check adds
   the largest Hessian measure's declared vectors beyond those five and compares the sum with the
   free memory then (the working copy, θ and the data are already resident). When recompute is on
   (``true``, or ``auto`` with blocks (`find_blocks`) and a product above 80% of free memory, as
   `flatcli.engine.products.ProductContext.route` decides), the product is the block-by-block
   one (`flatcli.engine.segments`) and is predicted by its own rule (``predicted_product_bytes(...,
   by_blocks=L)``); on blocks that are not a chain it checkpoints, is not predicted, and only the
   vectors are checked. A run that auto-recompute makes fit is never refused, and
   ``runtime.recompute: true`` is suggested only when its predicted product fits. Likewise with ``hvp_mode: finite_difference`` (a product is two gradients,
   no graph kept) and when the counting pass itself fails (a model without a double backward: its
   Hessian measures fail on their own and say why, the others still run).

   Cost rule: the counting pass is one forward and backward over one batch. It is skipped when
   the free memory is at least `SKIP_FACTOR` (1,000) times the P-vectors counted plus the bytes of
   one batch of inputs: activations would have to exceed a thousand times those for the run not to
   fit, which the tests' tiny models never approach (a small convolutional net on large images
   could; then the run's own out-of-memory back-off still applies).

A failed check is a `flatcli.errors.MeasurementError` (exit code 1), not a `ConfigError`: the config
is valid and the same run fits on a larger device or with more free memory; the verdict depends on
the machine's state, like an out-of-memory error, and fails one checkpoint's row
(`flatcli.run.measuring.measure_job` turns it into an error row; the other checkpoints go on). Its one
line names the checkpoint, the measure(s) that need the most, the bytes predicted against the bytes
free, and the settings that shrink the part that is too big (`MemoryVerdict.suggestions`).
``runtime.check_memory: false`` turns both checks off (for a machine whose ``MemAvailable``
misleads, e.g. a container limit it does not show).
"""

from __future__ import annotations

import dataclasses
import gc
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...engine.linalg._store import default_capacity
from ...engine.recompute import (
    AUTO_RECOMPUTE,
    find_blocks,
    free_bytes,
    predicted_product_bytes,
    saved_bytes,
)
from ...engine.segments import BlockChain
from ...errors import MeasurementError
from ...measures import Dims, MeasureSpec, get_measure
from ...measures._layers import weight_matrices
from ..settings import Settings

GRAPH_FRACTION = (
    0.5  # runtime.cache_graphs: auto keeps the graphs when their peak fits in this share
)
SKIP_FACTOR = 1000  # the counting pass is skipped when free memory ≥ this × (P-vectors + one batch)


_PARTS = {"theta_gradient": "θ and gradient", "product": "one product"}  # parts' keys in words


def _gib(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.3g} {unit}"
        x /= 1024
    return f"{x:.3g} GiB"


@dataclass
class MemoryVerdict:
    """Whether a run fits: ``need`` bytes counted (``parts``: what of), ``free`` bytes of the device
    (None: unknown, then it fits), ``measures`` the label(s) that need the most, ``suggestions`` the
    settings that shrink the part that is too big; ``stage``: ``model`` (before the data) or
    ``products`` (with the activations of one product); ``skipped``: what was not counted and why
    (with ``need`` 0: nothing was checked)."""

    stage: str
    need: int = 0
    free: int | None = None
    parts: dict[str, int] = field(default_factory=dict)
    measures: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    device: str = "cpu"
    skipped: str = ""

    @property
    def fits(self) -> bool:
        """Whether the counted bytes fit in the free memory (unknown free memory fits)."""
        return self.free is None or self.need <= self.free

    def _free_words(self) -> str:
        where = (
            "free on " + self.device
            if self.device.startswith("cuda")
            else "available (MemAvailable)"
        )
        return "free memory unknown" if self.free is None else f"{_gib(self.free)} {where}"

    def line(self) -> str:
        """``fits: needs at least 1.2 MiB of 20 GiB available (MemAvailable)`` or ``will not fit: …; try …``."""
        what = ", ".join(f"{_PARTS.get(k, k)} {_gib(v)}" for k, v in self.parts.items() if v)
        if self.skipped and not self.need:
            return f"not checked: {self.skipped}"
        if self.skipped:
            what += f"; {self.skipped}"
        if self.fits:
            return f"fits: needs at least {_gib(self.need)} ({what}) of {self._free_words()}"
        who = f" ({', '.join(self.measures)})" if self.measures else ""
        text = f"will not fit: needs at least {_gib(self.need)}{who}: {what}; {self._free_words()}"
        return text + ("; try " + "; or ".join(self.suggestions) if self.suggestions else "")

    def error(self) -> MeasurementError:
        """The one-line failure of a checkpoint's row (the row names the checkpoint, and the CLI's
        line prints it first: ``error: m0.pt: will not fit: ...``)."""
        return MeasurementError(f"{self.line()} (runtime.check_memory: false skips this check)")

    def to_json(self) -> dict[str, Any]:
        """``--dry-run --format json``'s ``memory`` entry."""
        return {
            "stage": self.stage,
            "fits": self.fits,
            "need_bytes": self.need,
            "free_bytes": self.free,
            "parts": dict(self.parts),
            "measures": list(self.measures),
            "suggestions": list(self.suggestions),
            "skipped": self.skipped or None,
            "verdict": self.line(),
        }


def refuse(verdict: MemoryVerdict, dist) -> None:
    """Raise ``verdict``'s `MeasurementError` when it will not fit here or, with several ranks
    (``dist``: `flatcli.engine.dist.Dist`), on another one: their collectives stay in step, so
    every rank fails the checkpoint together (every rank calls this: it is a collective)."""
    elsewhere = dist.active and dist.any(not verdict.fits)
    if not verdict.fits:
        raise verdict.error()
    if elsewhere:
        raise MeasurementError(
            "will not fit on another rank (its row of the log says why); "
            "runtime.check_memory: false skips this check"
        )


# ------------------------------------------------------------------ what each measure keeps
def vectors_kept(
    spec: MeasureSpec, dims: Dims, engine_block: int = 1, least: bool = False
) -> tuple[int, int]:
    """(declared, block): the P-vectors ``spec``'s estimate declares it keeps (``vectors``: a basis,
    a sketch, a trace's first block of probes and its near-zero floor; ``least``: those it always
    keeps, else the most) and those of one product input when it takes Hessian products
    (``hvp_block``; 0: the engine's block, ``engine_block``). `flatcli.run.prediction.predict.predict` counts
    the most; the checks before the run (a lower bound) the least."""
    est = spec.estimate(dims) or {}
    block = est.get("hvp_block", (1, 1))[1]
    takes = est.get("n_hvp", (0, 0))[1] > 0
    declared = est.get("vectors", (0, 0))[0 if least else 1]
    return int(declared), int((engine_block if block == 0 else block) * takes)


def takes_hessian_products(spec: MeasureSpec, dims: Dims) -> bool:
    """Whether ``spec``'s estimate declares Hessian-vector products."""
    return (spec.estimate(dims) or {}).get("n_hvp", (0, 0))[1] > 0


def model_dims(model: torch.nn.Module, st: Settings) -> Dims:
    """The `Dims` a memory need depends on, from the model alone (no data): P and the sizes of the
    selected tensors and weight matrices; n, C and rows are 1 (unknown before the data; no declared
    ``vectors`` depends on them)."""
    names = st.params.select(model)
    named = dict(model.named_parameters())
    chosen = set(names)
    P = int(sum(named[n].numel() for n in names))
    mats = weight_matrices(model, chosen)
    return Dims(
        P=P,
        n=1,
        C=1,
        rows=1,
        tensors=tuple(named[n].numel() for n in names),
        matrices=tuple(int(torch.Size(w.shape).numel()) for w in mats),
        matrix_tensors=tuple(list(names).index(w.param_name) for w in mats),
        verify=st.verifies(),
        max_basis=st.basis_cap(P),
        device=str(st.device),
        dtype=st.dtype,
    )


def copies_model(model: torch.nn.Module, st: Settings) -> bool:
    """Whether measuring ``model`` makes a working copy (`flatcli.run.measuring` then converts one): it is
    not on the device already, in θ's type or (``bf16``) the forward's."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None else torch.float32
    return not (device == st.device and dtype in (st.dtype, st.compute_dtype))


def _element(st: Settings) -> int:
    return torch.finfo(st.dtype).bits // 8


def _device_rows(declared: int, P: int, st: Settings) -> int:
    """The declared basis rows held on the device: all on CPU; on CUDA at most
    ``runtime.max_device_vectors`` (``auto``: `default_capacity`)."""
    if st.device.type != "cuda" or declared == 0:
        return declared
    cap = st.max_device_vectors
    if cap == "auto":
        cap = default_capacity(P, st.device, st.dtype)
    return declared if cap is None else min(declared, int(cap))


# ------------------------------------------------------------------ 1. before the data
def check_model(
    model: torch.nn.Module, specs: Sequence[MeasureSpec], st: Settings
) -> MemoryVerdict:
    """The least memory measuring ``model`` with ``specs`` adds (module docstring, 1), against the
    device's free memory."""
    dims = model_dims(model, st)
    P, elt = dims.P, _element(st)
    weights = 0
    if copies_model(model, st):
        tensors = [*model.parameters(), *model.buffers()]
        weights = sum(
            t.numel() * (elt if t.is_floating_point() else t.element_size()) for t in tensors
        )
    kept = {s.label: vectors_kept(s, dims, least=True) for s in specs}
    rows = {lab: _device_rows(d, P, st) + b for lab, (d, b) in kept.items()}
    most = max(rows.values(), default=0)
    parts = {"weights": int(weights), "theta_gradient": 2 * P * elt, "vectors": most * P * elt}
    v = MemoryVerdict(
        "model",
        sum(parts.values()),
        free_bytes(st.device),
        parts,
        tuple(lab for lab, r in rows.items() if r == most and most > 0),
        device=str(st.device),
    )
    if not v.fits:
        v.suggestions = tuple(_model_suggestions(v, model, st, kept, rows, specs, dims))
    return v


def _basis_cap(spec, lab: str, dims: Dims, room: int, declared: int) -> list[str]:
    """The largest ``runtime.max_basis_vectors`` whose basis and the estimator's own vectors fit
    ``room`` P-vectors (with ``min_steps`` lowered to it when the certified step count would keep
    more), when it keeps fewer than the ``declared`` vectors; none otherwise."""

    def held(sp, k: int, least: bool = False) -> int:
        return vectors_kept(sp, dataclasses.replace(dims, max_basis=k), least=least)[0]

    lowers = "min_steps" in _option_names(spec)
    for k in range(room, 0, -1):
        if held(spec, k) >= declared:
            return []  # a cap this large saves nothing
        if held(spec, k) <= room and held(spec, k, least=True) <= room:
            return [f"runtime.max_basis_vectors: {k} (Lanczos restarts beyond it)"]
        fewer = dataclasses.replace(spec, options={**spec.options, "min_steps": k})
        if lowers and k >= 2 and held(fewer, k, least=True) <= room and held(fewer, k) <= room:
            return [
                f"runtime.max_basis_vectors: {k} with {lab}: min_steps: {k} (the certified step "
                f"count keeps {held(spec, k, least=True)} vectors; fewer steps are not certified)"
            ]
    return []


def _model_suggestions(
    v: MemoryVerdict, model, st: Settings, kept, rows, specs, dims: Dims
) -> list[str]:
    """Settings that shrink the counted part enough to fit (only those)."""
    P, elt, free, out = dims.P, _element(st), v.free or 0, []
    fixed = v.parts["weights"] + 2 * P * elt
    if st.device.type == "cpu" and v.measures:  # a Lanczos basis capped by thick restarts
        lab = v.measures[0]
        room = (free - fixed - kept[lab][1] * P * elt) // (P * elt)  # the declared vectors' room
        spec = next(s for s in specs if s.label == lab)
        out += _basis_cap(spec, lab, dims, int(room), kept[lab][0])
    if st.device.type == "cuda" and v.measures:
        lab = v.measures[0]
        k = (free - fixed - kept[lab][1] * P * elt) // (P * elt)
        if 1 <= k < rows[lab] - kept[lab][1]:
            out.append(f"runtime.max_device_vectors: {k} (the other basis rows in host memory)")
    if st.precision == "fp64" and v.need // 2 <= free:
        out.append("runtime.precision: fp32 (halves every P-vector and the weights)")
    if (
        v.parts["weights"]
        and st.device.type == "cpu"
        and st.precision != "bf16"
        and next(model.parameters()).dtype == torch.bfloat16
        and v.need - v.parts["weights"] <= free
    ):
        out.append("runtime.precision: bf16 (uses the bfloat16 weights as loaded, no float32 copy)")
    per_param = elt * (2 + max(rows.values(), default=0))
    fit_p = (free - v.parts["weights"]) // per_param
    if 1 <= fit_p < P:
        out.append(
            f"a parameter subset of at most {fit_p:,} of the {P:,} parameters (params: include/exclude)"
        )
    others = [r for lab, r in rows.items() if lab not in v.measures]
    if others and fixed + max(others) * P * elt <= free:
        out.append(f"leaving out {', '.join(v.measures)} (the other measures fit)")
    return out


# ------------------------------------------------------------------ 2. before the first product
def _batch_bytes(batch) -> int:
    return int(sum(t.numel() * t.element_size() for t in batch.values()))


def check_products(
    problem, specs: Sequence[MeasureSpec], dims: Dims, st: Settings
) -> MemoryVerdict:
    """One Hessian product's predicted peak plus the largest Hessian measure's declared vectors,
    against the free memory now (module docstring, 2). ``problem``: the measurement set's
    `flatcli.engine.Problem` on the device; ``dims``: its sizes (`flatcli.run.measuring.problem_dims`)."""
    hess = [s for s in specs if takes_hessian_products(s, dims)]
    if not hess or not problem.batches:
        return MemoryVerdict("products", device=str(st.device), skipped="no Hessian products")
    P, elt = problem.num_params, _element(st)
    declared = {s.label: _device_rows(vectors_kept(s, dims, least=True)[0], P, st) for s in hess}
    most = max(declared.values())
    vectors = (
        max(most - 1, 0) * P * elt
    )  # the product's five P-vectors count one input: the rest of the basis
    free = free_bytes(st.device)
    base = 5 * P * elt + vectors
    labels = tuple(lab for lab, r in declared.items() if r == most)

    def vectors_only(why: str) -> MemoryVerdict:
        return MemoryVerdict(
            "products", base, free, {"vectors": base}, labels, device=str(st.device), skipped=why
        )

    if free is None:
        return vectors_only("free memory unknown")
    if st.hvp_mode == "finite_difference":
        return vectors_only(
            "finite-difference products keep no gradient graph; activations not counted"
        )
    if free >= SKIP_FACTOR * (base + _batch_bytes(problem.batches[0])):
        return vectors_only(
            f"with one batch, under 1/{SKIP_FACTOR} of {_gib(free)} free; activations not counted"
        )
    try:
        product, _ = predicted_product_bytes(
            problem, problem.batches[0], len(problem.batches), st.device
        )
    except (
        Exception
    ) as e:  # the counting pass failed (no double backward): the measures will say why
        return vectors_only(
            f"one product could not be predicted ({type(e).__name__}); activations not counted"
        )
    blocks = bool(find_blocks(problem.model))
    chain = (
        _chain_product(problem, st) if blocks else None
    )  # block by block: (bytes, blocks) or None
    if blocks and (
        st.recompute == "true" or (st.recompute == "auto" and product > AUTO_RECOMPUTE * free)
    ):
        if chain is None:
            return vectors_only(
                "activations recomputed with checkpointing (runtime.recompute): not counted"
            )
        product = chain[0]
    parts = {"product": int(product), "vectors": int(vectors)}
    v = MemoryVerdict("products", sum(parts.values()), free, parts, labels, device=str(st.device))
    if not v.fits:
        v.suggestions = tuple(
            _product_suggestions(v, problem, hess, st, blocks, base, chain, vectors)
        )
    return v


def _chain_product(problem, st: Settings, saved: int | None = None) -> tuple[int, int] | None:
    """(predicted bytes, blocks) of one block-by-block product (`flatcli.engine.segments`), or None
    when the model's blocks are not a chain (then ``recompute`` checkpoints, and is not predicted)."""
    chain, _ = BlockChain.find(problem)
    if chain is None:
        return None
    n = len(chain.blocks)
    counted = {} if saved is None else {"saved": saved}
    return predicted_product_bytes(
        problem, problem.batches[0], len(problem.batches), st.device, by_blocks=n, **counted
    )[0], n


def _option_names(spec: MeasureSpec) -> set[str]:
    """The option names of ``spec``'s measure."""
    return {f.name for f in dataclasses.fields(get_measure(spec.name).options)}


def _product_suggestions(
    v: MemoryVerdict,
    problem,
    hess,
    st: Settings,
    blocks: bool,
    base: int,
    chain: tuple[int, int] | None,
    vectors: int,
) -> list[str]:
    """Settings that shrink the activations of a product (the part beyond the P-vectors);
    ``runtime.recompute: true`` when its block-by-block product is predicted to fit (``chain``), or
    on blocks that are not a chain (checkpointing: not predicted, so offered as a try)."""
    free, out = v.free or 0, []
    act = max(v.need - base, 1)
    if blocks and st.recompute != "true" and (chain is None or chain[0] + vectors <= free):
        how = (
            f"block by block, {_gib(chain[0])} per product" if chain else "per-block checkpointing"
        )
        out.append(f"runtime.recompute: true (keeps one block's activations at a time: {how})")
    rows = problem.batches[0].rows
    fit = int(rows * (free - base) / act) if free > base else 0
    if 1 <= fit < rows:
        out.append(
            f"measure_data.batch_size: {fit} (activations grow with the rows of a batch; now {rows})"
        )
    if (
        st.precision != "bf16"
        and st.precision != "fp64"
        and any(get_measure(s.name).low_precision for s in hess)
        and base + act // 2 <= free
    ):
        out.append("runtime.precision: bf16 (the forward's activations in bfloat16)")
    return out


# ------------------------------------------------------------------ one product, counted
@dataclass
class ProductCount:
    """One Hessian product of ``k`` vectors as the run takes it, counted (never built on the whole
    set): ``saved`` the bytes a batch's gradient graph saves (`flatcli.engine.recompute.saved_bytes`:
    micro-batches of one and two rows, scaled to the batch), ``bytes`` the product's peak
    (`flatcli.engine.recompute.predicted_product_bytes`' rule, block by block when recomputing on a
    chain, plus the block's other k − 1 product rows), ``graphs`` the other batches' graphs when
    they are kept across products, ``how`` in words."""

    saved: int
    bytes: int
    graphs: int
    how: str

    @property
    def total(self) -> int:
        """The product's peak with the kept graphs."""
        return self.bytes + self.graphs


def product_bytes(problem, st: Settings, k: int = 1, keep: bool | None = None) -> ProductCount:
    """`ProductCount` of one product of ``k`` vectors over ``problem`` (its first batch, counted);
    ``keep``: whether the other batches' graphs are kept (None: ``st.cache_graphs``, ``auto``
    counted as kept; never while recomputing, which keeps none)."""
    batch, n = problem.batches[0], len(problem.batches)
    P, elt = problem.num_params, _element(st)
    S = saved_bytes(problem, batch)
    one, free = predicted_product_bytes(problem, batch, n, st.device, saved=S)
    rows = max(k - 1, 0) * P * elt  # the block's other products (its inputs are the caller's)
    blocks = bool(find_blocks(problem.model))
    auto_on = st.recompute == "auto" and free is not None and one > AUTO_RECOMPUTE * free
    if blocks and (st.recompute == "true" or auto_on):
        chain = _chain_product(problem, st, S)
        if chain is not None:
            return ProductCount(
                S, chain[0] + rows, 0, f"counted, block by block ({chain[1]} blocks)"
            )
        return ProductCount(S, one + rows, 0, "counted as the double backward (checkpointed)")
    keep = st.cache_graphs != "false" if keep is None else keep
    graphs = (n - 1) * S if keep else 0
    return ProductCount(
        S, one + rows, graphs, "counted: saved tensors of 1- and 2-row micro-batches"
    )


def graph_choice(
    problem, specs: Sequence[MeasureSpec], dims: Dims, st: Settings
) -> tuple[bool, str]:
    """(keep, why): whether the run keeps every batch's gradient graph across the products at one θ
    (``runtime.cache_graphs``). ``true``/``false`` as set; ``auto``: when the predicted peak with
    them (`product_bytes` with the kept graphs, and the P-vectors of the measure that keeps the
    most) fits in `GRAPH_FRACTION` of the free memory now. Without Hessian products, with one
    batch, or while recomputing, keeping changes nothing and ``auto`` keeps them."""
    hess = [s for s in specs if takes_hessian_products(s, dims)]
    if not hess and st.cache_graphs == "auto":
        return True, "gradient graphs kept (one batch or no products: nothing to choose)"
    P = problem.num_params
    most = max((_device_rows(vectors_kept(s, dims)[0], P, st) for s in hess), default=0)
    return keeps_graphs(problem, st, most)


def keeps_graphs(problem, st: Settings, vectors: int = 0) -> tuple[bool, str]:
    """(keep, why): `graph_choice` for products beside ``vectors`` P-vectors of the measures'
    (the dry-run, before any measure: none)."""
    if st.cache_graphs != "auto":
        return st.cache_graphs == "true", f"runtime.cache_graphs: {st.cache_graphs}"
    if len(problem.batches) <= 1 or st.recompute == "true":
        return True, "gradient graphs kept (one batch or no products: nothing to choose)"
    free = free_bytes(st.device)
    if free is None:
        return True, "gradient graphs kept (free memory unknown)"
    count = product_bytes(problem, st, keep=True)
    need = count.total + vectors * problem.num_params * _element(st)
    keep = need <= GRAPH_FRACTION * free
    return keep, (
        f"gradient graphs {'kept' if keep else 'not kept'}: predicted peak with them "
        f"{_gib(need)} ({len(problem.batches)} batches of {_gib(count.saved)}), "
        f"{'within' if keep else 'above'} {GRAPH_FRACTION:.0%} of {_gib(free)} free "
        "(runtime.cache_graphs: auto)"
    )


def _rss_bytes(field: str) -> int | None:
    """VmRSS/VmHWM of this process from /proc (Linux), None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ≥ 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_peak(fn, device: torch.device) -> tuple[int, str]:
    """(bytes, how) the call ``fn()`` took above what was in use before it.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the
    allocated memory before. CPU on Linux: the peak resident set (VmHWM) after resetting it through
    /proc/self/clear_refs, minus the resident set (VmRSS) before: repeatable, unlike the
    process-lifetime ``ru_maxrss``, which is the fallback elsewhere (then 0 when the call stays
    below an earlier peak). Garbage is collected first: memory that a collection during the call
    returned would otherwise hide the call's own (the peak would not rise above the start)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(
            int(torch.cuda.max_memory_allocated(device) - base), 0
        ), "torch.cuda.max_memory_allocated"
    before = _rss_bytes("VmRSS")
    if before is not None and _reset_peak():
        fn()
        return max(
            (_rss_bytes("VmHWM") or before) - before, 0
        ), "peak RSS (VmHWM reset via /proc/self/clear_refs)"
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start, 0
    ) * 1024, "ru_maxrss increase"


def resident_bytes(device: torch.device) -> int:
    """Bytes in use now: CUDA's allocated memory, else this process's resident set (0 unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _rss_bytes("VmRSS") or 0


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``; nothing elsewhere), so that
    a peak measured next is not hidden by memory the allocator kept."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
