"""Validation during `syncline train`: the held-out loss is the one-process value, the same
under data parallelism and a pipeline, and evaluating never changes what is trained."""

from __future__ import annotations

import json

import torch

from syncline.data import ShardedBatches
from syncline.models import model_loss
from syncline.pipeline.evaluate import evaluating
from syncline.train.checkpoint import load_checkpoint
from syncline.train.common import build_datasets, build_model_for
from syncline.train.config import TrainConfig
from syncline.train.validation import _STREAM
from tests.zoo.train import train

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "16"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _reference_val_loss(cfg: TrainConfig, weights: dict[str, torch.Tensor]) -> float:
    """The validation loss of ``weights`` in this process, on whole global batches."""
    model = build_model_for(cfg)
    model.load_state_dict(weights)
    _, val, _ = build_datasets(cfg)
    stream = ShardedBatches(val, cfg.batch_size, 0, 1, cfg.seed + _STREAM)
    loss_fn = model_loss(cfg.model)
    with evaluating([model]):
        losses = [float(loss_fn(model(x), y)) for x, y in map(stream.batch, range(4))]
    return sum(losses) / len(losses)


def test_validation_loss_is_the_one_process_value_under_dp_and_pipelines(tmp_path) -> None:
    common = [*TINY, "--steps", "7", "--eval-every", "3", "--log-every", "100"]
    dp, pp = tmp_path / "dp", tmp_path / "pp"
    res = train(*common, "--run-dir", str(dp))
    assert "validation loss" in res.stdout and "perplexity" in res.stdout
    train(*common, "--pipeline-stages", "2", "--run-dir", str(pp))
    cfg = TrainConfig(model_options={"n_layer": 2, "n_embd": 32}, seq_len=16, batch_size=16)
    val = {}
    for name, run in (("dp", dp), ("pp", pp)):
        records = [r for r in _records(run) if r["val_loss"] is not None]
        assert [r["step"] for r in records] == [0, 3, 6]  # step 0, every 3rd, the last
        val[name] = [r["val_loss"] for r in records]
        for r in records:
            assert abs(r["val_ppl"] - torch.tensor(r["val_loss"]).exp().item()) < 1e-3
        summary = json.loads((run / "summary.json").read_text())
        assert summary["best_val_loss"] == min(val[name])
        assert summary["final_val_loss"] == val[name][-1] < val[name][0]
        # the shards' average is the whole batches' mean, of the weights the run ended with
        weights = load_checkpoint(run / "checkpoint.pt")["model"]
        assert abs(val[name][-1] - _reference_val_loss(cfg, weights)) < 1e-5
    # the same model trained the same way under either layout
    assert all(abs(a - b) < 1e-4 for a, b in zip(val["dp"], val["pp"], strict=True))


def test_evaluating_does_not_change_training(tmp_path) -> None:
    """2BW with replicas, validated at every step or never: bit-identical final weights
    (evaluation touches no weight version, no optimizer, no batch in flight)."""
    common = [*TINY, "--steps", "6", "--pipeline-stages", "2", "--schedule", "2bw"]
    common += ["--microbatches", "2", "--nproc-per-node", "4", "--checkpoint-every", "0"]
    runs = {every: tmp_path / f"every{every}" for every in (1, 0)}
    for every, run in runs.items():
        train(*common, "--eval-every", str(every), "--run-dir", str(run))
    validated = [r for r in _records(runs[1]) if r["val_loss"] is not None]
    assert len(validated) == 6
    assert all(r["val_loss"] is None for r in _records(runs[0]))
    a, b = (load_checkpoint(run / "checkpoint.pt")["model"] for run in runs.values())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
