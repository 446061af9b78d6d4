"""K workers of the real outer loop (muloco/diloco/outer_loop.py) in one process, for the in-process
outer-loop tests: each a `Worker` (its parameters, a trainer or DeepSpeed-engine stand-in as the host,
the real OuterLoop) on fake wires (tests/fake_wire.py), under the real StaticMembership session or the
real elastic QuorumMembership over a fake torchft quorum; the drivers that step them, the checksums
that compare them, and the doubles of time and of a quorum that forms without a member."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
from fake_wire import Board, FakeQuorum, FakeStatic, FakeWire, run_ranks
from job_keys import KEY

from muloco.core.topology import ParallelSizes, RankCoordinates, Topology
from muloco.diloco.auth import JobKey
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.elastic_config import ElasticConfig
from muloco.diloco.outer_loop import OuterLoop
from muloco.elastic.membership import QuorumMembership
from muloco.hook.attach import EngineHost
from trainer.outer_host import TrainerHost, megatron_tensors

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


def steps(workers: list[Worker], first: int, last: int) -> None:
    """Inner steps first..last on every worker (each runs the hook: syncs launch and land)."""
    for step in range(first, last + 1):
        run_ranks(len(workers), lambda r: workers[r].train(step))
    for w in workers:
        w.loop.flush_metrics()


def global_by_name(worker: Worker) -> dict[str, torch.Tensor]:
    return {worker.loop.tensors[i].name: w.clone() for i, w in worker.loop.state.global_weights.items()}


class FakeTime:
    """A worker's clock and sleep: sleeping moves the clock at once, and is recorded."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


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
