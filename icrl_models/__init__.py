"""icrl-models: environments, learning-history generators, reference ICRL models, training and analysis.

Built on the layers of :mod:`icrl_kernels`. See README.md for the commands.
"""

__version__ = "0.1.0"
