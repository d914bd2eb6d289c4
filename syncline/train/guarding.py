"""What ``syncline train`` does with the non-finite guard's verdicts: read late, act, record.

The verdict of a step is settled on the device, inside the step's own allreduce
(:mod:`syncline.dp.guard`), and the optimizer already skipped on it there. The host learns of
it **one step later**: after step ``k`` is queued, its verdict is copied to the host without
waiting (``non_blocking``, into pinned memory on a GPU, with a CUDA event); once step ``k+1``
is queued, the host waits for that event (step ``k``'s work, long done or nearly: the device
never idles for it) and reads the copy. Before a checkpoint, whose writing reads the device
anyway, the outstanding verdict is read at once, so no checkpoint is written after an event.

What "``stop`` ends within step ``k``" means here: the update of step ``k`` is never applied,
nor that of step ``k+1``, which may already be queued when the host reads step ``k``'s
verdict (``stop`` latches on the device: once set, every update is dropped until the host
acts); no checkpoint holds any step from ``k`` on; then every rank ends with the one line. The
weights left in memory are those after step ``k-1``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from syncline import comm
from syncline.dp.guard import VERDICT_FIELDS, StepGuard
from syncline.dp.guard_config import GuardConfig

__all__ = ["GuardEvent", "GuardStop", "GuardWatch", "batch_of", "inject"]


class GuardStop(RuntimeError):
    """The run ended by ``--on-nonfinite stop``; the message is the one line."""


@dataclass(frozen=True)
class GuardEvent:
    """One event as metrics.jsonl, summary.json and ``syncline report`` record it."""

    step: int
    kind: str  # "nonfinite" or "spike"
    action: str  # "stop", "skip" or "rollback"
    loss: float  # the ranks' mean loss of the step
    median: float | None  # the window's median before it (spikes)
    ranks: list[int] | None = None  # ranks that saw a non-finite value (stop)
    parameter: str | None = None  # the first non-finite parameter (stop)
    rolled_back_to: int | None = None  # rollback: the checkpoint's step
    skipped_batches: list[int] | None = None  # rollback: the batches left out


class GuardWatch:
    """The host's side of one rank's guard: the outstanding verdict copy and the events."""

    def __init__(self, config: GuardConfig, guard: StepGuard | None, device: torch.device) -> None:
        self.config = config
        self.guard = guard
        self.cuda = device.type == "cuda"
        self._pending: tuple[int, torch.Tensor, Any] | None = None
        self.events: list[GuardEvent] = []

    def after_step(self, step: int) -> dict[str, float] | None:
        """Step ``step`` is queued: copy its verdict to the host without waiting; returns the
        previous step's verdict if it was an event (else ``None``)."""
        if self.guard is None:
            return None
        earlier, self._pending = self._pending, self._copy(step)
        return self._read(earlier)

    def settle_now(self) -> dict[str, float] | None:
        """The outstanding verdict, read now (before a checkpoint; the device is read then
        anyway); ``None`` if it was no event."""
        earlier, self._pending = self._pending, None
        return self._read(earlier)

    def forget(self) -> None:
        """Drop the outstanding verdict (after a rollback: that step is undone)."""
        self._pending = None

    def _copy(self, step: int) -> tuple[int, torch.Tensor, Any]:
        assert self.guard is not None
        verdict = self.guard.verdict
        host = torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=self.cuda)
        host.copy_(verdict, non_blocking=self.cuda)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        return step, host, done

    @staticmethod
    def _read(pending: tuple[int, torch.Tensor, Any] | None) -> dict[str, float] | None:
        if pending is None:
            return None
        step, host, done = pending
        if done is not None:
            done.synchronize()
        values = dict(zip(VERDICT_FIELDS, host.tolist(), strict=True))
        if not values["event"]:
            return None
        values["step"] = step
        return values

    def event(self, verdict: dict[str, float], **extra: Any) -> GuardEvent:
        """Record the event of ``verdict`` (every rank keeps the list; rank 0 writes it)."""
        median = verdict["median"]
        found = GuardEvent(
            step=int(verdict["step"]),
            kind="nonfinite" if verdict["nonfinite"] else "spike",
            action=self.config.on_nonfinite,
            loss=verdict["loss"],
            median=None if median != median else median,  # NaN: the window was not full
            **extra,
        )
        self.events.append(found)
        return found

    def stop_line(
        self, verdict: dict[str, float], rank: int, timeout_s: float, device: torch.device
    ) -> str:
        """The ``stop`` line, naming the step, the ranks and the first non-finite parameter:
        each rank's own observation of that step, gathered once (the run ends here)."""
        assert self.guard is not None
        mine = (rank, bool(verdict["local"]), self.guard.name_of(int(verdict["first_bad"])))
        seen = comm.gather_objects(
            mine, what="gather of the guard's observations", timeout_s=timeout_s, device=device
        )
        ranks = [r for r, bad, _ in seen or [mine] if bad]
        names = [n for _, bad, n in seen or [mine] if bad and n is not None]
        event = self.event(verdict, ranks=ranks, parameter=names[0] if names else None)
        if event.kind == "spike":
            return (
                f"stopped at step {event.step}: loss spike, mean loss {event.loss:.4g} > "
                f"{self.config.spike_factor} x median {event.median:.4g} of the last "
                f"{self.config.spike_window} steps; no checkpoint after step {event.step - 1}"
            )
        what = f"parameter {event.parameter!r}" if event.parameter else "the loss"
        return (
            f"stopped at step {event.step}: non-finite value on rank(s) "
            f"{', '.join(map(str, event.ranks or [])) or '?'}, first in {what}; "
            f"no checkpoint after step {event.step - 1}"
        )

    def summary(self) -> dict[str, Any]:
        """The summary.json fields: every event, and how many updates were skipped."""
        return {
            "guard": self.config.on_nonfinite,
            "guard_events": [asdict(e) for e in self.events],
            "skipped_steps": sum(e.action == "skip" for e in self.events),
        }

    def write(self, metrics: Path, event: GuardEvent) -> None:
        """Append ``event`` to metrics.jsonl (rank 0), as a line of its own."""
        with metrics.open("a") as f:
            f.write(json.dumps({"guard_event": asdict(event)}) + "\n")


def inject(
    config: GuardConfig, rank: int, step: int, model: torch.nn.Module, loss: torch.Tensor
) -> tuple[torch.Tensor, list[Any]]:
    """The testing aid ``inject_nonfinite``: at its rank and step, the loss x1000
    (``spike``), or a hook that makes the first parameter's gradient NaN (``nan``); the
    loss to backpropagate and the hooks to remove after backward."""
    point = config.injection()
    if point is None or point[:2] != (rank, step):
        return loss, []
    if point[2] == "spike":
        return loss * 1000.0, []
    first = next(p for p in model.parameters() if p.requires_grad)
    return loss, [first.register_hook(lambda g: g * float("nan"))]


def batch_of(step: int, skipped: list[int]) -> int:
    """The batch step ``step`` trains on: the ``step``-th of the data stream once the
    ``skipped`` batches (sorted) are left out.

    Example:
        >>> [batch_of(s, [3, 4]) for s in range(6)]
        [0, 1, 2, 5, 6, 7]
    """
    batch = step
    for b in skipped:
        if b <= batch:
            batch += 1
    return batch
