"""PURE: a cluster as the planner sees it: links, memory, compute speed, measured overheads.

A description is measured once on the machine at hand (``syncline plan --profile``) or
written by hand for hardware nobody here has (64 V100s, 8 per server). Links follow the
alpha-beta model every collective's price rests on (Hockney 1994; the ring allreduce of
Patarasuk and Yuan 2009): a message of ``n`` bytes takes ``latency + n / bandwidth``.

JSON form (sizes and rates as numbers or strings with units)::

    {"name": "v100-x8", "ranks_per_node": 8, "memory_per_rank": "16GiB",
     "intra": {"bandwidth": "1200gbit", "latency_s": 5e-6},
     "inter": {"bandwidth": "25gbit", "latency_s": 2e-5},
     "flops_per_s": 1.0e14}

or, instead of ``flops_per_s``, a ``"device"`` (:class:`~syncline.planner.device.Device`: peak
FLOP/s, memory bandwidth and the efficiency curve of its kernels, with their sources), and
``"base_memory"`` / ``"workspace"``: what a rank holds before the model, and what a step
holds beyond the model's state and stashed activations.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_float, check_int
from syncline.planner.device import Device

__all__ = ["Cluster", "Link", "parse_bandwidth", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from ``12345``, ``"16GiB"``, ``"512MB"`` (powers of 1024 for KiB/MiB/GiB/TiB).

    Raises:
        ConfigError: naming the value and the valid forms.

    Example:
        >>> parse_size("16GiB"), parse_size("1.5kb"), parse_size(7)
        (17179869184, 1500, 7)
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a size; valid: bytes or e.g. '16GiB'")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = _NUMBER.match(str(value))
        if match is None or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(
                f"{what}={value!r} is not a size; valid: bytes or a number with "
                "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, e.g. '16GiB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = round(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{what}={value!r} must be positive")
    return size


def parse_bandwidth(value: object, what: str = "bandwidth") -> float:
    """Bytes per second from a number (bytes/s) or a rate string in bits (``"25gbit"``).

    Raises:
        ConfigError: naming the value and the valid forms.

    Example:
        >>> parse_bandwidth("8gbit"), parse_bandwidth(1e9)
        (1000000000.0, 1000000000.0)
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        rate = float(value)
    else:
        match = _NUMBER.match(str(value))
        if match is None or match.group(2).lower() not in _RATE_UNITS:
            raise ConfigError(
                f"{what}={value!r} is not a rate; valid: bytes/s or a number with bit, "
                "kbit, mbit, gbit or tbit, e.g. '25gbit'"
            )
        rate = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()] / 8
    if rate <= 0:
        raise ConfigError(f"{what}={value!r} must be positive")
    return rate


def _check_nonnegative(what: str, value: float) -> None:
    check_float(what, value, at_least=0, finite=False)


@dataclass(frozen=True)
class Link:
    """One kind of link between two ranks."""

    bandwidth: float
    """Bytes per second one rank sends (and receives) at once, unidirectional."""
    latency_s: float = 0.0
    """Seconds a message costs whatever its size (software and wire)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth, "link.bandwidth"))
        _check_nonnegative("link.latency_s", self.latency_s)

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` in one message."""
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """A cluster of identical ranks, ``ranks_per_node`` to a node.

    Measured numbers that are not links (``base_memory``, ``step_overhead_s``, the
    compressors' compute) are this machine's; a hand-written description may leave them 0.
    """

    name: str
    """What the description is of, e.g. ``"this machine (loopback)"``."""
    ranks_per_node: int
    """Ranks sharing a node's fast links (GPUs per server)."""
    memory_per_rank: int
    """Bytes one rank may hold (GPU memory; on CPU, this machine's RAM over its ranks)."""
    intra: Link
    """The link between two ranks of one node."""
    inter: Link
    """The link between ranks of different nodes."""
    flops_per_s: float | None = None
    """Sustained FLOP/s of one rank, for model costs computed from a model's shape."""
    base_memory: int = 0
    """Bytes a rank holds before any model state (the framework, the process group)."""
    step_overhead_s: float = 0.0
    """Seconds each training step spends outside the model (data, logging, the loop)."""
    microbatch_overhead_s: float = 0.0
    """Seconds each pipeline micro-batch costs beyond its layers (dispatch, packing)."""
    compress_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    """Compute seconds per gradient byte of each compressor (by name), on one rank."""
    reduce_s_per_byte: float = 0.0
    """Compute seconds per byte an allreduce spends summing what it receives (gloo sums on
    the CPU; measured by fitting allreduce times on top of the point-to-point link)."""
    update_s_per_byte: float = 0.0
    """Seconds per parameter byte of copying a weight version (2BW's STEP copies one)."""
    overlap_slowdown: float = 0.0
    """Compute time lost per second of communication that overlaps it (CPU ranks share
    their cores with the communication threads; ~0 on GPUs)."""
    inter_ports_per_node: int = 1
    """Network ports a node has at the ``inter`` bandwidth. Ranks of one node that cross
    nodes at once share them (a hierarchical allreduce's per-rank rings, a stage's
    replicas sending to the next stage); a flat ring crosses each node boundary once."""
    device: Device | None = None
    """The accelerator kind, for model costs computed from a model's shape on a roofline
    (:mod:`syncline.planner.device`); a profiled cluster leaves it out."""
    workspace: int = 0
    """Bytes a training step holds on every rank beyond the model state and the stash (the
    libraries' workspaces, the allocator's slack); a profile measures its own per model."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"cluster name={self.name!r} is invalid; valid: a non-empty string")
        check_int("ranks_per_node", self.ranks_per_node)
        object.__setattr__(
            self, "memory_per_rank", parse_size(self.memory_per_rank, "memory_per_rank")
        )
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if isinstance(link, Mapping):
                object.__setattr__(self, name, Link(**link))
            elif not isinstance(link, Link):
                raise ConfigError(f"cluster {name}={link!r} is not a link")
        if self.flops_per_s is not None:
            _check_nonnegative("flops_per_s", self.flops_per_s)
        base = 0 if self.base_memory == 0 else parse_size(self.base_memory, "base_memory")
        object.__setattr__(self, "base_memory", base)
        work = 0 if self.workspace == 0 else parse_size(self.workspace, "workspace")
        object.__setattr__(self, "workspace", work)
        if isinstance(self.device, Mapping):
            object.__setattr__(self, "device", Device.from_dict(self.device))
        elif self.device is not None and not isinstance(self.device, Device):
            raise ConfigError(f"cluster device={self.device!r} is not a device description")
        for name in (
            "step_overhead_s",
            "microbatch_overhead_s",
            "reduce_s_per_byte",
            "update_s_per_byte",
            "overlap_slowdown",
        ):
            _check_nonnegative(name, getattr(self, name))
        check_int("inter_ports_per_node", self.inter_ports_per_node)
        for key, value in self.compress_s_per_byte.items():
            _check_nonnegative(f"compress_s_per_byte[{key!r}]", value)
        object.__setattr__(self, "compress_s_per_byte", dict(self.compress_s_per_byte))

    def nodes(self, ranks: int) -> int:
        """Nodes ``ranks`` occupy (the last may be partly used)."""
        return -(-ranks // self.ranks_per_node)

    def link_between(self, group: list[int]) -> Link:
        """The slowest link a group of ranks (by global rank) communicates over."""
        nodes = {r // self.ranks_per_node for r in group}
        return self.intra if len(nodes) <= 1 else self.inter

    def inter_shared(self, concurrent: int) -> Link:
        """The ``inter`` link as each of ``concurrent`` ranks of one node sees it when they
        all cross nodes at once over the node's ports."""
        share = min(1.0, self.inter_ports_per_node / max(1, concurrent))
        if share == 1.0:
            return self.inter
        return Link(self.inter.bandwidth * share, self.inter.latency_s)

    def with_ranks_per_node(self, ranks_per_node: int | None) -> Cluster:
        """This cluster with another node size (``--ranks-per-node``), or itself."""
        if ranks_per_node is None or ranks_per_node == self.ranks_per_node:
            return self
        return Cluster(**{**self._fields(), "ranks_per_node": ranks_per_node})

    def with_memory(self, memory_per_rank: int | None) -> Cluster:
        """This cluster with another memory per rank (``--memory-per-rank``), or itself."""
        if memory_per_rank is None:
            return self
        return Cluster(**{**self._fields(), "memory_per_rank": memory_per_rank})

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """A cluster from its JSON form.

        Raises:
            ConfigError: an unknown or missing key, or a bad value, named.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"cluster: unknown keys {unknown}; valid: {sorted(known)}")
        missing = sorted(
            {"name", "ranks_per_node", "memory_per_rank", "intra", "inter"} - set(data)
        )
        if missing:
            raise ConfigError(f"cluster: missing keys {missing}")
        try:
            return cls(**data)
        except TypeError as exc:  # a link with unknown keys
            raise ConfigError(f"cluster: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read a JSON description (a cluster alone, or under ``"cluster"`` in a profile).

        Raises:
            ConfigError: the file cannot be read or is not a valid description.
        """
        return cls.from_dict(read_section(path, "cluster", "cluster file"))


def read_section(path: str | Path, key: str, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, or the one under ``key`` when the file is a whole
    profile (``{"cluster": ..., "model": ...}``).

    Raises:
        ConfigError: the file cannot be read or holds no JSON object.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    if isinstance(data, dict) and key in data:
        data = data[key]
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} does not hold a JSON object")
    return data
