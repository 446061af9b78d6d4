"""How an elastic worker asks the lighthouse for its quorums (muloco/elastic/membership.py), in process,
on the workers of tests/outer_workers.py with fake time: one inner step ahead of each sync; again, with
backoff and a line each, when it gets none or one smaller than muloco.elastic.min_workers; alone at the
start only when min_workers allows it (and saying so); and one clear error once quorum_timeout_s is
spent."""
from __future__ import annotations

import pytest
from fake_wire import Board, FakeQuorum
from outer_workers import FakeTime, Worker, checksums, elastic_config, quorum_worker, steps, sync_all

from muloco.diloco.auth import JobKey
from muloco.diloco.config import MuLoCoConfig, StreamingConfig
from muloco.diloco.elastic_config import ElasticConfig
from muloco.diloco.wire import CollectiveError
from muloco.elastic.quorum import NoQuorum


def test_a_worker_alone_at_the_start_stops_with_one_line_naming_the_lighthouse(capsys):
    """Its peers never come (two workers on one host, one died): it waits quorum_timeout_s for them,
    asking every second, then stops with one line, instead of training alone at K_eff = 1."""
    config = elastic_config(elastic=ElasticConfig(lighthouse="http://x:1", quorum_timeout_s=30))
    clock = FakeTime()
    worker = quorum_worker(0, Board(1), config, clock=clock.clock, sleep=clock.sleep)
    with pytest.raises(CollectiveError) as stopped:
        with worker.loop.attached(worker.loop.host):
            pass
    assert str(stopped.value) == (
        "worker 0: no quorum from the lighthouse at http://x:1 in 30 s of asking (31 requests): its last quorum held "
        "1 of 3 workers, fewer than muloco.elastic.min_workers = 2 (its default, min(2, K))")
    assert capsys.readouterr().out.splitlines() == [
        "worker 0: elastic, lighthouse http://x:1: waits up to 30 s for all 3 workers at the start, and syncs only in "
        "quorums of at least muloco.elastic.min_workers = 2 (its default, min(2, K))"]
    assert not worker.records


def test_a_worker_that_min_workers_lets_train_alone_says_so_first_and_in_every_record(capsys):
    config = elastic_config(elastic=ElasticConfig(lighthouse="http://x:1", quorum_timeout_s=30, min_workers=1))
    clock = FakeTime()
    worker = quorum_worker(0, Board(1), config, clock=clock.clock, sleep=clock.sleep)
    worker.loop.host.last_step = 8
    with worker.loop.attached(worker.loop.host):
        for step in range(1, 9):
            worker.train(step)
    assert clock.now == 30  # it waited for its peers first
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("worker 0: elastic, lighthouse http://x:1: ") and lines[0].endswith(
        "at least muloco.elastic.min_workers = 1 (1: it may train alone)")
    assert lines[1] == ("worker 0: starting with 1 of 3 workers [0] after 30 s of waiting (missing [1, 2]): training "
                        "alone, as muloco.elastic.min_workers = 1 allows")
    assert [(r["outer_step"], r["alone"], r["missing"]) for r in worker.records] == [(1, True, [1, 2]), (2, True, [1, 2])]


class AloneFromOuterStep2(FakeQuorum):
    """Worker 0's quorums from outer step 2 on hold it alone (its peer died)."""

    def __init__(self, board: Board, rank: int, key: JobKey | None, wire=None):
        super().__init__(board, rank, key, wire=wire)
        self.alone = Board(1)

    def start(self) -> None:
        if self.committed_syncs >= 1:
            self.board = self.alone
        super().start()


def test_a_quorum_smaller_than_min_workers_is_asked_again_with_backoff_then_the_worker_stops(capsys):
    config = elastic_config(workers=2, elastic=ElasticConfig(lighthouse="http://x:1", quorum_timeout_s=20))
    clock = FakeTime()
    board = Board(2)
    workers = [quorum_worker(r, board, config, quorum=AloneFromOuterStep2, clock=clock.clock, sleep=clock.sleep)
               for r in range(2)]
    sync_all(workers, 4)
    with pytest.raises(CollectiveError, match=r"^worker 0: no quorum from the lighthouse at http://x:1 in 20 s of "
                                              r"asking \(6 requests\): its last quorum held 1 of 2 workers, fewer "
                                              r"than muloco.elastic.min_workers = 2"):
        sync_all(workers[:1], 8)
    assert clock.slept == [1.0, 2.0, 4.0, 8.0, 5.0]
    lines = [line for line in capsys.readouterr().out.splitlines() if "no quorum" in line]
    assert lines[0] == ("worker 0: no quorum from the lighthouse at http://x:1: its last quorum held 1 of 2 workers, "
                        "fewer than muloco.elastic.min_workers = 2 (its default, min(2, K)); asking again in 1 s "
                        "(gives up in 20 s)")
    assert [r["outer_step"] for r in workers[0].records] == [1]  # no sync alone


def test_min_workers_above_the_workers_is_one_config_error():
    from muloco.core.errors import ConfigError
    from muloco.core.typed_json import load
    with pytest.raises(ConfigError, match=r"muloco.elastic.min_workers \(4\) cannot exceed workers \(3\)"):
        load(MuLoCoConfig, {"workers": 3, "elastic": {"lighthouse": "http://x:1", "min_workers": 4}, "auth": "none"},
             "muloco")


class CountedQuorum(FakeQuorum):
    """Counts this member's quorum requests."""
    asked = 0

    def start(self) -> None:
        self.asked += 1
        super().start()


class LighthouseFails(CountedQuorum):
    """This member's first `failures` requests get no quorum (the lighthouse unreachable, or its
    transport failing: what QuorumGroup.start raises then), later ones do."""
    failures = 1

    def start(self) -> None:
        if self.asked < self.failures:
            self.asked += 1
            raise NoQuorum("no answer within 60 s (torchft's log says why)")
        super().start()


def idle(workers: list[Worker]) -> None:
    """Wait until every worker's background thread has run what was submitted to it."""
    for w in workers:
        w.loop.background.submit(lambda: None).result()


@pytest.mark.parametrize("tau", [0, 1])
def test_each_sync_asks_for_its_quorum_one_inner_step_ahead_and_uses_it(tau):
    """The lighthouse's round trip overlaps the inner step before a sync: the request is made after
    step H-1's hook, and the sync after step H makes none of its own."""
    config = elastic_config(streaming=StreamingConfig(overlap_steps=tau))
    board = Board(3)
    workers = [quorum_worker(r, board, config, quorum=CountedQuorum) for r in range(3)]
    asked = lambda: [w.loop.membership.quorum.asked for w in workers]  # noqa: E731
    steps(workers, 1, 2)
    idle(workers)
    assert asked() == [0, 0, 0]
    steps(workers, 3, 3)
    idle(workers)
    assert asked() == [1, 1, 1]  # during inner step 4
    steps(workers, 4, 4 + tau)
    idle(workers)
    assert asked() == [1, 1, 1]
    assert all(w.records[-1]["outer_step"] == 1 and w.records[-1]["attempts"] == 1 for w in workers)
    assert len(checksums(workers)) == 1


def test_a_quorum_asked_for_ahead_that_failed_is_asked_for_again_at_the_sync():
    config = elastic_config()
    board = Board(3)
    times = [FakeTime() for _ in range(3)]
    workers = [quorum_worker(r, board, config, quorum=LighthouseFails, clock=t.clock, sleep=t.sleep) for r, t in
               enumerate(times)]
    steps(workers, 1, 8)
    for w, t in zip(workers, times):
        assert [(r["outer_step"], r["attempts"]) for r in w.records] == [(1, 1), (2, 1)]  # no quorum: no attempt
        assert w.loop.membership.quorum.asked == 3 and t.slept == [1.0]
    assert len(checksums(workers)) == 1


class LighthouseFailsFiveTimes(LighthouseFails):
    failures = 5  # more than max_attempts


def test_a_worker_the_lighthouse_gives_no_quorum_asks_again_with_backoff_and_says_so(capsys):
    """Worker 2's first five requests get no quorum: it asks again after 1, 2, 4, 8 and 15 s (its
    clock), one line each, and no attempt is counted. The sync then commits as every member's first
    attempt, and their global weights are bit-identical, and those of the same run without failures."""
    config = elastic_config()
    runs = {}
    for failing in (FakeQuorum, LighthouseFailsFiveTimes):
        board = Board(3)
        time_2 = FakeTime()
        workers = [quorum_worker(r, board, config, quorum=failing if r == 2 else FakeQuorum, clock=time_2.clock,
                                 sleep=time_2.sleep) for r in range(3)]
        sync_all(workers, 4)
        sync_all(workers, 8)
        assert all([(r["outer_step"], r["attempts"]) for r in w.records] == [(1, 1), (2, 1)] for w in workers)
        assert len(checksums(workers)) == 1
        runs[failing] = checksums(workers)
    assert runs[FakeQuorum] == runs[LighthouseFailsFiveTimes]
    assert time_2.slept == [1.0, 2.0, 4.0, 8.0, 15.0]
    lines = [line for line in capsys.readouterr().out.splitlines() if "no quorum" in line]
    assert lines[0] == ("worker 2: no quorum from the lighthouse at http://x:1: no answer within 60 s (torchft's "
                        "log says why); asking again in 1 s (gives up in 600 s)")
    assert len(lines) == 5 and all(line.startswith("worker 2: ") for line in lines)
    assert lines[-1].endswith("asking again in 15 s (gives up in 585 s)")


class LighthouseGone(FakeQuorum):
    def start(self) -> None:
        raise NoQuorum("no answer within 60 s (torchft's log says why)")


def test_a_worker_the_lighthouse_never_answers_stops_after_quorum_timeout_s_with_one_error(capsys):
    config = elastic_config(elastic=ElasticConfig(lighthouse="http://x:1", quorum_timeout_s=100))
    times = [FakeTime() for _ in range(3)]
    board = Board(3)
    workers = [quorum_worker(r, board, config, quorum=LighthouseGone, clock=t.clock, sleep=t.sleep) for r, t in
               enumerate(times)]
    with pytest.raises(CollectiveError, match=r"^worker 0: no quorum from the lighthouse at http://x:1 in 100 s of "
                                              r"asking \(11 requests\): no answer within 60 s"):
        sync_all(workers, 4)
    assert times[0].slept == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0, 15.0, 15.0, 10.0] and times[0].now == 100
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("worker 0: no quorum")]) == 10
