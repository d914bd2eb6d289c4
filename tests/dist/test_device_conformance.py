"""Device conformance (issue 33): DataParallel and pipelines hand torch.distributed only
tensors on the model's device, and read nothing on the host in a steady-state step.

Each case plays one rank of a job alone over torch's ``fake`` backend, with the model on
the ``meta`` device standing for a GPU (:mod:`syncline.testing.conformance`), with the
backend named ``"nccl"`` (``torch.distributed.get_backend`` forced), so that the library's
NCCL-only branches run, and for DataParallel also ``"gloo"`` (gloo takes GPU tensors in
collectives). A step is steady from the third on, and for DataParallel once bucket tuning
has decided; the host reads of the steps before (and of construction, checkpoint, resume)
are allowed, and printed.

- DataParallel: every registered compressor, bucket rebuild on, bucket tuning on for the
  stateless ones (tuned within the first steps), then a checkpoint of the compressor state
  read back as a CPU host reads it (``map_location="cpu"``) and resumed in a new wrapper.
- Pipelines: every registered schedule, as the first rank and as the last stage's rank of a
  two-rank pipeline; and with two replicas (four ranks), as rank 0 and rank 3. Over the fake
  backend a receive delivers nothing, so a stage that must read a shape header to size a
  received activation cannot run: the runtime must know the shapes locally. gloo sends and
  receives CPU tensors only, so a pipeline on a GPU over gloo must be refused up front.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from syncline import DataParallel, comm
from syncline.dp.precision import LossScaler
from syncline.dp.registry import COMPRESSORS, build_compressor
from syncline.pipeline import Pipeline
from syncline.schedule import SCHEDULES
from syncline.testing.conformance import (
    Conformance,
    failure_line,
    force_backend_name,
    run_fake_rank,
)

META = torch.device("meta")
BACKENDS = ("gloo", "nccl")
#: one spec per registered compressor, sized for the tiny model (several chunks, matrices)
SPECS = {
    "none": "none",
    "fp16": "fp16",
    "bf16": "bf16",
    "csc": "csc:0.25:chunk=64:warmup=1",
    "topk": "topk:0.1",
    "powersgd": "powersgd:2:warmup=1",
}
#: buckets of the stateful compressors: 24 KiB, so the 39 KiB model has two, one of them
#: past 4096 elements (where TopK samples a threshold and keeps the candidates above it)
CAP_MB = 24 / 1024
#: tuning: one step per trial, one round each, candidates down to ~16 KB (two of them for
#: the 39 KiB model: one bucket, or two), so it decides by the sixth step
TUNING = {
    "autotune_buckets": True,
    "tune_steps_per_trial": 1,
    "tune_rounds": 1,
    "tune_final_rounds": 1,
    "tune_min_bucket_mb": 16000 / 2**20,
}
WARMUP_STEPS = 2  # steps 0 and 1 may read on the host; from the third on, none may
STEADY_STEPS = 3


def _mlp(device: torch.device = META) -> nn.Sequential:
    """Seven one-tensor layers (9928 parameters), built on ``device``."""
    return nn.Sequential(
        nn.Linear(16, 64, device=device),
        nn.ReLU(),
        nn.Linear(64, 64, device=device),
        nn.ReLU(),
        nn.Linear(64, 64, device=device),
        nn.ReLU(),
        nn.Linear(64, 8, device=device),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, device=META), torch.randn(8, 8, device=META)


def _run(body: Any, backend: str, *args: Any) -> dict[str, Any]:
    """``body(spy, *args)`` under the spy and the forced backend name; what the spy saw,
    and how the run failed, if it did."""
    spy = Conformance(META)
    error = None
    with force_backend_name(backend), spy:
        assert comm.backend_name() == backend
        try:
            body(spy, *args)
        except Exception as exc:
            error = f"{failure_line(exc)} [in {spy.current_phase}]"
    summary = spy.summary()
    return {
        **summary,
        "error": error,
        "calls": len(spy.calls),
        "shadow_failures": spy.shadow_failures,
    }


def _check(result: dict[str, Any], reads_per_step: int = 0) -> None:
    """Fail with every problem at once: the run's error, tensors off the device, and host
    reads in a steady-state step (more than ``reads_per_step`` in one)."""
    warmup = "\n  ".join(result["warmup_reads"]) or "none"
    print(f"host reads outside the steady state (allowed):\n  {warmup}")
    problems = []
    if result["error"] is not None:
        problems.append(f"the run failed: {result['error']}")
    problems += [f"tensor off the model's device: {x}" for x in result["offenders"]]
    most = max(result["reads_per_steady_phase"].values(), default=0)
    if most > reads_per_step:
        problems.append(
            f"host reads in a steady-state step: up to {most}, allowed {reads_per_step}"
        )
        problems += [f"host read in a steady-state step: {x}" for x in result["steady_reads"]]
    assert not problems, "\n".join(problems)


# -- DataParallel ----------------------------------------------------------------------------
def _train(spy: Conformance, dp: DataParallel, opt: Any, start: int, warmup: int) -> int:
    """Steps until ``STEADY_STEPS`` steady ones ran (steady: ``warmup`` steps done and the
    bucket tuning decided); returns the next step's number."""
    steady = k = 0
    while steady < STEADY_STEPS:
        if k == 30:
            raise AssertionError(f"no steady state after 30 steps (tuning: {dp.bucket_tuning})")
        is_steady = k >= warmup and not dp.tuning_pending
        spy.phase(f"step {start + k}", steady=is_steady)
        x, y = _batch()
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
        steady += is_steady
        k += 1
    return start + k


def _as_read_on_a_cpu_host(spy: Conformance, state: Any) -> Any:
    """The checkpointed state as ``torch.load(map_location="cpu")`` gives it back."""
    host = _tree_map(spy.host_value, state)
    buf = io.BytesIO()
    torch.save(host, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _tree_map(fn: Any, tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return tree


def _data_parallel(spy: Conformance, name: str) -> None:
    spec = SPECS[name]
    stateless = build_compressor(spec).stateless
    options = TUNING if stateless else {"bucket_cap_mb": CAP_MB}
    momentum = 0.0 if COMPRESSORS.get(name).owns_momentum else 0.9

    def build() -> tuple[DataParallel, torch.optim.Optimizer]:
        dp = DataParallel(
            _mlp(), compression=build_compressor(spec), rebuild_buckets=True, **options
        )
        return dp, torch.optim.SGD(dp.parameters(), lr=0.01, momentum=momentum)

    spy.phase("construction")
    dp, opt = build()
    step = _train(spy, dp, opt, 0, WARMUP_STEPS)
    spy.phase("checkpoint")
    state = _as_read_on_a_cpu_host(spy, dp.compression_state_dict())
    spy.phase("resume: construction and load")
    dp, opt = build()
    dp.load_compression_state_dict(state)
    _train(spy, dp, opt, step, 1)  # the first step after loading may still settle


def _dp_rank(rank: int, world: int, name: str, backend: str) -> dict[str, Any]:
    del rank, world
    return _run(_data_parallel, backend, name)


def test_specs_cover_every_registered_compressor() -> None:
    assert sorted(SPECS) == sorted(spec.name for spec in COMPRESSORS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SPECS))
def test_data_parallel_on_device(name: str, backend: str) -> None:
    _check(run_fake_rank(_dp_rank, 0, 2, name, backend, timeout_s=120))


def _fp16_loss_scaling(spy: Conformance, name: str) -> None:
    """fp16's dynamic loss scaling beside DataParallel, as ``syncline train`` runs it: the
    verdict (any rank overflowed?) is read once a step, to skip or take the step; with an
    error-feedback compressor the engine's own flag joins that verdict."""
    spy.phase("construction")
    compressor = build_compressor(SPECS[name])
    in_reduce = not compressor.stateless  # a residual must see unscaled, finite values
    options = TUNING if compressor.stateless else {"bucket_cap_mb": CAP_MB}
    dp = DataParallel(_mlp(), compression=compressor, **options)
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    scaler = LossScaler()
    steady = 0
    for step in range(30):
        if steady == STEADY_STEPS:
            break
        is_steady = step >= WARMUP_STEPS and not dp.tuning_pending
        spy.phase(f"step {step}", steady=is_steady)
        steady += is_steady
        if in_reduce:
            dp.unscale_in_reduce(scaler.value)
        x, y = _batch()
        scaler.scale(F.mse_loss(dp(x), y)).backward()
        # this rank's flag from the reduce, on the device where the engine offers it so
        flag = getattr(dp, "overflow_flag_in_reduce", None)
        overflowed = in_reduce and (dp.overflowed_in_reduce() if flag is None else flag())
        if scaler.unscale_or_skip(
            list(dp.parameters()), step, unscaled=in_reduce, overflowed=overflowed
        ):
            opt.step()
        opt.zero_grad()
    assert steady == STEADY_STEPS, f"no steady state in 30 steps (tuning: {dp.bucket_tuning})"


def _fp16_rank(rank: int, world: int, name: str, backend: str) -> dict[str, Any]:
    del rank, world
    return _run(_fp16_loss_scaling, backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["none", "topk"])
def test_fp16_loss_scaling_on_device(name: str, backend: str) -> None:
    """One host read a step at most: the overflow verdict (as torch's GradScaler)."""
    _check(run_fake_rank(_fp16_rank, 0, 2, name, backend, timeout_s=120), reads_per_step=1)


def _guarded(spy: Conformance, optimizer: str) -> None:
    """The non-finite guard: each bucket checked on the device, the verdict agreed in the
    bucket allreduce's tail, the optimizer skipping on it by a masked update (torch's SGD,
    LARS): no host read in a steady step. (The fused optimizers' ``found_inf`` path cannot
    run here: fused kernels refuse ``meta`` tensors.)"""
    from syncline.dp.guard import StepGuard
    from syncline.dp.guard_config import GuardConfig
    from syncline.optim.lars import Lars
    from syncline.optim.skip import step_unless

    spy.phase("construction")
    guard = StepGuard(GuardConfig(on_nonfinite="rollback", spike_factor=3.0, spike_window=3))
    dp = DataParallel(_mlp(), rebuild_buckets=True, guard=guard, **TUNING)
    params = list(dp.parameters())
    opt = (
        torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if optimizer == "sgd"
        else Lars(params, lr=0.01, momentum=0.9)
    )
    steady = 0
    for step in range(30):
        if steady == STEADY_STEPS:
            break
        is_steady = step >= WARMUP_STEPS and not dp.tuning_pending
        spy.phase(f"step {step}", steady=is_steady)
        steady += is_steady
        x, y = _batch()
        loss = F.mse_loss(dp(x), y)
        guard.watch_loss(loss)
        loss.backward()
        step_unless(opt, guard.skip_flag)
        opt.zero_grad()
    assert steady == STEADY_STEPS, f"no steady state in 30 steps (tuning: {dp.bucket_tuning})"


def _guard_rank(rank: int, world: int, optimizer: str, backend: str) -> dict[str, Any]:
    del rank, world
    return _run(_guarded, backend, optimizer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
def test_nonfinite_guard_on_device(optimizer: str, backend: str) -> None:
    _check(run_fake_rank(_guard_rank, 0, 2, optimizer, backend, timeout_s=120))


# -- pipelines -------------------------------------------------------------------------------
def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield _batch()


def _pipeline(spy: Conformance, schedule: str, replicas: bool, compression: str) -> None:
    spy.phase("construction")
    stages = 4 if SCHEDULES.get(schedule).stages_per_rank > 1 else 2
    groups = comm.build_pipeline_groups(2) if replicas else (None, None)
    pipe = Pipeline(
        _mlp(),
        num_stages=stages,
        num_microbatches=4,
        schedule=schedule,
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        balance=[4, 3] if stages == 2 else [2, 2, 2, 1],
        process_group=groups[0],
        data_parallel_group=groups[1],
        compression=build_compressor(compression),
        device=META,
        timeout_s=30,
    )
    batches = _batches()
    # the loss stays on the device until it is logged (where train_step can return it so)
    keep = {"return_tensor": True} if _takes(pipe.train_step, "return_tensor") else {}
    for step in range(WARMUP_STEPS + STEADY_STEPS):
        spy.phase(f"step {step}", steady=step >= WARMUP_STEPS)
        pipe.train_step(batches, **keep)
    spy.phase("flush")
    pipe.flush()


def _takes(fn: Any, keyword: str) -> bool:
    return keyword in inspect.signature(fn).parameters


def _pipe_rank(
    rank: int, world: int, schedule: str, backend: str, replicas: bool, compression: str
) -> dict[str, Any]:
    del rank, world
    return _run(_pipeline, backend, schedule, replicas, compression)


@pytest.mark.parametrize("rank", [0, 1], ids=["first", "last"])
@pytest.mark.parametrize("schedule", [spec.name for spec in SCHEDULES])
def test_pipeline_on_device(schedule: str, rank: int) -> None:
    result = run_fake_rank(_pipe_rank, rank, 2, schedule, "nccl", False, "none", timeout_s=120)
    _check(result)


@pytest.mark.parametrize("rank", [0, 3], ids=["rank0", "rank3"])
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_pipeline_with_replicas_on_device(schedule: str, rank: int) -> None:
    """Two stages times two replicas; the REDUCE through a stateful compressor (TopK)."""
    result = run_fake_rank(_pipe_rank, rank, 4, schedule, "nccl", True, "topk:0.1", timeout_s=120)
    _check(result)


def _construction_rank(rank: int, world: int) -> dict[str, list[str]]:
    """The torch.distributed calls of each phase: a pipeline with replicas constructed with
    its balance, then its first step."""
    del rank, world
    spy = Conformance(META)
    with force_backend_name("nccl"), spy:
        pipe_group, dp_group = comm.build_pipeline_groups(2)
        model = _mlp()
        spy.phase("construction")
        pipe = Pipeline(
            model, num_stages=2, num_microbatches=4, schedule="1f1b", loss_fn=F.mse_loss,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), balance=[4, 3],
            process_group=pipe_group, data_parallel_group=dp_group, device=META, timeout_s=30,
        )  # fmt: skip
        spy.phase("first step")
        pipe.train_step(_batches(), return_tensor=True)
    calls: dict[str, list[str]] = {}
    for call in spy.calls:
        calls.setdefault(call.phase, []).append(call.op)
    return calls


def test_a_pipeline_constructor_does_not_communicate() -> None:
    """Constructors store and check settings: the stages are built, and each stage's weights
    broadcast from its first replica, by the first call that needs them."""
    calls = run_fake_rank(_construction_rank, 0, 4, timeout_s=120)
    assert calls.get("construction", []) == []
    assert "broadcast" in calls["first step"], calls


def test_pipeline_over_gloo_on_a_device_is_refused() -> None:
    """gloo has no device send/recv: refused at construction, before anything is sent."""
    result = run_fake_rank(_pipe_rank, 0, 2, "1f1b", "gloo", False, "none", timeout_s=120)
    assert result["error"] is not None, "a gloo pipeline on meta ran instead of being refused"
    assert result["error"].startswith("ConfigError") and "gloo" in result["error"]
    assert result["error"].endswith("[in construction]")
    assert result["calls"] == 0


# -- the spy itself --------------------------------------------------------------------------
def _offending(spy: Conformance) -> None:
    spy.phase("step 0")
    warm = torch.ones(4, device=META)
    assert warm.sum().item() == 4.0  # answered from the shadow, and on record
    spy.phase("step 2", steady=True)
    t = torch.arange(4, device=META)
    comm.FlatAllreduce(None).allreduce(t.cpu(), "a CPU tensor").wait()
    out = [torch.empty_like(t) for _ in range(2)]
    torch.distributed.all_gather(out, t)  # the fake all-gather, shadowed on meta
    assert [spy.host_value(o).tolist() for o in out] == [[0, 1, 2, 3]] * 2


def _shadows_follow_cpu(spy: Conformance) -> None:
    """A meta model's shadows hold exactly what the same model computes on the CPU."""
    values = []
    for device in (META, torch.device("cpu")):
        torch.manual_seed(0)
        model = _mlp(device)
        x, y = torch.randn(8, 16, device=device), torch.randn(8, 8, device=device)
        F.mse_loss(model(x), y).backward()
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).step()
        tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
        values.append([spy.host_value(t) for t in tensors])
    assert len(values[0]) == 16
    assert all(torch.equal(a, b) for a, b in zip(*values, strict=True))


def _spy_rank(rank: int, world: int, backend: str) -> dict[str, Any]:
    del rank, world
    return _run(_offending, backend)


def _shadow_rank(rank: int, world: int) -> dict[str, Any]:
    del rank, world
    return _run(_shadows_follow_cpu, "nccl")


def test_the_spy_catches_cpu_tensors_and_steady_host_reads() -> None:
    result = run_fake_rank(_spy_rank, 0, 2, "nccl", timeout_s=60)
    assert result["error"] is None
    assert len(result["offenders"]) == 1
    assert result["offenders"][0].startswith("all_reduce on cpu at syncline/comm/collectives.py")
    assert [x.split(":")[0] for x in result["steady_reads"]] == [
        "_to_copy at test_device_conformance.py"
    ]
    assert [x.split(":")[0] for x in result["warmup_reads"]] == [
        "_local_scalar_dense at test_device_conformance.py"
    ]
    with pytest.raises(AssertionError, match="tensor off the model's device: all_reduce on cpu"):
        _check(result)


def test_shadows_of_a_meta_model_equal_its_cpu_twin() -> None:
    result = run_fake_rank(_shadow_rank, 0, 2, timeout_s=60)
    assert result["error"] is None
    assert result["shadow_failures"] == 0
