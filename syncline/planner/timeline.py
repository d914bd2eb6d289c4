"""PURE: a schedule compiled once into arrays, then timed many times with different costs.

The planner prices thousands of configurations, many sharing one schedule (same depth,
micro-batches and recomputation; other compressors or link speeds). The schedule engine
(:func:`syncline.schedule._engine.execute`) decides the dependencies; this keeps them, in an
order valid for any costs (a topological order of the same dependency graph: each rank's
list order plus "a RECV after its SEND", "a stage after its neighbour" without
communication), so timing a schedule again is one pass of float arithmetic. The timing rules
are the engine's: an action starts when its rank is free and its dependency has ended (a RECV
also waits for the message's latency).
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.schedule._engine import RECVS, cross_dependency, execute, has_communication, key
from syncline.schedule.ir import ActionKind, Schedule, ScheduleError

__all__ = ["Compiled", "compile_schedule"]


@dataclass(frozen=True)
class Compiled:
    """A schedule as arrays, in an execution order valid for any costs.

    Attributes:
        ranks: number of ranks.
        order: ``(rank, position, price index, dependency order index or -1, is_recv)``.
        slots: ``(kind, stage)`` of each price index.
        positions: ``positions[rank]``, the order index of each of the rank's actions.
    """

    ranks: int
    order: tuple[tuple[int, int, int, int, bool], ...]
    slots: tuple[tuple[ActionKind, int], ...]
    positions: tuple[tuple[int, ...], ...]

    def run(self, price: list[float], delay: list[float]) -> list[list[float]]:
        """End time of each action, ``ends[rank][position]``, for per-slot costs.

        ``price[i]`` is the duration of an action of slot ``i``; ``delay[i]`` the latency a
        RECV of slot ``i`` adds after its SEND.
        """
        end = [0.0] * len(self.order)
        free = [0.0] * self.ranks
        for index, (rank, _pos, slot, dep, recv) in enumerate(self.order):
            start = free[rank]
            if dep >= 0:
                ready = end[dep] + (delay[slot] if recv else 0.0)
                if ready > start:
                    start = ready
            finish = start + price[slot]
            end[index] = finish
            free[rank] = finish
        return [[end[i] for i in pos] for pos in self.positions]


def compile_schedule(schedule: Schedule) -> Compiled:
    """Compile ``schedule`` (its dependencies, a valid order, its price slots).

    Raises:
        ScheduleError: the schedule deadlocks.
    """
    run = execute(schedule, lambda a: 1.0)
    if run.stalled:
        raise ScheduleError(f"{schedule.name} deadlocks")
    with_comm = has_communication(schedule)
    timed = [
        (run.times[rank][i][0], rank, i)
        for rank, acts in schedule.actions.items()
        for i in range(len(acts))
    ]
    timed.sort()
    slot_of: dict[tuple[ActionKind, int], int] = {}
    index_of: dict[tuple[int, int], int] = {}
    first_of: dict[object, int] = {}
    order: list[tuple[int, int, int, int, bool]] = []
    ranks = sorted(schedule.actions)
    rank_index = {r: i for i, r in enumerate(ranks)}
    for start, rank, i in timed:
        del start
        action = schedule.actions[rank][i]
        slot = slot_of.setdefault((action.kind, action.stage), len(slot_of))
        dep_key = cross_dependency(action, schedule.num_stages, with_comm)
        dep = -1 if dep_key is None else first_of[dep_key]
        index_of[rank, i] = len(order)
        first_of.setdefault(key(action), len(order))
        order.append((rank_index[rank], i, slot, dep, action.kind in RECVS))
    positions = tuple(
        tuple(index_of[rank, i] for i in range(len(schedule.actions[rank]))) for rank in ranks
    )
    return Compiled(len(ranks), tuple(order), tuple(slot_of), positions)
