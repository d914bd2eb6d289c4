"""PURE: what a model costs, layer by layer: time as a function of micro-batch size, bytes.

Profiled on the machine at hand (``syncline plan --profile``, each layer at two micro-batch
sizes, so that time is ``fixed + per_sample * b``: the fixed part is what small micro-batches
pay in dispatch, and why a pipeline cannot cut them without limit) or computed from a model's
shape for models nobody here can run (:func:`transformer_costs`). The layers are the ones a
pipeline cuts (``syncline train --balance`` counts them), in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_float
from syncline.planner.device import Device
from syncline.planner.hardware import read_section

__all__ = ["Affine", "LayerCost", "ModelCosts", "transformer_costs"]


@dataclass(frozen=True)
class Affine:
    """``fixed + per_sample * b`` for a micro-batch of ``b`` samples (seconds, or bytes)."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "per_sample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"Affine.{name}={value!r} is invalid; valid: a number >= 0")

    def at(self, b: float) -> float:
        return self.fixed + self.per_sample * b

    @classmethod
    def fit(cls, b1: int, t1: float, b2: int, t2: float) -> Affine:
        """The line through two measurements (clipped so that neither part is negative)."""
        if b1 == b2:
            return cls(0.0, max(t1, 0.0) / b1)
        slope = max((t2 - t1) / (b2 - b1), 0.0)
        fixed = max(t1 - slope * b1, 0.0)
        return cls(fixed, slope)


@dataclass(frozen=True)
class LayerCost:
    """One layer of the model (one entry of what a pipeline cuts)."""

    name: str
    forward: Affine
    backward: Affine
    params: int
    """Parameters (elements); their bytes follow ``ModelCosts.param_bytes``."""
    activation_bytes: float
    """Bytes autograd keeps for this layer's backward, per sample."""
    output_bytes: float
    """Bytes of this layer's output, per sample: the message when a stage ends here."""
    matrices: tuple[tuple[int, int], ...] = ()
    """Shapes of the weight matrices, for PowerSGD's price (optional)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, Affine(**value))
        object.__setattr__(self, "matrices", tuple(tuple(m) for m in self.matrices))
        for name in ("params", "activation_bytes", "output_bytes"):
            check_float(
                f"layer {self.name!r}: {name}", getattr(self, name), at_least=0, finite=False
            )


@dataclass(frozen=True)
class ModelCosts:
    """A model's layers and what is measured once per model rather than per layer."""

    name: str
    layers: tuple[LayerCost, ...]
    input_bytes: float
    """Bytes of one sample of the model's input (what stage 0 keeps per micro-batch)."""
    param_bytes: int = 4
    """Bytes per parameter element (fp32: 4)."""
    tokens_per_sample: int = 1
    """Tokens in one sample (a sequence), for tokens/s; 1 for images."""
    update_s_per_param: float = 0.0
    """Optimizer step compute per parameter (measured with the run's optimizer)."""
    loss: Affine = field(default_factory=Affine)
    """Forward + backward of the loss on the last stage's output."""
    train_args: tuple[str, ...] = ()
    """The ``syncline train`` model options these costs describe (e.g. ``--model gpt``)."""
    workspace: Affine = field(default_factory=Affine)
    """Bytes a training step holds beyond the stash and the model state, by micro-batch
    size: the temporaries of the layer being run and of its backward, and the memory the
    allocator keeps after freeing them (measured by ``--profile`` as the peak of real
    steps minus what the model accounts for; 0 when computed from a shape)."""
    master_bytes: int = 0
    """Bytes per parameter of a master copy kept beside the weights: mixed precision's fp32
    master weights (4) when ``param_bytes`` is 2 (Micikevicius et al. 2018, "Mixed
    precision training", section 3.1); 0 when the weights are the master copy."""

    def __post_init__(self) -> None:
        layers = tuple(
            LayerCost(**layer) if isinstance(layer, Mapping) else layer for layer in self.layers
        )
        if not layers:
            raise ConfigError(f"model costs {self.name!r} have no layers")
        object.__setattr__(self, "layers", layers)
        for name in ("loss", "workspace"):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, Affine(**getattr(self, name)))
        object.__setattr__(self, "train_args", tuple(self.train_args))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelCosts:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"model costs: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> ModelCosts:
        """Read model costs (alone, or under ``"model"`` in a profile).

        Raises:
            ConfigError: unreadable, or not valid costs.
        """
        return cls.from_dict(read_section(path, "model", "model costs"))


# Kernels syncline's GPT launches per layer and micro-batch in eager PyTorch, counted from
# its modules (syncline.models.gpt). A block's forward: ln_1, the qkv GEMM, attention,
# the heads' transpose copy, the output GEMM, dropout, the residual add, ln_2, the two MLP
# GEMMs, GELU, dropout and the add (13). Backward: twice that (autograd runs each GEMM's
# two gradient GEMMs and each elementwise op's backward, plus the bias reductions).
BLOCK_KERNELS = (13, 26)
# The embedding: two lookups, their add and dropout; backward: the lookups' scatters and
# the dense zero-fill of the token table's gradient.
EMBEDDING_KERNELS = (4, 4)
# The head: ln_f and the vocabulary GEMM; backward: two GEMMs and ln_f's backward (2).
HEAD_KERNELS = (2, 4)
# The loss: log-softmax and the gather of the targets; backward: both gradients.
LOSS_KERNELS = (2, 2)
# Adam under mixed precision, per parameter (apex's and Megatron's fused update): read the
# 16-bit gradient (2), read and write the fp32 master weight and both moments (3 x 8), write
# the 16-bit weight (2).
ADAM_MIXED_BYTES_PER_PARAM = 28


def transformer_costs(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    seq_len: int,
    vocab_size: int,
    flops_per_s: float | None = None,
    activation_bytes_per_value: int = 2,
    param_bytes: int = 2,
    name: str = "gpt",
    train_args: Sequence[str] = (),
    device: Device | None = None,
) -> ModelCosts:
    """A GPT's costs from its shape (``n_layer + 2`` layers: embedding, blocks, head),
    nothing allocated.

    FLOPs of one block per sample (Narayanan et al. 2021, "Efficient large-scale language
    model training on GPU clusters using Megatron-LM", eq. 3 without the head):
    ``24*s*h^2 + 4*s^2*h`` forward, twice that backward; the head's ``2*s*h*V``. Stashed
    activations per sample and block (Korthikanti et al. 2022, "Reducing activation
    recomputation in large transformer models", section 4.1, no parallelism):
    ``s*h*(34 + 5*a*s/h)`` bytes with 16-bit values, scaled by
    ``activation_bytes_per_value / 2``. The head's logits ``s*V`` are kept for the loss.

    Times: with ``flops_per_s`` (the sustained, not peak, rate), FLOPs over it and nothing
    else. With a ``device`` (:mod:`syncline.planner.device`), each layer's kernels on its
    roofline: ``kernels * kernel_s`` fixed per micro-batch, plus per sample the larger of
    FLOPs over the sustained rate and bytes over the memory bandwidth, so that small
    micro-batches pay their kernels' fixed costs. Elementwise work inside a block is not
    priced apart: the sustained rate of a whole model, as published, includes it. What is
    priced by bytes is what has no FLOPs to hide behind: the loss over ``s*V`` fp32 logits
    (log-softmax reads the 16-bit logits and writes fp32, the gather reads them: ``10*s*V``
    bytes forward, ``12*s*V`` backward), the embedding's lookups, and its backward's dense
    gradient of the token table (``V*h`` values written per micro-batch). The optimizer
    step is memory-bound: :data:`ADAM_MIXED_BYTES_PER_PARAM` bytes a parameter.

    With 16-bit parameters (``param_bytes=2``) the costs count mixed precision's fp32 master
    copy (``master_bytes=4``).

    Raises:
        ConfigError: neither ``flops_per_s`` nor ``device`` given.
    """
    if device is None and not flops_per_s:
        raise ConfigError("transformer_costs needs flops_per_s or a device")
    s, h, a, v = seq_len, n_embd, n_head, vocab_size
    scale = activation_bytes_per_value / 2
    out = s * h * activation_bytes_per_value

    def timed(
        flops: float,
        kernels: tuple[int, int] = (0, 0),
        nbytes: tuple[float, float] = (0.0, 0.0),
        fixed_bytes: float = 0.0,
    ) -> tuple[Affine, Affine]:
        if device is None:
            assert flops_per_s
            return Affine(0.0, flops / flops_per_s), Affine(0.0, 2 * flops / flops_per_s)
        forward = Affine(kernels[0] * device.kernel_s, device.per_sample_s(flops, nbytes[0]))
        backward = Affine(
            kernels[1] * device.kernel_s + fixed_bytes / device.memory_bandwidth,
            device.per_sample_s(2 * flops, nbytes[1]),
        )
        return forward, backward

    lookup = 4.0 * s * h * activation_bytes_per_value  # two gathers, the add, dropout
    f, b = timed(0.0, EMBEDDING_KERNELS, (lookup, lookup), v * h * param_bytes)
    layers = [
        LayerCost("embedding", f, b, (v + s) * h, s * 8.0, out, ()),
    ]
    block_f, block_b = timed(24 * s * h * h + 4 * s * s * h, BLOCK_KERNELS)
    for i in range(n_layer):
        layers.append(
            LayerCost(
                f"block.{i}",
                block_f,
                block_b,
                12 * h * h + 13 * h,
                s * h * (34 + 5 * a * s / h) * scale,
                out,
                ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)),
            )
        )
    head_f, head_b = timed(2 * s * h * v, HEAD_KERNELS)
    layers.append(
        LayerCost(
            "head",
            head_f,
            head_b,
            v * h + 2 * h,
            s * h * activation_bytes_per_value + s * v * 4.0,
            s * v * 4.0,
            ((v, h),),
        )
    )
    loss = Affine()
    update = 0.0
    if device is not None:
        loss_f, loss_b = timed(0.0, LOSS_KERNELS, (10.0 * s * v, 12.0 * s * v))
        loss = Affine(loss_f.fixed + loss_b.fixed, loss_f.per_sample + loss_b.per_sample)
        update = ADAM_MIXED_BYTES_PER_PARAM / device.memory_bandwidth
    return ModelCosts(
        name,
        tuple(layers),
        input_bytes=s * 8.0,
        param_bytes=param_bytes,
        tokens_per_sample=s,
        update_s_per_param=update,
        loss=loss,
        train_args=tuple(train_args),
        master_bytes=4 if param_bytes < 4 else 0,
    )
