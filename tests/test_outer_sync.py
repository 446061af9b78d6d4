"""The outer loop's one sync body (muloco/diloco/outer_loop.py) under both memberships, in process:
K workers as threads on fake wires (tests/fake_wire.py), the real OuterLoop, the real StaticMembership
session and the real elastic QuorumMembership over a fake torchft quorum. References are plain
computations: the Nesterov outer step on the average of the contributors' payloads, and every
member's global weights bit-identical after every sync."""
from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fake_wire import Board, FakeQuorum, FakeStatic, FakeWire, run_ranks
from muloco.diloco.auth import JobKey
from muloco.diloco.wire import CollectiveError
from muloco.diloco.config import CompressionConfig, MuLoCoConfig, StreamingConfig
from muloco.hook.attach import EngineHost
from muloco.diloco.outer_loop import OuterLoop
from muloco.diloco.sync import SyncTask
from muloco.diloco.elastic_config import ElasticConfig
from muloco.elastic.membership import DIVERGED, QuorumMembership
from muloco.elastic.quorum import NoQuorum
from trainer.outer_host import TrainerHost, megatron_tensors
from muloco.core.topology import ParallelSizes, RankCoordinates, Topology

KEY = JobKey(b"k" * 32, "test-job")
SHAPES = {"decoder.layers.0.mlp.linear_fc1.weight": (8, 6), "decoder.layers.0.mlp.linear_fc2.weight": (6, 4),
          "decoder.layers.1.self_attention.linear_qkv.weight": (6, 6), "decoder.layers.1.input_layernorm.weight": (6,)}
NUM_LAYERS = 2


class Worker:
    """One worker's parameters, trainer stand-in and outer loop."""

    def __init__(self, rank: int, workers: int, config: MuLoCoConfig, membership, topology: Topology | None = None,
                 host: str = "trainer", clock=time.perf_counter):
        generator = torch.Generator().manual_seed(0)  # every worker starts from the same weights
        self.params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES.values()]
        optimizer = torch.optim.SGD(self.params, lr=0.1)
        engine = SimpleNamespace(lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)),
                                 optimizer=optimizer, set_step=lambda step: None)
        self.trainer = SimpleNamespace(step=0, engine=engine, config=SimpleNamespace(schedule=SimpleNamespace(
            train_iters=None)))
        topology = topology or Topology(ParallelSizes(workers, 1, 1, 1), rank, RankCoordinates(rank, 0, 0, 0), None, None)
        names = list(SHAPES)
        tensors = megatron_tensors(list(zip(names, self.params)), {n: n for n in names}, 0, NUM_LAYERS,
                                   config.streaming.fragments)
        self.loop = OuterLoop(config, tensors, topology, log=lambda record, step: self.records.append(record),
                              membership=membership, key=getattr(membership, "key", None), clock=clock)
        # The host the loop is attached to: this project's trainer, or a DeepSpeed engine (its counters and
        # lr schedule; stage 0 with SGD has no master partitions to refresh).
        self.engine = SimpleNamespace(global_steps=0, lr_scheduler=engine.lr_scheduler, optimizer=optimizer,
                                      train_batch_size=lambda: 4, zero_optimization_stage=lambda: 0)
        self.loop.host = TrainerHost(self.trainer) if host == "trainer" else EngineHost(self.engine, None)
        self.records: list[dict] = []

    def train(self, step: int, scale: float = 1.0) -> None:
        """Some inner steps' worth of change, different on every worker and step; then the hook."""
        generator = torch.Generator().manual_seed(1000 * step + self.loop.topology.rank)
        with torch.no_grad():
            for p in self.params:
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.01 * scale)
        self.trainer.step = self.engine.global_steps = step
        self.loop.after_inner_step(step)


def static_workers(workers: int, config: MuLoCoConfig) -> list[Worker]:
    boards = (Board(workers), Board(workers))
    return [Worker(r, workers, config, FakeStatic(boards, r, KEY, config.max_norm_ratio)) for r in range(workers)]


def elastic_config(**muloco) -> MuLoCoConfig:
    return MuLoCoConfig(**{"workers": 3, "sync_interval": 4, "elastic": ElasticConfig(lighthouse="http://x:1"), **muloco})


class FakeQuorumMembership(QuorumMembership):
    """The elastic membership on the fake torchft quorum it was given (`join` included)."""

    def _connect(self):
        return self.quorum


def quorum_membership(rank: int, board: Board, config: MuLoCoConfig, wire=FakeWire, quorum=FakeQuorum,
                      clock=time.monotonic, sleep=time.sleep) -> QuorumMembership:
    """The membership of elastic worker `rank` (a world of one rank: it logs); it waits with `sleep` on `clock`."""
    topology = Topology(ParallelSizes(1, 1, 1, 1), 0, RankCoordinates(rank, 0, 0, 0), None, None)
    membership = FakeQuorumMembership(config, topology, KEY, worker=rank, clock=clock, sleep=sleep)
    membership.quorum = quorum(board, rank, KEY, wire=wire)
    return membership


def quorum_worker(rank: int, board: Board, config: MuLoCoConfig, wire=FakeWire, quorum=FakeQuorum,
                  host: str = "trainer", clock=time.monotonic, sleep=time.sleep) -> Worker:
    """An elastic worker on a fake torchft quorum (`quorum_membership`)."""
    membership = quorum_membership(rank, board, config, wire, quorum, clock, sleep)
    worker = Worker(rank, config.workers, config, membership, membership.topology, host)
    membership.loop = worker.loop
    return worker


def checksums(workers: list[Worker]) -> set[str]:
    return {w.loop.state.checksum() for w in workers}


def sync_all(workers: list[Worker], step: int, scale=lambda rank: 1.0) -> None:
    """One inner step that is a sync step (no overlap) on every worker."""
    run_ranks(len(workers), lambda r: workers[r].train(step, scale(r)))
    for w in workers:
        w.loop.flush_metrics()


def nesterov_reference(before: dict, deltas: list[dict], config: MuLoCoConfig, momentum: dict) -> dict:
    """theta <- theta - lr (avg + mu m'), m' = mu m + avg, on plain fp32 tensors."""
    out = {}
    for name in before:
        average = sum(d[name] for d in deltas) / len(deltas)
        m = config.outer_momentum * momentum[name] + average
        out[name] = before[name] - config.outer_lr * (average + config.outer_momentum * m)
    return out


def global_by_name(worker: Worker) -> dict[str, torch.Tensor]:
    return {worker.loop.tensors[i].name: w.clone() for i, w in worker.loop.state.global_weights.items()}


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


def steps(workers: list[Worker], first: int, last: int) -> None:
    """Inner steps first..last on every worker (each runs the hook: syncs launch and land)."""
    for step in range(first, last + 1):
        run_ranks(len(workers), lambda r: workers[r].train(step))
    for w in workers:
        w.loop.flush_metrics()


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


class PairAt(FakeQuorum):
    """Workers 1 and 2 meet on a board of their own (`pair`) for the syncs whose committed count is in
    `alone_at`: worker 0 asked later than the lighthouse's grace window (its join timeout) after them,
    and its request lands in their next quorum on the shared board. Every other quorum is the shared one."""

    def __init__(self, board: Board, rank: int, key: JobKey | None, wire=None, pair: Board = None,
                 alone_at: tuple[int, ...] = ()):
        super().__init__(board, rank, key, wire=wire)
        self.shared, self.pair, self.alone_at, self.member = board, pair, alone_at, rank

    def start(self) -> None:
        paired = self.member > 0 and self.committed_syncs in self.alone_at
        self.board, self.rank = (self.pair, self.member - 1) if paired else (self.shared, self.member)
        super().start()


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


def test_min_workers_above_the_workers_is_one_config_error():
    from muloco.core.errors import ConfigError
    from muloco.core.typed_json import load
    with pytest.raises(ConfigError, match=r"muloco.elastic.min_workers \(4\) cannot exceed workers \(3\)"):
        load(MuLoCoConfig, {"workers": 3, "elastic": {"lighthouse": "http://x:1", "min_workers": 4}, "auth": "none"},
             "muloco")


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


class FakeTime:
    """A worker's clock and sleep: sleeping moves the clock at once, and is recorded."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


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


class FakeClock:
    """A worker's clock that moves only when told (inner steps, and the sync's exchange)."""

    def __init__(self):
        self.now, self.lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


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
