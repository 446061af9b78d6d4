"""An elastic member that is behind its peers catches up (muloco/elastic/membership.py), in process, on the
workers of tests/outer_workers.py: a restarted worker at whichever sync its peers are at, a member whose
weights drifted, a live member that missed a whole sync, one that missed the grace window (its late
contribution dropped: the same weights as a run without it), and none in a quorum too small to sync.
After each, every member's global weights are bit-identical."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from fake_wire import Board, FakeQuorum, FakeWire, RateLimitedWire, run_ranks
from outer_workers import FakeTime, PairAt, Worker, checksums, elastic_config, quorum_worker, steps, sync_all

from muloco.diloco.auth import JobKey
from muloco.diloco.config import MuLoCoConfig, StreamingConfig
from muloco.diloco.elastic_config import ElasticConfig
from muloco.diloco.link import SlowLink
from muloco.diloco.sync import SyncTask
from muloco.diloco.wire import CollectiveError
from muloco.elastic.membership import DIVERGED, MAX_CATCH_UP_PIECES, _piece_bytes


@pytest.mark.parametrize("fragments, tau, host", [(1, 0, "trainer"), (2, 1, "trainer"), (2, 1, "deepspeed")])
def test_a_restarted_worker_catches_up_at_whichever_sync_its_peers_are_at(fragments, tau, host):
    """Worker 2 restarts (fresh weights, no committed syncs) while its peers are at a sync of some
    fragment, possibly with another fragment's sync still in flight: it receives their state first,
    takes part in that sync without contributing, and from then on every member's global weights are
    bit-identical. The same through the DeepSpeed hook's host: the engine's step and lr schedule move."""
    # (No final sync: worker 2's last step below is where it dies, not the run's end.)
    config = elastic_config(streaming=StreamingConfig(fragments=fragments, overlap_steps=tau), final_sync=False)
    board = Board(3)
    workers = [quorum_worker(r, board, config, host=host) for r in range(3)]
    # Worker 2 dies after step 9's sync landed, before it asks for the quorum of a sync at step 10 (a
    # member that dies after asking is in that quorum: the exchange fails and is retried, see test_elastic).
    workers[2].loop.host.last_step = 9
    steps(workers, 1, 9)
    workers[2].loop.close()
    restarted = quorum_worker(2, board, config, host=host)  # its outer state is the initial one: committed 0
    syncing = next(s for s in range(10, 20) if any(s % 4 == o for o in restarted.loop.offsets))
    steps(workers[:2], 10, syncing - 1) if syncing > 10 else None
    workers[2] = restarted

    def rank(r):
        if r < 2:
            workers[r].train(syncing)
            return
        # QuorumMembership.join without torchft: a sync of fragment 0 from the start, whichever the peers are at
        loop = restarted.loop
        loop.joining = True
        task = SyncTask(0, 0, loop.state.outer_step + 1, restarted.trainer.engine.lr_scheduler.state_dict())
        result = loop.sync(task, loop.zero_deltas(0))
        loop.apply(result, overlapped=False)
    run_ranks(3, rank)
    assert restarted.loop.host.inner_step() == syncing
    assert restarted.engine.lr_scheduler.last_epoch == workers[0].engine.lr_scheduler.last_epoch
    steps(workers, syncing + 1, syncing + 12)
    assert not any(w.loop.pending for w in workers) or tau
    joined = next(r for r in restarted.records if r.get("rejoined"))
    assert joined["left_out"] == {"2": "joining"} and joined["step"] == syncing
    assert joined["fragment"] == restarted.loop.offsets.index(syncing % 4)
    assert len(checksums(workers)) == 1
    assert workers[0].records[-1]["workers_in_sync"] == 3 and not workers[0].records[-1]["left_out"]


def _restarted_after_step_8(config: MuLoCoConfig, wires: list) -> list[Worker]:
    """Three workers (worker r on `wires[r]`) to step 8's sync; worker 2 dies there and is restarted
    (its outer state the initial one: committed 0) while its peers go on to step 11."""
    board = Board(3)
    workers = [quorum_worker(r, board, config, wire=wires[r]) for r in range(3)]
    workers[2].loop.host.last_step = 8
    steps(workers, 1, 8)
    workers[2].loop.close()
    workers[2] = quorum_worker(2, board, config, wire=wires[2])
    steps(workers[:2], 9, 11)
    return workers


def _rejoin_at_step_12(workers: list[Worker]) -> None:
    """Workers 0 and 1 sync at step 12; the restarted worker 2 joins that sync (QuorumMembership.join
    without torchft)."""
    def rank(r):
        if r < 2:
            workers[r].train(12)
            return
        loop = workers[2].loop
        loop.joining = True
        result = loop.sync(SyncTask(0, 0, loop.state.outer_step + 1, None), loop.zero_deltas(0))
        loop.apply(result, overlapped=False)
    run_ranks(3, rank)


def test_a_restarted_worker_catches_up_over_a_link_too_slow_to_move_its_state_within_the_sync_timeout():
    """Each op of the quorum's group times out after sync_timeout_s (10 s); the link moves 100 bytes a
    second: a sync's largest part (~550 bytes, 5.5 s) crosses in time, the outer state a restarted worker
    needs (weights, momentum and the sync it joins: ~2.8 kB, 28 s) does not. Sent in one op, its catch-up
    timed out on every attempt, for its peers too, and the run stopped; in pieces no larger than the parts
    the link moved in the syncs before, it catches up at the first attempt and every member ends
    bit-identical."""
    config = elastic_config(sync_timeout_s=10.0, final_sync=False)
    link = SlowLink(bandwidth_gbit_s=800e-9)  # 100 bytes a second
    wire = partial(RateLimitedWire, link=link, timeout_s=config.sync_timeout_s)
    workers = _restarted_after_step_8(config, [wire] * 3)
    _rejoin_at_step_12(workers)
    steps(workers, 13, 16)
    joined = next(r for r in workers[2].records if r.get("rejoined"))
    assert (joined["outer_step"], joined["attempts"], joined["left_out"]) == (3, 1, {"2": "joining"})
    assert len(checksums(workers)) == 1 and workers[0].records[-1]["workers_in_sync"] == 3


def test_a_piece_of_a_catch_up_that_fails_its_tag_fails_the_attempt_on_every_member_at_once(capsys):
    """Worker 0 sends the state; one of its pieces to worker 2 is altered on the way. Every member learns
    it from the progress gathered after that piece and fails the attempt there, with the same line: none
    waits out a timeout for a member that stopped."""
    config = elastic_config(final_sync=False, elastic=ElasticConfig(lighthouse="http://x:1", max_attempts=1))

    def flip(op: str, sequence: int, data: torch.Tensor) -> torch.Tensor:
        if op == "all_to_all":
            data[-1] ^= 1  # the tag of the last block: the piece to worker 2
        return data
    workers = _restarted_after_step_8(config, [partial(FakeWire, tamper=flip), FakeWire, FakeWire])
    with pytest.raises(CollectiveError, match="outer sync failed 1 times in a row"):
        _rejoin_at_step_12(workers)
    out = capsys.readouterr().out
    for k in range(3):
        assert (f"worker {k}: outer sync attempt 1 failed: the state from quorum member 0 failed authentication at "
                f"quorum member(s) [2] (bytes 0-") in out, out


def test_a_member_whose_weights_drifted_is_left_out_and_caught_up_at_its_next_sync():
    config = elastic_config()
    board = Board(3)
    workers = [quorum_worker(r, board, config) for r in range(3)]
    sync_all(workers, 4)
    with torch.no_grad():  # worker 1 committed a sync the others did not see
        next(iter(workers[1].loop.state.global_weights.values())).add_(1e-3)
    sync_all(workers, 8)
    assert all(w.records[-1]["left_out"] == {"1": DIVERGED} for w in workers)
    sync_all(workers, 12)
    assert len(checksums(workers)) == 1
    assert workers[1].records[-1]["rejoined"] and workers[0].records[-1]["left_out"] == {"1": "joining"}
    sync_all(workers, 16)
    assert workers[0].records[-1]["workers_in_sync"] == 3 and len(checksums(workers)) == 1


class AloneForOuterStep3(FakeQuorum):
    """Worker 1's quorum for outer step 3 forms without worker 0 (it came later than the lighthouse's
    join timeout); every other quorum is the shared board's."""

    def __init__(self, board: Board, rank: int, key: JobKey | None, wire=None):
        super().__init__(board, rank, key, wire=wire)
        self.shared, self.alone, self.member = board, Board(1), rank

    def start(self) -> None:
        alone = self.committed_syncs == 2
        self.board, self.rank = (self.alone, 0) if alone else (self.shared, self.member)  # its place in the quorum
        super().start()


def test_a_live_member_that_missed_a_whole_sync_goes_on_from_its_peers_step():
    """F=2 fragments of H=4, tau=1: fragment 0 launches after steps 2, 6, 10, ..., fragment 1 after 4,
    8, 12. Worker 1 syncs outer step 3 (fragment 0, step 6) alone; worker 0, still at its step-6 sync,
    meets it at outer step 4 (fragment 1, step 8), catches up and takes part. It must go on from its
    peers' step: on its own (step 7) it would launch fragment 1 where its peer launches fragment 0,
    payloads of different sizes in one collective (gloo aborts the process). (min_workers 1: worker 1
    may sync alone.)"""
    config = MuLoCoConfig(workers=2, sync_interval=4, elastic=ElasticConfig(lighthouse="http://x:1", min_workers=1),
                          streaming=StreamingConfig(fragments=2, overlap_steps=1))
    board = Board(2)
    workers = [quorum_worker(0, board, config), quorum_worker(1, board, config, quorum=AloneForOuterStep3)]
    steps(workers, 1, 5)
    run_ranks(2, lambda r: [workers[r].train(s) for s in ((6, 7) if r == 0 else (6, 7, 8))])
    assert workers[0].trainer.step == 8, "the caught-up member stays at its own inner step"
    run_ranks(2, lambda r: [workers[r].train(s) for s in range(workers[r].trainer.step + 1, 16)])
    for w in workers:
        w.loop.flush_metrics()
    caught_up = next(r for r in workers[0].records if r["outer_step"] == 4)
    assert (caught_up["fragment"], caught_up["rejoined"], caught_up["left_out"]) == (1, True, {"0": "joining"})
    assert [r["outer_step"] for r in workers[1].records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["outer_step"] for r in workers[0].records] == [1, 2, 4, 5, 6, 7]
    assert [r["outer_step"] for r in workers[1].records if r["alone"]] == [3]  # said in its record
    assert all(r["workers_in_sync"] == 2 and r["quorum"] == [0, 1] for r in workers[0].records[-3:])
    assert len(checksums(workers)) == 1


def late_worker_0(alone_at: tuple[int, ...]) -> list[Worker]:
    board, pair = Board(3), Board(2)
    quorum = lambda board, rank, key, wire: PairAt(board, rank, key, wire, pair, alone_at)  # noqa: E731
    return [quorum_worker(r, board, elastic_config(), quorum=quorum) for r in range(3)]


def test_a_member_that_misses_the_grace_window_is_dropped_and_goes_on_bit_identical_from_the_next_sync():
    """Outer step 2 (step 8) forms without worker 0 (it came after the grace window). Its pseudogradient
    of that interval is dropped, not folded into a later sync: at outer step 3 (its peers' step 12) it
    catches up, takes the step without contributing and goes on from their step; every member's global
    weights are bit-identical after it, and after outer step 3 they are those of a run in which worker
    0 was not there at all for outer steps 2 and 3 (its late contribution changed nothing)."""
    workers = late_worker_0(alone_at=(1,))
    steps(workers, 1, 7)
    run_ranks(3, lambda r: [workers[r].train(s) for s in ((8,) if r == 0 else range(8, 13))])
    assert workers[0].trainer.step == 12, "the late member goes on from its peers' step"
    steps(workers, 13, 16)
    step2 = [next(r for r in w.records if r["outer_step"] == 2) for w in workers[1:]]
    assert all((r["quorum"], r["missing"], r["workers_in_sync"]) == ([1, 2], [0], 2) for r in step2)
    assert [r["outer_step"] for r in workers[0].records] == [1, 3, 4]
    late = [next(r for r in w.records if r["outer_step"] == 3) for w in workers]
    assert late[0]["rejoined"] and all(r["left_out"] == {"0": "joining"} and r["workers_in_sync"] == 2 for r in late)
    assert len({r["weights_sha"] for r in late}) == 1 and len(checksums(workers)) == 1
    assert workers[0].records[-1]["workers_in_sync"] == 3

    without_0 = late_worker_0(alone_at=(1, 2))  # worker 0 stops after outer step 1
    steps(without_0, 1, 4)
    run_ranks(2, lambda r: [without_0[r + 1].train(s) for s in range(5, 13)])
    without_0[1].loop.flush_metrics()
    reference = next(r for r in without_0[1].records if r["outer_step"] == 3)
    assert reference["weights_sha"] == late[0]["weights_sha"]


def test_a_member_behind_loads_no_state_in_a_quorum_smaller_than_min_workers():
    """Worker 1 is one sync behind worker 0 in a quorum of 2 where 3 are needed: the quorum is refused
    before the catch-up, so worker 1 keeps its own state and task (once it had loaded its peer's, its
    retry in the next quorum would have exchanged its own task's payload as a member with no
    pseudogradient, at another step)."""
    config = elastic_config(elastic=ElasticConfig(lighthouse="http://x:1", quorum_timeout_s=3, min_workers=3))
    board = Board(2)
    times = [FakeTime(), FakeTime()]
    behind = lambda board, rank, key, wire: FakeQuorum(board, rank, key, committed=1 - rank, wire=wire)  # noqa: E731
    workers = [quorum_worker(r, board, config, quorum=behind, clock=times[r].clock, sleep=times[r].sleep)
               for r in range(2)]
    with pytest.raises(CollectiveError, match="its last quorum held 2 of 3 workers, fewer than"):
        sync_all(workers, 4)
    assert not workers[1].loop.joining and not workers[1].loop.membership.rejoined


def test_a_catch_up_takes_at_most_its_bound_of_pieces_and_never_more_than_a_synced_part_per_receiver():
    state = 100 << 20
    assert _piece_bytes(24, 1, state) * MAX_CATCH_UP_PIECES >= state  # only header bytes moved: the bound holds
    assert _piece_bytes(4 << 20, 2, state) == 2 << 20  # two behind: each piece is half a synced part
    assert _piece_bytes(0, 1, state) == state  # it has only ever synced alone: one piece
