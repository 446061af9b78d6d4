"""The outer loop's snapshot (muloco/diloco/snapshot.py): one form for checkpoints and for an elastic
member's catch-up, every field of a crafted one checked before anything is loaded, and another job's,
worker's, rank's, layout's, plan's or step's refused with one line. In process: the workers of
tests/outer_workers.py on the fake outer link."""
from __future__ import annotations

import re

import pytest
import torch

from fake_wire import Board, FakeStatic, run_ranks
from job_keys import KEY
from outer_workers import Worker
from muloco.core.errors import CheckpointError
from muloco.core.rank_file import state_from_bytes, state_to_bytes
from muloco.core.topology import ParallelSizes, RankCoordinates, Topology
from muloco.diloco.auth import JobKey
from muloco.diloco import loop_snapshot
from muloco.diloco.config import MuLoCoConfig, StreamingConfig
from muloco.diloco.snapshot import (CATCH_UP, CHECKPOINT, SnapshotError, read_rank_snapshot, save_rank_snapshot,
                                    snapshot_file)
from muloco.diloco.sync import SyncTask

# 4-bit + EF, F=2 fragments overlapped with one inner step: error feedback and a sync in flight to save.
CONFIG = MuLoCoConfig(workers=2, sync_interval=4, streaming=StreamingConfig(fragments=2, overlap_steps=1),
                      compression={"method": "statistical", "bits": 4, "error_feedback": True})


def trained(steps: int, config: MuLoCoConfig = CONFIG, key: JobKey = KEY) -> list[Worker]:
    boards = (Board(2), Board(2))
    workers = [Worker(r, 2, config, FakeStatic(boards, r, key)) for r in range(2)]
    for step in range(1, steps + 1):
        run_ranks(2, lambda r: workers[r].train(step))
    return workers


def roundtrip(tree: dict) -> dict:
    return state_from_bytes(state_to_bytes(tree), "x")


def test_a_checkpoint_snapshot_holds_everything_a_resume_needs_and_reads_back_exactly():
    worker = trained(6)[0]  # fragment 1 (offset 4) launched at step 4 and applied at 5; fragment 0 (offset 2) at 6
    loop = worker.loop
    assert loop.pending and loop_snapshot.error_feedback_state(loop)  # a sync in flight, residuals kept
    tree = roundtrip(loop.state_dict())
    snapshot = loop.read_snapshot(tree, CHECKPOINT, "x")
    assert snapshot.step == 6 and snapshot.outer_step == loop.state.outer_step
    assert [(e.fragment, e.launched_at, e.apply_at) for e in snapshot.in_flight] == [(0, 6, 7)]
    for name, i in loop.state.names().items():
        assert torch.equal(snapshot.global_weights[name], loop.state.global_weights[i])
        assert torch.equal(snapshot.momentum[name], loop.state.momentum[i])
    assert snapshot.error_feedback.keys() == loop_snapshot.error_feedback_state(loop).keys()
    assert snapshot.identity == loop_snapshot.identity(loop) and snapshot.identity.job_key == KEY.snapshot_tag()


def test_a_resumed_loop_continues_as_the_uninterrupted_one():
    """Both workers save at step 6 with a sync in flight, fresh loops load, and all go on to step 12:
    the resumed workers' global weights equal the uninterrupted ones' bit for bit."""
    uninterrupted = trained(12)
    saved = [roundtrip(w.loop.state_dict()) for w in trained(6)]
    boards = (Board(2), Board(2))
    resumed = [Worker(r, 2, CONFIG, FakeStatic(boards, r, KEY)) for r in range(2)]
    for worker, ref in zip(resumed, trained(6)):  # the local weights and step as the model's checkpoint has them
        with torch.no_grad():
            for p, q in zip(worker.params, ref.params):
                p.copy_(q)
        worker.trainer.step = 6
    run_ranks(2, lambda r: resumed[r].loop.load_state_dict(saved[r]))  # replays the sync in flight
    for step in range(7, 13):
        run_ranks(2, lambda r: resumed[r].train(step))
    for a, b in zip(resumed, uninterrupted):
        assert a.loop.state.checksum() == b.loop.state.checksum()
        assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))


CRAFTED = [
    (lambda s: s["global_weights"].update({next(iter(s["global_weights"])): torch.zeros(5)}), r"is not a torch.float32"),
    (lambda s: s["momentum"].update(extra=torch.zeros(1)), "momentum holds other parameters"),
    (lambda s: s.update(outer_step="3"), "outer_step '3' is not a count"),
    (lambda s: s.pop("in_flight"), "its keys are"),
    (lambda s: s.update(format="muloco-outer-snapshot-0"), "its format is"),
    (lambda s: s.update(kind="both"), "kind 'both'"),
    (lambda s: s["in_flight"][0].update(fragment=3), r"in_flight\[0\].fragment 3 is not a fragment"),
    (lambda s: s["in_flight"][0].update(deltas=[torch.zeros(2)]), r"in_flight\[0\].deltas are not fp32 buckets"),
    (lambda s: s["in_flight"][0].update(apply_at=1), "apply_at >= launched_at"),
    (lambda s: s["identity"].update(layout=[2, 1, 1]), "layout"),
    (lambda s: s.update(pace_deadline_s=-1.0), "pace_deadline_s -1.0"),
    (lambda s: s.update(joins={"fragment": 0, "step": 4, "outer_step": 1, "scheduler": None}),
     "a checkpoint names a sync to join"),
]


@pytest.mark.parametrize("change, message", CRAFTED)
def test_a_crafted_checkpoint_snapshot_is_refused_before_anything_is_loaded(change, message):
    loop = trained(6)[0].loop
    before = loop.state.checksum()
    tree = roundtrip(loop.state_dict())
    change(tree)
    with pytest.raises(SnapshotError, match=message):
        loop.load_state_dict(tree)
    assert loop.state.checksum() == before
    loop.load_state_dict(roundtrip(loop.state_dict()))  # the honest one passes


def catch_up_tree(loop) -> dict:
    return roundtrip(loop.snapshot(CATCH_UP, joins=SyncTask(0, 6, 3, None)).to_tree())


@pytest.mark.parametrize("change, message", [
    (lambda s: s["joins"].update(step=-5), "sync to join has steps that are not counts"),
    (lambda s: s["joins"].update(fragment=3), "joins.fragment 3 is not a fragment"),
    (lambda s: s["joins"].update(scheduler={"x": 1}), "lr schedule"),
    (lambda s: s.update(joins=None), "sync to join is not a record"),
    (lambda s: s["error_feedback"].update(w=torch.zeros(1)), "carries its own error feedback"),
    (lambda s: s["in_flight"].append({"fragment": 0, "launched_at": 2, "apply_at": 3, "outer_step": 1, "deltas": [],
                                      "averages": [torch.zeros(2)]}), r"in_flight\[0\].averages are not fp32 buckets"),
])
def test_a_crafted_catch_up_is_refused_before_anything_is_loaded(change, message):
    peer, member = (w.loop for w in trained(5))
    tree = catch_up_tree(peer)
    change(tree)
    with pytest.raises(SnapshotError, match=message):
        member.read_snapshot(tree, CATCH_UP, "the state from quorum member 0")
    member.read_snapshot(catch_up_tree(peer), CATCH_UP, "x")  # a peer's honest state: another worker's, accepted


def test_a_snapshot_of_another_rank_job_layout_plan_or_step_is_refused_in_one_line():
    workers = trained(6)
    mine, other = workers[0].loop, workers[1].loop
    with pytest.raises(SnapshotError, match=r"worker 1's, rank 1's, not this rank's \(worker 0, rank 0\)"):
        mine.load_state_dict(roundtrip(other.state_dict()))
    with pytest.raises(SnapshotError, match="it is of another job .*another job secret"):
        mine.load_state_dict(roundtrip(trained(6, key=JobKey(b"x" * 32, "test-job"))[0].loop.state_dict()))
    wider = Worker(0, 3, MuLoCoConfig(**{**CONFIG.__dict__, "workers": 3}), FakeStatic((Board(3), Board(3)), 0, KEY),
                   Topology(ParallelSizes(3, 1, 1, 1), 0, RankCoordinates(0, 0, 0, 0), None, None))
    wider.trainer.step = 6
    with pytest.raises(SnapshotError, match=r"written at K x D x P x T = 2 x 1 x 1 x 1, this run is 3 x 1 x 1 x 1"):
        wider.loop.load_state_dict(roundtrip(mine.state_dict()))
    one_fragment = trained(6, MuLoCoConfig(**{**CONFIG.__dict__, "streaming": StreamingConfig()}))[0].loop
    with pytest.raises(SnapshotError, match=r"in_flight\[0\].deltas are not fp32 buckets"):  # its form, first
        one_fragment.read_snapshot(roundtrip(mine.state_dict()), CHECKPOINT, "x")
    tree = roundtrip(mine.state_dict())
    tree["identity"]["plan"] = "0" * 64  # another model's plan with tensors of this one's shapes
    with pytest.raises(SnapshotError, match="its plan .* is not this run's"):
        mine.read_snapshot(tree, CHECKPOINT, "x")
    workers[0].trainer.step = 7
    with pytest.raises(SnapshotError, match="taken at inner step 6, but the run is at step 7"):
        mine.load_state_dict(roundtrip(mine.state_dict() | {"step": 6}))


def test_a_snapshot_file_is_checksummed_and_a_damaged_or_missing_one_is_named(tmp_path):
    loop = trained(6)[0].loop
    path = save_rank_snapshot(tmp_path, loop.snapshot(CHECKPOINT))
    assert path == snapshot_file(tmp_path, 0) and path.with_name(path.name + ".sha256").is_file()
    assert loop.read_snapshot(read_rank_snapshot(tmp_path, 0), CHECKPOINT, "x").outer_step == loop.state.outer_step
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is damaged")):
        read_rank_snapshot(tmp_path, 0)
    with pytest.raises(CheckpointError, match="rank_00001.safetensors does not exist"):
        read_rank_snapshot(tmp_path, 1)
    path.with_name(path.name + ".sha256").write_text("not a digest\n")
    with pytest.raises(CheckpointError, match="does not hold a SHA-256"):
        read_rank_snapshot(tmp_path, 0)
