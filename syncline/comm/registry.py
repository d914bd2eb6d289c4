"""PURE: the allreduce-algorithm registry: what ``allreduce=NAME`` builds, and where it fits.

An entry's ``build(group, timeout_s, ranks_per_node)`` returns a
:class:`~syncline.comm.collectives.Collective` (collective calls: every rank builds it at the
same point). Adding an algorithm is one ``Collective`` class plus one
``ALLREDUCE.register(AllreduceSpec(...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from syncline.registry import Registry, resolve

__all__ = ["ALLREDUCE", "AllreduceSpec", "build_allreduce", "resolve_allreduce"]


@dataclass(frozen=True)
class AllreduceSpec:
    """One allreduce algorithm.

    Attributes:
        name: what ``allreduce=`` and ``--allreduce`` take.
        summary: one line for ``--help``.
        build: ``(group, timeout_s, ranks_per_node) -> Collective`` or ``"module:function"``.
        with_pipelines: usable for the REDUCE of a pipeline stage's replicas (a subgroup);
            algorithms that need the whole world's topology are not.
    """

    name: str
    summary: str
    build: str | Callable[[Any, float, int | None], Any]
    with_pipelines: bool = True


ALLREDUCE: Registry[AllreduceSpec] = Registry("allreduce")


def build_allreduce(
    name: str, group: Any = None, *, timeout_s: float, ranks_per_node: int | None = None
) -> Any:
    """Build the registered algorithm ``name`` over ``group`` (a collective call).

    Raises:
        ConfigError: an unknown name (listing the valid ones) or a bad topology.
    """
    return resolve(ALLREDUCE.get(name).build)(group, timeout_s, ranks_per_node)


def resolve_allreduce(allreduce: Any, group: Any = None, *, timeout_s: float) -> Any:
    """A registered algorithm's name built over ``group`` (:func:`build_allreduce`), or a
    ``Collective`` the caller built (e.g. a hierarchical one from a topology) as it is."""
    if isinstance(allreduce, str):
        return build_allreduce(allreduce, group, timeout_s=timeout_s)
    return allreduce


ALLREDUCE.register(
    AllreduceSpec("flat", "one ring over all ranks", "syncline.comm.collectives:build_flat")
)
ALLREDUCE.register(
    AllreduceSpec(
        "hierarchical",
        "reduce-scatter in each node, allreduce across nodes, allgather in each node",
        "syncline.comm.hierarchical:build_hierarchical",
    )
)
