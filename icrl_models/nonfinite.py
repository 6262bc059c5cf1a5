"""Non-finite losses and gradient norms in training: watched on the device, reported in one line, never saved.

A diverging run (a learning rate far too high, an overflow) turns its loss or gradient norm into ``inf`` or
NaN, then every parameter. Left alone it keeps training, writes checkpoints full of NaN over the good ones
and dies later somewhere unrelated. :class:`NonFiniteGuard` is the one place every trainer of this package
(``icrl-train`` and the commands built on it, ``icrl-looped``, ``icrl-markov``, ``icrl-induction``) handles
that, with one of two policies (:data:`NONFINITE_POLICIES`, the trainers' ``--nonfinite`` flag):

* ``"stop"`` (the default): the first non-finite step is recorded on the device; the next time the trainer
  reads the host anyway (a log point, before every checkpoint save, at the end) :meth:`NonFiniteGuard.check`
  raises :class:`TrainingDiverged`, whose one-line message names the step, the loss and gradient norm, and
  the last good checkpoint. The trainer saves nothing after that step, so the checkpoint stays intact; a
  command prints the line and exits with status 1.
* ``"skip"``: a non-finite step is undone on the device, so the parameters, buffers and optimiser state are
  exactly what they were before it (the learning-rate schedule still moves on); the run goes on and
  :meth:`~NonFiniteGuard.check` reports how many steps it skipped.

Nothing here reads a device value on the host per step: the bookkeeping is a handful of device ops inside
the training step, so a step stays capturable in a CUDA graph (:mod:`icrl_models.cuda_graphs`: pass
:meth:`NonFiniteGuard.state_tensors` as the capture's ``extra_state`` so that its warm-up steps leave no trace).

Use::

    guard = NonFiniteGuard(model, optimizer, policy="stop", step=first_step)
    step = guard.watch(train_step)         # train_step(...) -> loss, or [loss, grad_norm, ...]
    for ...:
        stats = step(batch)                # no host read
        if at_a_log_point:
            guard.check()                  # one host read; raises TrainingDiverged under "stop"
        if at_a_checkpoint:
            guard.check()                  # before the save: never a checkpoint of a diverged model
            save(...)
            guard.saved(path, step)        # the checkpoint the message names
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ._checks import NONFINITE_POLICIES, check_nonfinite_policy
from ._cli import ReportedFailure

#: ``--help`` text of the trainers' ``nonfinite`` field.
NONFINITE_HELP = (
    "a step whose loss or gradient norm is inf or NaN: stop (end the run, one line naming the step, the "
    "checkpoint left intact) or skip (undo the step exactly and go on)"
)


class TrainingDiverged(ReportedFailure):
    """A step's loss or gradient norm was not finite under the ``"stop"`` policy. A command prints the message
    as one line and exits with status 1; a sweep records the run as failed and goes on with the others.

    Attributes: ``step`` (1-based), ``loss``, ``grad_norm``, ``checkpoint`` (path of the last good checkpoint,
    or None) and ``checkpoint_step``.
    """

    def __init__(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        checkpoint: str | None,
        checkpoint_step: int | None,
        run: str | None = None,
    ) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.checkpoint, self.checkpoint_step, self.run = checkpoint, checkpoint_step, run
        if checkpoint is None:
            kept = "no checkpoint had been saved"
        else:
            kept = f"the last good checkpoint, {checkpoint} (step {checkpoint_step}), is intact"
        which = "training" if run is None else f"run {run}"
        super().__init__(
            f"{which} diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped without saving "
            f"({kept}; --nonfinite skip skips such steps instead)"
        )


class NonFiniteGuard:
    """Watches a model's training steps for a non-finite loss or gradient norm, on the device.

    Args:
        model: the model being trained (the parameters and persistent buffers a ``"skip"`` restores; its
            gradients give the gradient norm when a step does not return one).
        optimizer: its optimiser (the state a ``"skip"`` restores). Under ``"skip"`` on CUDA it must be
            ``torch.optim.Adam``/``AdamW``, made capturable here so that its step counters live on the device.
        policy: ``"stop"`` or ``"skip"`` (:data:`NONFINITE_POLICIES`).
        step: the steps already done (a resumed run's checkpoint step): the next watched step is ``step + 1``.
        log: where :meth:`check` reports skipped steps (default: a line on stderr).
        runs: ``K`` for a batch of runs stacked along a leading run dimension (:mod:`icrl_models.batched`): the
            step returns ``[K, 2]`` statistics, each run's first non-finite step is kept apart, and under
            ``"skip"`` only the runs whose step was not finite are undone (every state tensor has the run
            dimension first). ``None``: one run.
        run_names: with ``runs``, how :meth:`check`'s message names each run (default: its index).

    The device state (:meth:`state_tensors`): the steps seen, the first non-finite step (-1: none), its loss
    and gradient norm, and the number of non-finite steps (those skipped, under ``"skip"``); per run with
    ``runs``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        policy: str = "stop",
        step: int = 0,
        log: Callable[[str], None] | None = None,
        runs: int | None = None,
        run_names: Sequence[str] | None = None,
    ) -> None:
        self.policy = check_nonfinite_policy(policy)
        self.model, self.optimizer = model, optimizer
        self.device = next(model.parameters()).device
        self.log = log if log is not None else functools.partial(print, file=sys.stderr)
        if self.policy == "skip" and self.device.type == "cuda" and not getattr(type(optimizer), "graph_capturable", 0):
            from .cuda_graphs import prepare_capturable  # the step counters move to the device: no host read

            prepare_capturable(optimizer)
        self.runs = runs
        self.run_names = list(run_names) if run_names is not None else [str(i) for i in range(runs or 0)]
        shape = () if runs is None else (runs,)
        self.steps = torch.tensor(int(step), dtype=torch.int64, device=self.device)
        self.first_step = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.first_values = torch.zeros(*shape, 2, dtype=torch.float32, device=self.device)  # loss, gradient norm
        self.bad_steps = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.checkpoint: tuple[str, int] | None = None
        self.checkpoints: dict[int, tuple[str, int]] = {}  # per run, with runs
        self._reported_by_run: dict[int, int] = {}
        self._counted: dict[int | None, int] = {}
        self._reported_skips = 0
        self._backups: dict[tuple, torch.Tensor] = {}

    def state_tensors(self) -> list[torch.Tensor]:
        """The guard's device state, updated in place by every watched step (for a capture's ``extra_state``)."""
        return [self.steps, self.first_step, self.first_values, self.bad_steps]

    # -- inside the training step (device ops only) ---------------------------------------------------
    def watch(self, step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``step`` wrapped: :meth:`before_step`, ``step(*args)``, :meth:`after_step` on what it returns, which
        must be the loss (0-d) or a tensor whose last dimension starts with the loss and the gradient norm
        (``[2+]``; ``[K, 2+]`` with ``runs``)."""

        @functools.wraps(step)
        def watched(*args, **kwargs) -> torch.Tensor:
            self.before_step()
            out = step(*args, **kwargs)
            self.after_step(out) if out.dim() == 0 else self.after_step(out[..., 0], out[..., 1])
            return out

        return watched

    def before_step(self) -> None:
        """Under ``"skip"``: copy the parameters, buffers and optimiser state aside (into buffers allocated on
        the first steps, so a captured step writes to fixed addresses). Nothing under ``"stop"``."""
        if self.policy != "skip":
            return
        with torch.no_grad():
            for key, tensor in self._state():
                backup = self._backups.get(key)
                if backup is None or backup.shape != tensor.shape or backup.dtype != tensor.dtype:
                    backup = self._backups[key] = torch.empty_like(tensor)
                backup.copy_(tensor)

    def after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """Record the step (after ``optimizer.step()``); returns the 0-d bool "not finite" of this step.

        ``grad_norm``: the total gradient norm (what ``clip_grad_norm_`` returns); ``None`` computes it from
        the model's gradients. Under ``"skip"`` a non-finite step is undone from :meth:`before_step`'s copy
        (optimiser state that the step created is reset to zeros, Adam's fresh state).
        """
        with torch.no_grad():
            if grad_norm is None:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
            shape = self.first_step.shape  # () or [K]
            values = torch.stack([loss.detach().float().reshape(shape), grad_norm.detach().float().reshape(shape)], -1)
            bad = ~torch.isfinite(values).all(-1)
            self.steps.add_(1)
            first = bad & (self.first_step < 0)
            self.first_step.copy_(torch.where(first, self.steps, self.first_step))
            self.first_values.copy_(torch.where(first[..., None], values, self.first_values))
            self.bad_steps.add_(bad.long())
            if self.policy == "skip":
                for key, tensor in self._state():
                    backup = self._backups.get(key)
                    undo = self._per_run(bad, tensor, key)
                    tensor.copy_(torch.where(undo, backup if backup is not None else 0, tensor))
        return bad

    def _per_run(self, bad: torch.Tensor, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        """``bad`` (``[K]`` with runs) broadcast over ``tensor``, whose first dimension must be the run's."""
        if self.runs is None:
            return bad
        if tensor.dim() == 0 or tensor.shape[0] != self.runs:
            raise ValueError(f"nonfinite skip of {self.runs} runs: state {key} has no leading run dimension")
        return bad.view(-1, *([1] * (tensor.dim() - 1)))

    def _state(self):
        """``(key, tensor)`` of everything a step changes: parameters and persistent buffers, optimiser state."""
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            yield ("model", name), tensor.data
        for param, state in self.optimizer.state.items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield ("optimizer", id(param), name), value

    # -- on the host, where the trainer reads the device anyway ----------------------------------------
    def saved(self, path: str | Path, step: int, run: int | None = None) -> None:
        """Note that the checkpoint ``path`` of ``step`` (of run ``run`` with ``runs``) was written (after
        :meth:`check` passed)."""
        if run is None:
            self.checkpoint = (str(path), int(step))
        else:
            self.checkpoints[run] = (str(path), int(step))

    def check(self) -> int:
        """One host read of the guard's state. Under ``"stop"``: raise :class:`TrainingDiverged` if a watched
        step was not finite (with ``runs``: the run that diverged first, named). Under ``"skip"``: report newly
        skipped steps through ``log``. Returns the number of non-finite steps so far (0 under ``"stop"``, or it
        raises; with ``runs``, summed over the runs)."""
        if self.runs is not None:
            return self._check_runs()
        first_step, loss, grad_norm, bad_steps = torch.stack(
            [self.first_step.double(), *self.first_values.double(), self.bad_steps.double()]
        ).tolist()
        skipped = int(bad_steps)
        self._counted = {None: skipped}
        if skipped == 0:
            return 0
        if self.policy == "stop":
            path, step = self.checkpoint if self.checkpoint is not None else (None, None)
            raise TrainingDiverged(int(first_step), loss, grad_norm, path, step)
        if skipped > self._reported_skips:
            self.log(
                f"icrl: skipped {skipped - self._reported_skips} non-finite step(s), {skipped} in all (the first at "
                f"step {int(first_step)}: loss {loss}, gradient norm {grad_norm})"
            )
            self._reported_skips = skipped
        return skipped

    def skipped(self, run: int | None = None) -> int:
        """The non-finite steps of run ``run`` (None: of the one run) as of the last :meth:`check`; no host read."""
        return self._counted.get(run, 0)

    def _check_runs(self) -> int:
        rows = torch.cat(
            [self.first_step.double()[:, None], self.first_values.double(), self.bad_steps.double()[:, None]], 1
        ).tolist()
        diverged = [(int(first), run) for run, (first, _, _, bad) in enumerate(rows) if bad > 0]
        self._counted = {run: int(row[3]) for run, row in enumerate(rows)}
        if not diverged:
            return 0
        if self.policy == "stop":
            first_step, run = min(diverged)
            path, step = self.checkpoints.get(run, (None, None))
            _, loss, grad_norm, _ = rows[run]
            raise TrainingDiverged(first_step, loss, grad_norm, path, step, run=self.run_names[run])
        for _, run in diverged:
            skipped = int(rows[run][3])
            if skipped > self._reported_by_run.get(run, 0):
                self.log(f"icrl: run {self.run_names[run]}: skipped {skipped - self._reported_by_run.get(run, 0)} "
                         f"non-finite step(s), {skipped} in all (the first at step {int(rows[run][0])})")  # fmt: skip
                self._reported_by_run[run] = skipped
        return sum(int(row[3]) for row in rows)


__all__ = [
    "NONFINITE_HELP",
    "NONFINITE_POLICIES",
    "NonFiniteGuard",
    "TrainingDiverged",
    "check_nonfinite_policy",
]
