"""Parse command-line compressor specs such as ``"csc:0.01:warmup=50"`` into compressors.

The grammar is ``name[:positional][:key=value]...``; one table below is the source of truth
for the valid forms, and every error prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from syncline.dp.compression import Compressor, NoCompression
from syncline.dp.compressors.csc import CSC
from syncline.dp.compressors.halfwidth import BF16, FP16
from syncline.dp.compressors.powersgd import PowerSGD
from syncline.dp.compressors.topk import TopK
from syncline.errors import ConfigError

#: spec form -> what it means (printed by every parse error)
FORMS = {
    "none": "lossless fp32 allreduce",
    "fp16": "fp16 on the wire",
    "bf16": "bf16 on the wire",
    "csc:DENSITY[:warmup=N][:chunk=C][:momentum=M][:ramp=dense|exp]": (
        "coarse-grained sparse, e.g. csc:0.01"
    ),
    "topk:RATIO": "element-wise top-k with error feedback, e.g. topk:0.01",
    "powersgd:RANK[:warmup=N]": "low-rank PowerSGD, e.g. powersgd:4",
}

# name -> (positional argument name and type, {key: (argument name, type)}, factory)
_Table = dict[str, tuple[tuple[str, type] | None, dict[str, tuple[str, type]], Callable[..., Any]]]
_TABLE: _Table = {
    "none": (None, {}, NoCompression),
    "fp16": (None, {}, FP16),
    "bf16": (None, {}, BF16),
    "csc": (
        ("density", float),
        {
            "warmup": ("warmup_steps", int),
            "chunk": ("chunk_elems", int),
            "momentum": ("momentum", float),
            "ramp": ("ramp", str),
        },
        CSC,
    ),
    "topk": (("ratio", float), {}, TopK),
    "powersgd": (("rank", int), {"warmup": ("warmup_steps", int)}, PowerSGD),
}


def _fail(spec: str, why: str) -> ConfigError:
    forms = ", ".join(FORMS)
    return ConfigError(f"compression spec {spec!r}: {why}; valid forms: {forms}")


def _convert(spec: str, key: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise _fail(spec, f"{key}={text!r} is not {what}") from None


def build_compressor(spec: str) -> Compressor:
    """Build a compressor from a CLI-style spec.

    Args:
        spec: one of :data:`FORMS`, e.g. ``"none"``, ``"fp16"``, ``"csc:0.01:warmup=50"``,
            ``"topk:0.01"``, ``"powersgd:4"``.

    Returns:
        The compressor, validated by its own constructor.

    Raises:
        ConfigError: on an unknown name, a missing or extra argument, or a bad value; the
            message lists the valid forms.

    Example:
        >>> build_compressor("csc:0.05:warmup=20").warmup_steps
        20
    """
    name, *parts = spec.strip().split(":")
    entry = _TABLE.get(name.lower())
    if entry is None:
        raise _fail(spec, f"unknown compressor {name!r}")
    positional, keys, factory = entry
    kwargs: dict[str, Any] = {}
    if positional is not None:
        if not parts or "=" in parts[0]:
            raise _fail(spec, f"{name} needs its {positional[0]}")
        kwargs[positional[0]] = _convert(spec, positional[0], parts[0], positional[1])
        parts = parts[1:]
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or key not in keys:
            valid = ", ".join(f"{k}=" for k in keys) or "none"
            raise _fail(spec, f"unexpected {part!r} (options of {name}: {valid})")
        arg, kind = keys[key]
        if arg in kwargs:
            raise _fail(spec, f"{key}= given twice")
        kwargs[arg] = _convert(spec, key, text, kind)
    compressor: Compressor = factory(**kwargs)
    return compressor
