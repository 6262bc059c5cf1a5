"""Token ids for n-gram attention over RL trajectories (N-Gram AD matches states or transitions)."""

from __future__ import annotations

import torch

from .._validation import INT_DTYPES, check_choice, check_int, check_same_device, check_tensor, check_values

TOKEN_MODES = ("state", "transition")


def transition_ids(
    states: torch.Tensor,
    actions: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    *,
    num_states: int,
    num_actions: int | None = None,
    num_rewards: int | None = None,
    mode: str = "transition",
) -> torch.Tensor:
    """Map discrete ``(state, action, reward)`` steps to one token id per step.

    ``mode="state"``: ``id = state``. ``mode="transition"``:
    ``id = (state * num_actions + action) * num_rewards + reward``, a bijection onto
    ``[0, num_states * num_actions * num_rewards)``. Which action and reward go with a state is the
    caller's convention (AD tokens pair a state with the previous action and reward).

    Args:
        states: integer tensor of any shape (e.g. ``[B, L]``); negative entries are padding.
        actions, rewards: integer tensors of the same shape (``mode="transition"`` only); rewards must
            already be discrete in ``[0, num_rewards)``.
        num_states, num_actions, num_rewards: sizes of the three discrete spaces.
        mode: ``"state"`` or ``"transition"``.

    Returns:
        int64 ids of ``states.shape``; ``-1`` wherever any input is negative (padding).

    Raises:
        ValueError: shape or device mismatch, missing inputs; ``num_states * num_actions * num_rewards``
            above ``2**63`` (ids would wrap around int64); a value at or above its ``num_*`` (checked
            through ``icrl_kernels._validation.check_values``: a ValueError on CPU, an asynchronous
            device assert on CUDA unless ``set_value_checks("sync")``).
    """
    check_choice(mode, "mode", TOKEN_MODES)
    num_states = check_int(num_states, "num_states", min_value=1)
    check_tensor(states, "states", dtypes=INT_DTYPES)
    parts = [("states", states.long(), num_states)]
    if mode == "transition":
        if actions is None or rewards is None:
            raise ValueError("mode='transition' needs actions and rewards")
        if num_actions is None or num_rewards is None:
            raise ValueError("mode='transition' needs num_actions and num_rewards")
        for name, value, size in (("actions", actions, num_actions), ("rewards", rewards, num_rewards)):
            check_tensor(value, name, dtypes=INT_DTYPES)
            if value.shape != states.shape:
                raise ValueError(
                    f"{name} must have the shape of states {tuple(states.shape)}, got {tuple(value.shape)}"
                )
            check_same_device(states=states, **{name: value})
            parts.append((name, value.long(), check_int(size, f"num_{name}", min_value=1)))
    total = 1
    for _, _, size in parts:
        total *= size
    if total > 2**63:  # the largest id, total - 1, must fit in int64 (else two steps would share an id)
        sizes = ", ".join(f"num_{name}={size}" for name, _, size in parts)
        raise ValueError(
            f"{sizes} give {total} distinct ids, more than int64 holds (2**63); "
            "use fewer states, actions or rewards, or mode='state'"
        )
    padding = torch.zeros(states.shape, dtype=torch.bool, device=states.device)
    ids = torch.zeros(states.shape, dtype=torch.int64, device=states.device)
    for name, value, size in parts:
        # A device-side check (no host sync on GPU; a ValueError on CPU): see check_values.
        check_values(
            (value >= size).any(),
            f"{name} must be < {size} (its num_{name})",
            lambda value=value: f", got max {int(value.max())}",
        )
        padding = padding | (value < 0)  # not in place: under vmap (batched runs) value may carry a run dim
        ids = ids * size + value.clamp(min=0)
    return torch.where(padding, torch.full_like(ids, -1), ids)
