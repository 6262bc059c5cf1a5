"""icrl-models: environments, learning-history generators, reference ICRL models, training and analysis.

Built on the layers of :mod:`icrl_kernels`. The commands: README.md and docs/ (training.md, data.md, experiments.md).
"""

__version__ = "0.1.0"
