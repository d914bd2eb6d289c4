"""The pipeline runtime in one process (one stage): 2BW's update rule, recompute, memory, errors."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.pipeline import Pipeline
from syncline.pipeline.versions import WeightVersions
from syncline.schedule import ActionKind, to_chrome_trace
from tests.zoo.models import reference_training

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
loss_fn: LossFn = nn.functional.cross_entropy
M = 4


def _mlp(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 12), nn.Tanh(), nn.Dropout(dropout), nn.Linear(12, 12), nn.Linear(12, 3)
    )


def _data(n: int = 5, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(size, 5, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


SGD = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731


def _pipe(schedule: str, opt=SGD, **kw) -> Pipeline:
    kw.setdefault("balance", [5])
    return Pipeline(
        kw.pop("module", None) or _mlp(),
        num_stages=1,
        num_microbatches=kw.pop("m", M),
        schedule=schedule,
        loss_fn=loss_fn,
        optimizer=opt,
        **kw,
    )


def _train(pipe: Pipeline, data) -> tuple[list[float], float | None]:
    it, losses = iter(data), []
    while True:
        try:
            losses.append(pipe.train_step(it))
        except StopIteration:
            break
    return losses, pipe.flush()


def _reference_2bw(data, opt_factory) -> tuple[nn.Module, list[float]]:
    """W(t+1) = W(t) - lr * grad f(W(t-1)), W(-1) = W(0) (the zoo's one-process reference)."""
    model = _mlp()
    return model, reference_training(model, opt_factory, data, loss_fn, stale=True)


def _reference_flush(data, opt_factory) -> tuple[nn.Module, list[float]]:
    model = _mlp()
    return model, reference_training(model, opt_factory, data, loss_fn, stale=False)


def _assert_params(got: nn.Module, want: nn.Module) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("recompute", [False, True])
def test_two_bw_applies_the_one_step_stale_gradient(opt, recompute: bool) -> None:
    data = _data()
    pipe = _pipe("2bw", opt, recompute=recompute)
    losses, flushed = _train(pipe, data)
    want, want_losses = _reference_2bw(data, opt)
    _assert_params(pipe.stage_module, want)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    assert flushed is None  # the last call already drained (the iterator ran out)
    # and it really differs from plain SGD
    plain, _ = _reference_flush(data, opt)
    assert not torch.allclose(plain[0].weight, want[0].weight, atol=1e-4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flush_schedules_match_whole_batch_training(schedule: str) -> None:
    data = _data()
    pipe = _pipe(schedule)
    losses, _ = _train(pipe, data)
    want, want_losses = _reference_flush(data, SGD)
    _assert_params(pipe.stage_module, want)
    assert losses == pytest.approx(want_losses, abs=1e-6)


def test_flush_finishes_the_batch_started_early() -> None:
    data = _data(4)
    pipe = _pipe("2bw")
    it = iter(data)
    first = [pipe.train_step(it) for _ in range(2)]  # the second call took batch 2 already
    last = pipe.flush()
    assert last is not None
    want, want_losses = _reference_2bw(data[:3], SGD)
    _assert_params(pipe.stage_module, want)
    assert [*first, last] == pytest.approx(want_losses, abs=1e-6)
    assert pipe.flush() is None
    # after a flush the next batch runs on the newest weights, like a first batch
    assert pipe.train_step(it) > 0


def test_recompute_replays_dropout() -> None:
    data = _data(3)
    results = []
    for recompute in (False, True):
        torch.manual_seed(7)
        pipe = _pipe("1f1b", module=_mlp(dropout=0.5), recompute=recompute)
        results.append((_train(pipe, data)[0], pipe.stage_module))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    _assert_params(results[1][1], results[0][1])


def test_memory_stats_gpipe_1f1b_2bw_recompute() -> None:
    data = _data(3)
    stats = {}
    for schedule in ("gpipe", "1f1b", "2bw"):
        for recompute in (False, True):
            pipe = _pipe(schedule, recompute=recompute, track_memory=True)
            _train(pipe, data)
            stats[(schedule, recompute)] = pipe.memory_stats()[0]
    full = stats[("gpipe", False)].microbatch_activation_bytes
    inp = stats[("gpipe", False)].input_bytes
    assert inp == 2 * 5 * 4  # 2 samples x 5 features x fp32
    assert stats[("gpipe", False)].peak_activation_bytes == M * full
    assert stats[("gpipe", False)].peak_microbatches == M
    assert stats[("1f1b", False)].peak_activation_bytes == full  # d = 1 in flight
    assert stats[("gpipe", True)].peak_activation_bytes == (M - 1) * inp + full
    assert stats[("2bw", False)].weight_versions == 2
    assert stats[("1f1b", False)].weight_versions == 1
    weights = sum(p.numel() * 4 for p in _mlp().parameters())
    assert stats[("2bw", True)].peak_weight_bytes == 2 * weights
    assert stats[("gpipe", True)].peak_weight_bytes == weights


def test_trace_records_every_action_in_order() -> None:
    pipe = _pipe("1f1b", m=2)
    _train(pipe, _data(2))
    timeline = pipe.trace()
    events = timeline.events[0]
    kinds = [e.action.kind for e in events]
    assert kinds.count(ActionKind.FORWARD) == 4 and kinds.count(ActionKind.STEP) == 2
    assert [str(e.action) for e in events[:3]] == ["0F0@b0", "0B0@b0", "0F1@b0"]
    assert events[0].start == 0.0
    assert all(e.end >= e.start for e in events)
    assert all(a.end <= b.start for a, b in itertools.pairwise(events))
    trace = to_chrome_trace(timeline, us_per_unit=1e6)
    assert len(trace["traceEvents"]) == len(events)


def test_profiled_balance_on_first_step() -> None:
    pipe = _pipe("1f1b", balance=None)
    with pytest.raises(ConfigError, match="profiled in the first train_step"):
        _ = pipe.stage_module
    pipe.train_step(iter(_data(1)))
    assert pipe.balance == [5]
    assert set(pipe.local_state_dict()) == set(_mlp().state_dict())


def test_the_constructor_builds_nothing() -> None:
    """Constructors store and check settings: the stages (here materialised from the meta
    device) are built by the first call that needs them, not by ``Pipeline(...)``."""
    with torch.device("meta"):
        model = _mlp()
    pipe = _pipe("1f1b", module=model)
    assert pipe.balance == [5]
    assert all(p.is_meta for p in model.parameters())
    assert not any(p.is_meta for p in pipe.stage_module.parameters())
    assert not any(p.is_meta for p in model.parameters())  # the stage holds the model's layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"module": nn.Linear(2, 2)}, "module is a Linear; valid: an nn.Sequential"),
        ({"num_stages": 6}, "num_stages=6 is more than the module's 5 layers"),
        ({"num_stages": 0}, "num_stages=0 is invalid"),
        ({"num_microbatches": 0}, "num_microbatches=0 is invalid"),
        ({"schedule": "zb"}, "schedule='zb' is unknown"),
        ({"schedule": "2bw", "num_stages": 3, "num_microbatches": 2}, "must be >= num_stages=3"),
        ({"balance": [4]}, "sums to 4 layers but the module has 5"),
        ({"balance": [2, 3]}, "has 2 stages; valid: 1 entries"),
        ({"balance": [5, 0]}, "ints >= 1"),
        ({"num_stages": 2}, "must equal the process group's size 1"),
        ({"schedule": "interleaved"}, "group of 1 rank: adjacent stages"),
        ({"schedule": "interleaved", "num_stages": 2}, "group of 1 rank: adjacent stages"),
        ({"timeout_s": 0}, "timeout_s=0"),
    ],
)
def test_config_errors_before_any_work(kwargs: dict, match: str) -> None:
    args = dict(
        module=_mlp(),
        num_stages=1,
        num_microbatches=M,
        schedule="1f1b",
        loss_fn=loss_fn,
        optimizer=SGD,
        balance=None,
    )
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        Pipeline(args.pop("module"), **args)


def test_bad_batches_are_clear_errors() -> None:
    pipe = _pipe("2bw")
    with pytest.raises(ConfigError, match="has 6 samples, which does not split into num_microb"):
        pipe.train_step(iter(_data(1, size=6)))
    with pytest.raises(ConfigError, match="iterator"):
        pipe.train_step(_data(1))  # a list, not an iterator
    with pytest.raises(ConfigError, match="must share a leading batch dimension"):
        pipe.train_step(iter([(torch.randn(8, 5), torch.zeros(4, dtype=torch.long))]))
    # a bad *next* batch leaves the first one queued, untouched
    good, bad = _data(1)[0], _data(1, size=6)[0]
    with pytest.raises(ConfigError, match="batch 1 has 6"):
        pipe.train_step(iter([good, bad]))
    assert pipe.train_step(iter([])) > 0  # trains the queued batch


def test_failure_names_the_action_and_stops_the_pipeline() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("injected")

    module = _mlp()
    module.append(Boom())
    pipe = _pipe("1f1b", module=module, balance=[6])
    with pytest.raises(Exception, match=r"rank 0 \(stage 0\): FORWARD mb 0 of step 0 \(0F0@b0\)"):
        pipe.train_step(iter(_data(1)))
    with pytest.raises(Exception, match="pipeline stopped after a failure"):
        pipe.train_step(iter(_data(1)))


def test_weight_versions_refuse_to_overwrite_a_version_in_use() -> None:
    module = nn.Sequential(nn.Linear(2, 2))
    versions = WeightVersions(module, 0)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x = torch.randn(3, 2)
    w = versions.acquire(0)
    torch.func.functional_call(module, w, (x,)).sum().backward()
    versions.release(0)
    versions.step(0, 1, opt, lambda: True)  # first step of a run: a new buffer
    assert versions.held == [0, 1]
    w0 = versions.acquire(0)  # a micro-batch of the next batch still runs on v0
    assert module[0].weight.data_ptr() == versions.tensors(1)["0.weight"].data_ptr()
    with pytest.raises(RuntimeError, match="v0 still has 1 micro-batch"):
        versions.step(0, 2, opt, lambda: True)
    assert w0["0.weight"].data_ptr() != module[0].weight.data_ptr()
