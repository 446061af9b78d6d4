"""Wall-clock pacing and the token-weighted merge with its correction for unequal step counts
(muloco/diloco/pace.py, issue 43), in process: K workers as threads on fake wires (tests/fake_wire.py),
each on its own fake clock, the real OuterLoop, StaticMembership session and hosts. References: the
fixed-H run (bit for bit, when every worker is equal), and the documented formula computed here in
float64 from the workers' own inner steps."""
from __future__ import annotations

import re

from types import SimpleNamespace

import pytest
import torch

from fake_wire import Board, FakeStatic, run_ranks
from job_keys import KEY
from outer_workers import SHAPES, FakeClock, PairAt, Worker, checksums, global_by_name, quorum_membership
from muloco.diloco.snapshot import SnapshotError
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.elastic_config import ElasticConfig
from muloco.diloco.pace import Contribution, PaceConfig, auto_deadline
from muloco.core.errors import ConfigError
from muloco.core.typed_json import load

TOKENS_PER_STEP = 32  # 4 sequences of 8 tokens per worker and step
PEAK_LR = 0.1  # Worker's SGD; its LambdaLR makes step j (1-based) use 0.1 / j


def noise(step: int, rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES.values()]


class Paced:
    """A worker whose inner step j moves its weights by lr_j x noise(j, rank) and takes `seconds` on
    its own clock (plus its emulated slowdown's sleep, on the same clock)."""

    def __init__(self, rank: int, config: MuLoCoConfig, boards, seconds: float, host: str, last_step: int,
                 membership=None):
        """`membership`: the single world's on `boards` unless given."""
        self.clock, self.seconds = FakeClock(), seconds
        membership = membership or FakeStatic(boards, rank, KEY)
        self.worker = Worker(rank, config.workers, config, membership, getattr(membership, "topology", None), host=host,
                             clock=self.clock)
        self.worker.trainer.config = SimpleNamespace(batch=SimpleNamespace(per_worker=4),
                                                     model=SimpleNamespace(seq_length=8))
        self.loop, self.host = self.worker.loop, self.worker.loop.host
        self.loop.sleep = self.clock.advance
        self.host.last_step = last_step
        self.rank, self.taken = rank, []  # the inner steps this worker took

    def inner_step(self) -> None:
        self.clock.advance(self.seconds)
        step = self.host.inner_step() + 1
        optimizer = self.worker.trainer.engine.optimizer
        lr = optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            for p, n in zip(self.worker.params, noise(step, self.rank)):
                p.add_(n, alpha=lr)
        self.worker.trainer.engine.lr_scheduler.step()  # as the engine's step does
        self.worker.trainer.step = self.worker.engine.global_steps = step
        self.taken.append(step)
        self.loop.after_inner_step(step)

    def train(self) -> None:
        with self.loop.attached(self.host):
            while self.host.inner_step() < self.host.last_step:
                self.inner_step()


def run(config: MuLoCoConfig, seconds: list[float], last_step: int, host: str = "trainer") -> list[Paced]:
    boards = (Board(config.workers), Board(config.workers))
    workers = [Paced(r, config, boards, s, host, last_step) for r, s in enumerate(seconds)]
    run_ranks(len(workers), lambda r: workers[r].train())
    return workers


def paced_config(**muloco) -> MuLoCoConfig:
    return MuLoCoConfig(**{"workers": 3, "sync_interval": 4, "outer_momentum": 0.6,
                           "pace": PaceConfig(mode="wall_clock"), **muloco})


def test_equal_workers_with_pacing_are_the_fixed_h_run_bit_for_bit():
    """Three workers at one pace: the auto deadline (H times their step time) lets each take its H
    steps, the merge is the plain average and the momentum mu: every global weight, momentum and local
    weight equals the fixed-H run's, bit for bit."""
    fixed = run(MuLoCoConfig(workers=3, sync_interval=4, outer_momentum=0.6), [1.0] * 3, 12)
    paced = run(paced_config(), [1.0] * 3, 12)
    for a, b in zip(fixed, paced):
        assert b.taken == list(range(1, 13))
        assert all(torch.equal(x, y) for x, y in zip(a.worker.params, b.worker.params))
        assert all(torch.equal(a.loop.state.momentum[i], b.loop.state.momentum[i]) for i in a.loop.state.momentum)
    assert checksums([w.worker for w in fixed]) == checksums([w.worker for w in paced])
    records = paced[0].worker.records
    assert [r["inner_steps"] for r in records] == [[4, 4, 4]] * 3
    assert {r["momentum_exponent"] for r in records} == {1.0}
    assert "inner_steps" not in fixed[0].worker.records[0]  # a fixed-H run's header and record are today's


def expected_run(counts: list[list[int]], config: MuLoCoConfig, start: dict[str, torch.Tensor]):
    """The documented merge and outer step in float64, interval after interval: worker k took
    counts[i][k] inner steps of interval i (steps i*H+1 .., lr 0.1/j), each restarting from the global
    weights (0: it did not contribute)."""
    H, mu, lr = config.sync_interval, config.outer_momentum, config.outer_lr
    names = list(SHAPES)
    weights = {n: t.double() for n, t in start.items()}
    momentum = {n: torch.zeros_like(t) for n, t in weights.items()}
    for i, interval in enumerate(counts):
        first = i * H + 1
        interval_lr = sum(PEAK_LR / j for j in range(first, first + H))
        deltas, tokens, lr_sums = [], [], []
        for rank, n in enumerate(interval):
            if n == 0:
                continue
            steps = range(first, first + n)
            delta = {name: torch.zeros_like(weights[name]) for name in names}
            for j in steps:  # global - local: the local weights moved by lr_j x noise
                for name, z in zip(names, noise(j, rank)):
                    delta[name] -= PEAK_LR / j * z.double()
            deltas.append(delta)
            tokens.append(n * TOKENS_PER_STEP)
            lr_sums.append(sum(PEAK_LR / j for j in steps))
        total = sum(tokens)
        s_bar = sum(t * s for t, s in zip(tokens, lr_sums)) / total
        mu_eff = mu ** (s_bar / interval_lr)
        for name in names:
            merged = sum(t / total * (s_bar / s) * d[name] for t, s, d in zip(tokens, lr_sums, deltas))
            momentum[name] = mu_eff * momentum[name] + merged
            weights[name] = weights[name] - lr * (merged + mu_eff * momentum[name])
    return weights, momentum


@pytest.mark.parametrize("host", ["trainer", "deepspeed"])
def test_three_workers_of_10_7_and_4_steps_merge_by_tokens_with_the_unequal_step_correction(host):
    """H = 10, a deadline of 9.75 s: the worker of 1 s steps takes its 10, the one of 10/7 s stops after 7
    (an 8th would end past the deadline), the one of 1.25 s slowed down 2x after 4. Each slow worker then
    goes on from the sync's step (its lr schedule too); after two intervals every worker's global
    weights and momentum are the formula's (pace.py, computed here in float64), bit-identical across
    workers, and each worker holds them."""
    config = MuLoCoConfig(workers=3, sync_interval=10, outer_lr=0.7, outer_momentum=0.9,
                          pace=PaceConfig(mode="wall_clock", interval_s=9.75), emulate_slowdown=(1.0, 1.0, 2.0))
    start = global_by_name(Worker(0, 3, config, FakeStatic((Board(3), Board(3)), 0, KEY)))
    workers = run(config, [1.0, 10 / 7, 1.25], 20, host)
    assert [w.taken for w in workers] == [list(range(1, 21)), [*range(1, 8), *range(11, 18)],
                                          [*range(1, 5), *range(11, 15)]]
    assert [r["inner_steps"] for r in workers[0].worker.records] == [[10, 7, 4]] * 2
    weights, momentum = expected_run([[10, 7, 4]] * 2, config, start)
    assert len(checksums([w.worker for w in workers])) == 1
    for w in workers:
        for name, value in global_by_name(w.worker).items():
            torch.testing.assert_close(value.double(), weights[name], rtol=1e-5, atol=1e-6)
        state = w.loop.state
        for i, m in state.momentum.items():
            torch.testing.assert_close(m.double(), momentum[w.loop.tensors[i].name], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(w.loop.tensors[i].tensor, g) for i, g in state.global_weights.items())
        assert w.host.inner_step() == 20
        assert w.worker.trainer.engine.lr_scheduler.last_epoch == 20  # the schedule stepped past the skipped steps


def test_elastic_members_pace_and_merge_by_tokens_and_a_member_late_for_a_sync_is_dropped():
    """The three workers of 10, 7 and 4 steps per interval above, elastic (each its own membership on a
    fake torchft quorum). Worker 0 misses the first interval's sync (its quorum formed without it, after
    the grace window): workers 1 and 2 merge their 7 and 4 steps alone; at the second sync worker 0 catches
    up, sends an empty contribution and takes the step without contributing, so the merge is theirs again;
    the third holds all three. Every member's global weights and momentum are the formula's, for those
    contributions, and bit-identical across members."""
    config = MuLoCoConfig(workers=3, sync_interval=10, outer_lr=0.7, outer_momentum=0.9,
                          pace=PaceConfig(mode="wall_clock", interval_s=9.75), emulate_slowdown=(1.0, 1.0, 2.0),
                          elastic=ElasticConfig(lighthouse="http://x:1"))
    start = global_by_name(Worker(0, 3, config, FakeStatic((Board(3), Board(3)), 0, KEY)))
    board, pair = Board(3), Board(2)
    # committed syncs: 1 after the start's sync, so the first interval's sync is the one worker 0 misses
    quorum = lambda board, rank, key, wire: PairAt(board, rank, key, wire, pair, alone_at=(1,))  # noqa: E731
    workers = [Paced(r, config, None, s, "trainer", 30, quorum_membership(r, board, config, quorum=quorum))
               for r, s in enumerate([1.0, 10 / 7, 1.25])]
    run_ranks(3, lambda r: workers[r].train())
    assert workers[0].taken == [*range(1, 11), *range(21, 31)]  # it waited for its peers' next sync, then went on
    records = [w.worker.records for w in workers]
    assert [(r["quorum"], r["inner_steps"], r["left_out"]) for r in records[1]] == [
        ([1, 2], [7, 4], {}), ([0, 1, 2], [0, 7, 4], {"0": "joining"}), ([0, 1, 2], [10, 7, 4], {})]
    assert [r["outer_step"] for r in records[0]] == [2, 3]
    weights, momentum = expected_run([[0, 7, 4], [0, 7, 4], [10, 7, 4]], config, start)
    assert len(checksums([w.worker for w in workers])) == 1
    for w in workers:
        for name, value in global_by_name(w.worker).items():
            torch.testing.assert_close(value.double(), weights[name], rtol=1e-5, atol=1e-6)
        for i, m in w.loop.state.momentum.items():
            torch.testing.assert_close(m.double(), momentum[w.loop.tensors[i].name], rtol=1e-5, atol=1e-6)


def test_a_deadline_shorter_than_a_step_still_lets_each_worker_take_min_steps():
    """interval_s 0.5 s against steps of 1 s: every worker takes its min_steps (2) of each interval of 4,
    then goes on from the sync's step; equal contributions are the plain average, and the momentum
    decays by the lr the workers accumulated over the interval's."""
    config = paced_config(pace=PaceConfig(mode="wall_clock", interval_s=0.5, min_steps=2))
    workers = run(config, [1.0] * 3, 8)
    assert [w.taken for w in workers] == [[1, 2, 5, 6]] * 3
    exponents = [r["momentum_exponent"] for r in workers[0].worker.records]
    assert exponents == pytest.approx([(1 + 1 / 2) / sum(1 / j for j in range(1, 5)),
                                       (1 / 5 + 1 / 6) / sum(1 / j for j in range(5, 9))], rel=1e-12)
    assert len(checksums([w.worker for w in workers])) == 1


def test_a_slowed_down_worker_sleeps_its_factor_after_each_inner_step():
    """emulate_slowdown 3: every inner step after the first (the first has no start time) takes three
    times its own time on the worker's clock, which its records' step time shows."""
    config = MuLoCoConfig(workers=2, sync_interval=4, emulate_slowdown=(1.0, 3.0))
    workers = run(config, [0.5, 0.5], 8)
    assert [w.clock() for w in workers] == [4.0, 0.5 + 7 * 1.5]
    assert [r["step_seconds"] for r in workers[0].worker.records] == [0.5, 0.5]


def test_the_auto_deadline_waits_for_workers_at_full_speed_not_for_a_straggler():
    def at(*seconds_per_step):
        return [Contribution(4, 128.0, 0.4, 0.4, s) for s in seconds_per_step]
    assert auto_deadline(at(1.0, 1.2, 2.0), 10) == 12.0  # 1.2 is within 25% of 1.0: its noise, not a straggler
    assert auto_deadline(at(1.0, 1.3), 10) == 10.0
    assert auto_deadline(at(0.0, 0.0), 10) is None


def test_the_contribution_rides_the_header_and_a_malformed_one_skips_the_sync_for_everyone():
    c = Contribution(7, 7 * 32.0, 0.123, 0.456, 1.5)
    assert Contribution.decode(c.encode()) == c and c.encode().dtype == torch.uint8 and c.problem() is None
    # A worker that claims no tokens (a broken host): nothing would weigh its pseudogradient.
    config = paced_config()
    boards = (Board(3), Board(3))
    workers = [Paced(r, config, boards, 1.0, "trainer", 4) for r in range(3)]
    workers[1].worker.trainer.config.batch.per_worker = 0
    run_ranks(3, lambda r: workers[r].train())
    record = workers[0].worker.records[0]
    assert record["skipped"].startswith("worker 1: its contribution") and "non-positive tokens" in record["skipped"]
    assert len(checksums([w.worker for w in workers])) == 1 and workers[0].loop.state.skipped == 1


def test_a_resume_keeps_the_deadline_of_the_interval_after_it():
    workers = run(paced_config(), [1.0] * 3, 4)
    saved = workers[0].loop.state_dict()
    assert saved["pace_deadline_s"] == 4.0  # H times the fastest worker's step time
    fresh = Paced(0, paced_config(), (Board(3), Board(3)), 1.0, "trainer", 8)
    fresh.worker.trainer.step = saved["step"]  # as the trainer's resume restores it before the outer state
    assert fresh.loop.pacer.deadline is None
    fresh.loop.load_state_dict(saved)
    assert fresh.loop.pacer.deadline == 4.0
    with pytest.raises(SnapshotError, match="pace_deadline_s -1.0 is not a positive number"):
        fresh.loop.load_state_dict({**saved, "pace_deadline_s": -1.0})
    assert run(MuLoCoConfig(workers=3, sync_interval=4), [1.0] * 3, 4)[0].loop.state_dict()["pace_deadline_s"] is None


@pytest.mark.parametrize("muloco, message", [
    ({"streaming": {"fragments": 2}}, "muloco.streaming.fragments (2) is not supported with pace.mode 'wall_clock'"),
    ({"streaming": {"overlap_steps": 1}}, "muloco.streaming.overlap_steps (1) is not supported with pace.mode"),
    ({"emulate_slowdown": [1, 2]}, r"muloco.emulate_slowdown must be one factor >= 1 per worker (3), got [1.0, 2.0]"),
    ({"emulate_slowdown": [1, 0.5, 1]}, "muloco.emulate_slowdown must be one factor >= 1 per worker"),
])
def test_what_pacing_cannot_support_yet_is_one_config_error(muloco, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(MuLoCoConfig, {"workers": 3, "sync_interval": 4, "pace": {"mode": "wall_clock"}, **muloco}, "muloco")


def test_run_settings_that_need_every_worker_at_every_step_are_refused_with_pacing(tmp_path):
    from test_config_validation import GOOD, _resolve
    ds = {**GOOD, "muloco": {**GOOD["muloco"], "pace": {"mode": "wall_clock"}}}
    H = ds["muloco"]["sync_interval"]
    assert _resolve(tmp_path, ds, "--save", str(tmp_path), "--save-interval", str(2 * H)).muloco.pace.paced
    with pytest.raises(ConfigError, match=rf"--save-interval \({H + 1}\) must be a multiple of muloco.sync_interval"):
        _resolve(tmp_path, ds, "--save", str(tmp_path), "--save-interval", str(H + 1))
    with pytest.raises(ConfigError, match="--exit-signal-handler is not supported with muloco.pace.mode"):
        _resolve(tmp_path, ds, "--save", str(tmp_path), "--exit-signal-handler")
    assert _resolve(tmp_path, GOOD, "--emulate-slowdown", "1", "2").muloco.emulate_slowdown == (1.0, 2.0)
    data_parallel = {k: v for k, v in GOOD.items() if k != "muloco"}
    with pytest.raises(ConfigError, match="--emulate-slowdown: the ds_config has no muloco block"):
        _resolve(tmp_path, data_parallel, "--emulate-slowdown", "2")

