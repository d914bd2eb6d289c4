"""``SynclineStrategy``: Lightning trains through syncline's DataParallel, as with its DDP.

Two gloo ranks each run Lightning's ``Trainer`` several times in one process (Lightning's
import is what costs), with the environment torchrun gives a worker, as in
``tests/dist/test_hooks_frameworks.py``: lossless, the result equals ``DDPStrategy``'s bit
for bit, with and without gradient accumulation, under manual optimization and over the
hierarchical allreduce; with fp16 it equals DataParallel's own loop with fp16, and with CSC
the loss falls while a fraction of the gradient is sent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline.compression import FP16
from syncline.dp import DataParallel
from syncline.testing import run_ranks
from tests.zoo import frameworks

STEPS = 10
BATCH = frameworks.BATCH


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _plain_fp16(rank: int) -> list[torch.Tensor]:
    """The reference for fp16: DataParallel in a loop of our own."""
    net = frameworks.net()
    model = DataParallel(net, compression=FP16())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = frameworks.data(rank, 2 * STEPS)
    for i in range(STEPS):
        F.mse_loss(model(x[i * BATCH : (i + 1) * BATCH]), y[i * BATCH : (i + 1) * BATCH]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _params(net)


def _lightning_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    frameworks.torchrun_env(rank, world)
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from syncline.lightning import SynclineStrategy

    class Net(L.LightningModule):
        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            self.net = frameworks.net()
            self.losses: list[float] = []
            self.val_losses: list[float] = []
            self.automatic_optimization = not manual

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.losses.append(loss.item())
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
            self.val_losses.append(F.mse_loss(self(batch[0]), batch[1]).item())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Engine(L.Callback):
        """What wrapped the module, and what the wrapper sent, read at the end of fit."""

        def __init__(self) -> None:
            self.seen: dict[str, Any] = {}

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            model = trainer.strategy.model
            self.seen = {"wrapper": type(model).__name__}
            if isinstance(model, DataParallel):
                stats = model.last_stats
                self.seen.update(
                    synced=model.compression_state_dict()["steps_synced"],
                    collective=type(model._comm).__name__,  # the allreduce it was given
                    wire=stats.wire_bytes,
                    dense=stats.dense_bytes,
                )

    def fit(strategy: DDPStrategy, accumulate: int = 1, manual: bool = False) -> dict:
        x, y = frameworks.data(rank, 2 * STEPS)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
        held = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x[:16] + 1, y[:16]), batch_size=BATCH
        )
        engine = Engine()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=STEPS,
            accumulate_grad_batches=accumulate,
            val_check_interval=5,  # validation inside fit: the wrapper's no-grad forward
            callbacks=[engine],
            use_distributed_sampler=False,  # each rank its own samples
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        net = Net(manual)
        before = _full_loss(net, x, y)
        trainer.fit(net, data, held)
        trainer.validate(net, held, verbose=False)  # after teardown: the bare module
        return {
            "params": _params(net),
            "losses": net.losses,
            "val losses": net.val_losses,
            "engine": engine.seen,
            "unwrapped": trainer.strategy.model is net,
            "loss before": before,
            "loss after": _full_loss(net, x, y),
        }

    return {
        "ddp": fit(DDPStrategy()),
        "syncline": fit(SynclineStrategy()),
        "ddp accumulate": fit(DDPStrategy(), accumulate=2),
        "syncline accumulate": fit(SynclineStrategy(), accumulate=2),
        "ddp manual": fit(DDPStrategy(), manual=True),
        "syncline manual": fit(SynclineStrategy(), manual=True),
        "hierarchical": fit(SynclineStrategy(allreduce="hierarchical", bucket_cap_mb=0.002)),
        "fp16": fit(SynclineStrategy(compression="fp16")),
        "plain fp16": _plain_fp16(rank),
        "csc": fit(SynclineStrategy(compression="csc:0.25:chunk=16", bucket_cap_mb=0.002)),
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["val losses"] == b["val losses"]
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.slow  # 13-25 s: each rank imports Lightning and fits nine times
def test_lightning_trains_through_syncline_strategy(tmp_path) -> None:
    pytest.importorskip("lightning")
    for got in run_ranks(_lightning_rank, 2, str(tmp_path), timeout_s=300.0):
        ddp = got["ddp"]
        assert ddp["loss after"] < 0.9 * ddp["loss before"], ddp
        assert ddp["engine"] == {"wrapper": "DistributedDataParallel"}
        for run, reference in (
            ("syncline", "ddp"),
            ("syncline accumulate", "ddp accumulate"),
            ("syncline manual", "ddp manual"),
            ("hierarchical", "ddp"),
        ):
            _equal(got[run], got[reference])  # lossless: DDP's result, bit for bit
            engine = got[run]["engine"]
            assert engine["wrapper"] == "DataParallel", (run, engine)
            # one synchronised backward per optimizer step: accumulation ran under no_sync
            assert engine["synced"] == STEPS, (run, engine)
            assert engine["wire"] == engine["dense"] > 0, (run, engine)
            assert got[run]["unwrapped"], run  # teardown gave the bare module back
        assert len(got["ddp accumulate"]["losses"]) == 2 * STEPS
        # the sanity check, after steps 5 and 10, and trainer.validate: 2 batches each
        assert len(ddp["val losses"]) == 8, ddp["val losses"]
        assert got["syncline"]["engine"]["collective"] == "FlatAllreduce"
        assert got["hierarchical"]["engine"]["collective"] == "HierarchicalAllreduce"

        fp16 = got["fp16"]
        for p, q in zip(fp16["params"], got["plain fp16"], strict=True):
            assert torch.equal(p, q)  # DataParallel's own fp16 path, bit for bit
        assert fp16["engine"]["wire"] * 2 == fp16["engine"]["dense"], fp16["engine"]
        assert fp16["params"][0].ne(ddp["params"][0]).any()  # fp16 did round something

        csc = got["csc"]
        assert csc["loss after"] < 0.9 * csc["loss before"], csc
        assert 0 < csc["engine"]["wire"] < csc["engine"]["dense"] / 2, csc["engine"]
