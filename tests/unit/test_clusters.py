"""Launching where clusters launch: Slurm's node lists, the environments of an ``srun`` task,
a PyTorchJob pod and a torchrun worker read into a placement, and flags checked against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncline.cli.main import build_parser, config_from_args, main
from syncline.errors import ConfigError
from syncline.launch.clusters import Placement, detect, expand_nodelist, first_host

NODELISTS = [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b2", ["a1", "b2"]),
    ("nid[0009-0011]", ["nid0009", "nid0010", "nid0011"]),
    ("gpu[1-2],cpu[5]", ["gpu1", "gpu2", "cpu5"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    (" node[9-10] ", ["node9", "node10"]),
]


@pytest.mark.parametrize(("text", "hosts"), NODELISTS)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "names no host"),
        ("node[01-", "unbalanced"),
        ("node01]", "unbalanced"),
        ("node[[1]]", "unbalanced"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "no number or range"),
    ],
)
def test_bad_nodelists_are_refused(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        expand_nodelist(text)


def test_first_host_of_the_example() -> None:
    assert first_host("node[01-04,07]") == "node01"


# what srun gives the task on the third of four nodes (one task per node)
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "node[01-04]",
    "SLURM_NODELIST": "node[01-04]",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "4",
}


def test_nothing_set_is_no_cluster() -> None:
    assert detect({}) is None
    assert detect({"SLURM_JOB_ID": "1", "HOME": "/root"}) is None


def test_srun_task() -> None:
    p = detect(SRUN)
    assert p is not None
    assert (p.source, p.nnodes, p.node_rank, p.nproc_per_node) == ("Slurm", 4, 2, None)
    assert p.rdzv_endpoint == f"node01:{20000 + 123456 % 20000}"
    assert p.values() == {"nnodes": 4, "node_rank": 2, "rdzv_endpoint": "node01:23456"}
    assert p.origin["node_rank"] == "SLURM_NODEID=2"


def test_srun_task_on_gpus_and_an_exported_endpoint() -> None:
    env = {**SRUN, "SLURM_GPUS_ON_NODE": "8", "MASTER_ADDR": "node01-ib", "MASTER_PORT": "29400"}
    p = detect(env)
    assert p is not None and p.nproc_per_node == 8 and p.gpus_only
    assert p.rdzv_endpoint == "node01-ib:29400"


def test_only_the_node_list_counts_the_nodes() -> None:
    env = {k: v for k, v in SRUN.items() if "NUM_NODES" not in k and k != "SLURM_NNODES"}
    assert detect(env).values() == detect(SRUN).values()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"SLURM_NNODES": "3", "SLURM_STEP_NUM_NODES": "3"}, r"=3 but .*names 4 host"),
        ({"SLURM_STEP_NUM_TASKS": "32"}, "more than one task per node"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' in the environment is not an integer"),
    ],
)
def test_srun_environments_refused(change: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        detect({**SRUN, **change})


def test_tasks_per_node_without_step_counts() -> None:
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(ConfigError, match="SLURM_NTASKS_PER_NODE=8"):
        detect({**env, "SLURM_NTASKS_PER_NODE": "8"})
    assert detect({**env, "SLURM_NTASKS_PER_NODE": "1"}).values() == detect(SRUN).values()  # type: ignore[union-attr]


# a PyTorchJob's pod (Kubeflow training operator): one python process per pod, and with
# nprocPerNode torchrun's own PET_ variables
POD = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
PET = {
    **POD,
    "WORLD_SIZE": "24",
    "PET_NNODES": "3",
    "PET_NODE_RANK": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}


def test_pytorchjob_pod() -> None:
    assert detect(POD) == Placement(
        "PyTorchJob",
        3,
        2,
        "job-master-0:23456",
        origin={
            "nnodes": "WORLD_SIZE=3",
            "node_rank": "RANK=2",
            "rdzv_endpoint": "MASTER_ADDR=job-master-0, MASTER_PORT=23456",
        },
    )


def test_pytorchjob_pod_with_torchrun_variables() -> None:
    p = detect(PET)
    assert p is not None and p.source == "PyTorchJob"
    assert p.values() == {
        "nnodes": 3,
        "node_rank": 2,
        "rdzv_endpoint": "job-node-0-0.job:29400",
        "nproc_per_node": 8,
    }
    assert detect({**PET, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node is None  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="elastic range"):
        detect({**PET, "PET_NNODES": "1:3"})


# what torchrun gives each worker (here rank 3 of 2 nodes x 2), inside a Slurm job
WORKER = {
    **SRUN,
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "1",
    "LOCAL_RANK": "1",
    "RANK": "3",
    "GROUP_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_a_torchrun_worker_comes_first() -> None:
    p = detect(WORKER)
    assert p is not None and p.source == "torchrun"
    assert p.values() == {
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_endpoint": "127.0.0.1:29500",
        "nproc_per_node": 2,
    }
    assert (p.rank, p.run_id, p.attempt) == (3, "abc", 1)
    with pytest.raises(ConfigError, match="GROUP_WORLD_SIZE=3 x LOCAL_WORLD_SIZE=2"):
        detect({**WORKER, "GROUP_WORLD_SIZE": "3"})


def _env(monkeypatch, env: dict[str, str]) -> None:
    for name in [*SRUN, *PET, *WORKER]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _config(*args: str):
    return config_from_args(build_parser().parse_args(["train", *args]))


def test_syncline_train_takes_its_place_from_srun(monkeypatch, tmp_path: Path) -> None:
    _env(monkeypatch, SRUN)
    cfg = _config("--run-dir", str(tmp_path / "r"), "--batch-size", "16")
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint) == (4, 2, "node01:23456")
    same = _config("--run-dir", str(tmp_path / "r"), "--batch-size", "16", "--nnodes", "4")
    assert same == cfg  # a flag that agrees


@pytest.mark.parametrize(
    ("env", "flags", "line"),
    [
        (
            SRUN,
            ["--nnodes", "2"],
            "--nnodes 2 disagrees with Slurm's SLURM_STEP_NUM_NODES=4 (nnodes=4)",
        ),
        (SRUN, ["--node-rank", "0"], "--node-rank 0 disagrees with Slurm's SLURM_NODEID=2"),
        (
            POD,
            ["--rdzv-endpoint", "other:1"],
            "--rdzv-endpoint other:1 disagrees with PyTorchJob's MASTER_ADDR=job-master-0, "
            "MASTER_PORT=23456",
        ),
        (PET, ["--nproc-per-node", "2"], "disagrees with PyTorchJob's PET_NPROC_PER_NODE=8"),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "8"}, [], "more than one task per node"),
    ],
)
def test_a_flag_that_disagrees_is_refused_naming_both(
    monkeypatch, capsys, tmp_path: Path, env, flags, line
) -> None:
    _env(monkeypatch, env)
    run = tmp_path / "run"
    assert main(["train", *flags, "--batch-size", "48", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and line in err, err
    assert not run.exists()


def test_gpus_on_node_count_gpu_ranks_only(monkeypatch, tmp_path: Path) -> None:
    _env(monkeypatch, {**SRUN, "SLURM_GPUS_ON_NODE": "8"})
    cfg = _config("--run-dir", str(tmp_path / "r"), "--batch-size", "16", "--backend", "gloo")
    assert cfg.nproc_per_node == 2  # the CPU default: the GPUs are not what gloo ranks use
    cfg = _config("--run-dir", str(tmp_path / "r"), "--nproc-per-node", "1", "--batch-size", "4")
    assert cfg.nproc_per_node == 1


def test_under_torchrun_the_run_directory_is_shared(monkeypatch) -> None:
    _env(monkeypatch, {**WORKER, "TORCHELASTIC_RUN_ID": "job7"})
    cfg = _config("--batch-size", "16")
    assert cfg.run_dir == "runs/job7-gpt" and cfg.world_size == 4
    _env(monkeypatch, {**WORKER, "TORCHELASTIC_RUN_ID": "none"})
    with pytest.raises(ConfigError, match="give --run-dir"):
        _config("--batch-size", "16")


def test_plan_auto_is_refused_under_torchrun(monkeypatch, capsys, tmp_path: Path) -> None:
    _env(monkeypatch, WORKER)
    assert main(["train", "--plan", "auto", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--plan auto profiles and launches by itself" in capsys.readouterr().err


def test_the_docs_show_the_example_job_script_as_it_is() -> None:
    repo = Path(__file__).resolve().parents[2]
    (srun,) = [
        line
        for line in (repo / "examples" / "slurm" / "train.sbatch").read_text().splitlines()
        if line.startswith("srun ")
    ]
    assert srun in (repo / "docs" / "clusters.md").read_text()
