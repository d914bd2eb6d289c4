"""Split any model into stage modules at named points, with torch's own splitter.

``nn.Sequential`` models are cut by a balance (:mod:`syncline.pipeline.split`). Every other
model (a HuggingFace GPT-2, a ResNet, anything ``torch.export`` can trace) is split here at
the modules the user names, e.g. ``["transformer.h.6"]``: each named module starts a new
stage. The splitting is torch.distributed.pipelining's front end (``pipeline()``: an
export trace, cut at the split points into one ``GraphModule`` per stage); syncline runs
its own schedules on the result. No process group is involved.

What the trace gives, and what this module adds so that the stages are safe to train:

- **Wiring**: each stage's inputs by name, each from a model input (``input_ids``,
  ``attention_mask``) or from an output of an earlier stage (several values may cross a
  boundary: GPT-2 passes the hidden state and the expanded attention mask). Read from the
  root graph into :class:`Source` records, pure data.
- **Original names**: stage parameters keep the model's fully-qualified names; a tied
  weight (GPT-2's input embedding and output head) is copied into each stage that uses it,
  under the name that stage used. :attr:`TracedModel.tied` lists such groups and
  :attr:`TracedModel.canonical` maps every stage name to the model's first name for it, so
  checkpoints and gradient sums see one parameter. torch also leaves the tied Parameter
  registered, unused, on a stage that does not read it; those strays are removed.
- **Static shapes**: the trace bakes the example micro-batch's shapes into the graph (a
  ``view`` to the traced batch and sequence size), and a micro-batch of another shape may
  run without error and give wrong results. :meth:`TracedModel.check_inputs` refuses any
  input whose shape or dtype differs from the traced one, naming both.
- **Speed**: the stages' submodules run generated code, not ``torch.fx.Interpreter``
  (node-by-node Python, ~30x slower on a small model).

Known limits, refused or documented rather than silently wrong: training and evaluation
mode are fixed at trace time (dropout is traced as it was), and stage modules cannot be
pickled (trace on every rank; checkpoint their ``state_dict``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn

from syncline.errors import ConfigError


@dataclass(frozen=True)
class Source:
    """Where a stage input comes from: model input ``name`` (``stage is None``), or output
    ``index`` of stage ``stage`` (``index is None``: that stage returns a single value)."""

    name: str
    stage: int | None = None
    index: int | None = None


@dataclass
class TracedModel:
    """A model cut into stage modules (see the module docstring).

    Attributes:
        stages: the stage modules, in order; stage ``i``'s forward takes its inputs by
            position, in ``placeholders[i]``'s order.
        placeholders: each stage's input names (its graph's placeholders; the generated
            forward may call a parameter otherwise: one named like a builtin, ``input``,
            is the placeholder ``input_1``).
        sources: each stage's inputs, as :class:`Source` records (same order).
        output: where the model's output comes from (the last stage).
        tied: groups of ``{stage: parameter name}`` that are one parameter of the model
            (their gradients must be summed before each step, so the copies stay equal).
        canonical: per stage, parameter or buffer name -> the model's first name for it.
        signature: model input name -> ``(shape, dtype)`` of the traced micro-batch.
    """

    stages: list[nn.Module]
    placeholders: list[list[str]]
    sources: list[list[Source]]
    output: Source
    tied: list[dict[int, str]]
    canonical: list[dict[str, str]]
    signature: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Refuse micro-batch inputs the trace does not fit (names, shapes or dtypes).

        Raises:
            ConfigError: naming the input, its shape and the traced one.
        """
        if set(inputs) != set(self.signature):
            raise ConfigError(
                f"model inputs {sorted(inputs)} differ from the traced ones "
                f"{sorted(self.signature)}"
            )
        for name, value in inputs.items():
            shape, dtype = self.signature[name]
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise ConfigError(
                    f"input {name!r} is {list(value.shape)} {value.dtype} but the stages were "
                    f"traced for {list(shape)} {dtype}; the trace fixes the micro-batch shape "
                    "(valid: batches that split into micro-batches of the traced shape)"
                )

    def check_parts(self, parts: Sequence[object]) -> None:
        """:meth:`check_inputs` of every micro-batch (each a dict of the model's inputs)."""
        for part in parts:
            if not isinstance(part, Mapping):
                raise ConfigError(
                    f"a traced model takes its inputs as a dict by argument name, got "
                    f"{type(part).__name__}"
                )
            self.check_inputs(part)

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Run the stages one after another in this process (a reference; no boundaries are
        cut, so autograd flows through the whole model)."""
        self.check_inputs(inputs)
        outputs: list[Any] = []
        for stage, sources in zip(self.stages, self.sources, strict=True):
            # by position (see TracedStage.forward)
            outputs.append(stage(*[resolve(s, inputs, outputs) for s in sources]))
        return resolve(self.output, inputs, outputs)


def resolve(source: Source, inputs: Mapping[str, Any], outputs: Sequence[Any]) -> Any:
    """The value ``source`` names, given the model inputs and the stage outputs so far."""
    if source.stage is None:
        return inputs[source.name]
    out = outputs[source.stage]
    return out if source.index is None else out[source.index]


def trace_model(
    model: nn.Module,
    split_points: Sequence[str],
    example_inputs: Mapping[str, torch.Tensor],
) -> TracedModel:
    """Split ``model`` before each module named in ``split_points``.

    Args:
        model: any module ``torch.export`` traces; called as ``model(**example_inputs)``.
            Its forward should return what the loss takes (e.g. logits; a HuggingFace
            model's ``use_cache`` is turned off while tracing, as training needs no cache);
            the model is left as it was (the split points' forwards and its config restored).
        split_points: fully-qualified module names, in model order; each starts a stage.
        example_inputs: one micro-batch, by the forward's argument names (real tensors).

    Raises:
        ConfigError: a split point names no module, the tracer cannot take the model (one
            line naming it and what to change), or the trace gives another number of stages
            than split points + 1.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    names = dict(model.named_modules())
    unknown = [p for p in split_points if p not in names or not p]
    if unknown:
        raise ConfigError(
            f"split point(s) {unknown} name no module of {type(model).__name__}; valid: "
            f"names from model.named_modules(), e.g. {[n for n in names if n][:4]}"
        )
    canonical = _canonical_names(model)
    spec = {p: SplitPoint.BEGINNING for p in split_points}
    # A HuggingFace model built from its default config returns a key-value cache beside the
    # logits, which the tracer cannot carry ("Found DynamicCache in output"); training never
    # reads it, so the trace is taken without it and the user's config is left as it was.
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None) is True
    try:
        if cached:
            config.use_cache = False  # type: ignore[union-attr]
        pipe = pipeline(model, (), dict(example_inputs), split_spec=spec)
    except ConfigError:
        raise
    except Exception as exc:  # the tracer's own errors, many kinds: one line, what to change
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(
            f"torch.export could not trace {type(model).__name__} for split_points="
            f"{list(split_points)}: {type(exc).__name__}: {first}; valid: a forward that "
            "returns tensors (or a dict/tuple of them) without data-dependent Python control "
            "flow; or pipeline_stages=1"
        ) from exc
    finally:
        if cached:
            config.use_cache = True  # type: ignore[union-attr]
        for p in split_points:  # the splitter patches these modules' forward in place
            model.get_submodule(p).__dict__.pop("forward", None)
            model.get_submodule(p).__dict__.pop("_orig_forward", None)
    if pipe.num_stages != len(split_points) + 1:
        raise ConfigError(
            f"split points {list(split_points)} gave {pipe.num_stages} stages, not "
            f"{len(split_points) + 1}: is each point called once, in model order?"
        )
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    for stage in stages:
        _prune_unused(stage)
        _generated_code(stage)
    placeholders, sources, output = _wiring(pipe.split_gm.graph, stages)
    tied = [
        {int(sub.rsplit("_", 1)[1]): name for sub, name in group.items()}
        for group in pipe.replicated_params
    ]
    return TracedModel(
        stages=stages,
        placeholders=placeholders,
        sources=sources,
        output=output,
        tied=tied,
        canonical=[
            {n: canonical.get(n, n) for n, _ in [*s.named_parameters(), *s.named_buffers()]}
            for s in stages
        ],
        signature={k: (tuple(v.shape), v.dtype) for k, v in example_inputs.items()},
    )


def _generated_code(stage: nn.Module) -> None:
    """Run the stage's submodules as generated code rather than through torch's node-by-node
    interpreter (see Speed in the module docstring).

    The generated ``forward(self, ...)`` names each value after its node, and a call of a
    submodule named ``self`` (HuggingFace BERT's ``attention.self``) is a node named
    ``self``: its result would overwrite the module in the generated code ("'Tensor' object
    has no attribute 'output'"). Such nodes are renamed first (the interpreter never minded).
    """
    for m in stage.modules():
        if not hasattr(m, "_run_with_interpreter"):  # not torch's InterpreterModule
            continue
        graph = getattr(m, "graph", None)
        clashing = [n for n in graph.nodes if n.name == "self"] if graph is not None else []
        for node in clashing:
            node._rename("self_module")  # the graph's namespace keeps it unique
        code = getattr(m, "graph_module", None)
        if clashing and isinstance(code, fx.GraphModule):
            code.recompile()
        m.__dict__["_run_with_interpreter"] = False


def retarget(stage: nn.Module, device: torch.device) -> None:
    """Make a stage traced on the meta device compute on ``device``: the trace bakes the
    example's device into the graph (``arange(..., device=meta)``, ``to(device=meta)``), so
    every such argument is rewritten and the code regenerated."""
    meta = torch.device("meta")

    def swap(arg: Any) -> Any:
        return device if isinstance(arg, torch.device) and arg == meta else arg

    seen: set[int] = set()
    for module in stage.modules():
        for gm in (module, getattr(module, "graph_module", None)):
            if not isinstance(gm, fx.GraphModule) or id(gm) in seen:
                continue
            seen.add(id(gm))
            for node in gm.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, swap)
                node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
            gm.recompile()


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter and buffer -> its first name (tied ones share one)."""
    first: dict[int, str] = {}
    out = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        out[name] = first.setdefault(id(t), name)
    return out


def _used_attributes(stage: nn.Module) -> set[str]:
    """Fully-qualified names of the parameters and buffers the stage's graphs read."""
    used = set()
    for prefix, module in stage.named_modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, fx.Graph):
            for node in graph.nodes:
                if node.op == "get_attr":
                    used.add(f"{prefix}.{node.target}" if prefix else str(node.target))
    return used


def _prune_unused(stage: nn.Module) -> None:
    """Drop parameters and buffers registered on the stage that no graph reads (torch leaves
    a tied weight's other alias on a stage that does not use it)."""
    used = _used_attributes(stage)
    named = [
        *stage.named_parameters(remove_duplicate=False),
        *stage.named_buffers(remove_duplicate=False),
    ]
    for name, _ in named:
        if name in used:
            continue
        parent, _, leaf = name.rpartition(".")
        owner = stage.get_submodule(parent) if parent else stage
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)


def _wiring(
    graph: fx.Graph, stages: Sequence[nn.Module]
) -> tuple[list[list[str]], list[list[Source]], Source]:
    """Each stage's input names and sources, and the model output's source, from the root
    graph (placeholder -> call_module submod_pp_i -> getitem -> next stage -> output)."""
    origin: dict[fx.Node, Source] = {}
    placeholders: list[list[str]] = []
    sources: list[list[Source]] = []
    output: Source | None = None
    for node in graph.nodes:
        args = [cast(fx.Node, a) for a in node.args if isinstance(a, fx.Node)]
        if node.op == "placeholder":
            origin[node] = Source(str(node.target))
        elif node.op == "call_function" and node.target is operator.getitem:
            whole = origin[args[0]]
            origin[node] = Source(whole.name, whole.stage, int(cast(int, node.args[1])))
        elif node.op == "call_module":
            index = int(str(node.target).rsplit("_", 1)[1])
            origin[node] = Source(f"stage{index}", index)
            stage_graph = cast(fx.GraphModule, stages[index]).graph
            names = [str(p.target) for p in stage_graph.nodes if p.op == "placeholder"]
            if node.kwargs or len(names) != len(node.args) or len(args) != len(node.args):
                raise ConfigError(f"stage {index}: unexpected call in the split graph: {node}")
            placeholders.append(names)
            sources.append([origin[a] for a in args])
        elif node.op == "output":
            value = node.args[0]
            if isinstance(value, tuple | list):
                if len(value) != 1:
                    raise ConfigError(
                        f"the model returns {len(value)} values; return one (e.g. the logits)"
                    )
                value = value[0]
            output = origin[cast(fx.Node, value)]
    assert output is not None
    return placeholders, sources, output
