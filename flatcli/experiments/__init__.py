"""Reproductions of the seed papers' experiments, scaled to a 2-core CPU.

One command per experiment::

    flatcli experiments list
    flatcli experiments run NAME [--quick] [-o OUTDIR] [--jobs N] [--study S] [--publish DIR] [--device D]

(``python -m flatcli.experiments NAME ...`` is an alias of ``flatcli experiments run NAME ...``.)
Each experiment is a spec (``flatcli/experiments/specs/NAME.yaml``: studies, grids, training,
the flatcli measure catalogue, the papers' numbers) run by `run_experiment`: train every model
to the same training-loss target with `flatcli.training` (the demo's training module), write a
manifest and a flatcli config, then measure and correlate through `flatcli.api` (``sweep`` →
``collect`` → ``correlate``), as a user would.

* ``ns_regularization``: normalized sharpness vs. Hessian trace and Frobenius norm under weight
  decay, batch size and learning rate (Tsuzuku et al. 2020, Sec. 8.2, Tables 1–2).
* ``random_labels``: every measure against the random-label fraction and the gap (Tsuzuku et
  al. 2020, Sec. 8.1, Fig. 1).
* ``relative_flatness``: relative flatness against the other measures on LeNet-like CNNs
  (Petzka et al. 2021, Sec. 6, Fig. 5).
* ``reparameterization``: each measure's relative change under function-preserving layer- and
  node-wise rescalings (Dinh et al. 2017).
* ``modular_addition``: a one-block transformer on a + b mod 59 over training fraction × weight
  decay, every measure against the gap (Power et al. 2022's grokking task).
* ``cifar10_resnet18``: experiments 1 and 3 for a CIFAR-10 ResNet-18 (needs CIFAR-10 on disk;
  meant for a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..run.settings import resolve_device
from ..training import default_jobs as cores
from .base import Experiment
from .modular_addition import ModularAddition
from .random_labels import RandomLabels
from .reparameterization import Reparameterization
from .report import ExperimentReport, publish
from .spec import Spec, available, load_spec

__all__ = [
    "run_experiment", "list_experiments", "load_spec", "available", "publish", "Experiment", "ExperimentReport",
    "ExperimentInfo", "Spec",
]  # fmt: skip

RUNNERS: dict[str, type[Experiment]] = {
    "random_labels": RandomLabels,
    "reparameterization": Reparameterization,
    "modular_addition": ModularAddition,
}


@dataclass(frozen=True)
class ExperimentInfo:
    """A shipped experiment: its name, title, reference and studies with their model counts."""

    name: str
    title: str
    reference: str
    studies: tuple[tuple[str, int], ...]  # (study, number of models of the full grid)


def list_experiments() -> list[ExperimentInfo]:
    """The shipped experiments (``flatcli experiments list``)."""
    out = []
    for n in available():
        s = load_spec(n)
        out.append(
            ExperimentInfo(
                n, s.title, s.reference, tuple((st.name, len(st.points())) for st in s.studies)
            )
        )
    return out


def default_outdir(name: str | Path, quick: bool = False) -> Path:
    """``experiments-out/NAME`` (``NAME-quick`` with ``quick``); a spec file's stem names it."""
    stem = Path(name).stem if Path(name).suffix in (".yaml", ".yml") else str(name)
    return Path("experiments-out") / (f"{stem}-quick" if quick else stem)


def default_jobs(quick: bool) -> int:
    """Models trained (and sweep workers) in parallel: 1 with --quick, else the cores up to 2."""
    return 1 if quick else cores()


def run_experiment(
    name: str | Path,
    outdir: str | Path | None = None,
    *,
    quick: bool = False,
    jobs: int | None = None,
    studies: list[str] | None = None,
    plots: bool = True,
    device: str | None = None,
    log=print,
) -> ExperimentReport:
    """Run one experiment (a shipped name or a spec file) into ``outdir``; see the module docs.

    ``jobs`` models train (and sweep workers measure) in parallel, each in one thread, so the
    numbers do not depend on it (default `default_jobs`). Rerunning reuses the trained models
    and finished sweep units. ``plots`` draws the figures (when matplotlib is installed);
    ``device`` (auto, cpu, cuda:N) overrides the spec's training and measurement device.
    """
    if jobs is not None and jobs < 1:
        raise ConfigError(f"jobs must be ≥ 1. Got {jobs} instead.")
    if device is not None:
        resolve_device(device, "`device`")  # a one-line error before any training
    spec = load_spec(name, quick=quick)
    runner = RUNNERS.get(spec.name, Experiment)
    out = Path(outdir) if outdir is not None else default_outdir(name, quick)
    jobs = default_jobs(quick) if jobs is None else jobs
    return runner(spec, out, jobs=jobs, log=log, plots=plots, device=device).run(studies)
