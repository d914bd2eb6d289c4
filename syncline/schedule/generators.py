"""PURE: pipeline schedules (GPipe, 1F1B, 2BW, interleaved 1F1B) as functions of integers.

Each generator returns compute-only actions (F, B, R, REDUCE, STEP); ``add_communication``
inserts the SEND/RECV pairs. The timelines are lockstep ticks as ``render_grid`` draws them
(one tick per action, each starts once what it depends on is done), with REDUCE left out, the
stage prefix dropped unless interleaved, and ``S`` for STEP.

GPipe (Huang et al. 2019), ``gpipe(3, 4)``: all forwards, then all backwards, then the
flush. Stashes the activations of all m micro-batches::

    rank 0 | F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 S
    rank 1 | .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 S  .
    rank 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 S  .  .

1F1B with flush (PipeDream-Flush, Narayanan et al., ICML 2021), ``one_f_one_b(3, 4)``:
``min(d-r-1, m)`` warm-up forwards, then one forward / one backward, then the remaining
backwards, then the flush. Same bubble ``(d-1)/(m+d-1)``, but at most ``d-r`` micro-batches
in flight on stage r instead of m::

    rank 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 S
    rank 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 S  .
    rank 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 S  .  .

2BW (PipeDream-2BW, same paper), ``two_bw(3, 3, 2)``: the 1F1B order over all
``num_batches * m`` micro-batches, never flushed. Letters are batches; ``Sv`` is the STEP
after a batch's last backward on that stage, producing version v. Batches a and b use v0, a
batch c would use v1: of each m forwards between two STEPs on stage r, the first ``m-w_r``
(``w_r = d-r-1``) belong to the current batch and the last ``w_r`` to the next::

    rank 0 | F0a F1a F2a .   .   B0a F0b B1a F1b B2a S1  F2b B0b .   B1b .   B2b S2
    rank 1 | .   F0a F1a .   B0a F2a B1a F0b B2a S1  F1b B0b F2b B1b .   B2b S2  .
    rank 2 | .   .   F0a B0a F1a B1a F2a B2a S1  F0b B0b F1b B1b F2b B2b S2  .   .

Interleaved 1F1B (Megatron-LM, Narayanan et al., SC 2021), ``interleaved_1f1b(2, 4, 2)``:
rank r holds stages ``r, r+d, ...``; forwards move to the next local stage every d
micro-batches, backwards go through them in reverse. With equal forward and backward costs
the bubble shrinks to ``(d-1)/(chunks*m+d-1)``, for ``chunks`` times more messages::

    rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3 S   S
    rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 S   S   .
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from syncline.errors import ConfigError
from syncline.fields import check_int
from syncline.schedule.ir import Action, ActionKind, Schedule
from syncline.schedule.passes import add_recompute

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
REDUCE, STEP = ActionKind.REDUCE, ActionKind.STEP


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        check_int(name, value)


def _one_f_one_b_order(warmup: int, total: int) -> Iterator[tuple[ActionKind, int]]:
    """Yield ``(F or B, k)``: ``warmup`` forwards, then 1F/1B pairs, then the drain.

    ``k`` counts forwards and backwards separately, both from 0 to ``total - 1``.
    """
    warmup = min(warmup, total)
    for k in range(warmup):
        yield F, k
    for k in range(total - warmup):
        yield F, warmup + k
        yield B, k
    for k in range(total - warmup, total):
        yield B, k


def _flush(stage: int, batch: int | None = None, version: int | None = None) -> list[Action]:
    """Allreduce over data-parallel replicas, then the optimizer step."""
    return [Action(stage, REDUCE, batch=batch), Action(stage, STEP, version=version, batch=batch)]


def _finish(name: str, d: int, m: int, rows: dict[int, list[Action]], recompute: bool) -> Schedule:
    if recompute:
        rows = {r: add_recompute(acts) for r, acts in rows.items()}
    return Schedule(name, d, m, rows)


def gpipe(num_stages: int, num_microbatches: int, *, recompute: bool = False) -> Schedule:
    """GPipe: every stage runs all m forwards, then all m backwards, then REDUCE and STEP.

    Args:
        num_stages: pipeline depth d (one stage per rank).
        num_microbatches: micro-batches per mini-batch m.
        recompute: put a RECOMPUTE right before each BACKWARD.

    Raises:
        ConfigError: d or m is not an int >= 1.

    Example:
        >>> gpipe(2, 2).to_strings()[1]
        '1F0 1F1 1B0 1B1 1REDUCE 1STEP'
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    d, m = num_stages, num_microbatches
    rows = {
        r: [Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)] + _flush(r)
        for r in range(d)
    }
    return _finish("gpipe", d, m, rows, recompute)


def one_f_one_b(num_stages: int, num_microbatches: int, *, recompute: bool = False) -> Schedule:
    """PipeDream-Flush: ``min(d-r-1, m)`` warm-up forwards, 1F1B, drain, REDUCE, STEP.

    Fewer activations in flight than GPipe (at most ``d-r`` on stage r) for the same bubble.

    Raises:
        ConfigError: d or m is not an int >= 1.

    Example:
        >>> one_f_one_b(2, 2).to_strings()[0]
        '0F0 0F1 0B0 0B1 0REDUCE 0STEP'
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    d, m = num_stages, num_microbatches
    rows = {
        r: [Action(r, kind, k) for kind, k in _one_f_one_b_order(d - r - 1, m)] + _flush(r)
        for r in range(d)
    }
    return _finish("1f1b", d, m, rows, recompute)


def two_bw(
    num_stages: int, num_microbatches: int, num_batches: int, *, recompute: bool = False
) -> Schedule:
    """PipeDream-2BW: 1F1B across ``num_batches`` batches without flushes, two weight versions.

    Micro-batch ``k`` of the run is micro-batch ``k % m`` of batch ``k // m``. Batch ``b``
    uses weight version ``max(b-1, 0)``: stage r's first ``w_r = d-r-1`` forwards of batch
    ``b+1`` run before batch ``b``'s last backward there, so they cannot wait for the version
    that backward produces. The STEP after batch ``b``'s m-th backward produces version
    ``b+1`` (printed ``0STEP@v1b0``). With ``m < d`` stage 0 would start batch ``b+2``
    before batch ``b``'s STEP, needing a version not made yet.

    Raises:
        ConfigError: an argument is not an int >= 1, or m < d.

    Example:
        >>> two_bw(1, 1, 2).to_strings()[0]
        '0F0@v0b0 0B0@v0b0 0REDUCE@b0 0STEP@v1b0 0F0@v0b1 0B0@v0b1 0REDUCE@b1 0STEP@v2b1'
    """
    _check_positive(
        num_stages=num_stages, num_microbatches=num_microbatches, num_batches=num_batches
    )
    d, m = num_stages, num_microbatches
    if m < d:
        raise ConfigError(f"num_microbatches={m} must be >= num_stages={d} for 2bw")
    rows: dict[int, list[Action]] = {}
    for r in range(d):
        row: list[Action] = []
        for kind, k in _one_f_one_b_order(d - r - 1, num_batches * m):
            batch = k // m
            row.append(Action(r, kind, k % m, version=max(batch - 1, 0), batch=batch))
            if kind is B and k % m == m - 1:
                row += _flush(r, batch=batch, version=batch + 1)
        rows[r] = row
    return _finish("2bw", d, m, rows, recompute)


def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, chunks: int, *, recompute: bool = False
) -> Schedule:
    """Interleaved 1F1B (Megatron-LM virtual stages): ``chunks`` stages per rank.

    Rank r holds stages ``r, r+d, ..., r+(chunks-1)*d`` of ``d*chunks``. Following Megatron
    (and ``torch.distributed.pipelining``'s Interleaved1F1B): rank r runs
    ``min((chunks-1)*d + 2*(d-r-1), m*chunks)`` warm-up forwards, then 1F1B, then the drain;
    its k-th forward runs chunk ``(k // d) % chunks`` and its k-th backward chunk
    ``chunks - 1 - (k // d) % chunks``. With ``chunks == 1`` this is ``one_f_one_b`` (as in
    Megatron, which then uses its non-interleaved schedule). Each stage ends with REDUCE, STEP.

    Args:
        num_ranks: physical pipeline depth d.
        num_microbatches: micro-batches m; must be a multiple of d (micro-batches go round
            the ranks in groups of d).
        chunks: virtual stages per rank.
        recompute: put a RECOMPUTE right before each BACKWARD.

    Raises:
        ConfigError: an argument is not an int >= 1, or m is not a multiple of d.
    """
    _check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches, chunks=chunks)
    d, m = num_ranks, num_microbatches
    if m % d:
        raise ConfigError(
            f"num_microbatches={m} must be a multiple of num_ranks={d} for interleaved_1f1b"
        )
    if chunks == 1:
        return one_f_one_b(d, m, recompute=recompute)
    rows = {r: _interleaved_rank(r, d, m, chunks) for r in range(d)}
    if recompute:
        rows = {r: add_recompute(acts) for r, acts in rows.items()}
    return Schedule("interleaved_1f1b", d * chunks, m, rows, stages_per_rank=chunks)


def _interleaved_rank(r: int, d: int, m: int, chunks: int) -> list[Action]:
    warmup = (chunks - 1) * d + 2 * (d - r - 1)
    chunk_of: dict[ActionKind, Callable[[int], int]] = {
        F: lambda k: (k // d) % chunks,
        B: lambda k: chunks - 1 - (k // d) % chunks,
    }
    next_mb: dict[tuple[ActionKind, int], int] = {}
    row: list[Action] = []
    for kind, k in _one_f_one_b_order(warmup, m * chunks):
        stage = chunk_of[kind](k) * d + r
        mb = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = mb + 1
        row.append(Action(stage, kind, mb))
    for c in range(chunks):
        row += _flush(c * d + r)
    return row
