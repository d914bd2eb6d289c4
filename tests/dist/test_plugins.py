"""Third-party extensions, one registration each, used through the API and `syncline train`.

``tests/plugins/toy_plugin.py`` registers a compressor, a schedule, a model with its data
set and an allreduce algorithm without touching syncline. Through the API each must give
what the built-in it imitates gives (exactly where the maths says so); through the command
line each must be accepted, reach every rank and train.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from syncline.testing import run_ranks
from tests.plugins import toy_plugin
from tests.zoo.train import cli, train

# Importing the plug-in registered it (as `--plugin` needs); the entries exist only inside
# this file's tests (the fixture below) and its rank functions, never in other tests.
toy_plugin.unregister()


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    """The plug-in's entries exist during each test of this file, and only then."""
    toy_plugin.register()
    yield
    toy_plugin.unregister()


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    dataset, _ = toy_plugin.blobs(0, 0)
    return dataset.get(torch.arange(n))


def _dp_rank(rank: int, world: int) -> dict[str, object]:
    from syncline import DataParallel
    from syncline.dp import build_compressor
    from syncline.models import build_model, model_loss

    import tests.plugins.toy_plugin as plugin

    plugin.register()  # in this spawned rank

    torch.manual_seed(0)
    model = build_model("toy-mlp", hidden=8)
    dp = DataParallel(model, bucket_cap_mb=25, compression=build_compressor("toymean"))
    x, y = _data()
    half = len(x) // world
    mine = slice(rank * half, (rank + 1) * half)
    for _ in range(2):  # the first synchronised step is dense; the second is the plug-in's
        dp.zero_grad()
        model_loss("toy-mlp")(dp(x[mine]), y[mine]).backward()
    return {
        "grads": [p.grad.clone() for p in model.parameters()],
        "calls": plugin.ToyMean.calls,
    }


def test_plugin_compressor_and_model_average_gradients_exactly() -> None:
    results = run_ranks(_dp_rank, 2, timeout_s=120)
    torch.manual_seed(0)
    reference = toy_plugin.build_mlp(toy_plugin.ToyMLPConfig(hidden=8))
    x, y = _data()
    halves = [toy_plugin.mlp_loss(reference(x[i : i + 4]), y[i : i + 4]) for i in (0, 4)]
    ((halves[0] + halves[1]) / 2).backward()
    for out in results:
        assert out["calls"] >= 1  # the plug-in's compressor did the reduction
        for got, want in zip(out["grads"], reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.grad, rtol=1e-6, atol=1e-7)


def _pipe_rank(rank: int, world: int, schedule: str) -> list[float]:
    from syncline.models import build_model
    from syncline.pipeline import Pipeline

    toy_plugin.register()  # in this spawned rank

    torch.manual_seed(0)
    model = build_model("toy-mlp", hidden=8)
    pipe = Pipeline(
        model,
        num_stages=2,
        num_microbatches=4,
        schedule=schedule,
        loss_fn=toy_plugin.mlp_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        balance=[2, 3],
    )
    x, y = _data(32)
    batches = iter([(x[:16], y[:16]), (x[16:], y[16:])])
    return [pipe.train_step(batches), pipe.train_step(batches)]


def test_plugin_schedule_trains_like_the_schedule_it_reorders() -> None:
    """The LIFO schedule runs GPipe's micro-batches with the backwards reversed: the first
    loss is identical and the second equal up to the order of gradient accumulation."""
    lifo = run_ranks(_pipe_rank, 2, "toy-lifo", timeout_s=120)
    gpipe = run_ranks(_pipe_rank, 2, "gpipe", timeout_s=120)
    assert lifo[0][0] == gpipe[0][0] and lifo[0] == lifo[1]
    assert abs(lifo[0][1] - gpipe[0][1]) < 1e-5


def _train(run: Path, *args: str) -> dict[str, object]:
    """``syncline train --plugin tests.plugins.toy_plugin ...``: the command's checks here, the
    workers' code in-process (:mod:`tests.zoo.train`), where each rank imports the plug-in."""
    train(
        *("--plugin", "tests.plugins.toy_plugin", "--model", "toy-mlp", "--batch-size", "32"),
        *("--lr", "0.05", "--log-every", "5", "--run-dir", str(run), *args),
    )
    return json.loads((run / "summary.json").read_text())


def test_syncline_train_with_plugin_model_compressor_and_allreduce(tmp_path) -> None:
    summary = _train(
        tmp_path / "dp", "--steps", "30", "--compression", "toymean", "--allreduce", "toy-ring",
        "--toy-hidden", "16",
    )  # fmt: skip
    config = json.loads((tmp_path / "dp" / "config.json").read_text())
    assert config["plugins"] == ["tests.plugins.toy_plugin"]
    assert config["model_options"] == {"hidden": 16} and config["data"] is None
    assert summary["compression"] == "toymean"
    assert summary["final_loss"] < 0.5 * summary["first_loss"]


def test_syncline_train_with_plugin_schedule(tmp_path) -> None:
    summary = _train(
        tmp_path / "pp", "--steps", "20", "--pipeline-stages", "2", "--schedule", "toy-lifo",
        "--microbatches", "4",
    )  # fmt: skip
    assert summary["schedule"] == "toy-lifo"
    assert summary["final_loss"] < 0.5 * summary["first_loss"]


def test_unknown_plugin_is_one_line_and_exit_2(tmp_path) -> None:
    res = cli("train", "--plugin", "no.such.module", cwd=tmp_path)
    assert res.returncode == 2
    assert "plugin='no.such.module' cannot be imported" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
