"""PURE: the pipeline action IR: what one rank does next, printed and parsed compactly.

A schedule is data (as in ``torch.distributed.pipelining``): per rank, an ordered list of
actions. A runtime only executes the list; it never re-derives the order. Each action prints
as ``<stage><KIND>[<microbatch>][@[v<version>][b<batch>]]``:

    ``1F0``        stage 1, forward, micro-batch 0
    ``1B0``        stage 1, backward, micro-batch 0
    ``2R3``        stage 2, recompute (activation checkpointing) of micro-batch 3
    ``0SEND_F0``   stage 0 sends micro-batch 0's activation to stage 1
    ``1RECV_F0``   stage 1 receives it
    ``1SEND_B0``   stage 1 sends micro-batch 0's input gradient to stage 0; ``0RECV_B0``
    ``0REDUCE``    stage 0 allreduces its gradients over its data-parallel replicas
    ``0STEP``      stage 0 applies the optimizer step
    ``1F0@v1b2``   forward of micro-batch 0 of mini-batch 2 with weight version 1 (2BW)

Example:
    >>> a = parse_action("1F0@v1b2")
    >>> (a.stage, a.kind, a.microbatch, a.version, a.batch)
    (1, <ActionKind.FORWARD: 'F'>, 0, 1, 2)
    >>> str(a)
    '1F0@v1b2'
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class ScheduleError(ValueError):
    """A schedule or action is malformed, out of order, or would deadlock.

    Raised by ``validate`` with the rank x tick grid in the message, failing action marked.
    """


class ActionKind(Enum):
    """What an action does; the value is its code in the printed form."""

    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE = "REDUCE"
    STEP = "STEP"


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE})
COMM = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
PER_STAGE = frozenset({ActionKind.REDUCE, ActionKind.STEP})

# Longest codes first so that "REDUCE" is never read as "R" followed by junk.
_CODES = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_CODES})(\d+)?(?:@(v\d+)?(b\d+)?)?")


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    Attributes:
        stage: the (virtual) pipeline stage the action belongs to.
        kind: what it does.
        microbatch: micro-batch index within its mini-batch; ``None`` for REDUCE and STEP.
        version: weight version used (F/R/B) or produced (STEP); 2BW only, else ``None``.
        batch: mini-batch the micro-batch belongs to; set when a schedule spans several.
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None
    version: int | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ScheduleError(f"stage={self.stage} must be >= 0")
        if self.kind in PER_STAGE and self.microbatch is not None:
            raise ScheduleError(f"{self.kind.name} takes no micro-batch, got {self.microbatch}")
        if self.kind not in PER_STAGE and (self.microbatch is None or self.microbatch < 0):
            raise ScheduleError(f"{self.kind.name} needs a micro-batch >= 0, got {self.microbatch}")
        for name in ("version", "batch"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ScheduleError(f"{name}={value} must be >= 0 or None")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        suffix = ""
        if self.version is not None or self.batch is not None:
            suffix = "@"
            suffix += "" if self.version is None else f"v{self.version}"
            suffix += "" if self.batch is None else f"b{self.batch}"
        return f"{self.stage}{self.kind.value}{mb}{suffix}"


def parse_action(text: str) -> Action:
    """Parse the printed form of an action; ``parse_action(str(a)) == a``.

    Raises:
        ScheduleError: the text is not an action, e.g. ``"1X0"`` or ``"1F0@"``.
    """
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None or ("@" in text and match.group(4) is None and match.group(5) is None):
        raise ScheduleError(
            f"cannot parse action {text!r}: expected e.g. '1F0', '0SEND_F3', '0STEP', '1B2@v1b0'"
        )
    stage, code, mb, version, batch = match.groups()
    try:
        return Action(
            stage=int(stage),
            kind=ActionKind(code),
            microbatch=None if mb is None else int(mb),
            version=None if version is None else int(version[1:]),
            batch=None if batch is None else int(batch[1:]),
        )
    except ScheduleError as error:
        raise ScheduleError(f"cannot parse action {text!r}: {error}") from None


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists, plus the shape they were generated for.

    Stage ``s`` runs on rank ``s % num_ranks``; with ``stages_per_rank == 1`` rank and stage
    coincide, with more (interleaved 1F1B) rank ``r`` holds stages ``r, r + num_ranks, ...``.

    Attributes:
        name: the generator that made it, e.g. ``"1f1b"``; shown in errors and traces.
        num_stages: number of (virtual) stages.
        num_microbatches: micro-batches per mini-batch.
        actions: ``actions[rank]`` is that rank's ordered actions (stored as tuples).
        stages_per_rank: virtual stages per rank; must divide ``num_stages``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: Mapping[int, Sequence[Action]]
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_microbatches < 1 or self.stages_per_rank < 1:
            raise ScheduleError(
                f"num_stages={self.num_stages}, num_microbatches={self.num_microbatches} and "
                f"stages_per_rank={self.stages_per_rank} must all be >= 1"
            )
        if self.num_stages % self.stages_per_rank:
            raise ScheduleError(
                f"stages_per_rank={self.stages_per_rank} must divide num_stages={self.num_stages}"
            )
        if set(self.actions) != set(range(self.num_ranks)):
            raise ScheduleError(
                f"actions has ranks {sorted(self.actions)}, expected 0..{self.num_ranks - 1}"
            )
        # Copy into tuples so a caller's lists cannot change the schedule afterwards.
        frozen = {r: tuple(self.actions[r]) for r in range(self.num_ranks)}
        object.__setattr__(self, "actions", frozen)

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return stage % self.num_ranks

    def to_strings(self) -> dict[int, str]:
        """Each rank's actions, printed and space-separated (the literal-table form)."""
        return {r: " ".join(map(str, acts)) for r, acts in self.actions.items()}

    @classmethod
    def from_strings(
        cls,
        name: str,
        num_stages: int,
        num_microbatches: int,
        rows: Mapping[int, str],
        stages_per_rank: int = 1,
    ) -> Schedule:
        """Build a schedule from ``{rank: "0F0 0F1 0B0 ..."}``; inverse of ``to_strings``."""
        actions = {r: [parse_action(t) for t in row.split()] for r, row in rows.items()}
        return cls(name, num_stages, num_microbatches, actions, stages_per_rank)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: {row}" for r, row in self.to_strings().items())
