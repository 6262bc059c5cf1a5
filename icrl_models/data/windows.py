"""A torch ``Dataset`` of fixed-length training windows cut from learning histories.

Episode subsampling (the N-gram AD paper's Table 1, after Laskin et al.): with ``episode_subsample=k``
a history is read as ``k`` streams, stream ``o`` holding episodes ``o, o+k, o+2k, ...`` back to back,
so one window spans k times more learning progress. Windows of ``seq_len`` steps start every
``stride`` steps of each stream; a stream shorter than ``seq_len`` gives one window padded at the end
(``mask`` False there).

Nothing is copied per epoch: the dataset keeps the histories (memory-mapped when loaded with
``mmap=True``) and, for ``k > 1``, one int64 index per transition mapping stream positions back to
history steps; :meth:`HistoryWindows.get_batch` gathers a whole batch with one fancy index per array.
"""

from __future__ import annotations

import numpy as np
import torch
from einops import rearrange
from torch.utils.data import Dataset

from icrl_kernels.validation import check_values

from .._checks import is_integer
from .histories import LearningHistories

#: Steps handled at once while indexing subsampled streams (bounds temporary memory).
_BLOCK_ELEMENTS = 1 << 22
#: ``prev_actions`` value of a window's first step when the stream has no earlier step.
NO_ACTION = -1


class HistoryWindows(Dataset):
    """Training windows over :class:`LearningHistories`.

    Args:
        histories: the learning histories.
        seq_len: steps per window.
        episode_subsample: read every ``k``-th episode (see the module docstring); 1 reads them all.
        stride: steps between consecutive window starts in a stream.

    Each item (and :meth:`get_batch`, batched along a leading ``B``) is a dict of tensors:
    ``states`` ``[L]`` int64 (or ``[L, obs_dim]`` float32), ``actions`` ``[L]`` int64, ``rewards``
    ``[L]`` float32, ``prev_actions`` ``[L]`` int64 (the stream's previous action, :data:`NO_ACTION`
    before its first step), ``prev_rewards`` ``[L]`` float32 (0 there), ``episode_start`` ``[L]`` bool,
    ``mask`` ``[L]`` bool (False on padding), ``history`` and ``task_id`` (scalars) and ``action_set``
    ``[A]`` int64 (-1 padded).
    """

    def __init__(self, histories: LearningHistories, seq_len: int, *, episode_subsample: int = 1, stride: int = 1):
        if not isinstance(histories, LearningHistories):
            raise TypeError(f"histories must be LearningHistories, got {type(histories).__name__}")
        for name, value in (("seq_len", seq_len), ("episode_subsample", episode_subsample), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.histories = histories
        self.seq_len, self.subsample, self.stride = int(seq_len), int(episode_subsample), int(stride)
        num_histories, max_length = histories.actions.shape
        lengths = np.asarray(histories.lengths, dtype=np.int64)

        if self.subsample == 1:
            self._positions = None  # stream o=0 of history h is steps 0..lengths[h]-1 of h
            stream_history = np.arange(num_histories)
            stream_start = stream_history * max_length
            stream_length = lengths
        else:
            stream_history, stream_start, stream_length, self._positions = self._subsampled_streams(lengths)
        starts_per_stream = np.maximum(stream_length - self.seq_len, 0) // self.stride + 1
        self._stream_history = stream_history
        self._stream_start = stream_start  # into self._positions, or a flat history index when k == 1
        self._stream_length = stream_length
        self._first_window = np.concatenate([[0], np.cumsum(starts_per_stream)])

    def _subsampled_streams(self, lengths: np.ndarray):
        """Streams (history, offset) as ``(history, start, length)`` slices of one flat array of history
        positions (``history * T + step``), ordered by history, then offset, then step."""
        dones = self.histories.dones
        max_length = dones.shape[1]
        rows_per_block = max(1, _BLOCK_ELEMENTS // max_length)
        histories, lengths_out, chunks = [], [], []
        for first in range(0, dones.shape[0], rows_per_block):
            block = np.asarray(dones[first : first + rows_per_block], dtype=bool)
            valid = np.arange(max_length)[None, :] < lengths[first : first + block.shape[0], None]
            episode = np.cumsum(block, axis=1) - block  # episode index of every step
            flat = np.flatnonzero(valid)  # block-local positions, in history-then-step order
            history = flat // max_length
            stream_key = history * self.subsample + episode.reshape(-1)[flat] % self.subsample
            order = np.argsort(stream_key, kind="stable")
            keys, counts = np.unique(stream_key[order], return_counts=True)
            chunks.append(flat[order] + first * max_length)
            histories.append(keys // self.subsample + first)
            lengths_out.append(counts)
        stream_length = np.concatenate(lengths_out)
        stream_start = np.concatenate([[0], np.cumsum(stream_length)[:-1]])
        return np.concatenate(histories), stream_start, stream_length, np.concatenate(chunks)

    def __len__(self) -> int:
        return int(self._first_window[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not is_integer(index):
            raise TypeError(f"index must be an int, got {type(index).__name__} {index!r}")
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        batch = self.get_batch(np.array([index % len(self)]))
        return {name: value[0] for name, value in batch.items()}

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        """The windows ``indices`` (``[B]`` ints) stacked along a leading batch dimension."""
        if isinstance(indices, torch.Tensor):
            indices = indices.numpy(force=True)
        indices = np.asarray(indices)
        if indices.size == 0 and indices.dtype.kind == "f":
            indices = indices.astype(np.int64)  # an empty list has numpy's default float dtype
        # A float index would be truncated by the int64 conversion (window 2.7 read as window 2).
        if indices.dtype.kind not in "iu":
            raise TypeError(f"indices must hold integers, got dtype {indices.dtype}")
        indices = indices.astype(np.int64, copy=False)
        if indices.ndim != 1 or (indices.size and (indices.min() < 0 or indices.max() >= len(self))):
            raise IndexError(f"indices must be a 1-D array in [0, {len(self)})")
        stream = np.searchsorted(self._first_window, indices, side="right") - 1
        window_start = (indices - self._first_window[stream]) * self.stride
        offsets = window_start[:, None] + np.arange(self.seq_len)[None, :]  # [B, L] positions in the stream
        mask = offsets < self._stream_length[stream, None]
        current = self._flat_positions(stream, np.where(mask, offsets, 0))
        has_previous = mask & (offsets > 0)
        previous = self._flat_positions(stream, np.where(has_previous, offsets - 1, 0))

        h = self.histories
        max_length = h.actions.shape[1]
        rows, cols = np.divmod(current, max_length)
        prev_rows, prev_cols = np.divmod(previous, max_length)
        states = np.asarray(h.states[rows, cols])
        actions = np.where(mask, h.actions[rows, cols], 0).astype(np.int64)
        rewards = np.where(mask, h.rewards[rows, cols], 0.0).astype(np.float32)
        prev_done = np.asarray(h.dones[prev_rows, prev_cols])
        history = self._stream_history[stream]
        batch = {
            "states": torch.from_numpy(states.astype(np.float32 if states.dtype.kind == "f" else np.int64)),
            "actions": torch.from_numpy(actions),
            "rewards": torch.from_numpy(rewards),
            "prev_actions": torch.from_numpy(
                np.where(has_previous, h.actions[prev_rows, prev_cols], NO_ACTION).astype(np.int64)
            ),
            "prev_rewards": torch.from_numpy(
                np.where(has_previous, h.rewards[prev_rows, prev_cols], 0.0).astype(np.float32)
            ),
            "episode_start": torch.from_numpy(mask & ((offsets == 0) | (has_previous & prev_done))),
            "mask": torch.from_numpy(mask),
            "history": torch.from_numpy(history),
            "task_id": torch.from_numpy(np.asarray(h.task_ids)[history].astype(np.int64)),
            "action_set": torch.from_numpy(np.asarray(h.action_sets)[history].astype(np.int64)),
        }
        batch["states"][~batch["mask"]] = 0
        return batch

    def _flat_positions(self, stream: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Flat history positions (``history * T + step``) of stream positions ``offsets`` ([B, L])."""
        flat = self._stream_start[stream, None] + offsets
        return flat if self._positions is None else self._positions[flat]


def local_action_indices(actions: torch.Tensor, action_set: torch.Tensor) -> torch.Tensor:
    """Positions of global action ids in each sequence's action set.

    Args:
        actions: ``[B, ...]`` global ids, :data:`NO_ACTION` allowed (kept as is).
        action_set: ``[B, A]`` global ids, -1 padded.

    Returns:
        ``[B, ...]`` int64 local indices in ``[0, A)``, :data:`NO_ACTION` where ``actions`` was.

    Raises:
        ValueError: an action that is not in its sequence's set (on CUDA an asynchronous device assert:
            the check never waits for the GPU; see :func:`icrl_kernels._validation.check_values`).
    """
    flat = rearrange(actions, "b ... -> b (...)")
    match = (flat[..., None] == action_set[:, None, :]) & (action_set >= 0)[:, None, :]
    missing = (flat != NO_ACTION) & ~match.any(-1)
    check_values(
        missing.any(),
        "actions must be in their sequence's action set",
        lambda: f": {flat[missing][:5].tolist()} are not in it",  # read only once the check has failed
    )
    local = torch.where(flat == NO_ACTION, NO_ACTION, match.to(torch.uint8).argmax(-1))
    return local.reshape(actions.shape)


def local_action_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add ``local_actions``, ``local_prev_actions`` (positions in the window's action set, :data:`NO_ACTION`
    on the window's padding) and ``available`` (``[B, A]`` bool, False on the set's padding) to a
    :meth:`HistoryWindows.get_batch` batch. Models with variable action sets (Headless-AD, and AD's head
    over set positions) train on them.
    """
    action_set = batch["action_set"]
    # Padding positions hold action 0, which need not be in the set (composite Darkroom's sets): no action.
    actions = batch["actions"].masked_fill(~batch["mask"], NO_ACTION)
    return {
        **batch,
        "local_actions": local_action_indices(actions, action_set),
        "local_prev_actions": local_action_indices(batch["prev_actions"], action_set),
        "available": action_set >= 0,
    }
