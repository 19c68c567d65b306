r"""Recomputed activations (``runtime.recompute``): per-block activation checkpointing of the
model's forward pass inside every Hessian-vector product.

A reverse-mode Hessian product differentiates the gradient's graph (``create_graph``), which holds
the activations of every layer saved by the forward pass and, again, those the first backward
saves for the second. `checkpointed_blocks` runs each *block* of the model (every element of its
outermost ``nn.ModuleList``\ s: GPT-2's ``transformer.h``, BERT's and ViT's ``encoder.layer``)
under :func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False``: the forward keeps
only each block's inputs, and a block's activations are recomputed when the backward reaches it.

Why exact. The non-reentrant variant records the recomputation with the autograd graph (it
recomputes under ``enable_grad`` during the ``create_graph`` backward), so the second backward
differentiates through the recomputed tensors; PyTorch documents it as supporting higher-order
gradients, which the reentrant variant does not. One trap is specific to
:func:`torch.func.functional_call`, which swaps the functional parameters into the modules only
while the forward runs: a block recomputed later would read the model's own parameters and the
graph would lose its path to θ. So each block's parameters and buffers are read when it is called
(they are then the functional ones) and passed to the checkpointed function as *inputs*, which
rebinds them with ``functional_call`` when it runs, first time and recomputation alike.
tests/engine/test_recompute.py checks the products against those without recomputation on tiny GPT-2 and
BERT models in float64 (to rounding), and against a dense Hessian built row by row.

What it saves, and what it does not: the forward's saved activations of the whole model are
replaced by one block's plus the blocks' inputs; the graph the ``create_graph`` backward builds
still holds what *it* saves (the double backward needs those tensors), and per-batch gradient graphs
are no longer cached across products (`flatcli.engine.graphs`; the engine turns caching off). The
recomputed activations are kept alive by the first backward's graph until the second backward, and
the second backward recomputes each block once more (the checkpointed function runs three times per
block and gradient graph). Measured (docs/benchmarks/data/large.json, benchmarks/bench_large.py, GPT-2 shapes on
CPU): the same values; peak memory 0-3% lower over a whole λmax + trace run at 2M and 10M parameters
(18% for one product at 2M); 1.1-2× the time per product.

Products that keep no gradient graph: `torch.autograd.forward_ad` dual tensors through this
checkpointed forward and one plain backward did not lower the peak (tangents
double every saved tensor and the backward still held every block's). What does is to take the
product *block by block* (`flatcli.engine.segments`: a JVP of each block's forward, then a JVP of
each block's VJP from the last, keeping only the boundary tensors), so ``runtime.recompute: true``
runs that on a model whose blocks form a chain (GPT-2, BERT, ViT: checked on the first batch), and
this checkpointed double backward on the others (the reason is kept in
``ProductContext.chain_reason``). Measured in docs/benchmarks/data/hvp_memory-blocks.json.

Models without a ``ModuleList`` of blocks are run as they are (`find_blocks` returns nothing).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ..validation import RECOMPUTE as RECOMPUTE  # re-exported: the vocabulary is declared there
from ..validation import validate
from .graphs import saved_bytes_counter
from .lmhead import CHUNK_ELEMENTS

_state = threading.local()


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ``nn.ModuleList``\\ s of ``model`` with parameters (lists nested
    inside an element are left to it)."""
    blocks: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(b for b in child if any(True for _ in b.parameters()))
            else:
                walk(child)

    walk(model)
    return blocks


def _checkpointed_forward(block: nn.Module, original):
    """``block.forward`` replaced by a checkpointed call that passes the block's current tensors
    (the functional parameters while ``functional_call`` runs) as inputs."""

    def forward(*args, **kwargs):
        if getattr(_state, "inside", False) or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        args, kwargs = _without_cache(args, kwargs)
        names = [n for n, _ in block.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in block.named_buffers(remove_duplicate=False)]
        tensors = [
            *(t for _, t in block.named_parameters(remove_duplicate=False)),
            *(t for _, t in block.named_buffers(remove_duplicate=False)),
        ]
        n = len(names)

        def run(*flat):
            _state.inside = True
            try:
                return functional_call(
                    block,
                    dict(zip(names, flat[:n], strict=True)),
                    flat[n:],
                    kwargs,
                    tie_weights=False,
                    strict=False,
                )
            finally:
                _state.inside = False

        return checkpoint(run, *tensors, *args, use_reentrant=False, preserve_rng_state=False)

    return forward


def _is_cache(x) -> bool:
    """A Hugging Face key/value cache (duck-typed: ``transformers.Cache`` has these methods)."""
    return hasattr(x, "get_seq_length") and hasattr(x, "update")


def _without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's arguments with any key/value cache replaced by None and ``use_cache`` off: a
    recomputed block would append its keys and values to the cache a second time (as Hugging Face's
    own gradient checkpointing does, which passes no cache to checkpointed layers)."""
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


@contextlib.contextmanager
def checkpointed_blocks(blocks: list[nn.Module]):
    """Run ``blocks`` with activation checkpointing inside the context (their ``forward`` is
    restored on exit; recomputation later, in backward, needs no patch)."""
    saved = []
    try:
        for b in blocks:
            had = "forward" in b.__dict__
            saved.append((b, had, b.__dict__.get("forward")))
            b.forward = _checkpointed_forward(b, b.forward)
        yield
    finally:
        for b, had, f in reversed(saved):
            if had:
                b.forward = f
            else:
                del b.forward


def parse_recompute(value) -> str:
    """``runtime.recompute`` as one of "auto", "true", "false" (YAML booleans accepted)."""
    value = validate("recompute", value, error=ValueError)  # the one rule (flatcli.validation)
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: CUDA's free bytes, else the host's ``MemAvailable`` (Linux; None
    where it cannot be read)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except RuntimeError:
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


AUTO_RECOMPUTE = 0.8  # runtime.recompute: auto turns on when one product needs more than this share of free memory

PRODUCT_VECTORS = (
    5  # P-vectors of one product: the gradient, vector, product, backward's flat copies
)

HEAD_CHUNK_TENSORS = (
    8  # chunk-sized tensors alive at once in the fused head's Hessian product (lmhead)
)


def _count_saved(problem, batch) -> int:
    """Bytes of the distinct storages saved by one ``create_graph`` gradient over ``batch``."""
    t = problem.theta.detach().requires_grad_(True)
    hooks, total = saved_bytes_counter()
    with hooks:
        s = problem.batch_loss_sum(problem.unflatten(t), batch)
        if s.requires_grad:
            (g,) = torch.autograd.grad(s, t, create_graph=True)
            del g
    del s, t
    return int(total[0])


def saved_bytes(problem, batch) -> int:
    """``S``, the bytes a ``create_graph`` gradient over ``batch`` saves, counted on micro-batches
    of one and two rows and extrapolated to the batch's rows (the saved tensors of a row do not
    depend on the others): ``S(1) + (rows − 1)·(S(2) − S(1))``. The graph of the whole batch is
    never built, so the count costs two small gradients, not the memory it predicts. A batch of
    at most two rows is counted as it is."""
    rows = batch.rows
    if rows <= 2:
        return _count_saved(problem, batch)
    one = _count_saved(problem, batch.select(slice(0, 1)))
    two = _count_saved(problem, batch.select(slice(0, 2)))
    return int(one + (rows - 1) * max(two - one, 0))


def predicted_product_bytes(
    problem, batch, batches: int, device: torch.device, by_blocks: int = 0, saved: int | None = None
) -> tuple[int, int | None]:
    """(predicted peak bytes of one Hessian product, free bytes); ``by_blocks``: the number of
    blocks of a block-by-block product (`flatcli.engine.segments`), 0 for the double backward.

    Both rules start from the distinct storages a gradient with its graph (``create_graph``) over
    the first batch saves in the forward pass and the ``create_graph`` backward (``S = S_f + S_b``,
    `flatcli.engine.graphs.saved_bytes_counter`), counted on micro-batches of one and two rows and
    extrapolated to the batch (`saved_bytes`), P-vectors of ``b`` bytes
    and, with a fused LM head, its chunk workspace ``W`` (`HEAD_CHUNK_TENSORS` chunks of logits,
    `flatcli.engine.lmhead`).

    * Double backward (the rule of ``runtime.recompute: auto``): ``S + 5 P b + W``: the whole
      graph, and five P-vectors (the gradient, the vectors, the products and the backward's flat
      copies; θ is read in place, `flatcli.engine.Problem.theta_flat`, since it stopped being
      copied per product: six before). Measured against the peak resident set of one product in a
      fresh process (benchmarks/bench_hvp_memory.py, GPT-2 shapes, 8 × 128 tokens; docs/benchmarks/data/hvp_memory-schemes.json):
      predicted / measured 1.13 (30M), 1.18 (124M shape), 1.36 (350M shape), 1.13 (10M, bf16).
    * Block by block, L blocks: ``2 S / L + 3 P b + W``: one block's share of the graph, twice
      (activations and their tangents), and three P-vectors (θ, the vector, the product); the
      boundary tensors (2(L+1) of tokens × width) are below the rounding of this rule. Measured
      the same way: 1.23 (2M), 1.20 (10M), 0.99 (30M), 0.88 (124M shape) before θ was read in
      place; since, 1.37 (350M shape) and 1.28 (350M, bf16), 1.18 (10M, bf16): the θ it still counts
      is the margin kept on the side that does not refuse a run that fits too late.

    ``saved``: ``S`` when already counted. The gradient is not counted in ``n_grad`` (it measures,
    it does not compute)."""
    total = [saved_bytes(problem, batch) if saved is None else saved]
    elt = torch.finfo(problem.dtype).bits // 8
    head = 0
    if (
        problem.head is not None
    ):  # logits of one chunk: at most CHUNK_ELEMENTS, at most the batch's tokens
        vocab = dict(problem.model.named_modules())[problem.head].out_features
        head = HEAD_CHUNK_TENSORS * min(CHUNK_ELEMENTS, problem.units(batch) * vocab) * elt
    if by_blocks:
        return int(2 * total[0] / by_blocks + 3 * problem.num_params * elt + head), free_bytes(
            device
        )
    return int(total[0] + PRODUCT_VECTORS * problem.num_params * elt + head), free_bytes(device)
