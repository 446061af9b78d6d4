"""Blend files, as Megatron-LM reads them, and the subset weights the merge puts into them.

`--data-args-path FILE`: whitespace-separated `weight prefix` pairs (or prefixes alone), exactly what
`--data-path` takes; Megatron normalises the weights. `--per-split-data-args-path FILE`: a JSON object
`{"train": ..., "valid": ..., "test": ...}` whose values are such lists (or one whitespace-separated
string); this trainer builds no test split, so `test` may be absent and is not read.

The merge weighs each output file by its tokens times its subset's multiplier: with no subset weights
every token of the corpus is equally likely to be drawn. Weights are not normalised, so the files of
two merges concatenate into their combined token-weighted blend.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from muloco.core.durable import write_text_durably
from muloco.core.small_files import loads_json, read_capped_text

PER_SPLIT_KEYS = ("train", "valid", "test")
# A million prefixes of 200 characters fit; /dev/zero or a wrong file is refused at this size, not at MemoryError.
BLEND_FILE_MAX_BYTES = 256 << 20


class BlendFileError(ValueError):
    """A blend or subset-weights file (or flag) that cannot be read as one."""


@dataclass(frozen=True)
class BlendEntry:
    weight: float
    prefix: str


def parse_subset_weights(spec: str) -> dict[str, float]:
    """`high=2,medium=1.5` or a `.json` file holding `{"high": 2, "medium": 1.5}`."""
    if spec.endswith(".json"):
        try:
            weights = loads_json(read_capped_text(spec, BLEND_FILE_MAX_BYTES))
        except (OSError, ValueError) as error:
            raise BlendFileError(f"cannot read subset weights from {spec}: {error}") from None
        if not isinstance(weights, dict):
            raise BlendFileError(f"{spec} must hold a JSON object of subset name -> weight")
        items = list(weights.items())
    else:
        items = []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, equals, value = item.rpartition("=")
            if not equals or not name:
                raise BlendFileError(f"--subset-weights takes NAME=WEIGHT,... (e.g. high=2,medium=1), got {item!r}")
            items.append((name, _number(value)))
    parsed = {}
    for name, value in items:
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= 0):
            raise BlendFileError(f"subset weight {name}={value!r} is not a number >= 0")
        parsed[name] = float(value)
    if not parsed:
        raise BlendFileError(f"no subset weight in {spec!r}")
    return parsed


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # refused, by name, below


def subset_multipliers(subsets: Iterable[str], weights: dict[str, float]) -> dict[str, float]:
    """Each subset's multiplier: the product of the weights whose name is the subset, one of its folders
    (`quality=high`) or a folder's value (`high`); 1 where none matches. A name matching no subset is an
    error, so a typo cannot silently leave the blend unweighted."""
    subsets = list(subsets)
    names_of = {subset: _names(subset) for subset in subsets}
    unmatched = [name for name in weights if not any(name in names for names in names_of.values())]
    if unmatched:
        raise BlendFileError(f"subset weight(s) {', '.join(unmatched)} match no subset; the subsets are: "
                             f"{', '.join(subsets)}")
    return {subset: math.prod(weight for name, weight in weights.items() if name in names_of[subset])
            for subset in subsets}


def _names(subset: str) -> set[str]:
    folders = subset.split("/")
    return {subset, *folders, *(folder.partition("=")[2] for folder in folders if "=" in folder)}


def write_data_args(path: Path, entries: list[BlendEntry]) -> None:
    for entry in entries:
        if entry.prefix.split() != [entry.prefix]:
            raise BlendFileError(f"prefix {entry.prefix!r} holds whitespace, which a data-args file cannot hold")
    write_text_durably(path, "".join(f"{entry.weight:.17g} {entry.prefix}\n" for entry in entries))


def read_data_args(path: str | Path) -> list[str]:
    """The blend list of a --data-args-path file."""
    try:
        items = read_capped_text(path, BLEND_FILE_MAX_BYTES).split()
    except (OSError, ValueError) as error:
        raise BlendFileError(f"cannot read --data-args-path {path}: {error}") from None
    if not items:
        raise BlendFileError(f"--data-args-path {path} is empty")
    return items


def read_per_split_data_args(path: str | Path) -> dict[str, list[str]]:
    """The train and valid blend lists of a --per-split-data-args-path file."""
    try:
        splits = loads_json(read_capped_text(path, BLEND_FILE_MAX_BYTES))
    except (OSError, ValueError) as error:
        raise BlendFileError(f"cannot read --per-split-data-args-path {path}: {error}") from None
    if not isinstance(splits, dict) or set(splits) - set(PER_SPLIT_KEYS):
        raise BlendFileError(f"--per-split-data-args-path {path} must hold a JSON object with keys "
                             f"{', '.join(PER_SPLIT_KEYS)}")
    blends = {}
    for split in ("train", "valid"):
        value = splits.get(split)
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
            raise BlendFileError(f"--per-split-data-args-path {path}: {split!r} must be a non-empty list of "
                                 f"weights and prefixes (or one string of them), got {value!r}")
        blends[split] = items
    return blends
