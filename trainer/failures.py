"""Stopping every rank together when some rank fails on its own input (its rank file, a check only
rank 0 makes), so the user reads that rank's own line instead of a peer's gloo `Connection closed`.

Every rank calls `stop_together` at the same point with its error (or None). One all-gather over the
world tells every rank who failed. Each failing rank prints its line, unless a lower rank failed
with the same message (a bad meta.json is every rank's problem: it is printed once); the lowest rank
that did not fail prints one line pointing at the others; then every rank exits with `exit_code`.
"""
from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist

from muloco.core import comm

_DIGEST_BYTES = 8  # enough to tell messages apart


def _digest(message: str) -> list[int]:
    return list(hashlib.sha256(message.encode()).digest()[:_DIGEST_BYTES])


def stop_together(error: str | None, what: str, exit_code: int = 2) -> None:
    """Return if no rank has an error; else print as described above and exit every rank.
    `what` names the step for the pointing line ("load the checkpoint")."""
    mine = torch.zeros(1 + _DIGEST_BYTES, dtype=torch.int64)
    if error is not None:
        mine[0] = 1
        mine[1:] = torch.tensor(_digest(error))
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone = torch.zeros(world, 1 + _DIGEST_BYTES, dtype=torch.int64)
    comm.all_gather_into_tensor(everyone.view(-1), mine)
    failed = [r for r in range(world) if everyone[r, 0]]
    if not failed:
        return
    if error is not None and not any(torch.equal(everyone[r], everyone[rank]) for r in failed if r < rank):
        _print_line(error)
    comm.barrier()  # the failing ranks' lines first, so "above" is true
    if error is None and rank == min(set(range(world)) - set(failed)):
        ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        _print_line(f"stopping: {ranks} could not {what} (see {'its line' if len(failed) == 1 else 'their lines'} "
                    "above); every rank exits")
    raise SystemExit(exit_code)


def _print_line(line: str) -> None:
    """One write, so that lines of ranks sharing an output pipe do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
