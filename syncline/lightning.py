"""A PyTorch Lightning strategy that wraps the model in :class:`~syncline.DataParallel`.

Lightning's ``DDPStrategy`` keeps every job it has (launching, the process group, samplers,
checkpoints, ``reduce``/``barrier``); only what wraps the model changes, and the few places
of ``DDPStrategy`` that touch the wrapper are made to fit it:

* **wrapping** (``_setup_model``): ``DataParallel(module, compression=..., allreduce=...,
  **options)``; a ``"hierarchical"`` allreduce is built with Lightning's devices per node as
  its node size (what ``DataParallel(allreduce="hierarchical")`` alone cannot know).
* **gradient accumulation**: Lightning's ``block_backward_sync`` enters ``no_sync()`` of any
  wrapper that has one, so accumulated micro-batches send nothing, as under DDP.
* **DDP comm hooks and post-local SGD** (``ddp_comm_hook=``, ``ddp_comm_state=``,
  ``ddp_comm_wrapper=``, ``model_averaging_period=``): refused here, on creation, naming
  ``compression=`` (DataParallel takes no comm hooks; its compressors are the same ones).
* **teardown**: Lightning unwraps only torch's DDP; this unwraps DataParallel and detaches
  its hooks from the parameters, so a later ``validate``/``test`` sees the bare module.
* **manual optimization**: ``manual_backward`` runs inside DataParallel's forward, whose
  parameter hooks then start and finish the reduction by themselves; Lightning's DDP-only
  ``prepare_for_backward`` is skipped.

The compressor's per-rank state (CSC's residuals) is not in Lightning's checkpoint (rank 0
writes it); a resumed run starts its compressor afresh, warm-up included.

Example:
    >>> trainer = L.Trainer(strategy=SynclineStrategy(compression="fp16"), devices=2)
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from syncline.comm.registry import ALLREDUCE, build_allreduce
from syncline.dp.compression import Compressor
from syncline.dp.config import DataParallelConfig
from syncline.dp.engine import DataParallel
from syncline.dp.registry import build_compressor
from syncline.errors import ConfigError

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    raise ImportError("syncline.lightning needs PyTorch Lightning: pip install lightning") from None

__all__ = ["SynclineStrategy"]

_REFUSED = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class SynclineStrategy(DDPStrategy):
    """``DDPStrategy`` with :class:`~syncline.DataParallel` in place of DDP.

    Args:
        compression: a compressor, or its spec (``"fp16"``, ``"csc:0.01:warmup=50"``, see
            :func:`syncline.compression.build_compressor`; each fit builds its own);
            ``None``: lossless. A compressor object serves one fit (it keeps per-bucket
            state).
        allreduce: ``"flat"``, ``"hierarchical"`` (node size: Lightning's devices per node)
            or another registered name.
        kwargs: ``DDPStrategy``'s own arguments (``accelerator``, ``process_group_backend``,
            ``timeout``, ``start_method``, ...) and DataParallel's (``bucket_cap_mb``:
            ``None``, the default, measures the bucket sizes; ``find_unused_parameters``,
            ``timeout_s``, ``autotune_buckets``, ...).

    Raises:
        ConfigError: a DDP comm hook or model averaging, an invalid compression spec, an
            unknown allreduce name, or an option neither class takes (naming it).

    Example:
        >>> L.Trainer(strategy=SynclineStrategy(compression="csc:0.01", bucket_cap_mb=25))
    """

    def __init__(
        self,
        compression: Compressor | str | None = None,
        allreduce: str = "flat",
        **kwargs: Any,
    ) -> None:
        given = [name for name in _REFUSED if kwargs.get(name) is not None]
        if given:
            raise ConfigError(
                f"SynclineStrategy: {', '.join(given)} refused: DataParallel has no DDP comm "
                "hooks; choose what goes on the wire with compression= (e.g. 'fp16', "
                "'csc:0.01'), or use DDPStrategy with syncline.hooks"
            )
        known = set(inspect.signature(DDPStrategy.__init__).parameters)
        known |= set(inspect.signature(DataParallel.__init__).parameters)
        unknown = sorted(set(kwargs) - known - {"self", "module", "kwargs"})
        if unknown:
            raise ConfigError(
                f"SynclineStrategy: unknown option(s) {unknown}; valid: DDPStrategy's and "
                "syncline.DataParallel's arguments"
            )
        if kwargs.get("sync", "every-step") != "every-step":
            raise ConfigError(
                f"SynclineStrategy: sync={kwargs['sync']!r} refused: a periodic sync follows "
                "the optimizer's steps (DataParallel.attach), which Lightning's loop does not "
                "give it yet; use DataParallel(sync=...) in a loop of your own, or syncline "
                "train --sync"
            )
        ALLREDUCE.get(allreduce)  # an unknown name fails now, listing the valid ones
        if isinstance(compression, str):
            build_compressor(compression)  # an invalid spec fails now, listing the valid forms
        super().__init__(**kwargs)
        self._compression = compression
        self._allreduce = allreduce

    def _setup_model(self, model: nn.Module) -> DataParallel:  # type: ignore[override]
        """Wrap the module in DataParallel (Lightning calls this while fitting only)."""
        options = dict(self._ddp_kwargs)
        collective = build_allreduce(
            self._allreduce,
            options.get("process_group"),
            timeout_s=options.get("timeout_s", DataParallelConfig().timeout_s),
            ranks_per_node=self.num_processes,
        )
        return DataParallel(
            model,
            device_ids=self.determine_ddp_device_ids(),
            # a spec gives each fit a fresh compressor (its state is per bucket and rank)
            compression=(
                build_compressor(self._compression)
                if isinstance(self._compression, str)
                else self._compression
            ),
            allreduce=collective,
            **options,
        )

    def _register_ddp_hooks(self) -> None:
        """Nothing to register: comm hooks were refused on creation."""

    def teardown(self) -> None:
        """Unwrap the module and detach DataParallel's hooks, then Lightning's teardown."""
        if isinstance(self.model, DataParallel):
            self.model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()
