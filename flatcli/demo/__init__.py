"""The embedded default: a small zoo of MLPs on scikit-learn's bundled digits.

Each model is trained to the same training-loss target (cross-entropy 0.01 on
the full training split, evaluated in eval mode, as Jiang et al. 2020 do) rather
than for a fixed number of steps, so that measures are compared at minima.
The zoo varies width, weight decay and the fraction of randomized training
labels (label noise widens the generalization gap). `train_trajectory` (opt-in)
retrains one of them with its parameters saved every few steps, for
``flatcli landscape pca``.
"""

from .trajectory import train_trajectory
from .zoo import ZOO_GRID, run_demo, train_zoo

__all__ = ["run_demo", "train_trajectory", "train_zoo", "ZOO_GRID"]
