"""PURE: one accelerator kind as the planner prices its kernels: a roofline with a fixed cost.

For hardware nobody here has, a kernel's time is computed, not measured::

    t(kernel) = kernel_s + max(flops / (peak_flops * efficiency), bytes / memory_bandwidth)

the roofline (Williams, Waterman and Patterson 2009) with a fixed cost per kernel (launch,
ramp-up, tail). The efficiency a kernel reaches therefore rises with the work it carries,

    eff(W) = W / (peak_flops * t(W)) = efficiency / (1 + efficiency * peak_flops * kernel_s / W)

one curve per device kind, set by two numbers whose sources the description names: the
sustained fraction of peak on large work, and the fixed cost of a kernel. A layer of ``k``
kernels on a micro-batch of ``b`` samples then costs ``k * kernel_s + b * per_sample``,
the same ``fixed + per_sample * b`` shape ``syncline plan --profile`` fits to measurements,
so a larger micro-batch runs more efficiently: what pays for a deeper pipeline's memory room.

JSON form (under ``"device"`` in a cluster description)::

    {"kind": "V100-SXM2-16GB", "peak_flops": 125e12, "memory_bandwidth": "900GB",
     "efficiency": 0.30, "kernel_s": 3.8e-6, "source": "..."}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_float

__all__ = ["Device"]


@dataclass(frozen=True)
class Device:
    """An accelerator kind: its datasheet peaks and the efficiency curve its kernels follow."""

    kind: str
    """What the device is, e.g. ``"V100-SXM2-16GB"``."""
    peak_flops: float
    """Peak FLOP/s at the training precision (a datasheet's, e.g. V100 fp16 tensor cores)."""
    memory_bandwidth: float
    """Bytes per second of device memory (a datasheet's; ``"900GB"`` reads as 900e9/s)."""
    efficiency: float
    """Fraction of ``peak_flops`` that large compute-bound kernels sustain (measured or
    published; the source goes in ``source``)."""
    kernel_s: float
    """Fixed seconds each kernel costs whatever its size (launch and ramp; measured or
    published)."""
    source: str
    """Where each number comes from (datasheet, measurement, paper), in words."""

    def __post_init__(self) -> None:
        from syncline.planner.hardware import parse_size

        if not isinstance(self.kind, str) or not self.kind:
            raise ConfigError(f"device kind={self.kind!r} is invalid; valid: a non-empty string")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(
                f"device {self.kind!r}: source={self.source!r}; valid: where its numbers "
                "come from (datasheet, measurement, paper)"
            )
        bandwidth = self.memory_bandwidth
        if isinstance(bandwidth, str):
            bandwidth = parse_size(bandwidth, "device.memory_bandwidth")
        object.__setattr__(self, "memory_bandwidth", float(bandwidth))
        check_float("device.peak_flops", self.peak_flops, above=0)
        check_float("device.memory_bandwidth", self.memory_bandwidth, above=0)
        check_float("device.efficiency", self.efficiency, above=0, at_most=1)
        check_float("device.kernel_s", self.kernel_s, at_least=0)

    @property
    def sustained_flops(self) -> float:
        """FLOP/s of large compute-bound kernels: ``peak_flops * efficiency``."""
        return self.peak_flops * self.efficiency

    def per_sample_s(self, flops: float, nbytes: float = 0.0) -> float:
        """The size-proportional part of a kernel's time: the roofline's larger side."""
        return max(flops / self.sustained_flops, nbytes / self.memory_bandwidth)

    def seconds(self, flops: float, nbytes: float = 0.0, kernels: int = 1) -> float:
        """Seconds of ``kernels`` kernels carrying ``flops`` and moving ``nbytes`` in all."""
        return kernels * self.kernel_s + self.per_sample_s(flops, nbytes)

    def efficiency_at(self, flops: float) -> float:
        """The fraction of peak one compute-bound kernel of ``flops`` reaches (the curve).

        Example:
            >>> d = Device("x", 100e12, 1e12, 0.5, 1e-5, "example")
            >>> round(d.efficiency_at(1e9), 3), round(d.efficiency_at(1e12), 3)
            (0.333, 0.5)
        """
        return flops / (self.peak_flops * self.seconds(flops)) if flops > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        """A device from its JSON form.

        Raises:
            ConfigError: an unknown or missing key, or a bad value, named.
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        missing = [k for k in known if k not in data]
        if unknown or missing:
            raise ConfigError(f"device: unknown keys {unknown}, missing {missing}; valid: {known}")
        return cls(**data)
