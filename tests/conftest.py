"""Test fixtures: every kernel output starts NaN-poisoned; bad values raise ``ValueError`` on every device."""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import torch
from _helpers import HostReadDetector

from icrl_kernels import set_value_checks
from icrl_kernels.testing import poisoned_outputs


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Kernel outputs start as NaN, so an element a kernel never writes fails its test."""
    with poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def _synchronous_value_checks(request):
    """Bad values (targets out of range, NaN, ...) raise ``ValueError`` on CUDA too, in the tests that check
    them: every test not marked ``gpu`` (on the CPU "sync" and "auto" are the same), and the ``gpu`` tests
    marked ``sync_value_checks`` (the device-parametrised ones are, by the root conftest). There the default
    ("auto") is an asynchronous device assert, which ends the worker's CUDA context and fails every later
    CUDA test in it. The other ``gpu`` tests (training steps, CUDA graphs, host syncs) run as users run: in
    the default mode. The tests of the asynchronous mode (``test_no_host_sync.py``) choose it explicitly."""
    keywords = request.node.keywords
    if "gpu" in keywords and "sync_value_checks" not in keywords:
        yield
        return
    previous = set_value_checks("sync")
    try:
        yield
    finally:
        set_value_checks(previous)


@pytest.fixture(autouse=True)
def _cuda_state_isolated(request):
    """A ``gpu`` test's asynchronous CUDA errors are reported by that test, not the next one, and a test that
    changed torch's sync-debug mode cannot leave it on."""
    if "gpu" not in request.node.keywords or not torch.cuda.is_available():
        yield
        return
    try:
        yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def _experiment_trials_in_this_process(request, monkeypatch):
    """Experiment commands run their trials on Ray Tune by default when it is installed; the tests run them
    in this process (a Ray instance per test worker costs seconds and memory), except ``test_sweep.py``,
    which tests the Ray path itself."""
    if request.module.__name__.rsplit(".", 1)[-1] == "test_sweep":
        return
    from icrl_models.experiments import sweep

    monkeypatch.setattr(sweep, "ray_tune_available", lambda: False)


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """Let Adam's and AdamW's ``capturable=True`` path (the one a CUDA graph records) run on CPU tensors:
    the same tensor-only arithmetic (step counter and bias corrections on the device), so its host reads
    show in the host-read detector of ``test_no_host_sync``."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw
    import torch.optim.optimizer as optimizer

    for module in (adam, adamw, optimizer):  # AdamW runs Adam's functions in recent torch
        supported = getattr(module, "_get_capturable_supported_devices", None)
        if supported is not None:
            monkeypatch.setattr(
                module, "_get_capturable_supported_devices", lambda *a, _s=supported, **k: [*_s(*a, **k), "cpu"]
            )


class _FillingFile:
    """A file opened for writing on a :class:`FillingDisk`: its writes draw on the disk's budget."""

    def __init__(self, file, disk: FillingDisk) -> None:
        self._file, self._disk = file, disk

    def write(self, data):
        size = len(data)
        room = self._disk.take(size)
        if room < size:  # the disk fills up: the first bytes land, as on a real disk, then ENOSPC
            self._file.write(data[:room])
            self._file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._file.write(data)

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __iter__(self):
        return iter(self._file)

    def __getattr__(self, name):
        return getattr(self._file, name)


class FillingDisk:
    """Every file opened for writing or appending under ``folder`` (through ``open``, ``io.open``, ``os.fdopen``,
    ``Path.write_text`` and whatever calls them, matplotlib and numpy included) shares ``budget`` bytes; the
    write that crosses it is cut short and raises ``OSError(ENOSPC)``, as a full disk does. ``written`` counts
    the bytes (characters of text files) that went through."""

    def __init__(self, monkeypatch, folder, budget: int) -> None:
        import builtins
        import io

        self.folder, self.budget, self.written = os.path.realpath(folder), budget, 0
        real_open = io.open

        def filling_open(file, mode="r", *args, **kwargs):
            opened = real_open(file, mode, *args, **kwargs)
            if not any(flag in mode for flag in "wax+") or not self._inside(file):
                return opened
            return _FillingFile(opened, self)

        monkeypatch.setattr(builtins, "open", filling_open)
        monkeypatch.setattr(io, "open", filling_open)

    def _inside(self, file) -> bool:
        if isinstance(file, int):  # os.fdopen: the descriptor's path
            try:
                file = os.readlink(f"/proc/self/fd/{file}")
            except OSError:
                return False
        try:
            path = os.path.realpath(os.fspath(file))
        except TypeError:
            return False
        return path == self.folder or path.startswith(self.folder + os.sep)

    def take(self, size: int) -> int:
        """Bytes of a write of ``size`` that still fit (all of them, or what is left)."""
        room = max(0, min(size, self.budget - self.written))
        self.written += room
        return room


@pytest.fixture
def fill_disk(monkeypatch):
    """``fill_disk(folder, budget)``: a :class:`FillingDisk` of ``budget`` bytes for the files under ``folder``."""

    def make(folder, budget: int) -> FillingDisk:
        return FillingDisk(monkeypatch, folder, budget)

    return make


class _RaisingHostReadDetector(HostReadDetector):
    """torch's sync-debug mode ``"error"`` on the CPU: the first host read raises, at the line that reads."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if self.reads:
            raise RuntimeError(f"called a synchronizing CUDA operation (emulated): {self.reads[0]}")
        return result


class _EmulatedGraph:
    def __init__(self, record, output):
        self.record, self.output = record, output

    def replay(self):
        self.output.copy_(self.record())


class EmulatedCudaGraphs:
    """``icrl_models.cuda_graphs._CudaGraphs`` on the CPU, so that ``GraphedTrainStep`` runs its whole procedure
    here (warm-up, sync-debug step, restore, capture, failure clean-up, replays): torch's sync-debug mode is the
    host-read detector raising at the first read; a "capture" runs the step once under the same detector (a host
    read invalidates a real capture) and then undoes it, ``extra_state`` included (a real capture runs nothing);
    a "replay" runs the step on the static inputs. What a real capture adds (recording kernels) needs a GPU."""

    def __init__(self, model, optimizer, extra_state=()):
        self.model, self.optimizer, self.extra_state, self.captures = model, optimizer, extra_state, 0

    def __call__(self, device, generators=()):  # stands in for the class: _CudaGraphs(device, generators)
        return self

    @contextlib.contextmanager
    def side_stream(self):
        yield

    def host_syncs_raise(self):
        return _RaisingHostReadDetector()

    def generator_states(self):
        return [torch.get_rng_state()]

    def restore_generator_states(self, states):
        torch.set_rng_state(states[0])

    def capture(self, record):
        from icrl_models import cuda_graphs

        self.captures += 1
        saved = cuda_graphs._snapshot(self.model, self.optimizer, self.extra_state)
        rng = torch.get_rng_state()
        try:
            with _RaisingHostReadDetector():
                output = record()
        finally:
            cuda_graphs._restore(saved, self.model, self.optimizer)
            torch.set_rng_state(rng)
        graph = _EmulatedGraph(record, output.detach().clone())
        return graph, graph.output  # the static output, overwritten by each replay


@pytest.fixture
def emulated_cuda_graphs(monkeypatch):
    """``install(model, optimizer, extra_state=()) -> EmulatedCudaGraphs``: CUDA graph capture emulated on the
    CPU for the rest of the test (``StepRunner(...).graphed = True`` then takes the graphed path)."""
    from icrl_models import cuda_graphs

    def install(model, optimizer, extra_state=()):
        graphs = EmulatedCudaGraphs(model, optimizer, extra_state)
        monkeypatch.setattr(cuda_graphs, "_CudaGraphs", graphs)
        return graphs

    return install
