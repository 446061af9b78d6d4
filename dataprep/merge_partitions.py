"""--merge-manifests: the partitions' manifests checked to cover every input file exactly once, and the blend
(weights and dataset prefixes) written from their token counts and the subsets' weights. Reads metadata only."""
from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from dataprep.blend import BlendEntry, parse_subset_weights, subset_multipliers, write_data_args
from dataprep.manifest import ManifestError, SubsetStats, check_coverage, read_manifest, subset_totals


@dataclass(frozen=True)
class MergeConfig:
    manifests: tuple[str, ...]  # files or globs
    data_args_path: Path
    subset_weights: str | None = None  # dataprep.blend.parse_subset_weights


@dataclass
class MergeSummary:
    partitions: int
    entries: list[BlendEntry]
    subsets: dict[str, SubsetStats]
    multipliers: dict[str, float]


def run_merge(config: MergeConfig) -> MergeSummary:
    """Check that the partitions' manifests cover every input file exactly once; write the blend."""
    paths = []
    for pattern in config.manifests:
        matches = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
        if not matches:
            raise ManifestError(f"--merge-manifests {pattern!r} matched no file")
        paths += [Path(match) for match in matches]
    manifests = {path: read_manifest(path) for path in dict.fromkeys(paths)}
    groups = check_coverage(manifests)
    subsets = subset_totals([covered.record for covered in groups])
    weights = parse_subset_weights(config.subset_weights) if config.subset_weights else {}
    multipliers = subset_multipliers(subsets, weights)
    entries = [BlendEntry(output.tokens * multipliers[covered.record.subset],
                          str((covered.folder / output.name).resolve()))
               for covered in groups for output in covered.record.files if multipliers[covered.record.subset] > 0]
    if not entries:
        raise ManifestError("the blend would be empty: no partition wrote a document"
                            + (" in a subset of weight > 0" if weights else ""))
    write_data_args(config.data_args_path, entries)
    return MergeSummary(len(manifests), entries, subsets, multipliers)
