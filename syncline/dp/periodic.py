"""Synchronising less often: post-local SGD and DiLoCo, as DataParallel's ``sync=`` strategies.

A strategy says, per optimizer step, whether the backward averages the gradients, and what
runs after the optimizer has stepped (the parameters averaged, an outer step). Its step is
the count of optimizer steps (a hook on the optimizer, :meth:`Synchronizer.attach`), as
torch's ``PeriodicModelAverager`` counts them; step ``t`` is the ``t``-th, from 0::

    localsgd:4:start=2    t:  0  1 | 2  3  4  5  6  7  8  9 ...
                              G  G | La L  L  L  La L  L  L     G: gradients averaged
    diloco:4:start=2      t:  0  1 | 2  3  4  5  6  7  8  9     L: local step
                              G  G | L  L  L  Lo L  L  L  Lo    a: then weights averaged
                                                                o: then an outer step

Post-local SGD (Lin et al. 2020) averages the weights after step ``start``, then every
``period`` steps, exactly when torch's ``PeriodicModelAverager(period, warmup_steps=start)``
does beside ``post_localSGD_hook`` (``post_local_gradient_allreduce=False``), and as torch
does: all parameters in one flat buffer, divided by the world size, then summed.

DiLoCo (Douillard et al. 2023, Algorithm 1): at the first local step the outer weights
``theta`` are the replicas' (identical: the steps before were averaged). After ``H`` inner
steps of the user's optimizer (AdamW in the paper), the outer gradient is the mean over the
ranks of ``theta - theta_rank``, one allreduce; an outer SGD with Nesterov momentum (lr 0.7,
momentum 0.9 in the paper; torch's SGD arithmetic, dampening 0) moves ``theta``, and every
rank takes ``theta`` as its weights. The inner optimizer's state stays per rank.

Between synchronisations the replicas differ: their checkpoints hold every rank's weights
and optimizer state (:meth:`Synchronizer.in_sync` says when they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from syncline.comm.collectives import Collective
from syncline.dp.compression import Compressor
from syncline.dp.pairing import check_pair
from syncline.dp.syncs import build_sync, check_diloco, check_localsgd
from syncline.errors import ConfigError

__all__ = ["DiLoCo", "EveryStep", "LocalSGD", "SyncStrategy", "Synchronizer"]


class SyncStrategy(Protocol):
    """When the replicas agree (see the module docstring).

    Attributes:
        name: its registry name (:data:`syncline.dp.syncs.SYNCS`).
        step: optimizer steps done so far (restored from checkpoints).
    """

    name: str
    step: int

    def reduces(self) -> bool:
        """Whether the backward of step ``step`` averages the gradients."""
        ...

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        """A training forward of step ``step`` starts (DiLoCo keeps its outer weights)."""
        ...

    def after_step(self, params: Sequence[torch.Tensor], comm: Collective) -> int:
        """Step ``step``'s optimizer has stepped: synchronise if due, then count it; the
        bytes this rank put on the wire."""
        ...

    def in_sync(self) -> bool:
        """Whether every rank holds the same weights now."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EveryStep:
    """DDP's way: every backward averages the gradients; the replicas never drift."""

    name = "every-step"

    def __init__(self) -> None:
        self.step = 0

    def reduces(self) -> bool:
        return True

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        del params

    def after_step(self, params: Sequence[torch.Tensor], comm: Collective) -> int:
        del params, comm
        self.step += 1
        return 0

    def in_sync(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters in one fresh flat buffer (one dtype: checked by the synchronizer)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def _unflatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n


class LocalSGD:
    """Post-local SGD: ``start`` steps of averaged gradients, then each rank steps alone and
    the weights are averaged after step ``start`` and every ``period`` steps after it.

    Args:
        period: steps between two averagings, >= 1 (1: every step, as torch allows).
        start_step: steps whose gradients are averaged first, >= 0 (torch's
            ``start_localSGD_iter`` and the averager's ``warmup_steps``).

    Raises:
        ConfigError: a value out of range, naming it.

    Example:
        >>> dp = DataParallel(net, sync=LocalSGD(period=8, start_step=100))
    """

    name = "localsgd"

    def __init__(self, period: int, start_step: int = 0) -> None:
        check_localsgd(period, start_step)
        self.period, self.start_step = period, start_step
        self.step = 0

    def reduces(self) -> bool:
        return self.step < self.start_step

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        del params

    def _averages_at(self, step: int) -> bool:
        return step >= self.start_step and (step - self.start_step) % self.period == 0

    def after_step(self, params: Sequence[torch.Tensor], comm: Collective) -> int:
        sent = 0
        if self._averages_at(self.step) and comm.world_size > 1:
            flat = _flat(params)
            flat.div_(comm.world_size)  # as torch's average_parameters: divided, then summed
            pending = comm.allreduce(flat, f"localsgd averaging after step {self.step}")
            pending.wait()
            sent = pending.wire_bytes
            _unflatten_into(flat, params)
        self.step += 1
        return sent

    def in_sync(self) -> bool:
        return self.step <= self.start_step or self._averages_at(self.step - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period}, start_step={self.start_step})"


class DiLoCo:
    """DiLoCo: ``inner_steps`` local steps, then an outer Nesterov SGD step on the averaged
    weight change (Douillard et al. 2023).

    Args:
        inner_steps: H, local steps per outer step, >= 1.
        start_step: steps whose gradients are averaged first (data parallelism), >= 0.
        outer_lr: the outer learning rate, > 0 (0.7 in the paper).
        outer_momentum: the outer momentum, in [0, 1) (0.9 in the paper).
        nesterov: Nesterov momentum (1, the paper's) or heavy ball (0); with momentum > 0.

    Raises:
        ConfigError: a value out of range, naming it.

    Example:
        >>> dp = DataParallel(net, sync=DiLoCo(inner_steps=50))
        >>> opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)  # the inner optimizer
        >>> dp.attach(opt)
    """

    name = "diloco"

    def __init__(
        self,
        inner_steps: int,
        start_step: int = 0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: int | bool = True,
    ) -> None:
        check_diloco(inner_steps, start_step, outer_lr, outer_momentum, nesterov)
        self.inner_steps, self.start_step = inner_steps, start_step
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.step = 0
        self.outer: torch.Tensor | None = None  # the outer weights, flat
        self.momentum: torch.Tensor | None = None  # the outer optimizer's buffer

    def reduces(self) -> bool:
        return self.step < self.start_step

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        if self.step >= self.start_step and self.outer is None:
            self.outer = _flat(params).clone()  # the replicas' common weights

    def after_step(self, params: Sequence[torch.Tensor], comm: Collective) -> int:
        local = self.step - self.start_step
        sent = (
            self._outer_step(params, comm)
            if local >= 0 and (local + 1) % self.inner_steps == 0
            else 0
        )
        self.step += 1
        return sent

    def _outer_step(self, params: Sequence[torch.Tensor], comm: Collective) -> int:
        if self.outer is None:
            raise RuntimeError("DiLoCo: no outer weights (before_step was not called)")
        self.outer = self.outer.to(params[0].device)
        delta = self.outer - _flat(params)  # this rank's outer gradient
        sent = 0
        if comm.world_size > 1:
            delta.mul_(1.0 / comm.world_size)
            pending = comm.allreduce(delta, f"diloco outer gradient after step {self.step}")
            pending.wait()
            sent = pending.wire_bytes
        m, buf = self.outer_momentum, self.momentum  # torch.optim.SGD's arithmetic
        update = delta
        if m:
            if buf is None:
                buf = delta.clone()
            else:
                buf = buf.to(delta.device)
                buf.mul_(m).add_(delta)
            self.momentum = buf
            update = delta.add(buf, alpha=m) if self.nesterov else buf
        self.outer.add_(update, alpha=-self.outer_lr)
        _unflatten_into(self.outer, params)
        return sent

    def in_sync(self) -> bool:
        done = self.step - self.start_step
        return done <= 0 or done % self.inner_steps == 0

    def state_dict(self) -> dict[str, Any]:
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        return {"step": self.step, "outer": copy(self.outer), "momentum": copy(self.momentum)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.outer, self.momentum = state.get("outer"), state.get("momentum")

    def __repr__(self) -> str:
        return (
            f"DiLoCo(inner_steps={self.inner_steps}, start_step={self.start_step}, "
            f"outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
            f"nesterov={int(self.nesterov)})"
        )


class Synchronizer:
    """A :class:`DataParallel`'s strategy, its parameters and the optimizers it watches.

    Args:
        sync: a spec (``"localsgd:8:start=100"``) or a strategy object.
        params: the parameters it synchronises (the engine's trainable ones).
        compressor: the gradients' compressor: one with per-rank state (residuals) is
            refused beside a periodic strategy, which stops sending gradients after its start.
        comm: the collective the synchronisations go through (the engine's).

    Raises:
        ConfigError: a bad spec, a compressor with state beside a periodic strategy, or
            parameters of several dtypes (averaged in one flat buffer).
    """

    def __init__(
        self,
        sync: str | SyncStrategy,
        params: list[torch.Tensor],
        compressor: Compressor,
        comm: Collective,
    ) -> None:
        self.strategy: SyncStrategy = build_sync(sync) if isinstance(sync, str) else sync
        self.params = params
        self.comm = comm
        self.compressor = compressor
        self.periodic = self.strategy.name != "every-step"
        self._handles: dict[int, Any] = {}
        #: bytes this rank sent in the synchronisation after the last optimizer step
        self.last_wire_bytes = 0
        #: whether the last training forward's backward averaged the gradients
        self.last_reduced = True
        if self.periodic and not compressor.stateless:
            raise ConfigError(
                f"sync={self.strategy.name!r} with compression={compressor.name!r}: the "
                "compressor keeps per-rank residuals, which would never be sent once the "
                "gradients stop being averaged; valid: compression none, fp16 or bf16 (used "
                "in the averaged steps before the start), or sync='every-step'"
            )
        if self.periodic and len({p.dtype for p in params}) > 1:
            raise ConfigError(
                f"sync={self.strategy.name!r} averages the parameters in one flat buffer; "
                f"these have dtypes {sorted(str(d) for d in {p.dtype for p in params})}; "
                "valid: parameters of one dtype"
            )

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps and synchronise after them (idempotent).

        Raises:
            ConfigError: the optimizer applies momentum beside a compressor that applies it
                (:func:`syncline.dp.pairing.check_pair`).
        """
        check_pair(self.compressor, optimizer)
        if id(optimizer) not in self._handles:
            self._handles[id(optimizer)] = optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_: Any) -> None:
        self.last_wire_bytes = self.strategy.after_step(self.params, self.comm)

    def begin_forward(self, sync_enabled: bool, training: bool) -> bool:
        """A forward starts: whether its backward averages the gradients.

        Raises:
            ConfigError: a periodic strategy whose optimizer was never attached (its
                synchronisations would silently never happen).
        """
        if self.periodic and training and not self._handles:
            raise ConfigError(
                f"DataParallel(sync={self.strategy.name!r}) synchronises after each optimizer "
                "step and was given no optimizer: call model.attach(optimizer) once, after "
                "creating it"
            )
        reduce = sync_enabled and self.strategy.reduces()
        if training:
            self.strategy.before_step(self.params)
            self.last_reduced = reduce
        return reduce

    def in_sync(self) -> bool:
        """Whether every rank holds the same weights now (after the steps counted so far)."""
        return self.strategy.in_sync()

    def state_dict(self) -> dict[str, Any]:
        """The strategy's name and state (its step; DiLoCo's outer weights and momentum)."""
        return {"name": self.strategy.name, "state": self.strategy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`.

        Raises:
            ConfigError: the state is another strategy's.
        """
        if state.get("name") != self.strategy.name:
            raise ConfigError(
                f"checkpoint sync {state.get('name')!r} != configured {self.strategy.name!r}"
            )
        self.strategy.load_state_dict(state["state"])

    def restart_at(self, step: int) -> None:
        """Go on at optimizer step ``step`` with the replicas identical but nothing else
        known (a checkpoint resumed on another number of ranks): DiLoCo takes the current
        weights as its outer weights, with a fresh momentum."""
        self.strategy.load_state_dict({"step": step})
