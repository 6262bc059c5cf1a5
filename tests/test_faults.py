"""Faults during training and writing: diverging runs, killed processes, full disks and unwritable folders.

* Diverging runs: :class:`~icrl_models.nonfinite.NonFiniteGuard` (exactness of ``"skip"``, the one-line stop,
  the intact checkpoint) and every trainer that uses it (``icrl-train``, ``icrl-looped``, ``icrl-markov``,
  ``icrl-induction``; ``icrl-headless`` and ``icrl-compare`` train through ``icrl-train``), and a sweep that
  carries on past a diverged trial.
* Killed writes: a real ``python -m icrl_models.train`` killed with SIGKILL at random points, a checkpoint
  write among them, resumes to the parameters of an uninterrupted run, bit for bit.
* Full disks and unwritable folders: one line, exit status 2, no file corrupted or left half-written.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import icrl_models.lifecycle as lifecycle
import icrl_models.train as train_module
from icrl_models.checkpoint import load_checkpoint
from icrl_models.data import load_histories
from icrl_models.files import read_json_lines, save_figure, write_json
from icrl_models.nonfinite import NonFiniteGuard, TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]

# =================================================================================================
# NonFiniteGuard
# =================================================================================================


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)) for _ in range(count)]


def _step(model, optimizer, clip: bool = True):
    """A training step returning ``[loss, grad_norm]`` (``clip``) or the loss alone (the guard computes the norm)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if clip else None
        optimizer.step()
        return loss.detach() if grad_norm is None else torch.stack([loss.detach(), grad_norm])

    return step


def _poisoned(batch, where: str):
    """A batch whose step is not finite: a NaN input (loss and gradients NaN) or an infinite target (loss inf)."""
    x, y = batch
    if where == "nan":
        x = x.clone()
        x[0, 0] = float("nan")
        return x, y
    return x, y * float("inf")


def _state(model, optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    return tensors + [v.clone() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("clip", [True, False], ids=["grad-norm-given", "grad-norm-computed"])
@pytest.mark.parametrize("bad_at", [0, 2], ids=["first-step", "third-step"])
@pytest.mark.parametrize("where", ["nan", "inf-target"])
def test_skip_undoes_a_non_finite_step_exactly(clip, bad_at, where):
    """Under ``"skip"`` a run with a non-finite step in it ends with exactly the parameters and optimiser state
    of a run that never took that step (AdamW's weight decay, moments and step counter included; a bad first
    step, before the optimiser has any state, too)."""
    batches = _batches(5)
    runs = {}
    for with_bad in (False, True):
        model, optimizer = _model_and_optimizer()
        guard = NonFiniteGuard(model, optimizer, policy="skip", log=lambda line: None)
        step = guard.watch(_step(model, optimizer, clip))
        schedule = list(batches)
        if with_bad:
            schedule.insert(bad_at, _poisoned(batches[bad_at], where))
        for batch in schedule:
            step(*batch)
        runs[with_bad] = (_state(model, optimizer), guard.check())
    (clean, clean_skipped), (skipped_run, skipped) = runs[False], runs[True]
    assert (clean_skipped, skipped) == (0, 1)
    assert len(clean) == len(skipped_run)
    for want, got in zip(clean, skipped_run):
        assert torch.equal(want, got)


def test_stop_raises_at_the_check_naming_the_first_bad_step_and_the_checkpoint():
    model, optimizer = _model_and_optimizer()
    guard = NonFiniteGuard(model, optimizer, step=10)
    step = guard.watch(_step(model, optimizer))
    for batch in _batches(2):
        step(*batch)
    assert guard.check() == 0
    guard.saved("run/checkpoint.pt", 12)
    batches = _batches(3, seed=2)
    step(*batches[0])
    step(*_poisoned(batches[1], "nan"))  # step 14
    step(*batches[2])  # NaN parameters now: not finite either, but not the first
    with pytest.raises(TrainingDiverged) as info:
        guard.check()
    error = info.value
    assert (error.step, error.checkpoint, error.checkpoint_step) == (14, "run/checkpoint.pt", 12)
    message = str(error)
    assert "\n" not in message
    assert message.startswith("training diverged at step 14: loss nan, gradient norm nan; stopped without saving")
    assert "the last good checkpoint, run/checkpoint.pt (step 12), is intact" in message


def test_guard_reads_nothing_on_the_host_until_checked(monkeypatch):
    """The watched step is device ops only: ``check`` is the one place the guard reads the device (SGD with
    momentum: CPU AdamW reads its own step counter with ``.item()``; ``test_train_cuda_graph`` checks the
    trainers' capturable steps under the guard)."""
    model, _ = _model_and_optimizer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self))
    for policy in ("stop", "skip"):
        guard = NonFiniteGuard(model, optimizer, policy=policy, log=lambda line: None)
        step = guard.watch(_step(model, optimizer, clip=False))
        for batch in _batches(3):
            step(*batch)
        assert reads == [], policy
        guard.check()
        assert reads == ["tolist"], policy
        reads.clear()


def test_nonfinite_policy_is_checked_and_named(tmp_path):
    from icrl_models.experiments.induction_heads import InductionConfig
    from icrl_models.experiments.looped import LoopedExperimentConfig
    from icrl_models.experiments.markov_heads import MarkovConfig
    from icrl_models.train import TrainConfig

    model, optimizer = _model_and_optimizer()
    for make in (
        lambda: NonFiniteGuard(model, optimizer, policy="ignore"),
        lambda: TrainConfig(nonfinite="ignore"),
        lambda: LoopedExperimentConfig(nonfinite="ignore"),
        lambda: MarkovConfig(nonfinite="ignore"),
        lambda: InductionConfig(nonfinite="ignore"),
    ):
        with pytest.raises(ValueError, match=r"nonfinite must be one of \('stop', 'skip'\), got 'ignore'"):
            make()


# =================================================================================================
# the trainers
# =================================================================================================

TINY_TRAIN = [
    "--num-histories", "8", "--source-episodes", "8", "--seq-len", "16", "--d-model", "16", "--num-heads", "2",
    "--num-layers", "1", "--episode-subsample", "2", "--batch-size", "4", "--warmup-steps", "2",
    "--eval-episodes", "1", "--eval-envs-per-task", "1", "--backend", "eager", "--device", "cpu", "--no-progress",
]  # fmt: skip


def _error_lines(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]


def _poison_train_step_at(monkeypatch, module, name: str, at: int) -> list[int]:
    """Make the ``at``-th call (1-based) of ``module.name`` (a training step) end with NaN parameters, as a
    diverging step does: the step after it is not finite either. Returns the call counter."""
    original = getattr(module, name)
    calls = [0]

    def poisoned(model, *args, **kwargs):
        calls[0] += 1
        out = original(model, *args, **kwargs)
        if calls[0] == at:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
            out = out * float("nan")
        return out

    monkeypatch.setattr(module, name, poisoned)
    return calls


def test_icrl_train_issue_example_ends_in_one_line(tmp_path):
    """The issue's example (a learning rate of 1e6, clipping off) in a real process: one line naming the step
    and the values, exit status 1, no evaluation, no checkpoint of NaN written."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "icrl_models.train", "--num-histories", "40", "--steps", "30", "--log-every", "5",
        "--learning-rate", "1e6", "--grad-clip", "1e9", "--out-dir", str(out), *TINY_TRAIN,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr, "icrl-train")
    assert line.startswith("icrl-train: error: training diverged at step ")
    assert "loss " in line and "gradient norm " in line and "no checkpoint had been saved" in line
    assert not (out / "checkpoint.pt").exists() and not (out / "eval.json").exists()
    assert all(np.isfinite(row["loss"]) for row in read_json_lines(out / "metrics.jsonl"))


def test_icrl_train_stop_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """Diverging at step 6 with checkpoints every 4 steps: the run stops at the next check (step 8, before its
    save), naming step 6 and the checkpoint of step 4, which is the one written at step 4, byte for byte."""
    saved = {}
    original_save = lifecycle.save_checkpoint

    def recording_save(payload, path):
        result = original_save(payload, path)
        saved[payload["step"]] = Path(path).read_bytes()
        return result

    monkeypatch.setattr(lifecycle, "save_checkpoint", recording_save)
    _poison_train_step_at(monkeypatch, train_module, "train_step", at=6)
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "12", "--checkpoint-every", "4", "--log-every", "4", "--out-dir", str(out)]
    assert train_module.main(argv) == 1
    (line,) = _error_lines(capsys.readouterr().err, "icrl-train")
    assert line.startswith("icrl-train: error: training diverged at step 6: loss nan, gradient norm nan")
    assert f"the last good checkpoint, {out / 'checkpoint.pt'} (step 4), is intact" in line
    assert list(saved) == [4]
    assert (out / "checkpoint.pt").read_bytes() == saved[4]
    assert [row["step"] for row in read_json_lines(out / "metrics.jsonl")] == [4]
    assert not list(out.glob("*.partial")) and not (out / "eval.json").exists()


def test_icrl_train_skip_finishes_and_logs_the_skipped_steps(tmp_path, monkeypatch, capsys):
    _poison_train_step_at(monkeypatch, train_module, "train_step", at=3)
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "6", "--checkpoint-every", "3", "--log-every", "2", "--out-dir", str(out),
            "--nonfinite", "skip"]  # fmt: skip
    assert train_module.main(argv) == 0
    err = capsys.readouterr().err
    assert "icrl: skipped 1 non-finite step(s), 1 in all (the first at step 3: loss nan, gradient norm nan)" in err
    rows = [row for row in read_json_lines(out / "metrics.jsonl") if "loss" in row]
    assert [(row["step"], row["skipped_steps"]) for row in rows] == [(2, 0), (4, 1), (6, 1)]
    payload = load_checkpoint(out / "checkpoint.pt")
    assert all(torch.isfinite(value).all() for value in payload["model"].values())
    assert (out / "eval.json").exists()


def test_icrl_looped_stops_in_one_line_and_keeps_its_checkpoint(tmp_path, monkeypatch, capsys):
    from icrl_models.experiments import looped

    _poison_train_step_at(monkeypatch, lifecycle, "train_step", at=5)
    out = tmp_path / "looped"
    argv = ["--steps", "8", "--batch-size", "4", "--n-dims", "3", "--n-points", "5", "--d-model", "16",
            "--n-heads", "2", "--loops-start", "2", "--loops-end", "2", "--grad-loops", "1", "--dims-start", "3",
            "--points-start", "5", "--eval-prompts", "8", "--eval-loop-factor", "1", "--eval-every", "2",
            "--checkpoint-every", "4", "--skip-unlooped", "--backend", "eager", "--out-dir", str(out)]  # fmt: skip
    assert looped.main(argv) == 1
    (line,) = _error_lines(capsys.readouterr().err, "icrl-looped")
    assert line.startswith(
        "icrl-looped: error: trials failed (0: TrainingDiverged: training diverged at step 5: loss nan"
    )
    assert f"{out / 'looped.pt'} (step 4), is intact" in line
    payload = load_checkpoint(out / "looped.pt")
    assert payload["step"] == 4 and all(torch.isfinite(v).all() for v in payload["model"].values())


def test_icrl_markov_stops_in_one_line(tmp_path, monkeypatch, capsys):
    from icrl_models.experiments import markov_heads

    _poison_train_step_at(monkeypatch, lifecycle, "train_step", at=3)  # the step of every run alone
    argv = ["--steps", "4", "--eval-every", "2", "--num-histories", "6", "--episodes-per-history", "3",
            "--analysis-windows", "8", "--eval-envs", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--markov-heads", "0", "--context-lens", "3", "--seeds", "0", "--tasks", "dark_room_visible",
            "--backend", "eager", "--device", "cpu", "--no-progress", "--scheduler", "local",
            "--out-dir", str(tmp_path / "markov")]  # fmt: skip
    assert markov_heads.main(argv) == 1
    (line,) = _error_lines(capsys.readouterr().err, "icrl-markov")
    assert line.startswith("icrl-markov: error: trials failed (0: TrainingDiverged: training diverged at step 3")


def test_icrl_induction_sweep_records_the_diverged_trial_and_carries_on(tmp_path, monkeypatch, capsys):
    """Two variants, the first diverges: the second still trains (its result is kept for a rerun), and the
    command ends with the one-line TrialsFailed report naming the first, exit status 1."""
    from icrl_models.experiments import induction_heads

    original_losses, original_train = induction_heads.next_token_losses, induction_heads.train_variant

    def nan_training_losses(logits, tokens):  # evaluations (no gradient) stay finite
        losses = original_losses(logits, tokens)
        return losses * float("nan") if logits.requires_grad else losses

    def train_variant(name, *args, **kwargs):
        if name != "1L":
            return original_train(name, *args, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(induction_heads, "next_token_losses", nan_training_losses)
            return original_train(name, *args, **kwargs)

    monkeypatch.setattr(induction_heads, "train_variant", train_variant)
    out = tmp_path / "induction"
    argv = ["--variants", "1L", "1L-smear", "--steps", "4", "--eval-every", "2", "--vocab-size", "12",
            "--context-len", "16", "--min-period", "3", "--max-period", "6", "--eval-seq-len", "6",
            "--eval-batch", "4", "--d-model", "16", "--batch-size", "4", "--no-progress", "--scheduler", "local",
            "--out-dir", str(out)]  # fmt: skip
    assert induction_heads.main(argv) == 1
    err = capsys.readouterr().err
    (line,) = _error_lines(err, "icrl-induction")
    assert line.startswith("icrl-induction: error: trials failed (0: TrainingDiverged: training diverged at step ")
    assert "icrl: trial 0 failed: training diverged" in err
    assert not (out / "runs" / "1L.json").exists()
    assert json.loads((out / "runs" / "1L-smear.json").read_text())["outcome"]["skipped_steps"] == 0


# =================================================================================================
# killed writes
# =================================================================================================

#: sitecustomize of the killed processes: with ICRL_TEST_STALL_CHECKPOINT=N set, the N-th checkpoint's rename
#: stalls (its temporary file complete and fsync-ed, the previous checkpoint still in place) after creating the
#: file ICRL_TEST_STALL_MARKER, so that the test kills the process inside a checkpoint write.
_STALL_CHECKPOINT_HOOK = """
import os, time
if os.environ.get("ICRL_TEST_STALL_CHECKPOINT"):
    _replace, _count = os.replace, [0]
    def _stalling_replace(src, dst, *args, **kwargs):
        if str(dst).endswith("checkpoint.pt"):
            _count[0] += 1
            if _count[0] == int(os.environ["ICRL_TEST_STALL_CHECKPOINT"]):
                open(os.environ["ICRL_TEST_STALL_MARKER"], "w").close()
                time.sleep(600)
        return _replace(src, dst, *args, **kwargs)
    os.replace = _stalling_replace
"""

KILL_ARGS = [*TINY_TRAIN, "--steps", "24", "--checkpoint-every", "4", "--log-every", "1", "--eval-episodes", "1"]


def _train_process(out: Path, hook_dir: Path, stall_checkpoint: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{hook_dir}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    if stall_checkpoint:
        env["ICRL_TEST_STALL_CHECKPOINT"] = str(stall_checkpoint)
        env["ICRL_TEST_STALL_MARKER"] = str(hook_dir / "stalled")
    command = [sys.executable, "-m", "icrl_models.train", *KILL_ARGS, "--out-dir", str(out)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _logged_steps(out: Path) -> int:
    return sum(1 for row in read_json_lines(out / "metrics.jsonl") if "loss" in row)


def _kill_when(process: subprocess.Popen, ready, timeout: float = 240.0) -> bool:
    """SIGKILL ``process`` once ``ready()`` holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if ready():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.01)
    return False


@pytest.mark.slow
def test_sigkilled_training_resumes_to_the_uninterrupted_parameters(tmp_path):
    """A real ``python -m icrl_models.train`` SIGKILLed at random points (seeded: after a random number of logged
    steps plus a random delay; once inside a checkpoint write, between the fsync-ed temporary file and its
    rename), rerun after each kill: every rerun resumes from the last complete checkpoint and the run ends
    with the parameters, optimiser state and per-step losses of an uninterrupted run, bit for bit."""
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_STALL_CHECKPOINT_HOOK)
    reference, resumed = tmp_path / "reference", tmp_path / "killed"
    assert _train_process(reference, hook_dir).wait(timeout=300) == 0

    rng = np.random.default_rng(2026)
    kills = 0
    # Inside a checkpoint write: the rename of the second checkpoint (step 8) stalls until the kill.
    process = _train_process(resumed, hook_dir, stall_checkpoint=2)
    kills += _kill_when(process, (hook_dir / "stalled").exists)
    partial = list(resumed.glob(".checkpoint.pt.*.partial"))
    assert partial, "the kill inside the checkpoint write must leave its temporary file behind"
    assert load_checkpoint(resumed / "checkpoint.pt")["step"] == 4  # the previous checkpoint, intact
    # Then at random points of training.
    for target in sorted(rng.integers(9, 24, size=3)):
        process = _train_process(resumed, hook_dir)
        delay = rng.uniform(0.0, 0.3)
        fired = []

        def ready(target=target, delay=delay, fired=fired) -> bool:
            if _logged_steps(resumed) >= target and not fired:
                fired.append(time.monotonic() + delay)
            return bool(fired) and time.monotonic() >= fired[0]

        kills += _kill_when(process, ready)
        assert load_checkpoint(resumed / "checkpoint.pt")["step"] % 4 == 0
    final = _train_process(resumed, hook_dir)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert kills >= 3

    want, got = load_checkpoint(reference / "checkpoint.pt"), load_checkpoint(resumed / "checkpoint.pt")
    assert got["step"] == want["step"] == 24
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name
    for index, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][name], value), (index, name)
    rows = {key: [r for r in read_json_lines(run / "metrics.jsonl") if "loss" in r] for key, run in
            (("want", reference), ("got", resumed))}  # fmt: skip
    assert [r["step"] for r in rows["got"]] == list(range(1, 25))  # each step logged once, none lost
    assert not list(resumed.glob(".*.partial"))  # the killed write's temporary file, removed by the rerun
    assert [(r["loss"], r["grad_norm"]) for r in rows["got"]] == [(r["loss"], r["grad_norm"]) for r in rows["want"]]


def test_metrics_are_on_disk_before_each_checkpoint_refers_to_them(tmp_path, monkeypatch):
    """The rows up to a checkpoint's step are fsync-ed before the checkpoint is renamed into place."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}"))))
        return real_fsync(descriptor)

    def replace(source, target, *args, **kwargs):
        events.append(("replace", os.path.basename(target)))
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "4", "--checkpoint-every", "2", "--log-every", "1", "--out-dir", str(out)]
    assert train_module.main(argv) == 0
    checkpoints = [i for i, event in enumerate(events) if event == ("replace", "checkpoint.pt")]
    assert len(checkpoints) == 2
    previous = 0
    for index in checkpoints:
        assert ("fsync", "metrics.jsonl") in events[previous:index], events[previous:index]
        previous = index
    for name in ("config.json", "train.icrl", "eval.json", "eval.png"):
        assert ("replace", name) in events, name


# =================================================================================================
# full disks and unwritable folders
# =================================================================================================


def _assert_nothing_corrupted(folder: Path) -> None:
    """Every file left in ``folder`` is whole: no temporary file, and each loads."""
    assert not list(folder.rglob("*.partial")), list(folder.rglob("*.partial"))
    for path in folder.rglob("*"):
        if path.name == "checkpoint.pt":
            load_checkpoint(path)
        elif path.suffix == ".icrl":
            load_histories(path)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".png":
            assert path.read_bytes().startswith(b"\x89PNG") and path.read_bytes().endswith(b"IEND\xaeB`\x82")


@pytest.mark.parametrize("budget", [100, 40_000, 150_000, 400_000])
def test_icrl_train_on_a_full_disk_is_one_line_and_corrupts_nothing(tmp_path, fill_disk, capsys, budget):
    """The disk fills up after ``budget`` bytes (in the dataset, a checkpoint, the metrics, the results): one
    line naming the file, exit status 2, every file left whole; a rerun with room resumes and finishes."""
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1", "--out-dir", str(out)]
    disk = fill_disk(tmp_path, budget)
    assert train_module.main(argv) == 2, f"budget {budget}: {disk.written} bytes written"
    (line,) = _error_lines(capsys.readouterr().err, "icrl-train")
    assert line.startswith("icrl-train: error: No space left on device: ") and str(out) in line
    _assert_nothing_corrupted(out)
    disk.budget = float("inf")
    assert train_module.main(argv) == 0
    _assert_nothing_corrupted(out)
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 6 and (out / "eval.json").exists()


def test_full_disk_at_fsync_is_one_line(tmp_path, monkeypatch, capsys):
    """Filesystems that allocate late report ENOSPC at fsync: the same one line, the file not renamed."""
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "2", "--checkpoint-every", "1", "--out-dir", str(out)]
    real_fsync, calls = os.fsync, [0]

    def fsync(descriptor):
        calls[0] += 1
        if calls[0] == 6:  # the dataset, config.json, then metrics and checkpoints
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    assert train_module.main(argv) == 2
    (line,) = _error_lines(capsys.readouterr().err, "icrl-train")
    assert line.startswith("icrl-train: error: No space left on device: ")
    _assert_nothing_corrupted(out)


def test_read_only_filesystem_is_one_line(tmp_path, monkeypatch, capsys):
    real_replace = os.replace

    def read_only(source, target, *args, **kwargs):
        if str(target).endswith("eval.json"):
            raise OSError(errno.EROFS, "Read-only file system", str(target))
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only)
    out = tmp_path / "run"
    assert train_module.main([*TINY_TRAIN, "--steps", "2", "--out-dir", str(out)]) == 2
    (line,) = _error_lines(capsys.readouterr().err, "icrl-train")
    assert line == f"icrl-train: error: Read-only file system: {out / 'eval.json'}"
    _assert_nothing_corrupted(out)


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder no one may write into: a ``chmod 555`` folder, or, where this runs as root (which chmod does not
    stop), ``/sys`` (read-only to everyone); skip if neither refuses a write."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK | os.X_OK) or _refuses_writes(Path("/sys")):
        return Path("/sys")
    pytest.skip("running as root and /sys accepts writes: no folder here refuses a write")


def _refuses_writes(folder: Path) -> bool:
    try:
        (folder / "icrl-write-probe").mkdir()
    except OSError:
        return True
    (folder / "icrl-write-probe").rmdir()
    return False


@pytest.mark.parametrize("command", ["icrl-train", "icrl-data", "icrl-induction"])
def test_unwritable_folder_is_one_line(tmp_path, capsys, command):
    from icrl_models.data import cli as data_cli
    from icrl_models.experiments import induction_heads

    folder = _unwritable_folder(tmp_path)
    target = folder / "icrl-faults-test"
    calls = {
        "icrl-train": lambda: train_module.main([*TINY_TRAIN, "--steps", "2", "--out-dir", str(target)]),
        "icrl-data": lambda: data_cli.main(
            [
                "generate",
                "--env",
                "dark_room",
                "--num-histories",
                "2",
                "--num-episodes",
                "2",
                "--output",
                str(target / "d.icrl"),
            ]
        ),  # fmt: skip
        "icrl-induction": lambda: induction_heads.main(["--steps", "1", "--out-dir", str(target), "--no-progress"]),
    }
    try:
        assert calls[command]() == 2
    finally:
        if folder.name == "locked":
            folder.chmod(0o755)
    (line,) = _error_lines(capsys.readouterr().err, command)
    assert ("Permission denied" in line or "Operation not permitted" in line) and str(folder) in line, line
    assert not target.exists()


def test_result_files_survive_a_failed_rewrite(tmp_path, fill_disk):
    """A result file rewritten on a full disk keeps its previous version, whole; no temporary file stays."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path, png = tmp_path / "eval.json", tmp_path / "eval.png"
    write_json(path, {"version": 1})
    figure = plt.figure()
    save_figure(figure, png)
    before = png.read_bytes()
    fill_disk(tmp_path, 5)
    with pytest.raises(OSError, match="No space left on device"):
        write_json(path, {"version": 2, "padding": "x" * 100})
    with pytest.raises(OSError, match="No space left on device"):
        save_figure(plt.figure(), png)
    assert json.loads(path.read_text()) == {"version": 1} and png.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "eval.png"]
