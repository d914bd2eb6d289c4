"""PURE: the spec of a user's own model, ``--model package.module:factory``.

A factory needs no registry entry: :func:`factory_spec` makes a :class:`ModelSpec` for it on
the fly, whose config is the call to make (:class:`FactoryCall`) and whose builder, loss and
layer count are :mod:`syncline.models.user`'s, resolved on first use so that this module
(and the configuration checks that read it) loads neither torch nor the user's code.

[Note: the factory contract] ``factory(**options)`` returns an ``nn.Module``, or a pair
``(module, loss)`` with ``loss(output, target) -> scalar``; it may be a function or a class.
``options`` are the ``--model-option KEY=VALUE`` pairs (values read as Python literals,
else kept as text), and ``seq_len`` is passed too when the factory has a parameter of that
name. It may be called more than once in a process (on the meta device to check it, for
its loss and layer count), so it should do nothing but build. Without a loss of its own
the model trains on :func:`syncline.models.user.default_loss`: cross-entropy over the last
dimension of its output (class logits, or a language model's per-position logits against
the text's next tokens), mean squared error for floating-point targets.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncline.errors import ConfigError
from syncline.models.registry import ModelSpec
from syncline.registry import check_reference

__all__ = ["FactoryCall", "FactoryModelSpec", "check_split_points", "factory_spec", "split_names"]

_USER = "syncline.models.user"


@dataclass(frozen=True)
class FactoryCall:
    """One call of a user's model factory: the config of a :class:`FactoryModelSpec`.

    Attributes:
        ref: ``"package.module:factory"``.
        options: keyword arguments (``--model-option``).
        seq_len: offered as ``seq_len=`` to a factory that names that parameter.
    """

    ref: str
    options: Mapping[str, Any] = field(default_factory=dict)
    seq_len: int | None = None


def _literal(text: Any) -> Any:
    """A command-line option value as the Python literal it spells (``2``, ``0.1``,
    ``True``, ``'gelu'``), or the text itself."""
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _layers(call: FactoryCall) -> int | None:
    from syncline.models.user import sequential_layers

    return sequential_layers(call)


@dataclass(frozen=True)
class FactoryModelSpec(ModelSpec):
    """A :class:`ModelSpec` whose options are the factory's keyword arguments."""

    def coerce_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {key: _literal(value) for key, value in options.items()}

    def make_config(self, options: Mapping[str, Any], seq_len: int | None = None) -> Any:
        return FactoryCall(self.name, dict(options), seq_len)

    def loss_for(self, config: Any) -> Callable[[Any, Any], Any]:
        from syncline.models.user import user_loss

        return user_loss(config)


def factory_spec(ref: str) -> FactoryModelSpec:
    """The spec of ``--model ref`` for a ``"package.module:factory"`` reference.

    Raises:
        ConfigError: ``ref`` is not of that form (the module is not imported here).
    """
    check_reference("model", ref)
    return FactoryModelSpec(
        ref,
        "your own model, from its factory",
        FactoryCall,
        build=f"{_USER}:build_user_model",
        loss=f"{_USER}:default_loss",
        datasets=(),
        num_layers=_layers,
        describe_layers=lambda call: "the layers of the nn.Sequential it builds",
        any_data=True,
    )


def split_names(text: str) -> tuple[str, ...]:
    """``--split-points a.b,c.d`` as ``("a.b", "c.d")``."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise ValueError(
            f"split_points={text!r} is not a comma-separated list of module names, e.g. "
            "transformer.h.2"
        )
    return names


def check_split_points(points: Sequence[str], model: str, stages: int, balance: object) -> None:
    """The checks of ``split_points`` that need no model (:func:`syncline.models.user.
    check_user_model` checks the names against the built model).

    Args:
        points: module names, each starting a stage.
        model: ``--model``; split points apply to a factory's model only.
        stages: the pipeline's (virtual) stages.
        balance: the configured balance (split points exclude one).

    Raises:
        ConfigError: naming the value and what is valid.
    """
    if ":" not in model:
        raise ConfigError(
            f"split_points={list(points)} with model={model!r}: the built-in models are "
            "cut by layers; valid: --balance, or split points of your own factory's model"
        )
    if len(points) + 1 != stages or len(set(points)) != len(points):
        raise ConfigError(
            f"split_points={list(points)} cut the model into {len(points) + 1} stages, the "
            f"pipeline has {stages}; valid: {stages - 1} distinct module name(s)"
        )
    if balance is not None:
        raise ConfigError(
            f"balance={balance!r} with split_points: the split points say where the stages "
            "begin; valid: one of them"
        )
