"""A pipeline whose stages hold parameters of two dtypes (fp32 and fp64), with data-parallel
replicas: 2 stages x 2 replicas on 4 gloo ranks == one process on the whole batch.

The replicas' REDUCE keeps one flat buffer per dtype (as DataParallel does), and its buckets
are ~100 bytes here, so each stage's gradients go in several buckets of both dtypes. The fp64
activations cross the stage boundary as fp64. A bucket that mixed the dtypes, or a link that
cast the activations, would change the weights beyond fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline import comm
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks

WORLD, DEPTH, STEPS, BATCH = 4, 2, 3, 8
WIDTH = WORLD // DEPTH
SCHEDULES = ("gpipe", "1f1b")


class _In64(nn.Module):
    """A fp64 linear layer fed by fp32 activations."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x.double()))


class _Out32(nn.Module):
    """Back to fp32 after a fp64 layer."""

    def __init__(self, n: int, out: int) -> None:
        super().__init__()
        self.lin64 = nn.Linear(n, n).double()
        self.lin = nn.Linear(n, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin64(x)).float())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # stage 0: fp32 then fp64 (its output, fp64, crosses); stage 1: fp64 then fp32
    return nn.Sequential(nn.Linear(6, 12), _In64(12), _Out32(12, 3), nn.Linear(3, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g))
        for _ in range(STEPS)
    ]


def _opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = _opt(list(model.parameters()))
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _rank(rank: int, world: int) -> dict[str, dict]:
    pipe_group, dp_group = comm.build_pipeline_groups(DEPTH, timeout_s=30)
    replica = comm.group_rank(dp_group)
    n = BATCH // WIDTH
    out = {}
    for schedule in SCHEDULES:
        pipe = Pipeline(
            _model(),
            num_stages=DEPTH,
            num_microbatches=2,
            schedule=schedule,
            loss_fn=nn.functional.mse_loss,
            optimizer=_opt,
            balance=[2, 2],
            process_group=pipe_group,
            data_parallel_group=dp_group,
            reduce_bucket_mb=0.0001,
            timeout_s=30,
        )
        shard = iter(
            [
                (x[replica * n : (replica + 1) * n], y[replica * n : (replica + 1) * n])
                for x, y in _batches()
            ]
        )
        losses = [pipe.train_step(shard) for _ in range(STEPS)]
        out[schedule] = {
            "state": pipe.local_state_dict(),
            "losses": losses,
            "dtypes": sorted({str(p.dtype) for p in pipe.stage_module.parameters()}),
            "buckets": {s: r.num_buckets for s, r in pipe._ctx.replicas._reducers.items()},
        }
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_rank, WORLD, timeout_s=120)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mixed_dtype_stages_with_replicas_match_one_process(per_rank, schedule: str) -> None:
    want_state, want_losses = _reference()
    for r in per_rank:  # every stage really holds both dtypes, in several REDUCE buckets
        assert r[schedule]["dtypes"] == ["torch.float32", "torch.float64"], r[schedule]["dtypes"]
        assert all(n >= 2 for n in r[schedule]["buckets"].values()), r[schedule]["buckets"]
    for replica in range(WIDTH):
        state: dict[str, torch.Tensor] = {}
        for rank in range(replica, WORLD, WIDTH):
            state.update(per_rank[rank][schedule]["state"])
        assert set(state) == set(want_state)
        for key, value in want_state.items():
            assert state[key].dtype == value.dtype, key
            torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0, msg=key)
    for r in per_rank:
        assert r[schedule]["losses"] == pytest.approx(want_losses, abs=1e-6)
