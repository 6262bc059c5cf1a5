"""Incremental (one position at a time) n-gram attention for in-context rollouts.

Each batch row keeps a table of the distinct n-grams seen as keys so far, in insertion order, with
their running sum of values and count. A step first answers the new query (its n-gram ends at the new
position ``i``) from keys ``j <= i - 1``, then inserts the key ``j = i`` (n-gram ending at ``i - 1``,
value ``h[i]``): that order is exactly the strict ``j < i`` of the full op.

**No host sync, exact by construction.** A lookup compares the n-gram with every occupied table entry
at once (one ``[B, K, n]`` comparison, ``K`` = entries in use) and takes the matching entry; a new key
goes to the row's next free entry. There is no hashing, so no probe sequence whose length depends on
the data: a step is a fixed sequence of vectorised ops and never branches on a tensor value (the
former open-addressing table looped ``while pending.any()``, one host read per probe round). ``K`` is a
host-side bound (positions stepped since the last full :meth:`NGramDecodeState.reset`, at most
``max_len``), so a step costs ``O(B * (D + n * K))`` element operations: ``B = 16, n = 2, K = 4096`` is
131k integer compares, a few microseconds on a GPU, against the several host round trips of the probe
loop. The ``max_len`` overflow check goes through ``check_values`` (an asynchronous device assert on
CUDA) and runs only once the host-side bound reaches ``max_len``.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_device,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    check_values,
    row_mask,
)


class NGramDecodeState:
    """Per-sequence state for stepping n-gram attention one position at a time.

    ``state.step(h_t, ids_t)`` returns the n-gram attention output for the new position; over a whole
    sequence the outputs equal ``ngram_attention(h, ids, n)`` row by row. Each step is a fixed sequence of
    vectorised ops with no host sync; it costs ``O(B * (D + n * K))``, ``K`` = positions since the last
    full reset (see the module docstring).

    Args:
        batch_size: number of sequences ``B`` stepped together.
        dim: feature width ``D`` of ``h``.
        n: n-gram length, ``n >= 1``; ``n > max_len`` makes every output zero (no n-gram fits), at a
            cost independent of ``n``.
        max_len: the most positions a sequence will take (sizes the tables; more raises ``ValueError``
            on CPU, a device assert on CUDA).
        device, dtype: where the tables live (a ``torch.device``, a name such as ``"cuda:1"``, or an index;
            it must exist here) and the dtype of the returned outputs. Sums are fp32 (fp64 when ``dtype``
            is fp64).
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
        # n > max_len: no n-gram ever fits, every output is zero. The tables then keep 1-grams (never
        # read), so memory and time stay independent of n.
        self._never_matches = self.n > self.max_len
        width = 1 if self._never_matches else self.n
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.dtype = dtype
        self.device = check_device(device) if device is not None else torch.device("cpu")
        # One entry per distinct key: a row inserts at most one key per step, so max_len entries suffice.
        self.capacity = self.max_len
        sum_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        B, C = self.batch_size, self.capacity
        self._rows = torch.arange(B, device=self.device)
        self.table_keys = torch.zeros(B, C, width, dtype=torch.int64, device=self.device)
        self.table_used = torch.zeros(B, C, dtype=torch.bool, device=self.device)
        self.table_sum = torch.zeros(B, C, self.dim, dtype=sum_dtype, device=self.device)
        self.table_count = torch.zeros(B, C, dtype=torch.int64, device=self.device)
        self.num_keys = torch.zeros(B, dtype=torch.int64, device=self.device)
        self.window = torch.full((B, width), -1, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(B, dtype=torch.int64, device=self.device)
        # Host-side upper bound of every row's length (and so of its number of keys): steps since the
        # last full reset. A partial reset cannot lower it without reading which rows it cleared.
        self._length_bound = 0

    def reset(self, rows: torch.Tensor | list[int] | None = None) -> None:
        """Forget the context of the given rows, or of every row (``None``).

        Args:
            rows: a bool mask ``[B]``, or row indices in ``[0, B)`` (a 1-D integer tensor or a list of ints).

        Raises:
            TypeError/ValueError naming ``rows``: another type or dtype, a mask of another length, indices
            out of range (a value check: an asynchronous device assert on CUDA, no host read).
        """
        if rows is None:
            mask = torch.ones(self.batch_size, dtype=torch.bool, device=self.device)
            self._length_bound = 0
        else:
            mask = row_mask(rows, "rows", self.batch_size, self.device)
        self.table_used.masked_fill_(mask.unsqueeze(1), False)
        self.table_sum.masked_fill_(mask.view(-1, 1, 1), 0)
        self.table_count.masked_fill_(mask.unsqueeze(1), 0)
        self.num_keys.masked_fill_(mask, 0)
        self.window.masked_fill_(mask.unsqueeze(1), -1)
        self.length.masked_fill_(mask, 0)

    def _find(self, grams: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry of ``grams [B, n]`` in each row's table and whether it is there (only where ``active``)."""
        entries = min(self._length_bound, self.capacity)  # no row has more keys than that
        if entries == 0:
            return torch.zeros_like(self._rows), torch.zeros_like(active)
        same = self.table_used[:, :entries] & (self.table_keys[:, :entries] == grams.unsqueeze(1)).all(dim=2)
        # Keys are unique within a row: at most one entry matches.
        return same.to(torch.uint8).argmax(dim=1), active & same.any(dim=1)

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
        if self._length_bound >= self.max_len:  # some row may be full: check on the device
            check_values(
                self.length.max() >= self.max_len,
                f"more than max_len={self.max_len} positions; create the state with a larger max_len",
            )

        if self._never_matches:
            self.length += 1
            self._length_bound += 1
            return torch.zeros(self.batch_size, self.dim, dtype=self.dtype, device=self.device)

        previous_gram = self.window
        gram = torch.cat([self.window[:, 1:], ids_t.long().unsqueeze(1)], dim=1)

        query_ok = (gram >= 0).all(dim=1)
        entry, found = self._find(gram, query_ok)
        count = torch.where(found, self.table_count[self._rows, entry], 0)
        total = self.table_sum[self._rows, entry]
        out = torch.where((count > 0).unsqueeze(1), total / count.clamp(min=1).unsqueeze(1).to(total.dtype), 0.0)

        # Insert the key j = i in every row at once; rows without a valid key rewrite their entry unchanged.
        key_ok = (previous_gram >= 0).all(dim=1)
        entry, found = self._find(previous_gram, key_ok)
        # A new key takes the next free entry (clamped: an overflowing row is reported by the check above).
        entry = torch.where(found, entry, self.num_keys.clamp(max=self.capacity - 1))
        ok = key_ok.unsqueeze(1)
        self.table_keys[self._rows, entry] = torch.where(ok, previous_gram, self.table_keys[self._rows, entry])
        self.table_used[self._rows, entry] |= key_ok
        self.table_sum[self._rows, entry] += torch.where(ok, h_t.to(self.table_sum.dtype), 0)
        self.table_count[self._rows, entry] += key_ok.long()
        self.num_keys += (key_ok & ~found).long()

        self.window = gram
        self.length += 1
        self._length_bound += 1
        return out.to(self.dtype)


#: The tensors of a :class:`NGramDecodeState` (one row per sequence); its other attributes are host-side sizes.
_STATE_TENSORS = ("_rows", "table_keys", "table_used", "table_sum", "table_count", "num_keys", "window", "length")


def _flatten_state(state: NGramDecodeState) -> tuple[list[torch.Tensor], tuple]:
    return [getattr(state, name) for name in _STATE_TENSORS], tuple(
        (name, value) for name, value in vars(state).items() if name not in _STATE_TENSORS
    )


def _unflatten_state(tensors, context: tuple) -> NGramDecodeState:
    state = NGramDecodeState.__new__(NGramDecodeState)
    state.__dict__.update(context)
    state.__dict__.update(zip(_STATE_TENSORS, tensors))
    return state


# A pytree: torch.func.vmap takes a state of many models' decoders (every tensor with a leading model dimension,
# icrl_models.batched) as it is and returns the updated one.
pytree.register_pytree_node(NGramDecodeState, _flatten_state, _unflatten_state)
