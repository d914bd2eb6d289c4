"""``syncline.hooks`` without a process group: a state is made without side effects, checks
its arguments up front, and refuses a checkpoint that is not its own. Its work with DDP on
real ranks is ``tests/dist/test_hooks.py``'s."""

from __future__ import annotations

import inspect

import pytest
import torch

from syncline.dp import build_compressor
from syncline.errors import ConfigError
from syncline.hooks import HookState, _layout, hook


def test_a_state_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="no reduce"):
        HookState(object())  # type: ignore[arg-type]
    for bad in (0, -1.0, True, "60"):
        with pytest.raises(ConfigError, match="timeout_s"):
            HookState(build_compressor("fp16"), timeout_s=bad)  # type: ignore[arg-type]


def test_a_fresh_state_saves_and_refuses_another_compressors_checkpoint() -> None:
    state = HookState(build_compressor("csc:0.1"))
    saved = state.state_dict()
    assert saved == {
        "name": "csc",
        "step": 0,
        "shapes": [],
        "buckets": {},
        "compressor": saved["compressor"],
    }
    with pytest.raises(ConfigError, match="checkpoint compressor 'csc' != configured 'topk'"):
        HookState(build_compressor("topk:0.1")).load_state_dict(saved)
    other = HookState(build_compressor("csc:0.5"))
    other.load_state_dict({**saved, "step": 7, "shapes": [[4, 2]], "buckets": {"0": [0]}})
    assert other.step == 7 and other.state_dict()["buckets"] == {0: [0]}


def test_the_hook_has_the_annotations_ddp_accepts() -> None:
    """DDP refuses a hook whose annotations are not GradBucket and Future[Tensor] themselves
    (names given as strings included)."""
    sig = inspect.signature(hook)
    assert sig.parameters["bucket"].annotation is torch.distributed.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_layout_lays_parameters_back_to_back() -> None:
    assert _layout([(2, 3), (3,), (1, 1, 4)]) == ((0, (2, 3)), (6, (3,)), (9, (1, 1, 4)))
    assert _layout([]) == ()
