"""A user's own model: built from its factory, its loss, and the checks made before launch.

The contract is :mod:`syncline.models.factory`'s note. The checks build the model on the
meta device (no memory, no initialisation), so a bad factory, a factory that returns no
``nn.Module``, or split points that name no module stop the command before any process
starts, in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from syncline.errors import ConfigError
from syncline.models.factory import FactoryCall
from syncline.registry import call_factory, import_reference

__all__ = [
    "build_user_model",
    "check_user_model",
    "default_loss",
    "first_argument",
    "output_tensor",
    "sequential_layers",
    "user_loss",
]

LossFn = Callable[[Any, Any], Any]


def _call(call: FactoryCall) -> tuple[nn.Module, LossFn | None]:
    """The factory's model and its own loss (``None``: none given), checked."""
    factory = import_reference("model", call.ref)
    built = call_factory("model", call.ref, factory, call.options, {"seq_len": call.seq_len})
    loss = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, loss = built
        if not callable(loss):
            raise ConfigError(
                f"model={call.ref!r} returned a {type(loss).__name__} as its loss; valid: "
                "a callable loss(output, target) -> scalar"
            )
    if not isinstance(built, nn.Module):
        raise ConfigError(
            f"model={call.ref!r} returned an object of type {type(built).__name__}; valid: "
            "an nn.Module, or a pair (nn.Module, loss)"
        )
    return built, loss


def _on_meta(call: FactoryCall) -> tuple[nn.Module, LossFn | None]:
    """:func:`_call` on the meta device; a factory that cannot build there (it loads
    weights, say) is called for real instead."""
    import_reference("model", call.ref)  # an import error is reported once, as it is
    try:
        with torch.device("meta"):
            return _call(call)
    except ConfigError:
        return _call(call)


def build_user_model(call: FactoryCall) -> nn.Module:
    """The factory's model, built for real (the trainers seed torch before this)."""
    return _call(call)[0]


def user_loss(call: FactoryCall) -> LossFn:
    """The factory's own loss, or :func:`default_loss`."""
    return _on_meta(call)[1] or default_loss


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor a loss reads from a model's output: the output itself, its ``logits``
    (HuggingFace's model outputs), or the first element of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"the model returned a {type(output).__name__}; the default loss takes a tensor, "
        "an output with .logits, or a tuple whose first element is the logits (else give "
        "the factory's own loss: return (model, loss))"
    )


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss of a factory's model that brings none.

    Integer targets: cross-entropy of the logits in the output's last dimension, over every
    other position: class logits ``(N, C)`` against ``(N,)``, or a language model's ``(N,
    T, V)`` against the next tokens ``(N, T)`` (the text data sets shift the targets, so
    this is the shifted language-model loss). Floating-point targets: mean squared error.
    """
    out = output_tensor(output)
    if target.is_floating_point():
        return F.mse_loss(out.reshape(target.shape).float(), target)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def sequential_layers(call: FactoryCall) -> int:
    """Layers of the ``nn.Sequential`` the factory builds: what a pipeline can cut.

    Raises:
        ConfigError: it builds another kind of module (naming the way out).
    """
    model = _on_meta(call)[0]
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"model={call.ref!r} builds a {type(model).__name__}, not an nn.Sequential, so "
            "a pipeline cannot cut it by layers; valid: --split-points NAME,... (the modules "
            "where stages 2, 3, ... begin), or pipeline_stages=1"
        )
    return len(model)


def first_argument(model: nn.Module) -> str:
    """The name of the first parameter of ``model.forward``: how a model split at named
    modules is called (``model(**{name: inputs})``, e.g. ``input_ids``)."""
    import inspect

    params = list(inspect.signature(model.forward).parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    ):
        raise ConfigError(
            f"{type(model).__name__}.forward has no named first parameter; valid with "
            "split points: forward(self, x, ...) called with the data's inputs as x"
        )
    return params[0].name


def check_user_model(call: FactoryCall, split_points: Sequence[str] | None) -> None:
    """Everything that can be checked of a factory's model before any process starts:
    the import, the factory's return value, and that each split point names a module.

    Raises:
        ConfigError: naming the value and what is valid.
    """
    model, _ = _on_meta(call)
    if split_points:
        names = dict(model.named_modules())
        unknown = [p for p in split_points if p not in names]
        if unknown:
            examples = [n for n in names if n and n.count(".") <= 2][:6]
            raise ConfigError(
                f"split_points: {unknown[0]!r} names no module of {type(model).__name__}; "
                f"valid: names from model.named_modules(), e.g. {', '.join(examples)}"
            )
        first_argument(model)
