"""The embedded default: a small zoo of MLPs on scikit-learn's bundled digits.

Each model is trained to the same training-loss target (cross-entropy 0.01 on
the full training split, evaluated in eval mode, as Jiang et al. 2020 do) rather
than for a fixed number of steps, so that measures are compared at minima.
The zoo varies width, weight decay and the fraction of randomized training
labels (label noise widens the generalization gap).
"""

from .zoo import ZOO_GRID, run_demo, train_zoo

__all__ = ["run_demo", "train_zoo", "ZOO_GRID"]
