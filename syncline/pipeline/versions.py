"""2BW weight versions: two buffers per stage, ping-ponged, with one optimizer on the newest.

PipeDream-2BW (Narayanan et al., ICML 2021, section 3.1) keeps two versions of each stage's
weights: micro-batches of batch ``t+1`` run on version ``t`` while the gradient of batch ``t``
(taken on version ``t-1``) makes version ``t+1``::

    W(t+1) = W(t) - lr * grad f(W(t-1))

How it is kept here. Each version is a set of plain leaf tensors (``requires_grad``); a
micro-batch's forward runs the stage with its version's tensors put into the parameter slots
of the stage's own modules (``WeightVersions.installed``, undone after the call), so its
autograd graph holds those tensors and its backward accumulates into their ``.grad``. (Why not
``torch.func.functional_call``, which does the same: its reparametrisation cost ~0.35 ms of
Python per forward on a stage of the benchmark GPT, ~2.5 % of a 2BW step; a precomputed list
of slots costs a dict store per parameter. Why not a copy of the module per version: Python
state a module keeps on itself, a counter or a cache, would then split between copies.) The
stage's ``nn.Parameter`` objects always alias the newest version's storage
(``p.data = buffer``), so ``stage_module`` shows the newest weights and the optimizer (and
its state, keyed by those Parameters) is the user's, unchanged. A STEP producing version
``k+1`` from the newest ``k`` with the gradient of a batch that used version ``u``:

1. takes ``u``'s accumulated ``.grad``;
2. picks the buffer for ``k+1``: ``u``'s own buffer when ``u < k`` (its last micro-batch
   finished backward, so it is free; this is the steady state); when ``u == k`` (a run's
   first step, or a call that ran one batch without starting the next), an older version
   with nothing in flight, else a new one. So a run of one-batch calls holds two buffers,
   never one more per call;
3. copies ``k`` into it, points the Parameters at it, sets their ``.grad`` and runs the
   optimizer, which updates the new buffer in place; version ``k`` is untouched, so the
   in-flight micro-batches that use it stay valid.

So at most two buffers exist (the optimizer state exists once). Micro-batches of a version
are counted in and out, and a STEP that would overwrite a version still in use raises
instead of corrupting a backward. Buffers (e.g. BatchNorm statistics) are not versioned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]


class WeightVersions:
    """The live weight versions of one stage (see the module docstring).

    Args:
        module: the stage; its parameters are the newest version from here on.
        version: the global number of the newest version (the STEPs done so far).
    """

    def __init__(self, module: nn.Module, version: int) -> None:
        self._params = dict(module.named_parameters())
        by_id = {id(p): n for n, p in self._params.items()}
        # every slot holding a parameter, a tied one under each of its names
        self._slots = [
            (sub, key, by_id[id(p)])
            for sub in module.modules()
            for key, p in sub._parameters.items()
            if p is not None
        ]
        self._versions: dict[int, Tensors] = {}
        self._uses: dict[int, int] = {}
        self.newest = version
        self.peak_versions = 0
        self._adopt(version)

    def _adopt(self, version: int) -> None:
        """Make the current Parameters' values version ``version`` (a run's first)."""
        buffers = {
            n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self._params.items()
        }
        self._install(version, buffers)

    def _install(self, version: int, buffers: Tensors) -> None:
        for name, p in self._params.items():
            p.data = buffers[name].detach()
        self._versions[version] = buffers
        self._uses.setdefault(version, 0)
        self.newest = version
        self.peak_versions = max(self.peak_versions, len(self._versions))

    @property
    def held(self) -> list[int]:
        return sorted(self._versions)

    @property
    def version_bytes(self) -> int:
        """Bytes of one version."""
        return sum(p.numel() * p.element_size() for p in self._params.values())

    def storages(self) -> set[int]:
        """Storage pointers of every held version (left out of activation counts)."""
        return {
            t.untyped_storage().data_ptr() for vs in self._versions.values() for t in vs.values()
        }

    def acquire(self, version: int) -> Tensors:
        """The tensors of ``version`` for a micro-batch's forward; counts the micro-batch in."""
        if version not in self._versions:
            raise RuntimeError(f"weight version {version} is not held (held: {self.held})")
        self._uses[version] += 1
        return self._versions[version]

    @contextmanager
    def installed(self, tensors: Tensors) -> Iterator[None]:
        """Run the stage module on a version's ``tensors`` (from :meth:`acquire` or
        :meth:`tensors`) inside the block, a forward or a recompute; its own Parameters are
        back in their slots afterwards, also on error."""
        for sub, key, name in self._slots:
            sub._parameters[key] = tensors[name]  # type: ignore[assignment]
        try:
            yield
        finally:
            for sub, key, name in self._slots:
                sub._parameters[key] = self._params[name]

    def tensors(self, version: int) -> Tensors:
        """The tensors of ``version`` (recompute), without counting a new micro-batch."""
        return self._versions[version]

    def release(self, version: int) -> None:
        """A micro-batch of ``version`` finished its backward."""
        self._uses[version] -= 1

    def step(
        self, used: int, produces: int, optimizer: torch.optim.Optimizer, before: Callable[[], bool]
    ) -> None:
        """Make version ``produces`` from the newest with the gradient accumulated on ``used``.

        Args:
            used: the version the finished batch ran on.
            produces: must be ``newest + 1``.
            optimizer: over this stage's Parameters.
            before: run once the Parameters hold their gradient, before the optimizer, which
                runs only if it returns ``True`` (an fp16 overflow skips the step: version
                ``produces`` is then the newest's copy, unchanged). The
                data-parallel average has happened already: the REDUCE action before the
                STEP replaced ``used``'s ``.grad`` by the replicas' average
                (:meth:`~syncline.pipeline.stage.Stage.grad_holders`).

        Raises:
            RuntimeError: the numbers disagree with the versions held, or the buffer to be
                reused still has micro-batches in flight.
        """
        k = self.newest
        if produces != k + 1 or used not in self._versions or used > k:
            raise RuntimeError(
                f"STEP making v{produces} from v{used}'s gradient, but the newest is v{k} "
                f"(held: {self.held})"
            )
        source = self._versions[used]
        grads = {n: t.grad for n, t in source.items()}
        for t in source.values():
            t.grad = None
        if used < k:
            if self._uses[used]:
                raise RuntimeError(
                    f"v{used} still has {self._uses[used]} micro-batch(es) in flight at the STEP"
                )
            recycled: int | None = used
        else:  # the batch ran on the newest: an older idle version's buffer is free, if any
            recycled = next((v for v in self.held if v < k and not self._uses[v]), None)
        if recycled is not None:
            buffers = self._versions.pop(recycled)
            del self._uses[recycled]
        else:
            buffers = {n: torch.empty_like(t) for n, t in source.items()}
        with torch.no_grad():
            for name, t in buffers.items():
                t.copy_(self._versions[k][name])
                t.requires_grad_(self._params[name].requires_grad)
        self._install(produces, buffers)
        for name, p in self._params.items():
            p.grad = grads[name]
        if before():
            optimizer.step()
        for p in self._params.values():
            p.grad = None

    def renumber(self, version: int) -> None:
        """A resumed run: the one held version (after a flush) becomes global ``version``, the
        number of STEPs the checkpointed run had done, which the schedule's labels expect."""
        if len(self._versions) != 1 or any(self._uses.values()):
            raise RuntimeError(f"renumber needs one idle version (held: {self.held})")
        buffers = self._versions.pop(self.newest)
        self._uses = {}
        self._install(version, buffers)

    def keep_newest(self) -> None:
        """End of a run (flush): drop every version but the newest."""
        for v in [v for v in self._versions if v != self.newest]:
            if self._uses[v]:
                raise RuntimeError(f"v{v} still has {self._uses[v]} micro-batch(es) in flight")
            del self._versions[v]
            del self._uses[v]
