"""The outer loop on real DeepSpeed engines (muloco/hook/).

One 4-rank launch (tests/_deepspeed_hook_probe.py) trains K=2 workers x D=2 ranks of the example's
Hugging Face Llama (examples/deepspeed_muloco.py) under ZeRO 0, 1 and 2, with torch's AdamW and with
DeepSpeed's own Muon, plus the K=1 identity, 4-bit + EF runs and the setups that must be refused.
The reference is plain: K model copies in this process, each worker's gradient the mean of its D
ranks' micro-batch gradients, the inner optimizer classes DeepSpeed builds, and torch.optim.SGD
(Nesterov momentum) on the average pseudogradient as the outer step. The bad inputs that need no second worker are checked in
process, with stand-in engines.
"""
from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed_muon_precision import newton_schulz_in_fp32

from muloco import Workers, attach
from muloco.core.errors import ConfigError
from muloco.core.topology import ParallelSizes, RankCoordinates, Topology
from tools.trainer_runs import launch_ranks, shared_memory_files
from tools.trainer_runs import REPO_ROOT

PROBE = REPO_ROOT / "tests" / "_deepspeed_hook_probe.py"
K, D, H, STEPS, VOCAB, SEQ, MICRO = 2, 2, 3, 9, 128, 16, 2
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.6}
# Per parameter, ||hooked - reference|| <= RTOL ||reference||. The runs differ only in fp32 reduction
# order (DeepSpeed's all-reduce or reduce-scatter of the D gradients against a sum here) and in where
# ZeRO cuts the flat master weights; a wrong outer step moves weights by ~1e-2 of their norm. Muon's
# Newton-Schulz (run in fp32 here: tests/deepspeed_muon_precision.py) carries that order further: ZeRO 2
# lands 2.8e-6 from the reference on an AVX512/AMX CPU, under 1e-6 on the CPUs before it.
RTOL = {"adamw": 1e-6, "muon": 1e-5}


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_muloco", REPO_ROOT / "examples" / "deepspeed_muloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def probe_results(tmp: str) -> Path:
    out = Path(tmp) / "out"
    result = launch_ranks(PROBE, 4, [str(out)], timeout_s=900)
    leftovers = shared_memory_files(result.master_port)
    for path in leftovers:
        path.unlink(missing_ok=True)
    result.check("the DeepSpeed hook probe")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return probe_results(str(tmp_path_factory.mktemp("deepspeed_hook")))


def load(out: Path, case: str, rank: int) -> dict:
    return torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


def inner_optimizer(model: torch.nn.Module, inner: str, example) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed builds from the example's config, built here without DeepSpeed's engine."""
    params = example.ds_config(SimpleNamespace(inner=inner, lr=None, micro_batch=MICRO, zero_stage=0,
                                               bf16=False))["optimizer"]["params"]
    if inner == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"],
                                 weight_decay=params["weight_decay"])
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    groups = DeepSpeedEngine._muon_param_groups(list(model.parameters()), dict(params))
    # As the engine builds it (deepspeed/runtime/engine.py): Muon's own step, FusedAdam for the Adam half.
    return MuonWithAuxAdam(groups, adam_optimizer=FusedAdam, adam_optimizer_kwargs={"adam_w_mode": True})


def reference(inner: str, workers: int = K, ranks: int = D, steps: int = STEPS, outer_lr: float = 0.7,
              momentum: float = 0.6, nesterov: bool = True) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """The final weights (the same on every worker after the last sync) and every rank's losses."""
    example = _example()
    models = [example.llama(VOCAB, SEQ) for _ in range(workers)]
    optimizers = [inner_optimizer(m, inner, example) for m in models]
    streams = [example.markov_batches(VOCAB, SEQ, MICRO, seed=rank) for rank in range(workers * ranks)]
    global_weights = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    # DiLoCo's outer step is SGD with (Nesterov) momentum on the average pseudogradient: torch's own.
    outer_sgd = torch.optim.SGD(list(global_weights.values()), lr=outer_lr, momentum=momentum, nesterov=nesterov)
    losses = [[] for _ in range(workers * ranks)]
    for step in range(1, steps + 1):
        for k, (model, optimizer) in enumerate(zip(models, optimizers)):
            grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            for d in range(ranks):
                tokens = next(streams[k * ranks + d])
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                losses[k * ranks + d].append(float(loss))
                for n, p in model.named_parameters():
                    grads[n] += p.grad
            for n, p in model.named_parameters():
                p.grad = grads[n] / ranks
            optimizer.step()
        if step % H == 0:
            with torch.no_grad():
                for n, g in global_weights.items():
                    g.grad = sum(g - dict(m.named_parameters())[n] for m in models) / workers
                outer_sgd.step()
                for model in models:
                    for n, p in model.named_parameters():
                        p.copy_(global_weights[n])
    return {n: w.clone() for n, w in global_weights.items()}, losses


@cache
def cached_reference(inner: str) -> dict[str, torch.Tensor]:
    # One intra-op thread, as each rank of the launch has (a CPU matmul rounds by its blocking, which
    # follows the thread count), and DeepSpeed's Newton-Schulz in fp32, as the launch runs it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with newton_schulz_in_fp32():
            return reference(inner)[0]
    finally:
        torch.set_num_threads(threads)


def relative_errors(weights: dict, expected: dict) -> dict[str, float]:
    return {n: float((weights[n] - expected[n]).norm() / expected[n].norm()) for n in expected}


@pytest.mark.parametrize("inner", ["adamw", "muon"])
@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.launch
def test_the_hook_on_a_deepspeed_engine_is_diloco_computed_by_hand(results, zero, inner):
    expected = cached_reference(inner)
    for rank in range(K * D):
        got = load(results, f"k2_zero{zero}_{inner}", rank)
        errors = relative_errors(got["weights"], expected)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL[inner], (zero, inner, rank, worst, errors[worst])
        assert len(got["checksums"]) == STEPS // H + 1  # outer steps 0..3 were seen


@pytest.mark.launch
def test_one_worker_with_outer_lr_one_and_no_momentum_is_plain_deepspeed_training(results):
    for rank in range(4):
        plain, hooked = load(results, "k1_plain", rank), load(results, "k1_identity", rank)
        assert hooked["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
        assert hooked["checksums"].keys() == {0, 1, 2}


@pytest.mark.parametrize("case, syncs", [("k2_4bit_ef_zero2", STEPS // H), ("k2_4bit_ef_zero0", STEPS // H),
                                         # F=2 fragments every H: 6 launched, all applied (the last at the
                                         # last step), and fragment 0's final sync
                                         ("k2_streaming_zero1", 2 * STEPS // H + 1)])
@pytest.mark.launch
def test_compressed_syncs_leave_every_worker_with_bit_identical_global_weights(results, case, syncs):
    runs = [load(results, case, rank) for rank in range(K * D)]
    for d in range(D):  # the same shard in both workers, after every inner step (two syncs may land in one)
        assert runs[d]["checksums"] == runs[D + d]["checksums"]
        seen = sorted(runs[d]["checksums"])
        assert seen[0] == 0 and seen[-1] == syncs and len(seen) >= STEPS // H
    assert len({run["worker_sha256"] for run in runs}) == 1
    for name, weights in runs[0]["weights"].items():  # the run ended with one model on every worker
        assert all(torch.equal(weights, run["weights"][name]) for run in runs[1:]), name


@pytest.mark.parametrize("case, message", [
    ("different_models", r"workers \[1\] hold other parameters|workers \[0\] hold other parameters"),
    ("no_mpu", r"data-parallel group is ranks \[0, 1, 2, 3\], not this worker's .*pass mpu=workers.mpu"),
    ("attached_twice", "already attached to this engine"),
])
@pytest.mark.launch
def test_a_bad_setup_is_one_line_on_every_rank(results, case, message):
    import re
    for rank in range(K * D):
        error = load(results, case, rank)["error"]
        assert error is not None and re.search(message, error), (rank, error)


@pytest.mark.parametrize("case, ranks", [("k2_resumed_zero0", 4), ("k2_resumed_zero1", 4), ("k2_resumed_zero2", 4),
                                         ("k2_resumed_zero3", 4), ("k4_resumed_zero1", 4)])
@pytest.mark.launch
def test_a_run_saved_with_a_sync_in_flight_stopped_and_resumed_is_the_run_that_was_not_stopped(results, case, ranks):
    """outer.save_checkpoint after step 4 (4-bit + EF, F=2 fragments, tau=1: a sync in flight), a stop
    without the final sync, fresh engines and outer.load_checkpoint: every rank's weights, global
    weights and losses are the uninterrupted run's, bit for bit."""
    for rank in range(ranks):
        resumed, uninterrupted = load(results, case, rank), load(results, case.replace("resumed", "uninterrupted"), rank)
        assert resumed["in_flight_at_save"] == 1
        assert resumed["losses"] == uninterrupted["losses"]
        for kind in ("weights", "global_weights"):
            assert resumed[kind].keys() == uninterrupted[kind].keys()
            assert all(torch.equal(resumed[kind][n], uninterrupted[kind][n]) for n in resumed[kind]), (rank, kind)
        assert resumed["worker_sha256"] == uninterrupted["worker_sha256"]


@pytest.mark.launch
def test_a_step_deepspeed_skips_on_one_worker_is_counted_alike_and_the_workers_stay_together(results):
    """bf16 under ZeRO 1 skips a step with a non-finite gradient (DeepSpeed's overflow check) on one
    worker: at a sync step on worker 0 and at the step a sync in flight is due on worker 1."""
    runs = [load(results, "k2_skipped_bf16_zero1", rank) for rank in range(K * D)]
    skipped = [[step for step, applied in enumerate(run["applied"], 1) if not applied] for run in runs]
    assert skipped == [[3], [3], [5], [5]]  # DeepSpeed skipped them, on both ranks of the worker
    assert len({run["worker_sha256"] for run in runs}) == 1
    assert all(torch.isfinite(w).all() for run in runs for w in run["global_weights"].values())
    for d in range(D):
        assert runs[d]["checksums"] == runs[D + d]["checksums"]
        assert max(runs[d]["checksums"]) == 2 * STEPS // H + 1  # every sync taken by both (as the streaming case)


@pytest.mark.parametrize("case, kind, message", [
    ("different_start", "DisagreementError", r"at the start, worker 1 holds other global weights than worker 0 .*"
                                             r"start='worker0'"),
    ("past_the_end", "ConfigError", "a step after step 3, the last_step given to attach"),
    ("other_steps", "DisagreementError", r"after the resume, the workers are at different steps: worker 0 at outer "
                                         r"step 1 \(inner step 3\), worker 1 at outer step 2 \(inner step 6\)"),
    ("outer_state_not_loaded", "ConfigError", "engine.global_steps moved from 0 to 6 outside engine.step"),
])
@pytest.mark.launch
def test_a_user_loops_mistake_is_stopped_by_the_guard_that_names_it(results, case, kind, message):
    import re
    for rank in range(K * D):
        got = load(results, case, rank)
        assert got["kind"] == kind and re.search(message, got["error"]), (rank, got)


@pytest.mark.launch
def test_workers_that_start_apart_take_worker_zeros_weights_when_asked(results):
    runs = [load(results, "worker0_start", rank) for rank in range(K * D)]
    assert len({run["worker_sha256"] for run in runs}) == 1
    for run in runs[1:]:
        assert all(torch.equal(run["weights"][n], runs[0]["weights"][n]) for n in run["weights"])


@pytest.mark.launch
def test_deepspeeds_own_dataloader_gives_every_rank_of_every_worker_its_own_samples(results):
    runs = [load(results, "deepspeed_loader", rank) for rank in range(K * D)]
    firsts = [run["first_batch"] for run in runs]
    assert len({i for first in firsts for i in first}) == K * D * MICRO, firsts  # 64 samples, 4 readers
    assert {run["batches"] for run in runs} == {64 // (K * D * MICRO)}


# -- bad input that needs no second worker: stand-in engines, in process ---------------------------

def stand_in_engine(stage: int = 1, offload: str | None = None, fp16: bool = False) -> SimpleNamespace:
    offloaded = SimpleNamespace(device=offload) if offload else None
    return SimpleNamespace(zero_optimization_stage=lambda: stage, zero_offload_optimizer=lambda: offloaded,
                           zero_offload_param=lambda: None, fp16_enabled=lambda: fp16)


def two_workers() -> Workers:
    sizes = ParallelSizes(2, 1, 1, 1)
    return Workers(Topology(sizes, 0, RankCoordinates(0, 0, 0, 0), None, None), mpu=None)


@pytest.mark.parametrize("engine, block, message", [
    (stand_in_engine(stage=3, offload="nvme"), {"workers": 2}, "ZeRO offload to NVMe is not supported"),
    (stand_in_engine(fp16=True), {"workers": 2}, "fp16 with loss scaling is not supported"),
    (stand_in_engine(), {"workers": 2, "sync_interval": 0}, "sync_interval"),
    (stand_in_engine(), {"workers": 3}, "split into 2 workers"),
    (stand_in_engine(), {"workers": 2}, "the job needs a secret"),
])
def test_bad_input_is_one_config_error_before_any_collective(engine, block, message, monkeypatch):
    monkeypatch.delenv("MULOCO_AUTH_KEY_FILE", raising=False)
    with pytest.raises(ConfigError, match=message):
        attach(engine, block, two_workers())


def test_a_job_secret_others_can_read_is_refused_by_the_hook_too(tmp_path):
    from muloco.diloco.auth import write_new_key
    write_new_key(tmp_path / "job.key")
    (tmp_path / "job.key").chmod(0o644)
    with pytest.raises(ConfigError, match="has mode 0644, so other users may read it"):
        attach(stand_in_engine(), {"workers": 2, "auth": {"key_file": "job.key"}}, two_workers(), config_dir=tmp_path)
