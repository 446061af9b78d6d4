"""Splitting one preprocessing run over N independent processes (machines, Slurm array tasks).

The unit of work is an input group: a fixed number of consecutive input files of one subset, which becomes
its own output file(s). Groups depend only on the listing and the group size, so every output file is
the same whoever writes it.

Groups go to partitions by sizes balanced (largest group first, to the partition with the fewest bytes
so far; ties to the lower index), computed from the listing alone: every process derives the same
assignment without talking to the others, and the partitions finish at about the same time, which is
when a job array ends. (A stable hash of the names would need no sizes, but leaves partitions uneven
by chance, or empty for small inputs; a changed listing is an error at the merge either way.)
"""
from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dataprep.listing import Listing

_SLURM_ID = "SLURM_ARRAY_TASK_ID"


class PartitionError(ValueError):
    """A partition that cannot be: malformed --partition, or Slurm array variables that do not add up."""


@dataclass(frozen=True)
class Partition:
    index: int  # 0-based
    count: int
    source: str = "--partition"  # where it came from, for messages

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise PartitionError(f"partition {self.index}/{self.count} (from {self.source}): the index must be "
                                 f"in 0..{self.count - 1}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> Partition:
        """`I/N`: the I-th (0-based) of N partitions."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match or int(match[2]) < 1:
            raise PartitionError(f"--partition takes I/N with 0 <= I < N (e.g. 3/16), got {text!r}")
        return cls(int(match[1]), int(match[2]))

    @classmethod
    def from_slurm(cls, environ: Mapping[str, str]) -> Partition | None:
        """This Slurm array task's partition (`sbatch --array=0-15` or `1-16`, steps too), or None outside one."""
        if _SLURM_ID not in environ:
            return None

        def number(name: str, default: int | None = None) -> int:
            value = environ.get(name)
            if value is None and default is not None:
                return default
            if value is None or not value.strip().isdigit():
                raise PartitionError(f"Slurm array variable {name}={value!r} is not a number; pass --partition I/N")
            return int(value)

        task, first, step = number(_SLURM_ID), number("SLURM_ARRAY_TASK_MIN"), number("SLURM_ARRAY_TASK_STEP", 1)
        last = number("SLURM_ARRAY_TASK_MAX")
        count = number("SLURM_ARRAY_TASK_COUNT", (last - first) // max(step, 1) + 1)
        source = f"SLURM_ARRAY_TASK_ID={task} of {first}-{last}" + (f":{step}" if step != 1 else "")
        if step < 1 or (task - first) % step or count != (last - first) // step + 1:
            raise PartitionError(f"the Slurm array ({source}, {count} tasks) is not an evenly spaced range; "
                                 "use --array=0-N-1 or pass --partition I/N")
        return cls((task - first) // step, count, source)


@dataclass(frozen=True)
class InputGroup:
    index: int  # position among all groups of the run: names its output file(s)
    subset: str
    input_files: tuple[int, ...]  # positions in the listing, consecutive within the subset
    size: int  # bytes on disk


def plan_groups(listing: Listing, files_per_group: int) -> list[InputGroup]:
    """Subsets in order of their first input file, each cut into runs of `files_per_group` files."""
    by_subset: dict[str, list[int]] = {}
    for position, file in enumerate(listing.files):
        by_subset.setdefault(file.subset, []).append(position)
    groups = []
    for subset, positions in by_subset.items():
        for start in range(0, len(positions), files_per_group):
            members = tuple(positions[start:start + files_per_group])
            groups.append(InputGroup(len(groups), subset, members, sum(listing.files[p].size for p in members)))
    return groups


def assign_groups(groups: list[InputGroup], count: int) -> list[list[InputGroup]]:
    """Each partition's groups, in group order (see the module docstring for the rule)."""
    loads = [(0, partition) for partition in range(count)]
    assigned: list[list[InputGroup]] = [[] for _ in range(count)]
    for group in sorted(groups, key=lambda group: (-group.size, group.index)):
        load, partition = heapq.heappop(loads)
        assigned[partition].append(group)
        heapq.heappush(loads, (load + group.size, partition))
    return [sorted(mine, key=lambda group: group.index) for mine in assigned]
