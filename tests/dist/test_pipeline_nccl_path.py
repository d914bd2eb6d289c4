"""The pipeline's NCCL protocol, run on gloo: bit-identical to the gloo protocol.

Under NCCL (any backend but gloo) the runtime issues each run of SEND/RECV actions as one
``batch_isend_irecv`` group in the order of ``nccl_plan``, posts nothing early, takes the
activation shapes from shape inference instead of headers and keeps the loss on the device.
``Pipeline._use_grouped(ordered=True)`` runs that protocol on gloo with one wire tag, so gloo
pairs messages in issue order per pair of ranks as NCCL does (a mismatch of orders makes gloo
abort on a message of another size, so it cannot pass unnoticed). Every case trains 3 steps
of the schedule zoo's tiny GPT both ways in one spawn and must give the same losses and
weights bit for bit; so does 2BW with an evaluation between steps (its messages pass
between a batch sent early and its receipt). Also: the inferred shapes equal those the
header protocol learns; a model whose forward reads values falls back to headers inside the
groups; a stage whose real output differs from the inferred one is refused before it
sends; the hierarchical allreduce's NCCL order (all phases at launch) equals a flat
allreduce; and on torch's ``fake`` backend with the model on the meta device the NCCL path
runs every schedule without reading a value on the host.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline import comm
from syncline.comm.collectives import FlatAllreduce
from syncline.comm.hierarchical import HierarchicalAllreduce
from syncline.comm.topology import Topology
from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from syncline.pipeline.shapes import infer_sequential
from syncline.testing import run_ranks
from tests.zoo import schedules
from tests.zoo.models import lm_batches, tiny_gpt

STEPS = 3
TWO = ("gpipe", "1f1b", "2bw-sgd", "interleaved", "2bw-recompute")


def _train(pipe: Pipeline, schedule: str, data: list) -> dict:
    batches = iter(data)
    if schedule == "2bw":
        losses = [pipe.train_step(batches) for _ in range(STEPS - 1)]
        losses.append(pipe.flush())
    else:
        losses = [pipe.train_step(batches) for _ in range(STEPS)]
        assert pipe.flush() is None
    return {"losses": losses, "state": pipe.local_state_dict()}


def _both_ways(case: schedules.PipeCase, data: list, **kwargs: object) -> tuple[dict, dict]:
    gloo = _train(case.pipeline(timeout_s=30, **kwargs), case.schedule, data)
    pipe = case.pipeline(timeout_s=30, **kwargs)
    pipe._use_grouped(ordered=True)
    return gloo, _train(pipe, case.schedule, data)


def _two_ranks(rank: int, world: int) -> dict:
    out = {}
    data = lm_batches()[:STEPS]
    for name in TWO:
        out[name] = _both_ways(schedules.PARITY[2][name], data)
    # the header protocol's shapes (inference off) against inference
    pipe = schedules.PARITY[2]["1f1b"].pipeline(timeout_s=30)
    pipe._ctx.links.infer = None
    _train(pipe, "1f1b", data)
    book = pipe._ctx.links.shapes._book
    out["learnt"] = {key: like for key, (like, _) in book.items()}
    out["inferred"] = {(edge, sig): pipe._setup.infer(edge, sig) for (edge, sig) in out["learnt"]}
    out["reads_values"] = _reads_values()
    out["evaluated"] = _evaluated_between_steps(data)
    out["shrinks"] = _shrinks()  # last: it leaves the pair of ranks mid-message
    return out


def _evaluated_between_steps(data: list) -> tuple[dict, dict]:
    """2BW with an evaluation after every step: its messages go between a batch's first
    activations, sent early, and their receipt (the receiver posts those first)."""
    runs = []
    for grouped in (False, True):
        pipe = schedules.PARITY[2]["2bw-sgd"].pipeline(timeout_s=30)
        if grouped:
            pipe._use_grouped(ordered=True)
        it, losses, evals = iter(data), [], []
        for _ in range(STEPS - 1):
            losses.append(pipe.train_step(it))
            evals.append(pipe.eval_step(iter(data[:1])))
        losses.append(pipe.flush())
        runs.append({"losses": losses, "evals": evals, "state": pipe.local_state_dict()})
    return runs[0], runs[1]


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout_s=240, comm_timeout_s=30)


@pytest.mark.parametrize("name", TWO)
def test_grouped_protocol_is_bit_identical_on_two_ranks(two, name: str) -> None:
    for rank, result in enumerate(two):
        gloo, grouped = result[name]
        assert grouped["losses"] == gloo["losses"], (name, rank)
        assert set(grouped["state"]) == set(gloo["state"])
        for key, value in gloo["state"].items():
            assert torch.equal(grouped["state"][key], value), (name, rank, key)


def test_inferred_shapes_equal_the_learnt_ones(two) -> None:
    receiver = two[1]  # rank 1 receives stage 0's activations, of two signatures (8 and 5)
    assert len(receiver["learnt"]) == 2
    assert receiver["inferred"] == receiver["learnt"]
    for (_, signature), (shape, dtype) in receiver["learnt"].items():
        assert shape == (*signature[0], 16) and dtype == torch.float32


def test_two_bw_evaluated_between_steps_is_bit_identical(two) -> None:
    for rank, result in enumerate(two):
        gloo, grouped = result["evaluated"]
        assert grouped["losses"] == gloo["losses"] and grouped["evals"] == gloo["evals"], rank
        for key, value in gloo["state"].items():
            assert torch.equal(grouped["state"][key], value), (rank, key)


class Shrinks(nn.Module):
    """Identity for ``calls`` forwards, then drops a row: an output shape that does not
    follow from the input's, which inference (run on shapes) cannot foresee."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls, self.seen = calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return x if self.seen <= self.calls else x[:-1]


def _shrinks() -> str:
    torch.manual_seed(0)
    pipe = Pipeline(
        nn.Sequential(nn.Linear(4, 8), Shrinks(calls=4), nn.Linear(8, 3)),
        num_stages=2, num_microbatches=2, schedule="1f1b", balance=[2, 1], timeout_s=3.0,
        loss_fn=nn.functional.cross_entropy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )  # fmt: skip
    pipe._use_grouped(ordered=True)
    g = torch.Generator().manual_seed(0)
    batches = iter([(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))] * 3)
    try:
        for _ in range(3):
            pipe.train_step(batches)
    except Exception as exc:
        cause = exc.__cause__
        return f"{type(exc).__name__}: {exc} | cause: {type(cause).__name__}"
    return "no error"


def test_an_output_other_than_the_inferred_one_is_refused_before_it_is_sent(two) -> None:
    sender, receiver = two[0]["shrinks"], two[1]["shrinks"]
    assert sender.startswith("StageError: rank 0 (stage 0): SEND_F mb 0 of step 2"), sender
    assert "stage 0 output [1, 8] float32 for micro-batch inputs [2, 4] float32" in sender
    assert "forward run on the shapes alone gave [2, 8] float32" in sender
    assert sender.endswith("| cause: ConfigError"), sender
    assert receiver.startswith(("CommError: rank 1: ", "CommTimeout: rank 1: ")), receiver
    assert "1RECV_F0@b2" in receiver, receiver


class ReadsValues(nn.Module):
    """Reads a value in its forward (a host read), so its shapes cannot be inferred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if float(x.abs().sum()) > 0 else x


def _value_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), ReadsValues(), nn.Tanh(), nn.Linear(8, 3))


def _value_pipe(schedule: str) -> Pipeline:
    return Pipeline(
        _value_model(),
        num_stages=2,
        num_microbatches=4,
        schedule=schedule,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        balance=[2, 2],
        timeout_s=30,
    )


def _reads_values() -> dict:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))] * 4
    out = {}
    for schedule in ("1f1b", "2bw"):
        gloo = _train(_value_pipe(schedule), schedule, data)
        pipe = _value_pipe(schedule)
        pipe._use_grouped(ordered=True)
        out[schedule] = (gloo, _train(pipe, schedule, data))
        out[f"{schedule}-inferred"] = pipe._setup.infer(0, ((2, 6), torch.float32))
    return out


def test_a_forward_that_reads_values_falls_back_to_headers(two) -> None:
    for result in two:
        got = result["reads_values"]
        for schedule in ("1f1b", "2bw"):
            assert got[f"{schedule}-inferred"] is None  # not inferable: headers carry it
            gloo, grouped = got[schedule]
            assert grouped["losses"] == gloo["losses"], schedule
            for key, value in gloo["state"].items():
                assert torch.equal(grouped["state"][key], value), (schedule, key)


def _replicas(rank: int, world: int) -> dict:
    pipe_group, dp_group = comm.build_pipeline_groups(2, timeout_s=30)
    replica = comm.group_rank(dp_group)
    data = [(x[replica * 4 : replica * 4 + 4], y[replica * 4 : replica * 4 + 4])
            for x, y in lm_batches()[:STEPS]]  # fmt: skip
    case = schedules.REPLICAS["1f1b"]
    groups = {"process_group": pipe_group, "data_parallel_group": dp_group}
    return {"1f1b": _both_ways(case, data, **groups), "hier": _hierarchical()}


def _hierarchical() -> dict:
    """All phases issued at launch (the NCCL order) against the flat allreduce."""
    out = {}
    flat = FlatAllreduce(None, timeout_s=30)
    for scatter_as_allreduce in (True, False):
        hier = HierarchicalAllreduce(Topology(4, 2), timeout_s=30).build()
        hier._at_once, hier._scatter_as_allreduce = True, scatter_as_allreduce
        rank = comm.group_rank()
        tensors = [torch.arange(n, dtype=torch.float32) * (rank + 1) + rank for n in (1, 7, 1000)]
        expected = [t.clone() for t in tensors]
        pending = [hier.allreduce(t, f"bucket {i}") for i, t in enumerate(tensors)]
        for p in pending:
            p.wait()
        for t in expected:
            flat.allreduce(t, "flat").wait()
        out[scatter_as_allreduce] = (tensors, expected, dict(hier.early_starts))
    return out


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_replicas, 4, timeout_s=240, comm_timeout_s=30)


def test_grouped_protocol_with_replicas_is_bit_identical(four) -> None:
    for rank, result in enumerate(four):
        gloo, grouped = result["1f1b"]
        assert grouped["losses"] == gloo["losses"], rank
        for key, value in gloo["state"].items():
            assert torch.equal(grouped["state"][key], value), (rank, key)


def test_hierarchical_phases_at_launch_equal_a_flat_allreduce(four) -> None:
    for result in four:
        for tensors, expected, early in result["hier"].values():
            for got, want in zip(tensors, expected, strict=True):
                assert torch.equal(got, want)
            assert early == {2: 0, 3: 0}  # nothing left for poll()


def test_inference_follows_autocast() -> None:
    """Under bf16 a Linear's output is bf16: the inferred dtype is autocast's, as in the real
    forward (meta tensors would ignore autocast and say float32)."""
    parts = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 2))]
    cpu = torch.device("cpu")

    def bf16() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    reads = [nn.Sequential(nn.Linear(6, 8), ReadsValues()), nn.Linear(8, 3)]
    state = torch.get_rng_state()
    likes = infer_sequential(parts, ((3, 4), torch.float32), cpu, bf16)
    plain = infer_sequential(parts, ((3, 4), torch.float32), cpu, torch.no_grad)
    assert infer_sequential(reads, ((2, 6), torch.float32), cpu, torch.no_grad) is None
    assert torch.equal(torch.get_rng_state(), state)  # no random number drawn
    with bf16():
        real = parts[0](torch.randn(3, 4))
    assert likes == [((3, 8), real.dtype)] and real.dtype == torch.bfloat16
    assert plain == [((3, 8), torch.float32)]


class Caches(nn.Module):
    """Counts its calls and keeps its last input, as rotary-embedding caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.cache = x
        return x


def test_inference_leaves_no_trace_in_the_modules() -> None:
    caching = Caches()
    parts = [nn.Sequential(nn.Linear(4, 8), caching), nn.Linear(8, 2)]
    likes = infer_sequential(parts, ((3, 4), torch.float32), torch.device("cpu"), torch.no_grad)
    assert likes == [((3, 8), torch.float32)]
    assert caching.calls == 0 and not hasattr(caching, "cache")  # no fake tensor kept
    assert not parts[0][0].weight.is_meta and type(parts[0][0].weight) is nn.Parameter


FAKE = {"1f1b": (2, 1), "2bw": (2, 1), "interleaved": (4, 1), "1f1b-replicas": (2, 2)}


@pytest.mark.parametrize("name", list(FAKE))
def test_the_nccl_path_reads_nothing_on_the_host(name: str) -> None:
    """Every rank in turn, in this process, on torch's ``fake`` backend (any backend but
    gloo takes the NCCL path) with the model on the meta device, a stand-in for a GPU whose
    values cannot be read: a host sync in a step (``.item()``, a header read) would raise."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    depth, width = FAKE[name]
    for rank in range(2 * width):
        dist.init_process_group(
            "cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=2 * width
        )
        try:
            groups = {}
            if width > 1:
                pipe_group, dp_group = comm.build_pipeline_groups(2, timeout_s=10)
                groups = {"process_group": pipe_group, "data_parallel_group": dp_group}
            with torch.device("meta"):
                model = tiny_gpt()
            pipe = Pipeline(
                model, num_stages=depth, num_microbatches=4, schedule=name.split("-")[0],
                loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                balance=[4 // depth] * depth, device="meta", timeout_s=10, **groups,
            )  # fmt: skip
            assert pipe._ctx.links.grouped
            batches = iter([(x.to("meta"), y.to("meta")) for x, y in lm_batches()])
            losses = [pipe.train_step(batches, return_tensor=True) for _ in range(STEPS)]
            pipe.flush(return_tensor=True)
            assert all(loss.is_meta and loss.shape == (1,) for loss in losses)
        finally:
            dist.destroy_process_group()
