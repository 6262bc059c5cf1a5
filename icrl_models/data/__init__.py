"""Learning-history datasets: the container, one-file storage, training windows, generation.

* :class:`LearningHistories`: ``H`` histories of states, actions, rewards, episode ends, tasks.
* :func:`save_histories` / :func:`load_histories`: atomic writes; validated, memory-mapped loads.
* :func:`export_histories` / :func:`import_histories`: the same data as ``.npz`` or HDF5, for other tools.
* :class:`HistoryWindows`: a torch ``Dataset`` of training windows with episode subsampling.
* :class:`GenerateConfig` / :func:`generate_histories`: what ``icrl-data generate`` runs.
"""

from .histories import FORMAT_VERSION, DatasetError, LearningHistories
from .interop import MissingDependencyError, export_histories, import_histories
from .storage import load_histories, read_header, save_histories
from .windows import NO_ACTION, HistoryWindows, local_action_batch, local_action_indices

_GENERATE_NAMES = ("ENV_NAMES", "GenerateConfig", "build_env", "generate_histories")


def __getattr__(name: str):
    # Generation imports the generators, which import this package's containers: resolve it lazily.
    if name in _GENERATE_NAMES:
        from . import generate

        return getattr(generate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENV_NAMES",
    "FORMAT_VERSION",
    "NO_ACTION",
    "DatasetError",
    "GenerateConfig",
    "HistoryWindows",
    "LearningHistories",
    "MissingDependencyError",
    "build_env",
    "export_histories",
    "generate_histories",
    "import_histories",
    "load_histories",
    "local_action_batch",
    "local_action_indices",
    "read_header",
    "save_histories",
]
