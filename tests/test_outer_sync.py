"""The outer loop's one sync body (muloco/diloco/outer_loop.py) under both memberships, in process, on
the workers of tests/outer_workers.py. References are plain computations: the Nesterov outer step on the
average of the contributors' payloads, and every member's global weights bit-identical after every sync:
a non-finite worker skipped (static) or left out (elastic), reduce-scatter owners that disagree, the run's
final sync, a metrics round lost with a leaving member, and `overlap_steps: auto`."""
from __future__ import annotations

import math

import pytest
import torch
from fake_wire import Board, FakeStatic, FakeWire, run_ranks
from job_keys import KEY
from outer_workers import (
    SHAPES,
    FakeClock,
    Worker,
    checksums,
    elastic_config,
    global_by_name,
    quorum_worker,
    static_workers,
    steps,
    sync_all,
)

from muloco.diloco.config import CompressionConfig, MuLoCoConfig, StreamingConfig
from muloco.diloco.wire import CollectiveError


def nesterov_reference(before: dict, deltas: list[dict], config: MuLoCoConfig, momentum: dict) -> dict:
    """theta <- theta - lr (avg + mu m'), m' = mu m + avg, on plain fp32 tensors."""
    out = {}
    for name in before:
        average = sum(d[name] for d in deltas) / len(deltas)
        m = config.outer_momentum * momentum[name] + average
        out[name] = before[name] - config.outer_lr * (average + config.outer_momentum * m)
    return out


def test_static_sync_is_nesterov_on_the_plain_average_on_every_worker():
    config = MuLoCoConfig(workers=3, sync_interval=4, outer_momentum=0.5)
    workers = static_workers(3, config)
    before = global_by_name(workers[0])
    zero = {n: torch.zeros_like(t) for n, t in before.items()}
    deltas = []
    for w in workers:
        generator = torch.Generator().manual_seed(1000 * 4 + w.loop.topology.rank)
        deltas.append({n: -0.01 * torch.randn(SHAPES[n], generator=generator) for n in SHAPES})
    sync_all(workers, 4)
    assert len(checksums(workers)) == 1
    expected = nesterov_reference(before, deltas, config, zero)
    for name, value in global_by_name(workers[1]).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    record = workers[0].records[-1]
    assert record["round_trips"] == 1 and record["background_round_trips"] == 1 and "skipped" not in record


def test_static_sync_is_skipped_for_everyone_when_one_worker_is_non_finite():
    workers = static_workers(3, MuLoCoConfig(workers=3, sync_interval=4))
    before = checksums(workers)
    sync_all(workers, 4, scale=lambda r: math.nan if r == 2 else 1.0)
    assert checksums(workers) == before  # nobody applied anything
    assert "worker 2" in workers[0].records[-1]["skipped"]  # the logging rank's record


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_elastic_members_leave_out_a_nan_worker_and_average_the_others_bit_identically(collective):
    config = elastic_config(collective=collective, compression=CompressionConfig(method="statistical", bits=4))
    board = Board(3)
    workers = [quorum_worker(r, board, config) for r in range(3)]
    sync_all(workers, 4)
    sync_all(workers, 8, scale=lambda r: math.nan if r == 1 else 1.0)
    assert len(checksums(workers)) == 1
    for w in workers:
        record = w.records[-1]
        assert record["left_out"] == {"1": "non-finite pseudogradient"} and record["workers_in_sync"] == 2
        assert record["round_trips"] == (1 if collective == "all_gather" else 2)
        assert "weights_sha" in record


class NaNForTheFirstOwner(FakeWire):
    """An insider with the secret: the payload it sends owner 0 decodes to NaN (0xFF bytes after the
    claim and header); its payloads for the others, its header and its claims are honest."""
    HEAD = 8 + 8 * 7  # claim, then the elastic row

    def all_to_all(self, blocks, receive_sizes, context):
        blocks = [block.clone() for block in blocks]
        blocks[0][self.HEAD:] = 255
        return super().all_to_all(blocks, receive_sizes, context)


def test_reduce_scatter_owners_that_disagree_average_again_over_the_senders_nobody_refused():
    """Owner 0 refuses the insider's chunk, owners 1 and 2 do not: every owner then averages its chunk
    again without the insider (one more all-gather), so the result is one average over the same
    senders on every member."""
    statistical = CompressionConfig(method="statistical", bits=4)
    config = elastic_config(collective="reduce_scatter", compression=statistical)
    board = Board(3)
    workers = [quorum_worker(r, board, config, wire=NaNForTheFirstOwner if r == 2 else FakeWire) for r in range(3)]
    sync_all(workers, 4)
    assert len(checksums(workers)) == 1
    assert all(set(w.records[-1]["left_out"]) == {"2"} for w in workers)
    assert "non-finite" in workers[0].records[-1]["left_out"]["2"]
    assert workers[0].records[-1]["round_trips"] == 3  # all-to-all, all-gather, and the second average's all-gather


@pytest.mark.parametrize("membership", ["static", "elastic"])
@pytest.mark.parametrize("final_sync", [True, False])
def test_a_run_ends_with_one_model_on_every_worker_unless_told_not_to(final_sync, membership):
    """K=2, two fragments overlapped by one step, a last step (10) where fragment 0's sync launches: that
    sync is applied at once and fragment 1, not holding its global weights, syncs once more, so every
    worker's weights are its global ones, bit-identical across workers. Without it the run ends with K
    models and the sync in flight lands unapplied."""
    muloco = dict(workers=2, sync_interval=4, streaming=StreamingConfig(fragments=2, overlap_steps=1),
                  final_sync=final_sync)
    if membership == "static":
        workers = static_workers(2, MuLoCoConfig(**muloco))
    else:
        board = Board(2)
        workers = [quorum_worker(r, board, elastic_config(**muloco)) for r in range(2)]
    for w in workers:
        w.loop.host.last_step = 10
    launched_by_10 = sum(1 for step in range(1, 11) for offset in workers[0].loop.offsets if step % 4 == offset)
    steps(workers, 1, 10)
    weights = [[p.detach().clone() for p in w.params] for w in workers]
    held_global = all(torch.equal(w.loop.tensors[i].tensor, g) for w in workers
                      for i, g in w.loop.state.global_weights.items())
    assert held_global == final_sync
    if final_sync:
        assert all(torch.equal(a, b) for a, b in zip(*weights))
    assert len(checksums(workers)) == 1
    finals = [r for r in workers[0].records if r.get("final_sync")]
    if final_sync:  # fragment 0 launched at step 10 (offsets [2, 0]): it lands at once and holds the global
        assert [(r["step"], r["fragment"]) for r in finals] == [(10, 1)]  # weights; fragment 1 moved since step 9
        assert workers[0].loop.state.outer_step == launched_by_10 + 1 and not workers[0].loop.pending
    else:
        assert not finals and workers[0].loop.state.outer_step == launched_by_10 - 1
        assert [e.apply_at for e in workers[0].loop.pending] == [11]


class MetricsRoundFailsAtOuterStep2(FakeWire):
    """A member leaves right after outer step 2 committed: that sync's background metrics round fails."""

    def all_gather_floats(self, values, context):
        if context.endswith("outer step 2"):
            raise CollectiveError(f"all_gather failed in {context}: a member left")
        return super().all_gather_floats(values, context)


def test_a_member_leaving_after_a_sync_loses_its_metrics_not_the_run():
    config = elastic_config(compression=CompressionConfig(method="statistical", bits=4))
    board = Board(3)
    workers = [quorum_worker(r, board, config, wire=MetricsRoundFailsAtOuterStep2) for r in range(3)]
    for step in (4, 8, 12):
        sync_all(workers, step)
        assert len(checksums(workers)) == 1
    for w in workers:
        assert [r["outer_step"] for r in w.records] == [1, 2, 3]  # every sync applied once
        assert w.records[1].get("metrics_lost") is True and "bytes_sent_per_rank" not in w.records[1]
        assert all("bytes_sent_per_rank" in w.records[i] and "metrics_lost" not in w.records[i] for i in (0, 2))


class SlowStatic(FakeStatic):
    """A sync that takes `seconds` on the worker's clock."""

    def __init__(self, boards, rank, clock: FakeClock, seconds: float):
        super().__init__(boards, rank, KEY)
        self.clock, self.seconds = clock, seconds

    def run(self, task, sync):
        self.clock.advance(self.seconds)
        return super().run(task, sync)


def test_auto_overlap_picks_the_same_tau_on_every_worker_from_the_slowest_workers_last_sync():
    """Three workers whose inner steps take 1, 2 and 4 s and whose syncs take 5 s (their own clocks):
    every sync's tau is the same on every worker (the same apply step, so their global weights stay
    bit-identical), the first is 1, and each later one is the smallest that covers the fragment's
    previous sync on its slowest worker (in that worker's steps), with the margin, up to the maximum."""
    from muloco.diloco.plan import AUTO_MARGIN
    config = MuLoCoConfig(workers=3, sync_interval=8, streaming=StreamingConfig(fragments=2, overlap_steps="auto",
                                                                                max_overlap_steps=6))
    boards = (Board(3), Board(3))
    clocks = [FakeClock() for _ in range(3)]
    step_seconds = [1.0, 2.0, 4.0]
    workers = [Worker(r, 3, config, SlowStatic(boards, r, clocks[r], 5.0), clock=clocks[r]) for r in range(3)]
    records: list[list[dict]] = [[] for _ in workers]
    for w, mine in zip(workers, records):
        w.loop._log = mine.append  # every worker's records (only worker 0 logs)

    def step(r: int, n: int) -> None:
        clocks[r].advance(step_seconds[r])
        workers[r].train(n)
    for n in range(1, 41):
        run_ranks(3, lambda r: step(r, n))
        assert len({tuple((e.apply_at, e.task.fragment) for e in w.loop.pending) for w in workers}) == 1, n
    for w in workers:
        w.loop.finish()
    assert len(checksums(workers)) == 1
    by_sync = [{r["step"]: r for r in mine} for mine in records]  # by launch step (two in flight share an outer step)
    synced = sorted(by_sync[0])
    assert len(synced) >= 6 and all(set(b) == set(synced) for b in by_sync)
    last_needed: dict[int, float] = {}
    for n in synced:
        same = {b[n]["overlap_steps"] for b in by_sync}
        assert len(same) == 1, (n, same)
        fragment = by_sync[0][n]["fragment"]
        expected = 1 if fragment not in last_needed else min(6, math.ceil(AUTO_MARGIN * last_needed[fragment]))
        assert same == {max(1, expected)}, (n, same, last_needed)
        # What the next one is decided from: every worker reduced the slowest's sync in its own steps.
        needed = {b[n]["overlap_needed"] for b in by_sync}
        assert needed == {max(b[n]["sync_seconds"] / b[n]["step_seconds"] for b in by_sync)}
        last_needed[fragment] = needed.pop()
    assert max(last_needed.values()) >= 5.0  # the fast worker's sync spans five of its steps
    # A checkpoint carries what the next taus are decided from: a resumed loop picks the same ones.
    resumed = Worker(0, 3, config, SlowStatic((Board(3), Board(3)), 0, FakeClock(), 5.0))
    resumed.trainer.step = workers[0].trainer.step  # as the trainer's resume restores it before the outer state
    resumed.loop.load_state_dict(workers[0].loop.state_dict())
    assert [resumed.loop._overlap(f) for f in range(2)] == [workers[0].loop._overlap(f) for f in range(2)] != [1, 1]
