"""``syncline.lightning``: imported only when asked for, and its refusals made on creation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from syncline.errors import ConfigError


def test_syncline_does_not_import_lightning() -> None:
    code = (
        "import sys, syncline, syncline.hooks, syncline.compression; syncline.DataParallel; "
        "assert 'lightning' not in sys.modules, 'lightning was loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_lightning_the_error_names_the_install() -> None:
    code = "import sys; sys.modules['lightning'] = None; import syncline.lightning"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: syncline.lightning needs PyTorch Lightning: pip install lightning"
    ), res.stderr


@pytest.mark.slow  # importing Lightning takes 5-15 s on a shared core
def test_strategy_refuses_what_dataparallel_cannot_do() -> None:
    pytest.importorskip("lightning")
    from syncline.hooks import HookState, hook
    from syncline.lightning import SynclineStrategy

    with pytest.raises(ConfigError, match=r"ddp_comm_hook, ddp_comm_state.*compression="):
        from syncline.compression import FP16

        SynclineStrategy(ddp_comm_hook=hook, ddp_comm_state=HookState(FP16()))
    with pytest.raises(ConfigError, match="model_averaging_period"):
        SynclineStrategy(model_averaging_period=4)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['bucket_size'\]"):
        SynclineStrategy(bucket_size=25)
    with pytest.raises(ConfigError, match="compression spec 'csc'"):
        SynclineStrategy(compression="csc")  # CSC needs its density
    with pytest.raises(ConfigError, match="ring"):
        SynclineStrategy(allreduce="ring")
    with pytest.raises(ConfigError, match=r"sync='localsgd:4' refused.*DataParallel\(sync="):
        SynclineStrategy(sync="localsgd:4")
    # DDPStrategy's own arguments and DataParallel's are both taken
    strategy = SynclineStrategy(
        compression="fp16",
        allreduce="hierarchical",
        bucket_cap_mb=None,
        timeout_s=30.0,
        process_group_backend="gloo",
        find_unused_parameters=True,
    )
    assert strategy.process_group_backend == "gloo"
    assert strategy._compression == "fp16"
