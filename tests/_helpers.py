"""Helpers shared by several test files (test files never import each other).

* the host-read checks: :func:`host_reads` (a static scan of source code), :class:`HostReadDetector` (a
  dispatch mode that records every op whose CUDA version would wait for the device), :func:`gpu_value_checks`
  and :func:`cpu_backends`; used by test_no_host_sync.py, the CUDA-graph tests and the harness tests;
* the n-gram op's parity check against its reference: :func:`random_ids`, :func:`check_parity`.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

import icrl_kernels as ik
from icrl_kernels import ngram_attention, ngram_attention_reference
from icrl_kernels._backend import triton_runs_on
from icrl_kernels.testing import assert_close_rel

# -- host reads in source code ------------------------------------------------------------------------
#: The value checks, whose arguments may read values (``details``, run only when a synchronous check fails).
VALUE_CHECKS = {"check_values", "check_status_codes"}
#: Methods that copy a device value to the host (or a whole tensor).
HOST_READ_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
#: Tensor reductions whose result, passed to bool()/int()/float() or tested by `if`, is a host read.
REDUCTIONS = {"any", "all", "max", "min", "sum", "amax", "amin", "count_nonzero", "mean", "prod"}


def _calls_reduction(node: ast.AST) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in REDUCTIONS
        for sub in ast.walk(node)
    )


def host_reads(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every host read in ``source`` outside the arguments of ``check_values(...)``
    and ``check_status_codes(...)``."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):  # the arguments of the value checks may read values (details on failure)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in VALUE_CHECKS:
            skipped.update(id(sub) for arg in node.args + [k.value for k in node.keywords] for sub in ast.walk(arg))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READ_METHODS:
            found.append((node.lineno, f".{node.func.attr}()"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("bool", "int", "float"):
            if node.args and _calls_reduction(node.args[0]):
                found.append((node.lineno, f"{node.func.id}(<tensor reduction>)"))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) and _calls_reduction(node.test):
            found.append((node.lineno, f"{type(node).__name__.lower()} on a tensor reduction"))
    return sorted(found)


# -- host reads at run time ---------------------------------------------------------------------------
class HostReadDetector(TorchDispatchMode):
    """Records every dispatched op whose CUDA version would wait for the device: a value read on the host,
    or an output whose shape depends on values (``nonzero``, boolean indexing, ``unique``, ...)."""

    VALUE_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "icrl":  # a custom op: run its Python body with the mode on, to see inside
            opdef = _maybe_get_opdef(func)
            with self:
                return opdef._init_fn(*args, **kwargs)
        name = func.overloadpacket.__name__
        # aten.item shows inside custom ops (their bodies run above the autograd key), _local_scalar_dense elsewhere.
        if name in ("_local_scalar_dense", "item", "is_nonzero", "equal") or name in self.VALUE_DEPENDENT:
            self.reads.append(str(func))
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.reads.append(f"{func} with a boolean index")
        elif name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) == 1:
            self.reads.append(f"{func} without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def gpu_value_checks() -> Iterator[None]:
    """Within the block, value checks take their GPU path (``"async"``: device asserts, no host read)."""
    previous = ik.set_value_checks("async")
    try:
        yield
    finally:
        ik.set_value_checks(previous)


@contextlib.contextmanager
def no_host_reads() -> Iterator[HostReadDetector]:
    """Within the block, value checks take their GPU path and every op runs under :class:`HostReadDetector`;
    leaving it fails with ``host read: ...`` if any op read a device value on the host."""
    with gpu_value_checks(), HostReadDetector() as detector:
        yield detector
    assert not detector.reads, f"host read: {detector.reads}"


def cpu_backends() -> list[str]:
    """The backends that run on CPU tensors here: eager, and Triton under ``TRITON_INTERPRET=1``."""
    return ["eager", "triton"] if triton_runs_on(torch.device("cpu")) else ["eager"]


# -- n-gram attention parity --------------------------------------------------------------------------
def random_ids(
    batch: int, length: int, vocab: int, *, generator: torch.Generator, padding: float = 0.0
) -> torch.Tensor:
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    if padding > 0:
        ids[torch.rand(batch, length, generator=generator) < padding] = -1
    return ids


def check_parity(h: torch.Tensor, ids: torch.Tensor, n: int, backend: str, algorithm="auto", *, plan=None) -> None:
    """Output and gradient of ``backend`` / ``algorithm`` against the reference on the same inputs."""
    h = h.detach().requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)
    out = ngram_attention(h, ids, n, backend=backend, plan=plan, algorithm=algorithm)
    ref = ngram_attention_reference(h_ref, ids, n)
    assert out.dtype == h.dtype and out.shape == h.shape
    assert_close_rel(out, ref, name=f"{backend} output")
    grad_out = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(out, h, grad_out)
    (grad_ref,) = torch.autograd.grad(ref, h_ref, grad_out)
    assert_close_rel(grad, grad_ref, name=f"{backend} grad_h")
