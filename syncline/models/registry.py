"""PURE: the model registry: each model with its shape config, builder, loss, data and layers.

An entry is everything the rest of syncline needs to know about a model (torchtitan's
``ModelSpec`` plays the same part): the dataclass of its shape (whose fields are the model's
options), the builder and the loss (as objects or ``"module:attribute"`` references, so this
module loads no torch), the data sets it trains on, and how many layers a pipeline can cut.
Adding a model is one module plus one ``MODELS.register(ModelSpec(...))``. A user's own
model needs no entry: :func:`model_spec` turns ``"package.module:factory"`` into a spec
(:mod:`syncline.models.factory`).

Example:
    >>> MODELS.register(ModelSpec("mlp", "a small MLP", MLPConfig, build_mlp,
    ...                           "syncline.models.cnn:cnn_loss", datasets=("synthetic",),
    ...                           num_layers=lambda c: 3))
    >>> build_model("mlp", hidden=64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from syncline.errors import ConfigError
from syncline.models.configs import CNNConfig, GPTConfig
from syncline.registry import REFERENCE, Registry, resolve

__all__ = ["MODELS", "ModelSpec", "build_model", "model_forms", "model_loss", "model_spec"]


def _no_layers(config: Any) -> None:
    del config
    return None


@dataclass(frozen=True)
class ModelSpec:
    """One trainable model, as the trainers, the checks and the command line see it.

    Attributes:
        name: what ``--model`` takes.
        summary: one line for ``--help``.
        config: a dataclass of the model's shape, validating itself; its fields are the
            model's options (``--model-option KEY=VALUE``).
        build: ``config -> nn.Module`` (or ``"module:function"``); a pipeline needs an
            ``nn.Sequential``.
        loss: ``loss(output, target) -> scalar`` (or ``"module:function"``).
        datasets: registered data sets it trains on (:mod:`syncline.data.registry`); the
            first is the default.
        num_layers: ``config -> layers of the built nn.Sequential``, what a pipeline can cut
            (checked before any process starts); returns ``None`` when not pipelinable.
        describe_layers: ``config -> text`` naming those layers, for error messages.
        flags: ``config field -> its own command-line flag`` (e.g. ``n_layer -> --n-layer``);
            any field is also reachable as ``--model-option FIELD=VALUE``.
        seq_len_field: the config field that takes ``TrainConfig.seq_len`` (the GPT's
            ``block_size``), for sequence models.
        language_model: its targets are tokens of the input (throughput counts tokens).
        init: ``config -> init(index, layer)`` (or ``"module:function"``), initialising one
            layer in place; with it the trainers build the model on the meta device and
            materialise layer by layer from per-layer seeds, so a pipeline rank allocates
            only its stage (:mod:`syncline.models.meta_init`). ``None``: the model is
            built whole, initialised by its builder.
        any_data: it trains on whatever data the user gives (a user's factory model);
            ``datasets`` may then be empty, and ``--data`` is required.
    """

    name: str
    summary: str
    config: type
    build: str | Callable[[Any], Any]
    loss: str | Callable[[Any, Any], Any]
    datasets: tuple[str, ...]
    num_layers: Callable[[Any], int | None] = _no_layers
    describe_layers: Callable[[Any], str] = lambda config: "its layers"
    flags: Mapping[str, str] = field(default_factory=dict)
    seq_len_field: str | None = None
    language_model: bool = False
    init: str | Callable[[Any], Any] | None = None
    any_data: bool = False

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.config):
            raise ConfigError(f"model {self.name!r}: config={self.config!r} must be a dataclass")
        if not self.datasets and not self.any_data:
            raise ConfigError(f"model {self.name!r} needs at least one data set")

    def loss_for(self, config: Any) -> Callable[[Any, Any], Any]:
        """The loss ``loss(output, target) -> scalar`` of the model built from ``config``
        (a factory's model may bring its own)."""
        loss: Callable[[Any, Any], Any] = resolve(self.loss)
        return loss

    def coerce_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with text values (from the command line) turned into the types of the
        config's fields (``int``, ``float``, ``bool``); unknown keys are left for
        :meth:`make_config` to name."""
        kinds = {f.name: str(f.type) for f in dataclasses.fields(self.config)}
        out: dict[str, Any] = {}
        for key, value in options.items():
            kind = kinds.get(key, "")
            if isinstance(value, str) and kind in ("int", "float", "bool"):
                value = _from_text(self.name, key, value, kind)
            out[key] = value
        return out

    def make_config(self, options: Mapping[str, Any], seq_len: int | None = None) -> Any:
        """The model's config from its options (and the sequence length), validated.

        Raises:
            ConfigError: an option the config does not have, or a value it rejects.
        """
        valid = [f.name for f in dataclasses.fields(self.config)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r} for model {self.name!r}; valid: {', '.join(valid)}"
            )
        values = dict(options)
        if self.seq_len_field is not None and seq_len is not None:
            values.setdefault(self.seq_len_field, seq_len)
        try:
            return self.config(**values)
        except TypeError as exc:  # e.g. a required field left out
            raise ConfigError(f"model {self.name!r}: {exc}") from None


def _from_text(model: str, key: str, text: str, kind: str) -> Any:
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return int(text) if kind == "int" else float(text)
    except ValueError:
        raise ConfigError(
            f"model option {key}={text!r} of model {model!r} is not a valid {kind}"
        ) from None


MODELS: Registry[ModelSpec] = Registry("model")


def model_forms() -> tuple[str, ...]:
    """What ``--model`` takes: the registered names, then a factory reference."""
    return (*MODELS.names(), REFERENCE)


def model_spec(name: str) -> ModelSpec:
    """The spec of ``--model name``: a registered model, or, for a ``"package.module:factory"``
    reference (registered names have no ``:``), the user's factory (checked for its form
    only; :mod:`syncline.models.user` imports and builds it).

    Raises:
        ConfigError: an unknown name or a malformed reference, naming what is valid.
    """
    if ":" in name:
        from syncline.models.factory import factory_spec

        return factory_spec(name)
    if name not in MODELS:
        raise ConfigError(
            f"model={name!r} is unknown; valid: {', '.join(MODELS.names())}, or your own "
            f"factory as {REFERENCE}"
        )
    return MODELS.get(name)


def build_model(name: str, **overrides: Any) -> Any:
    """Build a registered model from its default config with some fields overridden.

    Args:
        name: a registered model (``MODELS.names()``).
        **overrides: fields of that model's config (e.g. ``GPTConfig``'s).

    Returns:
        The model (an ``nn.Sequential`` for the built-in ones).

    Raises:
        ConfigError: for an unknown name, an unknown field or an invalid value.

    Example:
        >>> model = build_model("gpt", n_layer=2, n_embd=32)
        >>> len(model)
        4
    """
    spec = MODELS.get(name)
    return resolve(spec.build)(spec.make_config(overrides))


def model_loss(name: str) -> Callable[[Any, Any], Any]:
    """The loss ``loss(output, target) -> scalar`` that goes with a registered model.

    Raises:
        ConfigError: for an unknown name.
    """
    return MODELS.get(name).loss_for(None)


MODELS.register(
    ModelSpec(
        "gpt",
        "byte-level GPT (nanoGPT's architecture): embedding, n_layer blocks, head",
        GPTConfig,
        build="syncline.models.gpt:build_gpt",
        loss="syncline.models.gpt:lm_loss",
        datasets=("stdlib", "text", "tokens"),
        num_layers=lambda c: c.n_layer + 2,
        describe_layers=lambda c: f"embedding + n_layer={c.n_layer} blocks + head",
        flags={"n_layer": "--n-layer", "n_embd": "--n-embd", "n_head": "--n-head"},
        seq_len_field="block_size",
        language_model=True,
        init="syncline.models.gpt:gpt_layer_init",
    )
)
MODELS.register(
    ModelSpec(
        "cnn",
        "ResNet-like image classifier with BatchNorm",
        CNNConfig,
        build="syncline.models.cnn:build_cnn",
        loss="syncline.models.cnn:cnn_loss",
        datasets=("digits", "synthetic", "images"),
        num_layers=lambda c: c.depth + 3,
        describe_layers=lambda c: "stem, residual blocks, pool, flatten, linear",
        flags={"width": "--cnn-width"},
        init="syncline.models.cnn:cnn_layer_init",
    )
)
