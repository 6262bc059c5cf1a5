"""Incremental (one position at a time) n-gram attention for in-context rollouts.

Each batch row keeps an open-addressing hash table from n-gram to (running sum of values, count),
stored in tensors so one step is a handful of vectorised ops whatever the context length. A step
first answers the new query (its n-gram ends at the new position ``i``) from keys ``j <= i - 1``,
then inserts the key ``j = i`` (n-gram ending at ``i - 1``, value ``h[i]``): that order is exactly the
strict ``j < i`` of the full op.
"""

from __future__ import annotations

import torch

from .._validation import FLOAT_DTYPES, INT_DTYPES, check_int, check_same_device, check_shape, check_tensor

# Odd 63-bit multipliers for hashing the n ids of an n-gram (fixed: the table must be deterministic).
_HASH_SEED = 0x9E3779B97F4A7C15 & ((1 << 63) - 1)


def _hash_multipliers(n: int, device: torch.device) -> torch.Tensor:
    values, state = [], _HASH_SEED
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) & ((1 << 63) - 1)
        values.append(state | 1)
    return torch.tensor(values, dtype=torch.int64, device=device)


class NGramDecodeState:
    """Per-sequence state for stepping n-gram attention one position at a time.

    ``state.step(h_t, ids_t)`` returns the n-gram attention output for the new position; over a whole
    sequence the outputs equal ``ngram_attention(h, ids, n)`` row by row. Each step costs O(B * D)
    work (expected O(1) hash probes), independent of how many positions came before.

    Args:
        batch_size: number of sequences ``B`` stepped together.
        dim: feature width ``D`` of ``h``.
        n: n-gram length, ``n >= 1``.
        max_len: the most positions a sequence will take (sizes the tables; more raises).
        device, dtype: where the tables live and the dtype of the returned outputs. Sums are fp32
            (fp64 when ``dtype`` is fp64).
    """

    def __init__(
        self,
        batch_size: int,
        dim: int,
        n: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.batch_size = check_int(batch_size, "batch_size", min_value=1)
        self.dim = check_int(dim, "dim", min_value=1)
        self.n = check_int(n, "n", min_value=1)
        self.max_len = check_int(max_len, "max_len", min_value=1)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.capacity = 1 << max(4, (2 * self.max_len - 1).bit_length())
        sum_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        B, C = self.batch_size, self.capacity
        self._multipliers = _hash_multipliers(self.n, self.device)
        self._rows = torch.arange(B, device=self.device)
        self.table_keys = torch.zeros(B, C, self.n, dtype=torch.int64, device=self.device)
        self.table_used = torch.zeros(B, C, dtype=torch.bool, device=self.device)
        self.table_sum = torch.zeros(B, C, self.dim, dtype=sum_dtype, device=self.device)
        self.table_count = torch.zeros(B, C, dtype=torch.int64, device=self.device)
        self.window = torch.full((B, self.n), -1, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(B, dtype=torch.int64, device=self.device)

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Forget the context of the given rows (bool mask ``[B]`` or indices), or of every row."""
        if rows is None:
            rows = torch.ones(self.batch_size, dtype=torch.bool, device=self.device)
        self.table_used[rows] = False
        self.table_sum[rows] = 0
        self.table_count[rows] = 0
        self.window[rows] = -1
        self.length[rows] = 0

    def _find_slots(self, grams: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear probing for ``grams [B, n]``: each row's slot and whether it already holds the n-gram."""
        hashed = (grams * self._multipliers).sum(dim=1)
        hashed = hashed ^ (hashed >> 31)
        slot = hashed & (self.capacity - 1)
        found = torch.zeros_like(active)
        pending = active.clone()
        for _ in range(self.capacity):
            used = self.table_used[self._rows, slot]
            same = used & (self.table_keys[self._rows, slot] == grams).all(dim=1)
            found |= pending & same
            pending &= used & ~same
            if not bool(pending.any()):
                break
            slot = torch.where(pending, (slot + 1) & (self.capacity - 1), slot)
        return slot, found

    @torch.no_grad()
    def step(self, h_t: torch.Tensor, ids_t: torch.Tensor) -> torch.Tensor:
        """Append one position to every row and return its n-gram attention output.

        Args:
            h_t: ``[B, D]`` hidden state of the new position.
            ids_t: ``[B]`` integer token id of the new position (negative = padding).

        Returns:
            ``[B, D]`` in the state's dtype: mean of ``h[j]`` over earlier keys ``j < i`` whose n-gram
            (ending at ``j - 1``) equals the n-gram ending at the new position ``i``; zero if none.
        """
        check_tensor(h_t, "h_t", ndim=2, dtypes=FLOAT_DTYPES)
        check_tensor(ids_t, "ids_t", ndim=1, dtypes=INT_DTYPES)
        check_shape(h_t, "h_t", (self.batch_size, self.dim), "(batch_size, dim)")
        check_shape(ids_t, "ids_t", (self.batch_size,), "(batch_size,)")
        check_same_device(h_t=h_t, ids_t=ids_t)
        if h_t.device != self.device:
            raise ValueError(f"h_t is on {h_t.device} but the state lives on {self.device}")
        if int(self.length.max()) >= self.max_len:
            raise ValueError(f"more than max_len={self.max_len} positions; create the state with a larger max_len")

        previous_gram = self.window
        gram = torch.cat([self.window[:, 1:], ids_t.long().unsqueeze(1)], dim=1)

        query_ok = (gram >= 0).all(dim=1)
        slot, found = self._find_slots(gram, query_ok)
        count = torch.where(found, self.table_count[self._rows, slot], 0)
        total = self.table_sum[self._rows, slot]
        out = torch.where((count > 0).unsqueeze(1), total / count.clamp(min=1).unsqueeze(1).to(total.dtype), 0.0)

        key_ok = (previous_gram >= 0).all(dim=1)
        slot, found = self._find_slots(previous_gram, key_ok)
        rows, slot = self._rows[key_ok], slot[key_ok]
        self.table_keys[rows, slot] = previous_gram[key_ok]
        self.table_used[rows, slot] = True
        self.table_sum[rows, slot] += h_t[key_ok].to(self.table_sum.dtype)
        self.table_count[rows, slot] += 1

        self.window = gram
        self.length += 1
        return out.to(self.dtype)
