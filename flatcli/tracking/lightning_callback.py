"""A PyTorch Lightning ``Callback`` that runs a `flatcli.tracking.Tracker` after every training batch
and logs its rows through the trainer's own loggers (``trainer.loggers``: TensorBoard, CSV, MLflow,
W&B... receive the columns without code for each). Needs ``pip install 'flatcli[lightning]'``;
only this module imports Lightning.

>>> from flatcli.tracking import Tracker
>>> from flatcli.tracking.lightning_callback import CurvatureCallback         # doctest: +SKIP
>>> tracker = Tracker(module, (x, y), "cross_entropy", every=50, out="runs/track")  # doctest: +SKIP
>>> trainer = lightning.Trainer(callbacks=[CurvatureCallback(tracker)])   # doctest: +SKIP
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError(
            "flatcli.tracking.lightning_callback needs PyTorch Lightning: "
            "pip install 'flatcli[lightning]'"
        ) from None

from .track_files import log_columns
from .tracker import Tracker


class CurvatureCallback(Callback):
    """Track curvature during ``trainer.fit``: ``tracker.step(trainer.global_step, optimizer=...)``
    after each training batch; a recorded row goes to every logger of the trainer.

    Parameters
    ----------
    tracker : Tracker
        Built over the LightningModule being trained and a fixed tracking set.
    prefix : str
        Prepended to every logged column (default ``curvature/``).
    """

    def __init__(self, tracker: Tracker, prefix: str = "curvature/"):
        super().__init__()
        self.tracker = tracker
        self.prefix = prefix

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """Evaluate when the tracker's schedule says so and log the row."""
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        row = self.tracker.step(
            int(trainer.global_step), optimizer=optimizer, epoch=int(trainer.current_epoch)
        )
        if row is None:
            return
        labels = [s.label for s in self.tracker.specs]
        metrics = log_columns(row, labels, self.prefix)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=int(trainer.global_step))
