"""A partition's manifest, `PREFIX_partition-IIIII-of-NNNNN.json` beside its outputs, and the merge's
cross-check of all of them.

A partition rewrites its manifest (atomically) after every input group it finishes: it is both the
partition's resume state and what the merge reads. It holds the run's identity (tokenizer, key, output
options), the whole input listing (names and sizes, so the merge can name any input file nobody covered),
and per finished group its input files, output files and counts. The merge reads metadata only: manifests,
and the sizes of the files they name.

Format 1 named input files "shards" and subsets "buckets"; its manifests are read in today's names
(`_from_format_1`), so a run started before the rename still resumes and merges.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dataprep.dataset_meta import meta_path
from muloco.core.durable import write_text_durably
from muloco.core.small_files import FileTooLargeError, loads_json, read_capped_text

FORMAT = "muloco-preprocess-partition/2"
FORMAT_1 = "muloco-preprocess-partition/1"
# Every manifest holds the run's whole listing: a million input files with their groups fit.
MANIFEST_MAX_BYTES = 1 << 30
_SHOWN = 5  # input files named in an error before "... and N more"


class ManifestError(ValueError):
    """Manifests that do not add up to the whole input exactly once, or one that cannot be read."""


@dataclass
class SubsetStats:
    input_files: int = 0
    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # bad records left out, by kind

    @property
    def dropped_records(self) -> int:
        return sum(self.dropped.values())

    def add(self, other: SubsetStats) -> None:
        self.input_files += other.input_files
        self.documents += other.documents
        self.tokens += other.tokens
        self.empty_documents += other.empty_documents
        for kind, count in other.dropped.items():
            self.dropped[kind] = self.dropped.get(kind, 0) + count

    def describe(self) -> str:
        dropped = ", ".join(f"{kind}={count}" for kind, count in sorted(self.dropped.items())) or "none"
        return (f"input_files={self.input_files} documents={self.documents} tokens={self.tokens} "
                f"empty_documents={self.empty_documents} dropped={self.dropped_records} ({dropped})")


@dataclass(frozen=True)
class OutputFile:
    name: str  # the dataset prefix's file name: NAME.bin, .idx and .meta.json lie beside the manifest
    documents: int
    tokens: int
    max_token_id: int
    bin_bytes: int
    idx_bytes: int


@dataclass
class GroupRecord:
    index: int
    subset: str
    input_files: list[str]  # listing names
    fingerprint: str  # of everything the group's files depend on
    files: list[OutputFile]  # none when every record of the group was empty or bad
    stats: SubsetStats


@dataclass
class PartitionManifest:
    partition: int
    partitions: int
    run: dict[str, typing.Any]  # the output's identity: partitions of one run agree on it
    root: str  # the listing's folder on the machine that wrote this
    listing: list[list]  # [name, size] of every input file of the run, in order
    groups: list[GroupRecord] = field(default_factory=list)
    complete: bool = False

    def subsets(self) -> dict[str, SubsetStats]:
        return subset_totals(self.groups)

    def to_json(self) -> str:
        subsets = {subset: asdict(stats) for subset, stats in self.subsets().items()}
        return json.dumps({"format": FORMAT, **asdict(self), "subsets": subsets}, indent=1) + "\n"


def subset_totals(groups: list[GroupRecord]) -> dict[str, SubsetStats]:
    totals: dict[str, SubsetStats] = {}
    for group in groups:
        totals.setdefault(group.subset, SubsetStats()).add(group.stats)
    return totals


def manifest_path(output_prefix: str, partition: int, partitions: int) -> Path:
    return Path(f"{output_prefix}_partition-{partition:05d}-of-{partitions:05d}.json")


def write_manifest(path: Path, manifest: PartitionManifest) -> None:
    write_text_durably(path, manifest.to_json())


def read_manifest(path: Path) -> PartitionManifest:
    try:
        document = loads_json(read_capped_text(path, MANIFEST_MAX_BYTES))
    except (OSError, FileTooLargeError) as error:
        raise ManifestError(f"cannot read manifest {path}: {error}") from None
    except ValueError as error:  # not UTF-8, not JSON, nested too deep
        raise ManifestError(f"manifest {path} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") not in (FORMAT, FORMAT_1):
        raise ManifestError(f"{path} is not a partition manifest of this tool (format {FORMAT!r})")
    if document["format"] == FORMAT_1:
        document = _from_format_1(document)
    # The per-subset totals are written for people reading the file; the groups are what counts.
    document = {key: value for key, value in document.items() if key not in ("format", "subsets")}
    manifest = _load(PartitionManifest, document, str(path))
    for entry in manifest.listing:
        if not (len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], int)):
            raise ManifestError(f"{path}: listing entries are [name, size], got {entry!r}")
    return manifest


def _from_format_1(document: dict) -> dict:
    """A format-1 manifest in today's keys (shards -> input files, buckets -> subsets). Anything malformed is
    left as it is, for `_load` to name."""
    document = _renamed(document, {"buckets": "subsets"})
    if "run" in document:
        document["run"] = _renamed(document["run"], {"shards_per_file": "input_files_per_output"})
    if isinstance(document.get("groups"), list):
        document["groups"] = [_group_from_format_1(group) for group in document["groups"]]
    return document


def _group_from_format_1(group):
    group = _renamed(group, {"bucket": "subset", "shards": "input_files"})
    if isinstance(group, dict) and "stats" in group:
        stats = group["stats"] = _renamed(group["stats"], {"shards": "input_files"})
        if isinstance(stats, dict) and "dropped" in stats:
            stats["dropped"] = _renamed(stats["dropped"], {"empty_shard": "empty_file",
                                                           "unreadable_shard": "unreadable_file"})
    return group


def _renamed(value, names: dict[str, str]):
    """An object with the keys in `names` renamed (anything else as it is)."""
    return {names.get(key, key): item for key, item in value.items()} if isinstance(value, dict) else value


def _load(annotation, value, where: str):
    """`value` (parsed JSON) as `annotation`, or ManifestError naming the first misfit."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        fields = dataclasses.fields(annotation)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        if not isinstance(value, dict) or set(value) - names or required - set(value):
            raise ManifestError(f"{where}: expected an object with keys {sorted(names)}, got {str(value)[:200]}")
        return annotation(**{key: _load(hints[key], item, f"{where}.{key}") for key, item in value.items()})
    if origin is list:
        if not isinstance(value, list):
            raise ManifestError(f"{where}: expected a list, got {str(value)[:200]}")
        return [_load(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: expected an object, got {str(value)[:200]}")
        return {key: _load(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if annotation is typing.Any:
        return value
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ManifestError(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# The merge's check: every input file of the listing covered exactly once.


@dataclass(frozen=True)
class CoveredGroup:
    record: GroupRecord
    folder: Path  # where its files are: the folder of the manifest that names them


def check_coverage(manifests: dict[Path, PartitionManifest]) -> list[CoveredGroup]:
    """Every group of the run, in group order, once all manifests agree and cover each input file exactly once."""
    if not manifests:
        raise ManifestError("no manifest to merge")
    (first_path, first), *others = manifests.items()
    for path, manifest in others:
        for what in ("run", "listing", "partitions"):
            if getattr(manifest, what) != getattr(first, what):
                raise ManifestError(f"{path} and {first_path} are not partitions of one run: their {what} differ"
                                    f"{_first_difference(getattr(first, what), getattr(manifest, what))}")
    listed = {name for name, _ in first.listing}
    covered_by: dict[str, Path] = {}
    groups: dict[int, CoveredGroup] = {}
    for path, manifest in manifests.items():
        for record in manifest.groups:
            for name in record.input_files:
                if name not in listed:
                    raise ManifestError(f"{path} covers input file {name}, which is not in the run's listing")
                if name in covered_by:
                    raise ManifestError(f"input file {name} is covered twice: by {covered_by[name]} and by {path}")
                covered_by[name] = path
            groups[record.index] = CoveredGroup(record, path.parent)
    absent = _check_partitions(manifests, first.partitions)
    missing = [name for name, _ in first.listing if name not in covered_by]
    if absent or missing:
        shown = ", ".join(missing[:_SHOWN]) + (f" ... and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
        problems = ([f"no manifest for partition(s) {', '.join(map(str, absent))} of {first.partitions}"] if absent
                    else []) + ([f"{len(missing)} input file(s) covered by no partition: {shown}"] if missing else [])
        raise ManifestError("; ".join(problems))
    for covered in groups.values():
        for output in covered.record.files:
            if problem := output_file_problem(covered.folder, output):
                raise ManifestError(problem)
    return [groups[index] for index in sorted(groups)]


def _check_partitions(manifests: dict[Path, PartitionManifest], partitions: int) -> list[int]:
    """The partitions without a manifest, once none has two and every one present is finished."""
    seen: dict[int, Path] = {}
    for path, manifest in manifests.items():
        if not 0 <= manifest.partition < partitions:
            raise ManifestError(f"{path} names partition {manifest.partition} of {partitions}")
        if manifest.partition in seen:
            raise ManifestError(f"partition {manifest.partition}/{partitions} has two manifests: "
                                f"{seen[manifest.partition]} and {path}")
        seen[manifest.partition] = path
        if not manifest.complete:
            raise ManifestError(f"partition {manifest.partition}/{partitions} is not finished ({path} records "
                                f"{len(manifest.groups)} group(s) so far): rerun it, it resumes")
    return [index for index in range(partitions) if index not in seen]


def output_file_problem(folder: Path, output: OutputFile) -> str | None:
    """Why the files of `output` beside a manifest in `folder` are not as it records them (None: they are)."""
    prefix = folder / output.name
    for suffix, size in ((".bin", output.bin_bytes), (".idx", output.idx_bytes)):
        path = Path(f"{prefix}{suffix}")
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            return f"output file {path} is " + ("missing" if actual is None else f"{actual} bytes, the manifest says {size}")
    if not meta_path(prefix).is_file():
        return f"output file {meta_path(prefix)} is missing"
    return None


def _first_difference(a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f" ({key}: {a.get(key)!r} vs {b.get(key)!r})"
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return f" (first difference: {x!r} vs {y!r})"
        return f" ({len(a)} vs {len(b)} entries)"
    return f" ({a!r} vs {b!r})"
