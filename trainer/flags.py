"""Command-line flags generated from the settings that declare one: `setting(..., flag="--lr")`.

A flag is declared once, beside its field: the field's annotation gives argparse's type, choices and
arity (bool: a switch; a Literal: its choices; a tuple: one or more values), its `doc` is the help,
and the field's name is the flag's `dest`. A flag either is a setting's value (`add_flags(...,
override=False)`: its default is the field's) or overrides a value read elsewhere (`override=True`:
None unless given, then written over the ds_config's value at the flag's dotted path, or over a
preset's shape; given nowhere, the field's default applies).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from muloco.core.typed_json import blocks_in, field_default, spec_of


@dataclass(frozen=True)
class Flag:
    name: str  # "--lr"
    aliases: tuple[str, ...]
    field: str  # the field it sets, also its argparse dest
    path: str  # the field's dotted path from the class walked ("optimizer.params.lr")
    annotation: Any
    default: Any  # the field's (MISSING: none, the run derives it)
    doc: str
    within: str | None = None  # the optional block on its path ("muloco"): a flag sets its values, never adds it

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def declared_flags(cls: type, path: str = "", within: str | None = None, nested: bool = True) -> list[Flag]:
    """The flags declared on `cls`'s fields and (with `nested`) on the blocks it holds, in field order."""
    flags = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec, child = spec_of(f), f"{path}.{f.name}" if path else f.name
        if spec.flag is not None:
            flags.append(Flag(spec.flag, spec.aliases, f.name, child, hints[f.name], field_default(cls, f.name),
                              spec.doc, within))
        if nested:
            optional = within or (child if type(None) in typing.get_args(hints[f.name]) else None)
            for block in blocks_in(hints[f.name]):
                flags += declared_flags(block, child, optional)
    return flags


def field_flag(name: str, cls: type, field: str, path: str) -> Flag:
    """A tool's own flag for a setting that has none in the trainer (tools/plan.py's --workers): the
    field's annotation, default and doc, at dotted `path` of the ds_config."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == field]
    return Flag(name, (), field, path, typing.get_type_hints(cls)[field], field_default(cls, field), spec_of(f).doc)


def add_flags(group: argparse._ActionsContainer, flags: list[Flag], override: bool, where: str = "") -> None:
    """`override`: each flag's value is None unless given (the config's, or the preset's, applies);
    `where`: a note on each help, formatted with the flag's dotted `path` ("ds_config {path}")."""
    for flag in flags:
        kwargs = _argparse_kwargs(flag, override)
        if where:
            kwargs["help"] = f"{kwargs['help']} ({where.format(path=flag.path)})"
        if "action" not in kwargs and "choices" not in kwargs:  # named as argparse names it from the flag
            kwargs["metavar"] = flag.name.lstrip("-").replace("-", "_").upper()
        group.add_argument(*flag.option_strings, dest=flag.field, **kwargs)


def _argparse_kwargs(flag: Flag, override: bool) -> dict[str, Any]:
    annotation = _without_none(flag.annotation)
    default = None if override or flag.default is MISSING else flag.default
    shown = default is not None and not isinstance(default, (bool, tuple))  # a switch says what it does
    kwargs: dict[str, Any] = {"default": default, "help": flag.doc + (" (default: %(default)s)" if shown else "")}
    if annotation is bool:  # a switch to the field's other value
        if override:
            return {**kwargs, "action": "store_const", "const": not flag.default}
        return {**kwargs, "action": "store_false" if flag.default else "store_true"}
    if typing.get_origin(annotation) is tuple:
        item, *rest = typing.get_args(annotation)
        if rest != [Ellipsis]:
            raise TypeError(f"{flag.name}: a flag takes a tuple of any length, not {annotation!r}")
        return {**kwargs, "nargs": "+", "type": item}
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return {**kwargs, "choices": choices, "type": type(choices[0])}
    if annotation in (int, float, str):
        return {**kwargs, "type": annotation}
    raise TypeError(f"{flag.name}: the flag generator does not model the annotation {flag.annotation!r}")


def _without_none(annotation: Any) -> Any:
    """X of X | None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
