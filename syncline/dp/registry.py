"""PURE: the compressor registry, and the ``--compression`` spec grammar it defines.

A spec is ``name[:ARGUMENT][:key=value]...``, e.g. ``csc:0.01:warmup=50``; each
:class:`CompressorSpec` says which argument and options its name takes, and every parse
error lists the valid forms of all registered compressors. Adding a compressor is one module
(a class following :class:`syncline.dp.compression.Compressor`) plus one
``COMPRESSORS.register(CompressorSpec(...))``.

Example:
    >>> COMPRESSORS.register(CompressorSpec("mine", "my compressor", factory=Mine))
    >>> build_compressor("mine").name
    'mine'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from syncline.errors import ConfigError
from syncline.registry import Registry, resolve

if TYPE_CHECKING:
    from syncline.dp.compression import Compressor

__all__ = ["COMPRESSORS", "CompressorSpec", "build_compressor", "compressor_name", "forms"]


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor as the command line and the trainers see it.

    Attributes:
        name: the spec's first word.
        summary: what goes on the wire, e.g. ``"fp16 on the wire"``.
        factory: the compressor class (or ``"module:Class"``), called with the parsed values.
        argument: ``(keyword, type, METAVAR)`` of the one positional value, if it takes one.
        options: ``key -> (keyword, type, METAVAR)`` of its ``key=value`` options.
        owns_momentum: applies momentum itself before sparsifying (CSC's momentum
            correction), so SGD must run without momentum beside it.
        traffic: its bytes on the wire per bucket, for the planner (``"module:function"``
            or a function, see :mod:`syncline.dp.traffic`); ``None``: the planner cannot
            price it and says so.
        state_buffers: gradient-sized fp32 buffers it keeps per parameter (CSC: the
            momentum and the residual), for the planner's memory.
        transient_bytes: bytes per element of the largest bucket it allocates while it
            reduces it, for the planner's peak memory.
        example: a spec of it that runs, for tests and docs (default: its name).
    """

    name: str
    summary: str
    factory: str | Callable[..., Any]
    argument: tuple[str, type, str] | None = None
    options: Mapping[str, tuple[str, type, str]] = field(default_factory=dict)
    owns_momentum: bool = False
    traffic: str | Callable[..., Any] | None = None
    state_buffers: int = 0
    transient_bytes: float = 0.0
    example: str | None = None

    @property
    def form(self) -> str:
        """The spec's grammar, e.g. ``topk:RATIO`` or ``powersgd:RANK[:warmup=N][:seed=S]``."""
        text = self.name + (f":{self.argument[2]}" if self.argument else "")
        return text + "".join(f"[:{key}={meta}]" for key, (_, _, meta) in self.options.items())


COMPRESSORS: Registry[CompressorSpec] = Registry("compressor")


def forms() -> dict[str, str]:
    """Every registered spec form and what it means (what ``--help`` and errors print)."""
    return {spec.form: spec.summary for spec in COMPRESSORS}


def _fail(spec: str, why: str) -> ConfigError:
    return ConfigError(f"compression spec {spec!r}: {why}; valid forms: {', '.join(forms())}")


def compressor_name(spec: str) -> str:
    """The registry name a spec starts with (``"csc:0.01"`` -> ``"csc"``), lower-cased."""
    return spec.strip().split(":")[0].lower()


class SpecEntry(Protocol):
    """What :func:`parse_spec` reads of a registry entry (compressors, synchronisations)."""

    @property
    def name(self) -> str: ...
    @property
    def argument(self) -> tuple[str, type, str] | None: ...
    @property
    def options(self) -> Mapping[str, tuple[str, type, str]]: ...


S = TypeVar("S", bound=SpecEntry)


def parse_spec(
    registry: Registry[S], spec: str, fail: Callable[[str, str], ConfigError]
) -> tuple[S, dict[str, Any]]:
    """The entry of ``registry`` a ``name[:ARGUMENT][:key=value]...`` spec names and the
    keyword arguments it gives (``fail(spec, why)`` makes the error, listing valid forms)."""
    name, *parts = spec.strip().split(":")
    if name.lower() not in registry:
        raise fail(spec, f"unknown {registry.kind} {name!r}")
    entry = registry.get(name.lower())
    kwargs: dict[str, Any] = {}

    def convert(key: str, text: str, kind: type) -> Any:
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise fail(spec, f"{key}={text!r} is not {what}") from None

    if entry.argument is not None:
        arg, kind, _ = entry.argument
        if not parts or "=" in parts[0]:
            raise fail(spec, f"{name} needs its {arg}")
        kwargs[arg] = convert(arg, parts[0], kind)
        parts = parts[1:]
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or key not in entry.options:
            valid = ", ".join(f"{k}=" for k in entry.options) or "none"
            raise fail(spec, f"unexpected {part!r} (options of {name}: {valid})")
        arg, kind, _ = entry.options[key]
        if arg in kwargs:
            raise fail(spec, f"{key}= given twice")
        kwargs[arg] = convert(key, text, kind)
    return entry, kwargs


def parse(spec: str) -> tuple[CompressorSpec, dict[str, Any]]:
    """The registry entry a spec names and the keyword arguments it gives; no torch needed.

    Raises:
        ConfigError: on an unknown name, a missing or extra argument, or a bad value; the
            message lists the valid forms.
    """
    return parse_spec(COMPRESSORS, spec, _fail)


def build_compressor(spec: str) -> Compressor:
    """Build a compressor from a command-line spec.

    Args:
        spec: one of :func:`forms`, e.g. ``"none"``, ``"fp16"``, ``"csc:0.01:warmup=50"``,
            ``"topk:0.01"``, ``"powersgd:4"``, or a registered plug-in's.

    Returns:
        The compressor, validated by its own constructor.

    Raises:
        ConfigError: on an unknown name, a missing or extra argument, or a bad value; the
            message lists the valid forms.

    Example:
        >>> build_compressor("csc:0.05:warmup=20").warmup_steps
        20
    """
    entry, kwargs = parse(spec)
    compressor: Compressor = resolve(entry.factory)(**kwargs)
    return compressor


_C = "syncline.dp.compressors"
_T = "syncline.dp.traffic"
COMPRESSORS.register(
    CompressorSpec(
        "none",
        "lossless fp32 allreduce",
        "syncline.dp.compression:NoCompression",
        traffic=f"{_T}:dense",
    )
)
for _half in ("fp16", "bf16"):
    COMPRESSORS.register(
        CompressorSpec(
            _half,
            f"{_half} on the wire",
            f"{_C}.halfwidth:{_half.upper()}",
            traffic=f"{_T}:halfwidth",
            transient_bytes=2,
        )
    )
COMPRESSORS.register(
    CompressorSpec(
        "csc",
        "coarse-grained sparse (GradientFlow), e.g. csc:0.01",
        f"{_C}.csc:CSC",
        argument=("density", float, "DENSITY"),
        options={
            "warmup": ("warmup_steps", int, "N"),
            "chunk": ("chunk_elems", int, "C"),
            "momentum": ("momentum", float, "M"),
            "ramp": ("ramp", str, "dense|exp"),
            "clip": ("clip", float, "X"),
            "bound": ("bound", float, "B"),
        },
        owns_momentum=True,
        traffic=f"{_T}:csc",
        state_buffers=2,
        transient_bytes=4,  # a dense step's fp32 copy; chunk scores read |v| 4 MiB at a time
        example="csc:0.01",
    )
)
COMPRESSORS.register(
    CompressorSpec(
        "topk",
        "element-wise top-k with error feedback, e.g. topk:0.01",
        f"{_C}.topk:TopK",
        argument=("ratio", float, "RATIO"),
        traffic=f"{_T}:topk",
        state_buffers=1,
        transient_bytes=5,
        example="topk:0.01",
    )
)
COMPRESSORS.register(
    CompressorSpec(
        "powersgd",
        "low-rank PowerSGD, e.g. powersgd:4",
        f"{_C}.powersgd:PowerSGD",
        argument=("rank", int, "RANK"),
        options={"warmup": ("warmup_steps", int, "N"), "seed": ("seed", int, "S")},
        traffic=f"{_T}:powersgd",
        state_buffers=1,
        transient_bytes=2,
        example="powersgd:4",
    )
)
