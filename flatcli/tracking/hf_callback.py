"""A Hugging Face ``TrainerCallback`` that runs a `flatcli.tracking.Tracker` after every optimizer
step and logs its rows through ``Trainer.log`` (so every ``report_to`` integration, TensorBoard,
MLflow, W&B..., and ``trainer.state.log_history`` receive the columns). Needs
``pip install 'flatcli[transformers]'``; only this module imports transformers.

>>> from flatcli.tracking import Tracker
>>> from flatcli.tracking.hf_callback import track_trainer                  # doctest: +SKIP
>>> tracker = Tracker(trainer.model, batch, "cross_entropy", every=50)      # doctest: +SKIP
>>> track_trainer(trainer, tracker); trainer.train()                        # doctest: +SKIP
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "flatcli.tracking.hf_callback needs transformers: pip install 'flatcli[transformers]'"
    ) from None

from ..errors import ConfigError
from .track_files import log_columns
from .tracker import Tracker


class CurvatureTrainerCallback(TrainerCallback):
    """Track curvature during ``Trainer.train``: ``tracker.step(state.global_step, optimizer=...)``
    at each step's end; a recorded row is logged with ``trainer.log``.

    Parameters
    ----------
    tracker : Tracker
        Built over the trainer's model and a fixed tracking set.
    prefix : str
        Prepended to every logged column (default ``curvature/``).
    """

    def __init__(self, tracker: Tracker, prefix: str = "curvature/"):
        self.tracker = tracker
        self.prefix = prefix
        self.trainer = None

    def bind(self, trainer) -> None:
        """The trainer whose ``log`` receives the rows (a callback is not given its trainer)."""
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        """Refuse to train unbound: the rows would reach no logger."""
        if self.trainer is None:
            raise ConfigError(
                "the curvature callback is not bound to its trainer: use "
                "flatcli.tracking.hf_callback.track_trainer(trainer, tracker)"
            )

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        """Evaluate when the tracker's schedule says so and log the row."""
        epoch = None if state.epoch is None else int(state.epoch)
        row = self.tracker.step(int(state.global_step), optimizer=optimizer, epoch=epoch)
        if row is not None:
            labels = [s.label for s in self.tracker.specs]
            self.trainer.log(log_columns(row, labels, self.prefix))


def track_trainer(
    trainer, tracker: Tracker, prefix: str = "curvature/"
) -> CurvatureTrainerCallback:
    """Add a `CurvatureTrainerCallback` of ``tracker`` to ``trainer``, bound to it; returns it."""
    cb = CurvatureTrainerCallback(tracker, prefix)
    cb.bind(trainer)
    trainer.add_callback(cb)
    return cb
