"""Where DataParallel's module and inputs live: DDP 2.13's ``device_ids``/``output_device``.

DDP takes ``device_ids=[i]`` for a module on one GPU and then moves the tensors in every
forward's arguments to that GPU (``_pre_forward`` -> ``_to_kwargs`` -> ``_recursive_to``);
for a CPU module, or a module over several devices, both arguments must be unset. The same
rules are checked here before anything is sent, with three refusals DDP does not make
(:func:`placement`), and the same inputs are moved (:func:`moved_to`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from syncline.errors import ConfigError

__all__ = ["moved_to", "placement"]


def placement(
    module: nn.Module,
    ignored: frozenset[str],
    device_ids: list[Any] | None,
    output_device: Any,
    backend: str,
) -> tuple[list[int] | None, int | None, torch.device | None]:
    """DDP 2.13's rules for ``device_ids`` and ``output_device``, checked before anything is
    sent: returns the two as DDP stores them (device indices, or ``None``) and the device
    each forward moves its inputs to (``None``: they stay where they are).

    As DDP: at most one device id; every parameter on one type of device; for a CPU module
    (or none given) both arguments unset (DDP tests them for truth, so ``[]`` and ``0`` pass
    as unset). Stricter than DDP, which would fail later or never: a device id the module's
    parameters are not on, a module spread over several devices (DDP takes those; the flat
    buffer cannot), and a module on the CPU under NCCL, which takes CUDA tensors only.
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ConfigError(
            f"device_ids={device_ids!r}: device_ids can only be None or contain a single "
            "element (the one device of this process's module), as in DDP"
        )
    devices = sorted({p.device for n, p in module.named_parameters() if n not in ignored}, key=str)
    if len({d.type for d in devices}) > 1 or len(devices) > 1:
        raise ConfigError(
            f"DataParallel needs every parameter on one device (one flat gradient buffer per "
            f"dtype lives there); the module's are on {[str(d) for d in devices]}: move it "
            "to one device, or split it with syncline.Pipeline"
        )
    device = devices[0] if devices else None
    if backend == "nccl" and device is not None and device.type == "cpu":
        raise ConfigError(
            f"the process group's backend is 'nccl', which takes CUDA tensors only, but the "
            f"module's parameters are on {device}: move the module to this rank's GPU "
            "(module.to(torch.device('cuda', local_rank))), or use the 'gloo' backend"
        )
    if not device_ids or device is None or device.type == "cpu":
        if device_ids or output_device:
            raise ConfigError(
                f"device_ids={device_ids!r}, output_device={output_device!r}: these apply to "
                f"a module on one GPU only; the module's parameters are on {device}: leave "
                "both None (DDP's rule)"
            )
        return None, None, None
    index = _device_index(device_ids[0], device, "device_ids[0]")
    if device.index is not None and index != device.index:
        raise ConfigError(
            f"device_ids={device_ids!r} names {device.type}:{index}, but the module's "
            f"parameters are on {device}: pass device_ids=[{device.index}] (or move the "
            "module there first)"
        )
    out = index if output_device is None else _device_index(output_device, device, "output_device")
    return [index], out, device


def _device_index(value: Any, device: torch.device, name: str) -> int:
    """An index, a ``torch.device`` or its name, as the index of a device of ``device``'s type
    (DDP's ``_get_device_index(value, optional=True)``: no index means the current one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str | torch.device):
        try:
            dev = torch.device(value)
        except RuntimeError:
            dev = None
        if dev is not None and dev.type == device.type:
            if dev.index is not None:
                return dev.index
            current = torch.cuda.current_device() if dev.type == "cuda" else device.index
            return 0 if current is None else current
    raise ConfigError(
        f"{name}={value!r} is not a device of the module's type {device.type!r}; valid: an "
        f"index, or a torch.device such as {str(device)!r}"
    )


def moved_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors on ``device``: DDP's ``_recursive_to`` (torch 2.13).

    Tensors and ``PackedSequence``s are moved (``.to``; DDP copies from another GPU on a
    side stream, here on the current one); namedtuples keep their type, other tuples become
    tuples, lists lists, and dicts (keys and values) keep their type; anything else,
    dataclasses included, is passed as it is.
    """
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, PackedSequence):  # its .to is typed after Tensor.to's dtype overload
        return obj if obj.data.device == device else obj.to(device)  # type: ignore[arg-type]
    if isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict"):
        return type(obj)(*(moved_to(x, device) for x in obj))
    if isinstance(obj, tuple | list):
        moved = [moved_to(x, device) for x in obj]
        return tuple(moved) if isinstance(obj, tuple) else moved
    if isinstance(obj, dict) and obj:
        return type(obj)((moved_to(k, device), moved_to(v, device)) for k, v in obj.items())
    return obj
