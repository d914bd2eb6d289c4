"""PURE: the synchronisation registry: how often replicas agree, and the ``--sync`` grammar.

Compressing sends fewer bytes each step; synchronising less often sends the whole model
every few steps and none between. Each way is a :class:`SyncSpec` in :data:`SYNCS`, named by
a spec in the compressors' grammar (``name[:ARGUMENT][:key=value]...``):

- ``every-step`` (default): the gradients are averaged in every backward (DDP's way);
- ``localsgd:PERIOD[:start=N]``: post-local SGD (Lin et al. 2020, "Don't use large
  mini-batches, use local SGD"): the first ``N`` steps average gradients, then each rank
  steps alone and the parameters are averaged every ``PERIOD`` steps;
- ``diloco:H[:start=N][:outer_lr=LR][:outer_momentum=M][:nesterov=0|1]``: DiLoCo (Douillard
  et al. 2023): after ``H`` inner steps the averaged weight change goes through an outer
  SGD with Nesterov momentum on the outer weights, which become every rank's weights.

The implementations are in :mod:`syncline.dp.periodic`; the planner prices an entry by its
``traffic`` (:func:`syncline.dp.traffic.periodic`).

Example:
    >>> parse_sync("localsgd:8:start=100")[1]
    {'period': 8, 'start_step': 100}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from syncline.dp.registry import parse_spec
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int
from syncline.registry import Registry, resolve

__all__ = [
    "DEFAULT_SYNC",
    "SYNCS",
    "SyncSpec",
    "build_sync",
    "check_diloco",
    "check_localsgd",
    "parse_sync",
    "sync_forms",
]

#: the spec of averaging the gradients every step
DEFAULT_SYNC = "every-step"


@dataclass(frozen=True)
class SyncSpec:
    """One way of keeping the replicas together, as the command line and the planner see it.

    Attributes:
        name: the spec's first word.
        summary: one line for ``--help``.
        factory: the strategy class (or ``"module:Class"``), called with the parsed values.
        argument: ``(keyword, type, METAVAR)`` of the one positional value, if any.
        options: ``key -> (keyword, type, METAVAR)`` of its ``key=value`` options.
        periodic: after its start, no gradient is averaged; the replicas drift apart between
            synchronisations (checkpoints then hold every rank's weights and optimizer).
        state_buffers: parameter-sized fp32 buffers it keeps (DiLoCo: the outer weights and
            their momentum), for the planner's memory.
        check: validates the parsed values (raising :class:`ConfigError`), so that a bad
            value is refused before any process starts; the strategy calls it too.
        traffic: for the planner, ``(numel, value_bytes, **spec values) -> (collectives,
            every)``: what one synchronisation sends (as a compressor's traffic, see
            :mod:`syncline.dp.traffic`) and how many steps apart they are, after its start;
            ``None`` for a strategy that averages the gradients (priced by the compressor).
    """

    name: str
    summary: str
    factory: str | Callable[..., Any]
    argument: tuple[str, type, str] | None = None
    options: Mapping[str, tuple[str, type, str]] = field(default_factory=dict)
    periodic: bool = False
    state_buffers: int = 0
    check: Callable[..., None] | None = None
    traffic: str | Callable[..., Any] | None = None

    @property
    def form(self) -> str:
        """The spec's grammar, e.g. ``localsgd:PERIOD[:start=N]``."""
        text = self.name + (f":{self.argument[2]}" if self.argument else "")
        return text + "".join(f"[:{key}={meta}]" for key, (_, _, meta) in self.options.items())


SYNCS: Registry[SyncSpec] = Registry("sync")


def sync_forms() -> dict[str, str]:
    """Every registered spec form and what it means (what ``--help`` and errors print)."""
    return {spec.form: spec.summary for spec in SYNCS}


def _fail(spec: str, why: str) -> ConfigError:
    return ConfigError(f"sync spec {spec!r}: {why}; valid forms: {', '.join(sync_forms())}")


def parse_sync(spec: str) -> tuple[SyncSpec, dict[str, Any]]:
    """The entry a sync spec names and its keyword arguments; no torch needed.

    Raises:
        ConfigError: an unknown name, a missing or extra argument, or a value that is not a
            number; the message lists the valid forms (ranges are the strategy's to check).
    """
    entry, kwargs = parse_spec(SYNCS, spec, _fail)
    if entry.check is not None:
        entry.check(**kwargs)
    return entry, kwargs


def check_localsgd(period: int, start_step: int = 0) -> None:
    """Post-local SGD's ranges: ``period >= 1``, ``start >= 0``."""
    check_int("localsgd period", period)
    check_int("localsgd start", start_step, low=0)


def check_diloco(
    inner_steps: int,
    start_step: int = 0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: int | bool = True,
) -> None:
    """DiLoCo's ranges: ``H >= 1``, ``start >= 0``, ``outer_lr > 0``, ``outer_momentum`` in
    [0, 1), ``nesterov`` 0 or 1 and only with momentum."""
    check_int("diloco inner_steps H", inner_steps)
    check_int("diloco start", start_step, low=0)
    check_float("diloco outer_lr", outer_lr, above=0)
    check_float("diloco outer_momentum", outer_momentum, at_least=0, below=1)
    if nesterov not in (0, 1):
        raise ConfigError(f"diloco nesterov={nesterov!r} is invalid; valid: 0 or 1")
    if nesterov and not outer_momentum:
        raise ConfigError(
            "diloco nesterov=1 with outer_momentum=0 is invalid (no momentum to look ahead "
            "with); valid: outer_momentum > 0, or nesterov=0"
        )


def build_sync(spec: str) -> Any:
    """The strategy a spec names (:mod:`syncline.dp.periodic`), validated by its constructor.

    Raises:
        ConfigError: as :func:`parse_sync`, or a value out of range, naming it.

    Example:
        >>> build_sync("diloco:50").outer_lr
        0.7
    """
    entry, kwargs = parse_sync(spec)
    return resolve(entry.factory)(**kwargs)


_P = "syncline.dp.periodic"
SYNCS.register(SyncSpec(DEFAULT_SYNC, "average the gradients in every backward", f"{_P}:EveryStep"))
SYNCS.register(
    SyncSpec(
        "localsgd",
        "post-local SGD: dense for start steps, then average the weights every PERIOD steps",
        f"{_P}:LocalSGD",
        argument=("period", int, "PERIOD"),
        options={"start": ("start_step", int, "N")},
        periodic=True,
        check=check_localsgd,
        traffic="syncline.dp.traffic:localsgd",
    )
)
SYNCS.register(
    SyncSpec(
        "diloco",
        "DiLoCo: H inner steps, then an outer Nesterov SGD step on the averaged weight change",
        f"{_P}:DiLoCo",
        argument=("inner_steps", int, "H"),
        options={
            "start": ("start_step", int, "N"),
            "outer_lr": ("outer_lr", float, "LR"),
            "outer_momentum": ("outer_momentum", float, "M"),
            "nesterov": ("nesterov", int, "0|1"),
        },
        periodic=True,
        state_buffers=2,
        check=check_diloco,
        traffic="syncline.dp.traffic:diloco",
    )
)
