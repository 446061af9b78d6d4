"""Frozen dataclass trees from JSON: the one loader of every configuration block.

A block is a frozen dataclass deriving from `ConfigBlock`; its fields say everything the loader
checks: the annotation (nested blocks, `Literal` choices, `X | None`, tuples, `dict[str, X]`) and,
through `setting(...)`, the allowed range, the one-line doc (docs/configuration.md's reference
is generated from them: tools/config_reference.py), the command-line flag that sets it, if any
(trainer/flags.py builds the parsers from them) and, for a block whose keys depend on a sibling
(an optimizer's params on its type), the block each sibling value selects.

A block may list keys it knows but refuses, with the reason, in a `REFUSED` class attribute
(DeepSpeed's fp16 in the ds_config).

`load(cls, block, where)` builds `cls` from a JSON object. JSON's types are taken strictly: bool is
not an int, an int is fine where a float is expected (and becomes one), numbers must be finite (no
NaN or Infinity), a list stands for a tuple. Every problem of the JSON is reported in one
`ConfigProblems` error, in the order of the file, each with its dotted path: unknown keys (with the
closest known key), wrong types, values out of range, then each block's cross-field `problems()`.
Building a block in Python (`MuonConfig(ns_steps=0)`) runs the same checks.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

from muloco.core.errors import ConfigError
from muloco.core.small_files import FileTooLargeError, loads_json, read_capped

Problem = tuple[str, str]  # (dotted path relative to the block checked, what is wrong)
_INVALID = object()  # a value that could not be converted; its problem is already recorded


class ConfigProblems(ConfigError):
    """Every problem found in one configuration, as one message."""

    def __init__(self, problems: list[Problem], origins: Mapping[str, str] | None = None):
        self.problems = problems
        origins = origins or {}
        super().__init__("; ".join(f"{origins.get(path, path)} {text}" if path else text for path, text in problems))


@dataclass(frozen=True)
class Range:
    """Bounds of a number (or of every number of a tuple); None: unbounded on that side."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, value: Any, raw: Any) -> str | None:
        """Why `value` (converted from the config's `raw`) is out of range, or None."""
        # Only the numbers: a field may also take a word (`int | Literal["auto"]`).
        numbers = [x for x in (value if isinstance(value, tuple) else (value,)) if isinstance(x, (int, float))]
        ok = all((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                 and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt) for x in numbers)
        return None if ok else f"must be {self}, got {_show(raw)}"

    def __str__(self) -> str:
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt)
        high = ("]", self.le) if self.le is not None else (")", self.lt)
        if low[1] is not None and high[1] is not None:
            return f"in {low[0]}{_show(low[1])}, {_show(high[1])}{high[0]}"
        if low[1] is not None:
            return f"{'>=' if low[0] == '[' else '>'} {_show(low[1])}"
        return f"{'<=' if high[0] == ']' else '<'} {_show(high[1])}"


@dataclass(frozen=True)
class Selected:
    """The block a field holds is chosen by a sibling field's value (an optimizer's params by its type)."""
    by: str
    blocks: Mapping[str, type]


@dataclass(frozen=True)
class FieldSpec:
    doc: str = ""
    range: Range | None = None
    flag: str | None = None  # the setting's command-line flag (trainer/flags.py builds the parsers from these)
    aliases: tuple[str, ...] = ()  # other spellings of the flag (DeepSpeed's, Megatron's)
    casefold: bool = False  # a string compared in lower case ("AdamW" is "adamw")
    selected: Selected | None = None


def setting(default: Any = MISSING, *, doc: str = "", factory: Any = MISSING, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None, flag: str | None = None,
            aliases: tuple[str, ...] = (), casefold: bool = False,
            selected_by: tuple[str, Mapping[str, type]] | None = None) -> Any:
    """A dataclass field with its default, one-line doc, range and command-line flag declared once."""
    bounds = Range(ge, gt, le, lt) if (ge, gt, le, lt) != (None, None, None, None) else None
    spec = FieldSpec(doc, bounds, flag, aliases, casefold, Selected(*selected_by) if selected_by else None)
    return dataclasses.field(default=default, default_factory=factory, metadata={"spec": spec})


# Resolving a block's string annotations is most of the cost of building one, and configs are built
# often (`dataclasses.replace` per compression group, per tensor, in the planner), so once per class.
_type_hints = functools.cache(typing.get_type_hints)


def spec_of(f: dataclasses.Field) -> FieldSpec:
    return f.metadata.get("spec", FieldSpec())


def blocks_in(annotation: Any) -> list[type]:
    """The config blocks a field's annotation holds (itself, or those of a union such as X | None)."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigBlock):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [b for a in typing.get_args(annotation) for b in blocks_in(a)]
    return []


def field_default(cls: type, name: str) -> Any:
    """The default a block declares for `name` (so a command-line parser need not write it again)."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


class ConfigBlock:
    """Base of the configuration dataclasses: constructing one checks (and normalises) every field
    the way the loader does, then the block's own cross-field `problems()`."""

    def problems(self) -> list[Problem]:
        """Problems between fields (each field's own type and range are already fine)."""
        return []

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        well_typed = True
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            spec, raw = spec_of(f), getattr(self, f.name)
            value = _convert(_selected_block(self, spec) or hints[f.name], _casefolded(spec, raw), f.name, problems)
            if value is _INVALID:
                well_typed = False
                continue
            if value is not raw:
                object.__setattr__(self, f.name, value)  # a list given for a tuple, an int for a float
            _in_range(spec, value, raw, f.name, problems)
        if well_typed:  # cross-field checks need values of the right types (out of range is fine)
            problems += self.problems()
        if problems:
            raise ConfigProblems(problems)


def load(cls: type, block: Any, where: str = "", origins: Mapping[str, str] | None = None) -> Any:
    """`cls` built from the JSON value `block` found at dotted path `where`; raises ConfigProblems
    naming every problem. `origins` maps dotted paths to what set them (a command-line flag), named
    in their problems instead of the path."""
    problems: list[Problem] = []
    value = _load_block(cls, block, where, problems)
    if problems:
        raise ConfigProblems(problems, origins)
    return value


def set_path(block: dict, path: str, value: Any) -> None:
    """Set the value at dotted `path` of a JSON object, making the objects on the way."""
    *parents, last = path.split(".")
    for key in parents:
        if block.get(key) is None:
            block[key] = {}
        block = block[key]
        if not isinstance(block, dict):
            raise ConfigError(f"{key} must be an object to set {path}, got {block!r}")
    block[last] = value


# -- the loader ------------------------------------------------------------------------------------

def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _load_block(cls: type, block: Any, where: str, problems: list[Problem],
                elsewhere: Mapping[str, str] | None = None) -> Any:
    """`elsewhere`: keys this block lacks that a sibling choice would have, with that choice."""
    if not isinstance(block, dict):
        problems.append((where, f"must be an object, got {_show(block)}"))
        return _INVALID
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _type_hints(cls)
    before = len(problems)
    values = {}
    for key, raw in block.items():
        path = _join(where, key)
        if key not in fields:
            refused = getattr(cls, "REFUSED", {}).get(key)
            problems.append((path, _unknown(key, list(fields), refused, (elsewhere or {}).get(key))))
            continue
        spec = spec_of(fields[key])
        if spec.selected is not None:
            annotation, others = _selection(cls, fields, hints, spec.selected, block)
            if annotation is None:
                continue  # the selecting field is wrong: its own problem says so
            value = _load_block(annotation, raw, path, problems, others)
        else:
            value = _field_value(hints[key], spec, raw, path, problems)
        if value is not _INVALID:
            values[key] = value
    for key, f in fields.items():
        if key in block:
            continue
        spec = spec_of(f)
        if spec.selected is not None:  # absent: the selected block with its defaults
            annotation, _ = _selection(cls, fields, hints, spec.selected, block)
            if annotation is not None:
                values[key] = _load_block(annotation, {}, _join(where, key), problems)
        elif f.default is MISSING and f.default_factory is MISSING:
            problems.append((_join(where, key), "is required"))
    if len(problems) > before:
        return _INVALID
    try:
        return cls(**values)
    except ConfigProblems as err:  # the block's cross-field problems
        problems.extend((_join(where, path), text) for path, text in err.problems)
        return _INVALID


def _unknown(key: str, known: list[str], refused: str | None, elsewhere: str | None) -> str:
    if refused:
        return f"is not supported: {refused}"
    if elsewhere:
        return f"is only for {elsewhere}"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"is not a known key: did you mean {close[0]}?" if close else \
        f"is not a known key (known: {', '.join(known)})"


def _selection(cls: type, fields: dict, hints: dict, selected: Selected, block: dict):
    """The block class the selecting sibling's value picks (None when that value is wrong), and the
    keys only the other choices have."""
    sibling = fields[selected.by]
    raw = block.get(selected.by, field_default(cls, selected.by))
    value = _field_value(hints[selected.by], spec_of(sibling), raw, "", [])
    chosen = selected.blocks.get(value) if isinstance(value, str) else None
    if chosen is None:
        return None, {}
    own = {f.name for f in dataclasses.fields(chosen)}
    others = {f.name: f"{selected.by} {name}" for name, other in selected.blocks.items() if other is not chosen
              for f in dataclasses.fields(other) if f.name not in own}
    return chosen, others


def _selected_block(block: ConfigBlock, spec: FieldSpec) -> type | None:
    if spec.selected is None:
        return None
    return spec.selected.blocks.get(getattr(block, spec.selected.by))


def _casefolded(spec: FieldSpec, raw: Any) -> Any:
    return raw.lower() if spec.casefold and isinstance(raw, str) else raw


def _in_range(spec: FieldSpec, value: Any, raw: Any, path: str, problems: list[Problem]) -> bool:
    problem = spec.range.problem(value, raw) if spec.range is not None and value is not None else None
    if problem:
        problems.append((path, problem))
    return problem is None


def _field_value(annotation: Any, spec: FieldSpec, raw: Any, path: str, problems: list[Problem]) -> Any:
    value = _convert(annotation, _casefolded(spec, raw), path, problems)
    if value is _INVALID or not _in_range(spec, value, raw, path, problems):
        return _INVALID
    return value


def _convert(annotation: Any, raw: Any, path: str, problems: list[Problem]) -> Any:
    """`raw` as `annotation` describes it (a JSON list as a tuple, an int as a float, an object as
    a block), or _INVALID after recording why it does not fit."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if type(raw) is annotation:  # exactly: a subclass may be another choice of a selected block
            return raw
        if isinstance(raw, ConfigBlock):
            problems.append((path, f"must be a {annotation.__name__}, got a {type(raw).__name__}"))
            return _INVALID
        return _load_block(annotation, raw, path, problems)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        tried = []
        for alternative in (a for a in args if a is not type(None)):
            scratch: list[Problem] = []
            value = _convert(alternative, raw, path, scratch)
            if not scratch:
                return value
            tried.append((alternative, scratch))
        # When one alternative has the JSON kind of the value (an object for a block, a list for a
        # tuple, or X of X | None), its own problem is the clearer one.
        same_kind = [scratch for a, scratch in tried if _same_kind(a, raw)]
        if len(same_kind) == 1:
            problems.extend(same_kind[0])
            return _INVALID
        problems.append((path, f"must be {' or '.join(describe(a) for a in args)}, got {_show(raw)}"))
        return _INVALID
    if origin is tuple:
        if not isinstance(raw, (list, tuple)) or (args and args[-1] is not Ellipsis and len(raw) != len(args)):
            problems.append((path, f"must be {describe(annotation)}, got {_show(raw)}"))
            return _INVALID
        items = args[:1] * len(raw) if args and args[-1] is Ellipsis else args or (Any,) * len(raw)
        before = len(problems)
        values = tuple(_convert(a, v, f"{path}[{i}]", problems) for i, (a, v) in enumerate(zip(items, raw)))
        return values if len(problems) == before else _INVALID
    if origin is dict:
        if not isinstance(raw, dict):
            problems.append((path, f"must be an object, got {_show(raw)}"))
            return _INVALID
        before = len(problems)
        values = {k: _convert(args[1], v, _join(path, k), problems) for k, v in raw.items()}
        return values if len(problems) == before else _INVALID
    if _fits(annotation, raw):
        return float(raw) if annotation is float else raw
    finite = annotation is float and isinstance(raw, float) and not math.isfinite(raw)
    problems.append((path, f"must be {'a finite number' if finite else describe(annotation)}, got {_show(raw)}"))
    return _INVALID


def _same_kind(annotation: Any, raw: Any) -> bool:
    if isinstance(raw, dict):
        return dataclasses.is_dataclass(annotation) or typing.get_origin(annotation) is dict
    if isinstance(raw, (list, tuple)):
        return typing.get_origin(annotation) is tuple
    return typing.get_origin(annotation) is not Literal and not dataclasses.is_dataclass(annotation) \
        and typing.get_origin(annotation) not in (tuple, dict)


def _fits(annotation: Any, raw: Any) -> bool:
    if annotation is Any:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(raw == choice and type(raw) is type(choice) for choice in typing.get_args(annotation))
    if annotation is type(None):
        return raw is None
    if annotation is bool:
        return isinstance(raw, bool)
    if annotation is int:
        return isinstance(raw, int) and not isinstance(raw, bool)
    if annotation is float:
        return isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw)
    if annotation is str:
        return isinstance(raw, str)
    raise TypeError(f"the configuration loader does not model the annotation {annotation!r}")


def describe(annotation: Any) -> str:
    """What a value of `annotation` looks like in JSON, for problems and docs/configuration.md's reference."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is tuple:
        return "a list" if not args or args[-1] is Ellipsis else f"a list of {len(args)}"
    if origin is dict or dataclasses.is_dataclass(annotation):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null",
            Any: "any value"}[annotation]


# -- reading a config file --------------------------------------------------------------------------

MAX_CONFIG_BYTES = 16 << 20  # a ds_config is a few KB: a larger file (or a device that never ends) is refused


class _RepeatedKey(Exception):
    pass


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if repeated is not None:
        raise _RepeatedKey(repr(repeated))
    return dict(pairs)


def read_json_object(path: str | Path, what: str = "ds_config") -> dict[str, Any]:
    """The JSON object in the regular file `path` (capped, depth-safe: small_files.py), or one ConfigError
    naming `what` and saying why it is not one."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ConfigError(f"{what} {path} is not a regular file")
    try:
        value = loads_json(read_capped(path, MAX_CONFIG_BYTES).decode(), object_pairs_hook=_refuse_repeated_keys)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except _RepeatedKey as err:
        raise ConfigError(f"{what} {path}: key {err} is given twice in one object (JSON keeps only the last; "
                          "remove one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} {path} is not valid JSON: {err}") from None
    except (FileTooLargeError, ValueError) as err:  # too long, or nested too deep
        raise ConfigError(f"{what} {path} is not a config: {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object")
    return value
