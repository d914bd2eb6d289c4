"""The ``syncline train`` options, generated from :class:`~syncline.train.config.TrainConfig`.

One flag per setting of the composed config, parts included (``--lr`` from
``TrainConfig.optim``), under the setting's flat name. Each flag's type, default and help
come from its config field (the docstring under it, in the part that owns it), the
choices from the registries, and each registered model's own flags from its config class, so
the command line cannot drift from the code it configures. Why not a library (``tyro``,
``simple-parsing``): they would decide the error format and exit codes, which ``syncline``
keeps to one line and code 2, and they would not know the registries.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from syncline.fields import CliOption, Leaf, cli_option, field_docs, leaves
from syncline.models.registry import MODELS
from syncline.train.config import TrainConfig

__all__ = ["MODEL_OPTION", "add_config_options", "values_from"]

#: prefix of the ``dest`` of a model's own flags (``--n-layer`` -> ``model_option:n_layer``)
MODEL_OPTION = "model_option:"
_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def _help_text(doc: str) -> str:
    """A docstring as one ``--help`` paragraph: rST literals and line breaks dropped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
    return " ".join(text.split()).replace("%", "%%")


def _base_type(annotation: str) -> str:
    """``"int | None"`` -> ``"int"``: the annotation without its ``None``."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    return parts[0] if parts else "str"


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. n_layer=6")
    return key.strip(), value.strip()


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ``ValueError`` reported by argparse as the message itself."""

    def run(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    run.__name__ = getattr(parse, "__name__", "value")
    return run


def _default_text(f: dataclasses.Field[Any], opt: CliOption) -> str:
    if opt.default_text is not None:
        return opt.default_text
    if f.default is dataclasses.MISSING:
        return "none"
    return str(f.default)


def _kwargs_for(f: dataclasses.Field[Any], opt: CliOption) -> dict[str, Any]:
    kind = _base_type(str(f.type))
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS}
    if kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind.startswith("dict"):
        kwargs.update(action="append", type=_key_value)
    elif kind.startswith("tuple") and opt.parse is None:
        kwargs["action"] = "append"
    else:
        parse = _checked(opt.parse) if opt.parse else _SCALARS.get(kind, str)
        kwargs["type"] = parse
    if opt.metavar:
        kwargs["metavar"] = opt.metavar
    return kwargs


def help_order(found: tuple[Leaf, ...]) -> list[Leaf]:
    """The settings in declaration order, each with ``listed_after`` moved behind that one."""
    order = [leaf for leaf in found if cli_option(leaf.field).listed_after is None]
    for leaf in found:
        after = cli_option(leaf.field).listed_after
        if after is not None:
            at = next(i for i, o in enumerate(order) if o.name == after)
            order.insert(at + 1, leaf)
    return order


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`TrainConfig` setting, grouped, then the models' own flags."""
    groups: dict[str, Any] = {}
    for leaf in help_order(leaves(TrainConfig)):
        f, opt = leaf.field, cli_option(leaf.field)
        if opt.hidden:
            continue
        doc = field_docs(opt.help_from or leaf.owner).get(f.name, "")
        help_text = _help_text(doc)
        if opt.choices is not None:
            help_text += f" Valid: {', '.join(opt.choices())}."
        help_text += f" (default: {_help_text(_default_text(f, opt))})"
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        group = groups[opt.group]
        flags = opt.flags or (f"--{f.name.replace('_', '-')}",)
        group.add_argument(*flags, dest=f.name, help=help_text, **_kwargs_for(f, opt))
    _add_model_flags(groups.get("model and data") or parser.add_argument_group("models"))


def _add_model_flags(group: Any) -> None:
    """Each registered model's own flags (``ModelSpec.flags``), typed from its config."""
    seen: set[str] = set()
    for spec in MODELS:
        fields = {f.name: f for f in dataclasses.fields(spec.config)}
        docs = field_docs(spec.config)
        for name, flag in spec.flags.items():
            if flag in seen or name not in fields:
                continue
            seen.add(flag)
            f = fields[name]
            kind = _base_type(str(f.type))
            help_text = _help_text(docs.get(name, name))
            group.add_argument(
                flag,
                dest=MODEL_OPTION + name,
                metavar=name.upper(),
                type=_SCALARS.get(kind, str),
                default=argparse.SUPPRESS,
                help=f"{help_text} ({spec.name} model; default: {f.default})",
            )


def values_from(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave, by flat name, for :meth:`TrainConfig.from_flat` (the
    others keep their defaults)."""
    names = {leaf.name for leaf in leaves(TrainConfig)}
    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in vars(ns).items():
        if key.startswith(MODEL_OPTION):
            options[key[len(MODEL_OPTION) :]] = value
        elif key == "model_options":
            options.update(dict(value))
        elif key in names:
            values[key] = tuple(value) if key == "plugins" else value
    if options:
        values["model_options"] = options
    return values
