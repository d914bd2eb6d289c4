"""Runs that survive: periodic sharded checkpoints, exact resume, elastic restart (issue 12).

The end-to-end tests run ``syncline train`` on 2 gloo ranks with a tiny GPT and compare the
final ``checkpoint.pt`` of an interrupted-then-continued run with an uninterrupted one's, bit
for bit (model and optimizer). The workers' code runs in-process (:mod:`tests.zoo.train`; a
restart by ``--max-restarts`` is its attempt 1); one elastic restart goes through torchrun,
whose restart is what it tests.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from syncline.errors import CheckpointError
from syncline.testing import run_ranks
from syncline.train.checkpoint import load_checkpoint
from tests.zoo.cli import syncline
from tests.zoo.train import Trained, cli, launched, train, train_failing, train_restarted

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
TINY += ["--batch-size", "8", "--log-every", "2", "--warmup-steps", "2"]


def _train(run: Path, *extra: str) -> Trained:
    return train(*TINY, "--run-dir", str(run), *extra)


def _final(run: Path) -> dict:
    return load_checkpoint(run / "checkpoint.pt")


def profiled_balance(run: Path) -> str:
    """The ``--balance`` a finished pipeline run was cut into (profiled, if not given).

    The profile times each layer, so two runs of one command may cut a model differently on
    a loaded machine: the same weights at the end, but other stages' optimizer states. A
    reference compared stage by stage with a run is cut as the run was.
    """
    return ",".join(str(n) for n in _final(run)["balance"])


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    _assert_same_tree(a["optimizer"], b["optimizer"], "optimizer")
    _assert_same_tree(a["compression"], b["compression"], "compression")


def _assert_same_tree(a: object, b: object, where: str) -> None:
    """Equal nested state: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict]:
    """The reference runs: 8 steps, no failure (one per compression); each keeps its
    checkpoints of steps 4, 6 and 8, the last written after the last step (under ``"dir"``)."""
    out = {}
    for name, flags in VARIANTS.items():
        run = tmp_path_factory.mktemp(f"ref-{name}")
        _train(run, "--steps", "8", "--checkpoint-every", "2", "--keep-checkpoints", "3", *flags)
        out[name] = {**_final(run), "dir": run}
    return out


VARIANTS = {
    "dense": [],
    "csc": ["--compression", "csc:0.05:warmup=2", "--optimizer", "sgd", "--lr", "0.05"],
    "powersgd": ["--compression", "powersgd:2:warmup=2"],
}


def test_resume_after_a_failure_is_bit_exact(tmp_path, uninterrupted) -> None:
    """Rank 1 dies at step 6, after the checkpoint of step 3 (and before that of 6);
    ``--resume`` continues from step 3 and ends with the uninterrupted run's weights and
    optimizer state, bit for bit; the metrics cover every step once."""
    run = tmp_path / "run"
    failed = train_failing(
        *TINY, "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "3",
        "--inject-failure", "1:5",
    )  # fmt: skip
    assert "rank 1: injected failure at step 5" in failed.text, failed.text[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003"]
    text = _train(run, "--resume", str(run), "--steps", "8").text
    assert "resumed from" in text and "(step 3)" in text
    final = _final(run)
    _assert_same_state(final, uninterrupted["dense"])
    assert final["optimizer"]["state"]  # AdamW's moments were compared, not an empty dict
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4, 6, 7]
    # the newest two checkpoints are kept, the last written after the last step
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000006",
        "step-00000008",
    ]


def test_resume_skips_a_damaged_newest_checkpoint_and_is_bit_exact(
    tmp_path, uninterrupted, capsys
) -> None:
    """One byte flipped in the newest checkpoint (of step 6): the command line checks it
    before launch and the ranks check it again; each says in one line that it skips it and
    why, the run continues from the intact one before it (step 4, kept by
    ``--keep-checkpoints 2``) and ends with the uninterrupted run's state, bit for bit."""
    run = tmp_path / "run"
    failed = train_failing(
        *TINY, "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "2",
        "--inject-failure", "1:7",
    )  # fmt: skip
    assert "rank 1: injected failure at step 7" in failed.text, failed.text[-3000:]
    newest = run / "checkpoints" / "step-00000006"
    victim = sorted(p for p in newest.iterdir() if p.suffix == ".distcp")[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    text = _train(run, "--resume", str(run), "--steps", "8").text
    why = f"damaged: {victim.name} ({len(data)} bytes) does not match its recorded digest"
    before_launch = capsys.readouterr().out
    assert f"syncline train: skipping checkpoint {newest}: {why}\n" in before_launch
    lines = [line for line in text.splitlines() if "skipping checkpoint" in line]
    assert lines == [f"skipping checkpoint {newest}: {why}; trying the one before it"], text
    assert "Traceback" not in text
    assert f"resumed from {run / 'checkpoints' / 'step-00000004'} (step 4)" in text, text
    _assert_same_state(_final(run), uninterrupted["dense"])


def test_a_checkpoint_that_does_not_fit_is_skipped_and_the_run_goes_on(
    tmp_path, uninterrupted
) -> None:
    """``--on-checkpoint-error skip``: rank 1's write of step 4's checkpoint fails as on a
    full disk (ENOSPC); every rank agrees, rank 0 warns in one line naming the directory and
    its free space, nothing of step 4 is published, the next checkpoint is written, and the
    run ends with the uninterrupted run's state, bit for bit."""
    run = tmp_path / "run"
    text = _train(
        run, "--steps", "8", "--checkpoint-every", "2", "--on-checkpoint-error", "skip",
        "--inject-failure", "1:3:nospace",
    ).text  # fmt: skip
    warned = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1, text
    assert warned[0].startswith(
        f"warning: checkpoint of step 4 does not fit in {run / 'checkpoints'}: "
        "[Errno 28] No space left on device (injected); "
    ), warned
    assert warned[0].endswith(
        " free there; skipped, trying again at step 6 (--on-checkpoint-error skip)"
    ), warned
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000006",
        "step-00000008",
    ]
    _assert_same_state(_final(run), uninterrupted["dense"])


def test_a_checkpoint_that_does_not_fit_stops_each_rank_with_one_line(tmp_path) -> None:
    """``--on-checkpoint-error stop`` (the default), through the workers' own entry point:
    each rank ends with one line naming the directory and the free space, no traceback on
    the console (it is in the rank's log file), and the checkpoint before is intact."""
    run = tmp_path / "run"
    res = launched(
        "train", *TINY, "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "2",
        "--inject-failure", "1:3:nospace",
    )  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    want = f"checkpoint of step 4 does not fit in {run / 'checkpoints'}: [Errno 28] No space"
    for rank in (0, 1):
        lines = [line for line in text.splitlines() if line.startswith(f"rank {rank}: {want}")]
        assert len(lines) == 1, text[-3000:]
        assert lines[0].endswith(f"(--on-checkpoint-error stop) (traceback: {run}/logs/rank{rank}.log)")
        assert "Traceback" in (run / "logs" / f"rank{rank}.log").read_text()
    # the launcher names the rank whose line it read first (the other may be stopped by then)
    pattern = r"job failed: rank (\d) \(exit code 1: CheckpointWriteError: rank \1: "
    assert re.search(pattern + re.escape(want), text), text[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]


def test_resume_refuses_when_no_checkpoint_is_intact(tmp_path) -> None:
    run = tmp_path / "run"
    _train(run, "--steps", "2", "--checkpoint-every", "2")
    for snap in (run / "checkpoints").iterdir():
        victim = sorted(p for p in snap.iterdir() if p.suffix == ".distcp")[0]
        victim.write_bytes(victim.read_bytes()[:-1])  # truncated
    res = cli("train", *TINY, "--resume", str(run), "--steps", "4")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no intact checkpoint to resume from (step-00000002: damaged:" in res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("dense", marks=pytest.mark.slow),  # through torchrun's own restart
        "csc",
        "powersgd",
    ],
)
def test_elastic_restart_is_bit_exact(tmp_path, uninterrupted, variant) -> None:
    """``--max-restarts 1``: torchrun restarts both workers after rank 1 dies at step 5; they
    resume from the checkpoint of step 4 by themselves (compressor state included: CSC's
    residuals and momentum, PowerSGD's error and Q) and finish bit-identical. The directory
    holds a newer checkpoint left by an earlier run (step 6): a fresh run clears it, so the
    restart does not resume from it. ``dense`` is restarted by torchrun itself; the others
    in-process, as attempt 1 of the same workers' code (what torchrun's restart runs)."""
    run = tmp_path / "run"
    stale = uninterrupted[variant]["dir"] / "checkpoints" / "step-00000006"
    shutil.copytree(stale, run / "checkpoints" / stale.name)
    flags = [*TINY, "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "2"]
    flags += ["--inject-failure", "1:5", "--max-restarts", "1", *VARIANTS[variant]]
    if variant == "dense":
        res = syncline("train", *flags)
        assert res.returncode == 0, res.stderr[-3000:]
        text = res.stdout + res.stderr
    else:
        text = train_restarted(*flags).text
    assert "resumed from" in text and "(step 4)" in text, text[-3000:]
    final = _final(run)
    _assert_same_state(final, uninterrupted[variant])
    if variant != "dense":  # the compressor's state took part (residuals, momentum, Q)
        assert final["compression"]["state"], final["compression"]


def test_resume_refuses_a_changed_option_and_a_run_without_checkpoints(
    tmp_path, uninterrupted
) -> None:
    """Both refused before any process starts (the run directory holds only its config); so
    is resuming a finished run without more steps (its last checkpoint is of its last step)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(uninterrupted["dense"]["dir"] / "config.json", run / "config.json")
    res = cli("train", *TINY, "--run-dir", str(run), "--resume", str(run))
    assert res.returncode == 2 and "no complete checkpoint" in res.stderr, res
    res = cli("train", *TINY, "--run-dir", str(run), "--resume", str(run), "--lr", "0.5")
    assert res.returncode == 2 and "lr=0.5 differs from the run's" in res.stderr, res
    done = uninterrupted["dense"]["dir"]
    res = cli("train", *TINY, "--run-dir", str(done), "--resume", str(done))
    text = res.stderr
    assert res.returncode == 2
    assert "newest checkpoint is of step 8, and steps=8 leaves nothing" in text, text
    assert "valid: --steps greater than 8" in text, text
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]  # nothing started


# -- the store on its own: atomic publication, verification, safe reading --------------------


def _store_rank(rank: int, world: int, root: str, what: str) -> object:
    from syncline.train.snapshots import SnapshotStore

    store = SnapshotStore(Path(root), keep=2, timeout_s=30)
    if what == "save":
        for step in (1, 2, 3):
            shared = {"w": torch.arange(6.0) * step}
            mine = {f"rank{rank}/x": torch.full((3,), float(10 * rank + step))}
            store.save(step, {**shared, **mine})
        return [s.step for s in store.complete()]
    snap = store.latest()
    assert snap is not None
    try:
        got = store.load(snap, ["w", f"rank{rank}/x"])
    except CheckpointError as exc:
        return ("CheckpointError", str(exc))
    return {k: v.tolist() for k, v in got.items()}


def test_store_keeps_the_newest_and_reads_back_each_ranks_part(tmp_path) -> None:
    root = str(tmp_path / "ck")
    assert run_ranks(_store_rank, 2, root, "save") == [[2, 3], [2, 3]]
    assert run_ranks(_store_rank, 2, root, "load") == [
        {"w": [0.0, 3.0, 6.0, 9.0, 12.0, 15.0], "rank0/x": [3.0, 3.0, 3.0]},
        {"w": [0.0, 3.0, 6.0, 9.0, 12.0, 15.0], "rank1/x": [13.0, 13.0, 13.0]},
    ]
    # damage one data file: every rank refuses, naming it
    step3 = Path(root) / "step-00000003"
    victim = sorted(p for p in step3.iterdir() if p.suffix == ".distcp")[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = run_ranks(_store_rank, 2, root, "load")
    assert [g[0] for g in got] == ["CheckpointError", "CheckpointError"], got
    assert victim.name in got[0][1] and got[0] == got[1]


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED_BY_METADATA",))


def test_hostile_metadata_is_refused_and_never_runs(tmp_path, monkeypatch) -> None:
    """A checkpoint whose DCP ``.metadata`` pickles ``os.system`` (with a matching manifest,
    as an attacker would write): refused with CheckpointError, and the command never ran."""
    from syncline.comm.sharded import read_index

    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "step-00000001"
    ck.mkdir()
    (ck / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match="nothing in it was run"):
        read_index(ck)
    assert not (tmp_path / "PWNED_BY_METADATA").exists()


# -- pipelines ------------------------------------------------------------------------------

PIPE = ["--pipeline-stages", "2", "--n-layer", "2", "--n-embd", "32", "--seq-len", "16"]
PIPE += ["--batch-size", "16", "--warmup-steps", "2", "--log-every", "2", "--steps", "8"]
PIPE += ["--checkpoint-every", "2"]

# GPipe resumes through the same code (ran once, passed); left out to keep the suite short
PIPELINES = {
    "interleaved": ["--schedule", "interleaved", "--microbatches", "4"],
    "1f1b-2x2-replicas": ["--schedule", "1f1b", "--nproc-per-node", "4", "--microbatches", "2"],
    # checkpoints every 4 steps: calls start, steady, steady, drain between them
    "2bw": ["--schedule", "2bw", "--microbatches", "2", "--checkpoint-every", "4"],
}


@pytest.mark.parametrize(
    "variant",
    # one in the fast tier; the option matrix restarts every schedule too (full tier)
    [v if v == "2bw" else pytest.param(v, marks=pytest.mark.slow) for v in sorted(PIPELINES)],
)
def test_pipeline_elastic_restart_is_bit_exact(tmp_path, variant) -> None:
    """A pipeline (interleaved 1F1B, 1F1B with 2 replicas per stage, 2BW flushed at its
    checkpoint steps as the uninterrupted run is too) whose rank 1 dies
    at step 5 restarts, resumes from step 4's checkpoint cut into the same stages (the
    profiled split is saved with it) and ends with the uninterrupted run's weights and
    every stage's optimizer state, bit for bit. The uninterrupted run is cut as the
    restarted one was (:func:`profiled_balance`)."""
    flags = [*PIPE, *PIPELINES[variant]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    res = train_restarted(
        *flags, "--run-dir", str(run), "--inject-failure", "1:5", "--max-restarts", "1"
    )
    assert "resumed from" in res.stdout and "(step 4)" in res.stdout, res.stdout[-3000:]
    train(*flags, "--balance", profiled_balance(run), "--run-dir", str(ref))
    a, b = _final(ref), _final(run)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizers"] and a["optimizers"][0]["state"]
    _assert_same_tree(a["optimizers"], b["optimizers"], "optimizers")


def test_a_pipeline_checkpoint_reshards_onto_4_stages_and_onto_data_parallelism(tmp_path):
    """Written by a 2-stage 1F1B pipeline at step 4, continued as a 4-stage pipeline (4 ranks)
    and as plain data parallelism (2 ranks): both end where the uninterrupted 2-stage run
    ends, up to floating-point reassociation (state is keyed by the unsplit model's names)."""
    flags = [*PIPE, "--schedule", "1f1b", "--checkpoint-every", "4"]
    ref = tmp_path / "ref"
    train(*flags, "--run-dir", str(ref))
    want = _final(ref)["model"]
    for name, shape in {
        "4-stages": ["--pipeline-stages", "4", "--nproc-per-node", "4"],
        "data-parallel": ["--pipeline-stages", "1"],
    }.items():
        run = tmp_path / name
        shutil.copytree(ref, run)
        shutil.rmtree(run / "checkpoints" / "step-00000008")  # the one after the last step
        res = train("--resume", str(run), *shape)
        assert "(step 4, resharded" in res.stdout, res.stdout[-2000:]
        got = _final(run)["model"]
        assert got.keys() == want.keys()
        for k in want:
            assert torch.allclose(got[k], want[k], rtol=0, atol=1e-5), (name, k)


def test_a_data_parallel_checkpoint_reshards_onto_a_pipeline(tmp_path, uninterrupted) -> None:
    """The other direction: data parallelism's checkpoint of step 4 (the uninterrupted dense
    run, its step-6 and step-8 checkpoints removed) continued as a 2-stage 1F1B pipeline ends where the
    uninterrupted data-parallel run ends, up to floating-point reassociation."""
    ref = uninterrupted["dense"]
    run = tmp_path / "run"
    shutil.copytree(ref["dir"], run)
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    res = train("--resume", str(run), "--pipeline-stages", "2", "--schedule", "1f1b")
    assert "(step 4, resharded" in res.stdout, res.stdout[-2000:]
    got, want = _final(run)["model"], ref["model"]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-5), k
