"""Learning-history datasets: the container, one-file storage, training windows, generation.

* :class:`LearningHistories`: ``H`` histories of states, actions, rewards, episode ends, tasks.
* :func:`save_histories` / :func:`load_histories`: atomic writes; validated, memory-mapped loads.
* :class:`HistoryWindows`: a torch ``Dataset`` of training windows with episode subsampling.
* :class:`GenerateConfig` / :func:`generate_histories`: what ``icrl-data generate`` runs.
"""

from .generate import ENV_NAMES, GenerateConfig, build_env, generate_histories
from .histories import FORMAT_VERSION, DatasetError, LearningHistories
from .storage import load_histories, read_header, save_histories
from .windows import NO_ACTION, HistoryWindows

__all__ = [
    "ENV_NAMES",
    "FORMAT_VERSION",
    "NO_ACTION",
    "DatasetError",
    "GenerateConfig",
    "HistoryWindows",
    "LearningHistories",
    "build_env",
    "generate_histories",
    "load_histories",
    "read_header",
    "save_histories",
]
