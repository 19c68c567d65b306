"""Reproductions of the seed papers' experiments, scaled to a 2-core CPU (issue 11).

One command per experiment::

    python -m flatcli.experiments NAME [--quick] [-o OUTDIR] [--jobs N] [--study S] [--publish DIR]
    python -m flatcli.experiments list

Each experiment is a spec (``flatcli/experiments/specs/NAME.yaml``: studies, grids, training,
the flatcli measure catalogue, the papers' numbers) run by `run_experiment`: train every model
to the same training-loss target, write a manifest and a flatcli config, then measure and
correlate through `flatcli.api` (``sweep`` → ``collect`` → ``correlate``), as a user would.

* ``ns_regularization``: normalized sharpness vs. Hessian trace and Frobenius norm under weight
  decay, batch size and learning rate (Tsuzuku et al. 2020, Sec. 8.2, Tables 1–2).
* ``random_labels``: every measure against the random-label fraction and the gap (Tsuzuku et
  al. 2020, Sec. 8.1, Fig. 1).
* ``relative_flatness``: relative flatness against the other measures on LeNet-like CNNs
  (Petzka et al. 2021, Sec. 6, Fig. 5).
* ``reparameterization``: each measure's relative change under function-preserving layer- and
  node-wise rescalings (Dinh et al. 2017).
* ``cifar10_resnet18``: experiments 1 and 3 for a CIFAR-10 ResNet-18 (needs CIFAR-10 on disk;
  meant for a GPU).
"""

from __future__ import annotations

from pathlib import Path

from .pipeline import Experiment, ExperimentReport, publish
from .random_labels import RandomLabels
from .reparameterization import Reparameterization
from .spec import Spec, available, load_spec

__all__ = ["run_experiment", "load_spec", "available", "publish", "Experiment", "ExperimentReport", "Spec"]

RUNNERS: dict[str, type[Experiment]] = {
    "random_labels": RandomLabels,
    "reparameterization": Reparameterization,
}


def default_outdir(name: str, quick: bool = False) -> Path:
    return Path("experiments-out") / (f"{name}-quick" if quick else name)


def run_experiment(
    name: str | Path,
    outdir: str | Path | None = None,
    *,
    quick: bool = False,
    jobs: int = 1,
    studies: list[str] | None = None,
    plots: bool = True,
    log=print,
) -> ExperimentReport:
    """Run one experiment (a shipped name or a spec file) into ``outdir``; see the module docs.

    ``jobs`` models train (and sweep workers measure) in parallel, each in one thread, so the
    numbers do not depend on it. Rerunning reuses the trained models and finished sweep units.
    ``plots`` draws the figures (when matplotlib is installed).
    """
    spec = load_spec(name, quick=quick)
    runner = RUNNERS.get(spec.name, Experiment)
    out = Path(outdir) if outdir is not None else default_outdir(spec.name, quick)
    return runner(spec, out, jobs=jobs, log=log, plots=plots).run(studies)
