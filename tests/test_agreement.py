"""What the single world's K workers must agree on (muloco/diloco/agreement.py and the sync header of
muloco/diloco/membership.py): at every sync their outer and inner step and their global weights; a
worker whose copy changed outside the outer loop, or that stands at another step, stops the run with
one line naming it instead of training on apart. In process, on the fake outer link."""
from __future__ import annotations

import math

import pytest
import torch

from fake_wire import Board, FakeStatic, run_ranks
from job_keys import KEY
from outer_workers import Worker
from muloco.core.errors import DisagreementError
from muloco.diloco.wire import CollectiveError
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import disagreement

CONFIG = MuLoCoConfig(workers=3, sync_interval=2, compression={"method": "statistical", "bits": 4,
                                                               "error_feedback": True})


def test_the_verdict_names_the_odd_worker_and_both_steps():
    assert disagreement([(2, 20, 7.0)] * 3) is None
    assert disagreement([(2, 20, math.nan)] * 2 + [(2, 20, 5.0)]) is None  # a replayed sync's digest is not known
    assert "worker 2 holds other global weights than worker 0 at outer step 2" in disagreement(
        [(2, 20, 7.0), (2, 20, 7.0), (2, 20, 8.0)])
    assert "workers 0, 2 hold other global weights than worker 1" in disagreement(
        [(2, 20, 6.0), (2, 20, 7.0), (2, 20, 8.0), (2, 20, 7.0)])
    why = disagreement([(2, 20, 7.0), (3, 30, 7.0), (2, 20, 7.0)])
    assert "worker 0 at outer step 2 (inner step 20), worker 1 at outer step 3 (inner step 30)" in why


def workers_at_step_4(key=KEY) -> list[Worker]:
    boards = (Board(3), Board(3))
    workers = [Worker(r, 3, CONFIG, FakeStatic(boards, r, key)) for r in range(3)]
    for step in range(1, 5):
        run_ranks(3, lambda r: workers[r].train(step))
    return workers


def sync_with(workers: list[Worker]) -> list:
    """Steps 5 and 6 (a sync at 6) on every worker; each worker's exception (or None)."""
    def steps(r: int):
        try:
            for step in (5, 6):
                workers[r].train(step)
        except DisagreementError as err:
            return err
        return None
    return run_ranks(3, steps)


def test_a_worker_whose_global_weights_changed_outside_the_outer_loop_stops_the_run_in_one_line():
    """A flipped bit in worker 2's copy (a checkpoint loaded without verification, say): before, the three
    workers synced on, worker 2 apart from the others for good."""
    workers = workers_at_step_4()
    weights = workers[2].loop.state.global_weights[0]
    weights.view(torch.int32).view(-1)[0] ^= 1
    errors = sync_with(workers)
    assert all(isinstance(e, DisagreementError) for e in errors), errors
    assert {str(e) for e in errors} == {"worker 2 holds other global weights than worker 0 at outer step 3: changed "
                                        "outside the outer loop (a different start, a damaged or unverified checkpoint)"}


def test_a_worker_at_another_outer_step_stops_the_run_naming_both():
    """Without a job secret the header says so; with one, the worker's messages fail their tags (the tag
    names the outer step) and the sync is skipped with the reason."""
    workers = workers_at_step_4(key=None)
    workers[1].loop.state.outer_step += 1  # resumed from another sync's checkpoint
    errors = sync_with(workers)
    assert all(isinstance(e, DisagreementError) for e in errors), errors
    assert "worker 0 at outer step 3 (inner step 6), worker 1 at outer step 4 (inner step 6)" in str(errors[0])
    workers = workers_at_step_4()
    workers[1].loop.state.outer_step += 1
    assert sync_with(workers) == [None] * 3
    with pytest.raises(CollectiveError, match="or a worker is at another outer step"):  # its metrics' verdicts
        run_ranks(3, lambda r: workers[r].loop.flush_metrics())
    assert [w.loop.state.skipped for w in workers] == [1, 1, 1]  # and the sync was not applied anywhere


def test_workers_that_agree_sync_as_before():
    workers = workers_at_step_4()
    assert sync_with(workers) == [None] * 3
    assert len({w.loop.state.checksum() for w in workers}) == 1 and workers[0].loop.state.outer_step == 3


def test_the_check_rides_in_the_sync_header_without_a_round_trip_of_its_own():
    workers = workers_at_step_4()
    sync_with(workers)
    run_ranks(3, lambda r: workers[r].loop.flush_metrics())
    assert [r["round_trips"] for r in workers[0].records] == [1, 1, 1]  # all_gather: one, as before the check


def test_a_tag_that_fails_in_the_single_world_is_said_to_be_another_syncs_message():
    from types import SimpleNamespace
    from muloco.diloco.averaging import Exchanged
    from muloco.diloco.payload_checks import AUTHENTICATION
    from muloco.diloco.membership import _StaticSession
    session = _StaticSession(SimpleNamespace(size=2), None, 2, 10.0)
    decision = session.decide(Exchanged([], [None, None], {1: AUTHENTICATION}))
    assert decision.skipped == ("worker 1: failed authentication (a message that is not this sync's: a process without "
                                "the job secret, or a worker at another outer step, resumed from another checkpoint)")
