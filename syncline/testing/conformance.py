"""Device conformance: every tensor handed to torch.distributed on the model's device, and no
host read in a steady-state step, checked on CPU with torch's ``fake`` backend and ``meta``.

Why: syncline is developed on CPU with gloo, where a tensor left on the CPU or a ``.item()``
per bucket costs nothing visible; on GPUs with NCCL the first is an error and the second a
stall per call. Here one process plays one rank of a job (:func:`run_fake_rank`) over the
``fake`` process-group backend (collectives return at once, receives deliver nothing), with
the model on the ``meta`` device, a stand-in for "not the CPU". :class:`Conformance` then

- wraps the ``torch.distributed`` entry points (``all_reduce`` ... ``batch_isend_irecv``) and
  records the device of every tensor handed to them, with the ``syncline`` file:line that
  made the call (the real fake-backend call still runs: instrumentation, not a mock); a
  collective reached by another path is recorded at the dispatcher (``c10d.*``);
- records every host read of a meta tensor (``.item()``, ``.tolist()``, ``.cpu()``,
  ``bool(t)``, ``nonzero()``, ``torch.equal``, a boolean mask: what syncs a GPU), with its
  call site and the phase it happened in (a label the caller sets: ``"step 3"``).

Meta tensors hold no data, so a host read would raise; a library may legitimately read on
the host once, before the steady state (the first step's bucket order, a decided bucket
plan, a checkpoint). So every meta tensor gets a CPU *shadow* that follows it op by op (the
same aten op run on CPU copies, sharing storage as the meta tensors do; collectives
shadowed with the fake backend's CPU behaviour: an all-gather copies this rank's input), and
a host read is answered from the shadow. A run thus behaves as it would on CPU under the
fake backend, while every read is on record: the caller decides which phases must have none.

Example:
    >>> spy = Conformance(torch.device("meta"))
    >>> with force_backend_name("nccl"), spy:
    ...     spy.phase("setup")
    ...     dp = DataParallel(model)                       # model on meta
    ...     for step in range(5):
    ...         spy.phase(f"step {step}", steady=step >= 2)
    ...         loss_fn(dp(x), y).backward()
    >>> spy.summary()["offenders"], spy.summary()["steady_reads"]
    ([], [])
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from syncline.testing.harness import _PRELOAD, RankFailure, _context

__all__ = [
    "COMM_ENTRY_POINTS",
    "CommCall",
    "Conformance",
    "HostRead",
    "failure_line",
    "force_backend_name",
    "run_fake_rank",
]

#: the ``torch.distributed`` functions watched (those missing from a torch build are skipped)
COMM_ENTRY_POINTS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip

aten = torch.ops.aten
#: where torch.distributed's ops live at the dispatcher (process groups; functional)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
#: ops that read a tensor's values on the host (a device sync on CUDA)
_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
#: factories whose fresh memory a shadow starts as zeros (deterministic stand-in values)
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
          aten.new_empty.default, aten.new_empty_strided.default}  # fmt: skip


@dataclass(frozen=True)
class CommCall:
    """One call into torch.distributed: which, with tensors on which devices, from where."""

    op: str
    devices: tuple[str, ...]
    site: str
    phase: str


@dataclass(frozen=True)
class HostRead:
    """One host read of a meta tensor's values: ``op`` is the aten op that read it
    (``_local_scalar_dense``: ``.item()``, ``bool()``, ``float()``; ``_to_copy``/``copy_``:
    ``.cpu()``, ``.tolist()``, ``.to("cpu")``; ``nonzero``, ``equal``, ...)."""

    op: str
    site: str
    phase: str
    steady: bool


def _site() -> str:
    """Where the library made the call: ``syncline/x.py:LINE (function)`` of the innermost
    library frame, and, when that is in ``syncline/comm/`` (a helper), ``<- `` the innermost
    frame outside it (its caller in dp/, pipeline/, ...). Outside the library: the caller's."""
    frame: Any = sys._getframe(2)
    found: list[str] = []
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/syncline/" in path and "/syncline/testing/" not in path:
            rel = path[path.rindex("/syncline/") + 1 :]
            found.append(f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})")
            if not rel.startswith("syncline/comm/"):
                break
        elif fallback is None and "/torch/" not in path and "/syncline/testing/" not in path:
            fallback = f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    if found:
        return found[0] if len(found) == 1 else f"{found[0]} <- {found[-1]}"
    return fallback or "<unknown>"


class _Shadows:
    """A CPU storage per meta storage, so views, in-place ops and saved tensors alias alike."""

    def __init__(self) -> None:
        # meta storage pointer -> (the meta storage, kept alive so the pointer is not reused;
        # its CPU shadow)
        self._by_storage: dict[int, tuple[Any, torch.UntypedStorage]] = {}

    def _entry(self, t: torch.Tensor) -> tuple[Any, torch.UntypedStorage]:
        storage = t.untyped_storage()
        entry = self._by_storage.get(storage._cdata)
        if entry is None or entry[1].nbytes() < storage.nbytes():
            cpu = torch.zeros(storage.nbytes(), dtype=torch.uint8).untyped_storage()
            entry = (storage, cpu)
            self._by_storage[storage._cdata] = entry
        return entry

    def get(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU shadow of meta tensor ``t`` (a view of its storage's shadow)."""
        if t.layout is not torch.strided:
            return torch.zeros(t.shape, dtype=t.dtype)
        cpu = self._entry(t)[1]
        return torch.empty(0, dtype=t.dtype).set_(cpu, t.storage_offset(), t.size(), t.stride())

    def bind(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        """Make ``cpu`` (an op's CPU result) the values of ``meta`` (the same op's result)."""
        if meta.layout is not torch.strided or cpu.layout is not torch.strided:
            return
        storage = meta.untyped_storage()
        known = self._by_storage.get(storage._cdata)
        if known is not None and known[1]._cdata == cpu.untyped_storage()._cdata:
            return  # in place, or a view of the same shadow: already there
        same_layout = (
            known is None
            and cpu.untyped_storage().nbytes() == storage.nbytes()
            and cpu.storage_offset() == meta.storage_offset()
            and cpu.stride() == meta.stride()
        )
        if same_layout:
            self._by_storage[storage._cdata] = (storage, cpu.untyped_storage())
        else:
            self.get(meta).copy_(cpu)

    def to_cpu(self, tree: Any) -> Any:
        """``tree`` with each meta tensor replaced by its shadow."""
        return pytree.tree_map(
            lambda x: self.get(x) if isinstance(x, torch.Tensor) and x.is_meta else x, tree
        )


def _is_meta_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: ("cpu" if k == "device" and _is_meta_device(v) else v) for k, v in kwargs.items()}


class _Inside(threading.local):
    depth = 0  # > 0 while a watched torch.distributed function runs (its c10d ops: not twice)


_INSIDE = _Inside()


class _ShadowMode(TorchDispatchMode):
    """Runs every op on meta tensors on their CPU shadows too; answers host reads from them."""

    def __init__(self, spy: Conformance) -> None:
        super().__init__()
        self.spy = spy
        self.shadows = _Shadows()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            return self._collective(func, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        metas = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_meta]
        makes_meta = _is_meta_device(kwargs.get("device"))
        if not metas and not makes_meta:
            return func(*args, **kwargs)
        if func in _READS or self._copies_out(func, args, kwargs, metas):
            self.spy._read(func)
            return func(*self.shadows.to_cpu(args), **self.shadows.to_cpu(kwargs))
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:  # no meta kernel: the output depends on the values
            self.spy._read(func)
            return self._from_shadow(
                func(*self.shadows.to_cpu(args), **self.shadows.to_cpu(kwargs))
            )
        self._follow(func, args, kwargs, out)
        return out

    @staticmethod
    def _copies_out(func: Any, args: Any, kwargs: dict[str, Any], metas: list[Any]) -> bool:
        """A copy from meta to the host: ``.cpu()``, ``.tolist()``, ``.numpy()``'s first half."""
        if func is aten._to_copy.default:
            device = kwargs.get("device")
            return bool(metas) and device is not None and not _is_meta_device(device)
        if func is aten.copy_.default:
            return not args[0].is_meta and args[1].is_meta
        return False

    def _follow(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        try:
            cpu_args, cpu_kwargs = self.shadows.to_cpu(args), _cpu_kwargs(kwargs)
            cpu_kwargs = self.shadows.to_cpu(cpu_kwargs)
            cpu_out = func(*cpu_args, **cpu_kwargs)
            if func in _EMPTY:
                cpu_out.zero_()
        except Exception:  # a shadow is a stand-in: never fail the run for it
            self.spy.shadow_failures += 1
            return
        metas, cpus = pytree.tree_leaves(out), pytree.tree_leaves(cpu_out)
        if len(metas) != len(cpus):
            return
        for m, c in zip(metas, cpus, strict=True):
            if isinstance(m, torch.Tensor) and m.is_meta and isinstance(c, torch.Tensor):
                self.shadows.bind(m, c)

    def _from_shadow(self, cpu_out: Any) -> Any:
        def meta_of(c: Any) -> Any:
            if not isinstance(c, torch.Tensor):
                return c
            m = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device="meta")
            self.shadows.bind(m, c)
            return m

        return pytree.tree_map(meta_of, cpu_out)

    def _collective(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A collective op: recorded if no watched function made it (e.g. a functional
        collective); all-gathers shadowed as the fake backend runs them on the CPU."""
        if _INSIDE.depth == 0 and not func.__name__.startswith(("wait_tensor", "_wrap_tensor")):
            tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            self.spy._call(f"c10d.{func.__name__}", tensors)
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in ("allgather_", "gather_", "allgather_coalesced_"):
            outputs, inputs = args[0], args[1]
            for outs, inp in zip(outputs, inputs, strict=False):
                for o in outs if isinstance(outs, list) else [outs]:
                    self._copy_shadow(o, inp)
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            outs, ins = args[0], args[1]
            for o, i in zip(outs if isinstance(outs, list) else [outs],
                            ins if isinstance(ins, list) else [ins], strict=False):  # fmt: skip
                self._copy_shadow(o, i)
        return out

    def _copy_shadow(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """The fake backend's all-gather on CPU: every slot gets this rank's input."""
        if not (out.is_meta and inp.is_meta) or inp.numel() == 0:
            return
        flat = self.shadows.get(out).view(-1)
        src = self.shadows.get(inp).reshape(-1)
        flat.copy_(src.repeat(flat.numel() // src.numel()))


def _tensors_of(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found = []
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dist.P2POp):
            found.append(x.tensor)
    return found


class Conformance:
    """Records what a run hands to torch.distributed and what it reads on the host.

    Args:
        device: the model's device; a tensor handed to torch.distributed anywhere else is an
            offender.

    Use as a context manager around the whole run (model construction included, so that
    every meta tensor has its shadow); :meth:`phase` labels what follows.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.calls: list[CommCall] = []
        self.reads: list[HostRead] = []
        self.shadow_failures = 0
        self._phase, self._steady = "setup", False
        self._stack: contextlib.ExitStack | None = None
        self._mode = _ShadowMode(self)

    def phase(self, label: str, *, steady: bool = False) -> None:
        """Label what follows (``"step 3"``); ``steady``: a steady-state phase, whose host
        reads :meth:`summary` lists apart (the caller decides how many it allows: none)."""
        self._phase, self._steady = label, steady

    @property
    def current_phase(self) -> str:
        """The label of the phase running now (to say where a run failed)."""
        return self._phase

    def host_value(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s value as its shadow holds it, on the CPU (the test's own read: not
        recorded), e.g. to write a checkpoint as a CPU host would read it back."""
        return self._mode.shadows.get(t).clone() if t.is_meta else t.detach().clone()

    # -- recording -------------------------------------------------------------------------
    def _call(self, op: str, tensors: list[torch.Tensor]) -> None:
        devices = tuple(str(t.device) for t in tensors)
        self.calls.append(CommCall(op, devices, _site(), self._phase))

    def _read(self, func: Any) -> None:
        op = func.__name__.split(".")[0]
        self.reads.append(HostRead(op, _site(), self._phase, self._steady))

    def _watch(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._call(name, _tensors_of(args, kwargs))
            _INSIDE.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _INSIDE.depth -= 1

        return watched

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> Conformance:
        stack = contextlib.ExitStack()
        for name in COMM_ENTRY_POINTS:
            if hasattr(dist, name):
                stack.enter_context(_patched(dist, name, self._watch(name, getattr(dist, name))))
        stack.enter_context(_patched(dist, "P2POp", _unwrapping_p2p_op()))
        for name in ("tensor", "as_tensor"):
            stack.enter_context(_patched(torch, name, _via_cpu(getattr(torch, name))))
        stack.enter_context(self._mode)
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    # -- results ---------------------------------------------------------------------------
    def offenders(self) -> list[CommCall]:
        """Calls that handed torch.distributed a tensor off the model's device."""
        return [c for c in self.calls if any(torch.device(d) != self.device for d in c.devices)]

    def summary(self) -> dict[str, Any]:
        """Plain values (picklable, readable in an assertion): ``offenders``, ``steady_reads``
        and ``warmup_reads`` (host reads in steady phases and in the others), one line per
        distinct site with its first phase; and ``reads_per_steady_phase``."""
        per_phase: dict[str, int] = {}
        for r in self.reads:
            if r.steady:
                per_phase[r.phase] = per_phase.get(r.phase, 0) + 1
        return {
            "offenders": _distinct(
                (f"{c.op} on {','.join(sorted(set(c.devices)))} at {c.site}", c.phase)
                for c in self.offenders()
            ),
            "steady_reads": _distinct(
                (f"{r.op} at {r.site}", r.phase) for r in self.reads if r.steady
            ),
            "warmup_reads": _distinct(
                (f"{r.op} at {r.site}", r.phase) for r in self.reads if not r.steady
            ),
            "reads_per_steady_phase": per_phase,
        }


def _distinct(items: Iterator[tuple[str, str]]) -> list[str]:
    seen: dict[str, tuple[str, int]] = {}
    for what, phase in items:
        first, n = seen.get(what, (phase, 0))
        seen[what] = (first, n + 1)
    return [f"{what} (first in {first}; {n}x)" for what, (first, n) in seen.items()]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _via_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor(data, device="meta")`` built on the CPU and moved, so that the move is
    seen by the dispatcher and the new tensor gets its data as shadow (the direct path
    creates it below the dispatcher, out of sight)."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> torch.Tensor:
        from_host = bool(args) and not isinstance(args[0], torch.Tensor)  # data, not a tensor
        if not (from_host and _is_meta_device(kwargs.get("device"))):
            return factory(*args, **kwargs)
        grad = bool(kwargs.pop("requires_grad", False))
        out = factory(*args, **{**kwargs, "device": "cpu"}).to("meta")
        return out.requires_grad_() if grad else out

    return build


def _unwrapping_p2p_op() -> type:
    """``P2POp`` accepting the watched ``isend``/``irecv`` (torch checks the originals)."""
    base = dist.P2POp

    def unwrap(op: Any) -> Any:
        return getattr(op, "__wrapped__", op)

    class P2POp(base):  # type: ignore[misc, valid-type]
        def __new__(cls, op: Any, *args: Any, **kwargs: Any) -> Any:
            return base.__new__(cls, unwrap(op), *args, **kwargs)

        def __init__(self, op: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(unwrap(op), *args, **kwargs)

    return P2POp


def failure_line(exc: BaseException) -> str:
    """One line for a failed run: the exception, and the innermost one it was raised from,
    with the innermost ``syncline`` file:line of its traceback (where the library failed)."""
    inner = exc
    while True:
        nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
        if nxt is None:
            break
        inner = nxt
    site = "?"
    for frame in traceback.extract_tb(inner.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if "/syncline/" in path and "/syncline/testing/" not in path:
            site = f"{path[path.rindex('/syncline/') + 1 :]}:{frame.lineno}"

    def line(e: BaseException) -> str:
        text = str(e).splitlines()[0][:300] if str(e) else ""
        return f"{type(e).__name__}: {text}"

    head = "" if inner is exc else f"{line(exc)} <- "
    return f"{head}{line(inner)} (at {site})"


@contextlib.contextmanager
def force_backend_name(name: str) -> Iterator[None]:
    """Make ``torch.distributed.get_backend`` answer ``name`` for every group, so that the
    library takes its ``name``-only branches (``"nccl"``) over the fake backend; torch's own
    code keeps seeing the real one."""
    with _patched(dist, "get_backend", lambda group=None: name):
        yield


# -- one rank over the fake backend, in a process of its own ------------------------------
#: what the fork server imports once, when it is started here: beside the harness's, what a
#: case needs (meta kernels written in Python and the dispatch mode pull in torch._dynamo:
#: ~3 s a process otherwise)
_PRELOAD_FAKE = [
    "torch._dynamo",
    "torch.testing._internal.distributed.fake_pg",
    "syncline.dp.engine",
    "syncline.pipeline.runtime",
]


def _fake_worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, "result.pt"))
    except BaseException:
        with open(os.path.join(workdir, "error.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_fake_rank(
    fn: Callable[..., Any], rank: int, world_size: int, *args: Any, timeout_s: float = 120.0
) -> Any:
    """Run ``fn(rank, world_size, *args)`` as rank ``rank`` of a ``world_size``-rank job over
    the fake backend, alone, in a fresh process (forked from the harness's server, torch
    already imported), so that no default group or patch outlives it; return its result.

    Raises:
        RankFailure: ``fn`` raised (with its traceback), the process died, or it ran past
            ``timeout_s``.
    """
    ctx = _context(None)
    if ctx.get_start_method() == "forkserver":  # effective only before the server starts
        ctx.set_forkserver_preload([*_PRELOAD, *_PRELOAD_FAKE])
    workdir = tempfile.mkdtemp(prefix="syncline-fake-")
    proc = ctx.Process(
        target=_fake_worker,
        args=(fn, rank, world_size, workdir, args, dict(os.environ)),
        daemon=True,
    )
    try:
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            raise RankFailure(rank, f"did not finish within {timeout_s}s")
        error = os.path.join(workdir, "error.txt")
        if os.path.exists(error):
            with open(error) as f:
                raise RankFailure(rank, f.read().strip())
        if proc.exitcode != 0:
            raise RankFailure(rank, f"process exited with code {proc.exitcode}")
        return torch.load(
            os.path.join(workdir, "result.pt"), weights_only=False, map_location="cpu"
        )
    finally:
        if proc.pid is not None:  # started
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
