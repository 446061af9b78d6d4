"""Checkpoints: exact resume at T=2 P=2 after a crash in the middle of an asynchronous save (with --keep-last), and
for streaming MuLoCo K=2 with 2-bit compression and error feedback after a SIGTERM preemption that
saves with a sync in flight, resharding to another T/P, and clear refusals of what cannot fit.
Multi-process runs are tiny (6 steps) and launched by tests/_ckpt_runs.py."""
import json
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _ckpt_runs import (REPO_ROOT, TRAIN_ITERS, Launch, assert_same_state, check, launch, losses, rank_files,
                        reference_checkpoint)
from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointReader, latest_iteration
from trainer.checkpoint.checkpointer import CRASH_ENV, check_fits
from muloco.core.topology import ParallelSizes, coordinates
from test_convert_checkpoint import convert

# Several launches per test, each bounded by its own timeout; on a shared 2-core machine the
# default 600 s per test is too tight for three 4-rank launches.
pytestmark = pytest.mark.timeout(1800)
T2P2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")


def copy_iteration(src_ckpt: Path, step: int, dst_ckpt: Path) -> Path:
    """A checkpoint folder holding only iteration `step` of another, as if a run had stopped there."""
    shutil.copytree(src_ckpt / f"iter_{step:07d}", dst_ckpt / f"iter_{step:07d}")
    (dst_ckpt / "latest").write_text(f"{step}\n")
    return dst_ckpt


@pytest.mark.launch
def test_resume_after_a_crash_mid_save_is_exact_at_t2_p2(base, tmp_path):
    ref = reference_checkpoint(base)
    ckpt = copy_iteration(ref / "ckpt", 3, tmp_path / "ckpt")
    resume = ("--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1", *T2P2)

    # Resume at step 3, save at 4, then rank 1 dies (os._exit, as kill -9: no clean-up) while writing step 5's
    # checkpoint. The saves are asynchronous: step 4's is published when step 5's begins (at most one in
    # flight); rank 1's writer thread dies mid-write while the ranks train on.
    crashed = launch(base, 4, tmp_path / "run1", *resume, "--async-save", env={CRASH_ENV: "5:1"})
    assert crashed.returncode != 0
    assert latest_iteration(ckpt) == 4, "latest moved although a rank never finished its file"
    assert not (ckpt / "iter_0000005" / "complete").exists()
    assert list((ckpt / "iter_0000005").glob("*.tmp.*")), "the crash hook did not fire mid-save"
    reader = CheckpointReader(ckpt)  # the previous checkpoint is intact and loadable
    assert reader.meta.step == 4 and all(reader.rank_state(r)["step"] == 4 for r in range(4))

    # Resume at step 4 (not a multiple of the reference's save interval) and finish, keeping the last 2
    # (synchronous saves: the state is the reference's whichever way it was saved).
    check(launch(base, 4, tmp_path / "run2", *resume, "--keep-last", "2"))
    assert not list(ckpt.glob("**/*.tmp.*")), "stale temporary files survived the next save"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000005", "iter_0000006"]
    assert (ckpt / "iter_0000005" / "complete").exists()

    stitched = {**losses(tmp_path / "run1"), **losses(tmp_path / "run2")}
    reference = losses(ref / "run")
    assert {s: stitched[s] for s in (4, 5, 6)} == {s: reference[s] for s in (4, 5, 6)}
    for a, b in zip(rank_files(ref / "ckpt", TRAIN_ITERS), rank_files(ckpt, TRAIN_ITERS), strict=True):
        assert_same_state(a, b)


@pytest.mark.launch
def test_resume_at_another_tensor_and_pipeline_size_reshards(base, tmp_path):
    ref = reference_checkpoint(base)
    ckpt = copy_iteration(ref / "ckpt", 3, tmp_path / "ckpt")
    result = check(launch(base, 1, tmp_path / "run", "--load", str(ckpt)))
    assert "resharded from K=1 D=1 P=2 T=2" in result.stdout
    resumed, reference = losses(tmp_path / "run"), losses(ref / "run")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:  # Muon is TP-invariant, so only reduction order differs
        assert resumed[step] == pytest.approx(reference[step], abs=1e-4)


@pytest.fixture(scope="module")
def muloco_k2(base, tmp_path_factory) -> tuple[Path, Path]:
    """A streaming MuLoCo K=2 run of TRAIN_ITERS steps (its ds_config, its folder): F=2 fragments of H=2
    with tau=1, so a fragment's sync starts after every step and lands one step later: at the save of
    step TRAIN_ITERS - 1 a sync is in flight (the workers hold two models); the run ends with its final
    sync, so the last save holds one. Muon keeps its momentum in bf16 (muon.momentum_dtype), which the
    checkpoint holds as is, and runs the Gram Newton-Schulz."""
    work = tmp_path_factory.mktemp("muloco_k2")
    config = json.loads((REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json").read_text())
    config["muloco"].update(workers=2, sync_interval=2, streaming={"fragments": 2, "overlap_steps": 1},
                            compression={"method": "statistical", "bits": 2, "error_feedback": True})
    config["optimizer"]["params"].update(momentum_dtype="bfloat16", ns_form="gram")
    ds_config = work / "muloco_k2.json"
    ds_config.write_text(json.dumps(config))
    check(launch(base, 2, work / "full" / "run", "--save", str(work / "full" / "ckpt"),
                 "--save-interval", str(TRAIN_ITERS - 1), ds_config=str(ds_config)))
    return ds_config, work / "full"


@pytest.mark.launch
def test_muloco_k2_streaming_2bit_error_feedback_preempted_by_sigterm_resumes_exactly(base, muloco_k2, tmp_path):
    # Whatever step the preemption stops at, one sync is in flight when it saves.
    ds_config, full = muloco_k2

    # The cluster takes worker 1's node back: SIGTERM to its rank only, mid-run. Both workers finish
    # the same step, save, and exit 0.
    ckpt = tmp_path / "ckpt"
    preempted = Launch(base, 2, tmp_path / "run1", "--save", str(ckpt), "--exit-signal-handler",
                       ds_config=str(ds_config))
    preempted.wait_for("[2/6")
    os.kill(preempted.rank_pid(1), signal.SIGTERM)
    assert preempted.finish() == 0, preempted.output[-6000:]
    stopped = latest_iteration(ckpt)
    assert stopped is not None and 2 <= stopped < TRAIN_ITERS, preempted.output[-3000:]
    assert f"preempted: SIGTERM received by 1 rank(s): stopping after step {stopped}" in preempted.output
    saved = CheckpointReader(ckpt).rank_state(0)
    in_flight = [e["apply_at"] for e in saved["extra"]["muloco"]["in_flight"]]
    assert in_flight == [stopped + 1], "the preemption's checkpoint should hold the sync still in flight"
    momentum = [s["momentum_buffer"] for s in saved["optimizer"]["state"].values() if "momentum_buffer" in s]
    assert momentum and all(m.dtype == torch.bfloat16 for m in momentum)

    check(launch(base, 2, tmp_path / "run2", "--load", str(ckpt), "--save", str(ckpt), ds_config=str(ds_config)))
    reference, resumed = losses(full / "run"), losses(tmp_path / "run2")
    after = range(stopped + 1, TRAIN_ITERS + 1)
    assert {s: resumed[s] for s in after} == {s: reference[s] for s in after}
    for a, b in zip(rank_files(full / "ckpt", TRAIN_ITERS), rank_files(ckpt, TRAIN_ITERS), strict=True):
        assert_same_state(a, b)  # includes the outer weights, momentum and error-feedback buffers


@pytest.mark.launch
def test_a_run_ends_with_its_final_sync_so_its_last_checkpoint_is_one_model(muloco_k2):
    _, full = muloco_k2
    reader = CheckpointReader(full / "ckpt")
    assert reader.meta.step == TRAIN_ITERS and reader.meta.workers_hold_one_model is True
    states = [reader.rank_state(r) for r in (0, 1)]
    for name, weights in states[0]["model"].items():
        assert torch.equal(weights, states[1]["model"][name]), name
        assert torch.equal(weights, states[0]["extra"]["muloco"]["global_weights"][name]), name
    assert states[0]["extra"]["muloco"]["in_flight"] == []
    # The sync launched at the last step (fragment 1's; fragment 0's landed then) was applied, not left
    # to land after the run: one sync per step, each applied; none more was needed.
    records = [json.loads(line) for line in (full / "run" / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "outer_step" in r]
    assert [r["step"] for r in syncs] == list(range(1, TRAIN_ITERS + 1)) and not any(r.get("final_sync") for r in syncs)


@pytest.mark.launch
def test_an_export_between_syncs_takes_the_global_weights_or_the_worker_asked_for(muloco_k2, tmp_path):
    from safetensors.torch import load_file

    _, full = muloco_k2
    between = copy_iteration(full / "ckpt", TRAIN_ITERS - 1, tmp_path / "between")
    reader = CheckpointReader(between)
    assert reader.meta.workers_hold_one_model is False  # saved between syncs: K=2 models
    # Fragment 0's sync (the first layers and the embedding) is in flight: its weights differ between the
    # workers; fragment 1's (the last layers and the head) landed at this step. D=1, T=1: each worker's
    # one rank holds every global weight.
    worker_state = [reader.rank_state(r) for r in (0, 1)]
    in_flight = "embedding.word_embeddings.weight"
    assert not torch.equal(worker_state[0]["model"][in_flight], worker_state[1]["model"][in_flight])
    name = "output_layer.weight"
    global_weights = worker_state[0]["extra"]["muloco"]["global_weights"][name]
    assert torch.equal(global_weights, worker_state[1]["extra"]["muloco"]["global_weights"][name])
    vocab = reader.meta.vocab_size

    exported = convert(between, tmp_path / "global", "--verify")  # the default
    chosen = convert(between, tmp_path / "worker1", "--verify", "--worker", "1")
    for result in (exported, chosen):
        assert result.returncode == 0 and "verify passed" in result.stdout, result.stdout + result.stderr
        assert "the workers held different models (saved between outer syncs)" in result.stdout
    assert "weights: the global (outer) weights" in exported.stdout and "weights: worker 1's weights" in chosen.stdout
    # worker 1's recorded logits are its own weights': compared; the global weights have no recorded logits
    assert "note not compared with the training model as saved" in exported.stdout
    assert "trainer model (T=1 P=1) vs training model as saved (K=2 D=1 P=1 T=1, worker 1)" in chosen.stdout
    for out, expected, weights in ((tmp_path / "global", "global", global_weights),
                                   (tmp_path / "worker1", "worker 1", worker_state[1]["model"][name])):
        assert json.loads((out / "config.json").read_text())["muloco_export"] == {
            "weights": expected, "step": TRAIN_ITERS - 1, "workers_hold_one_model": False}
        assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], weights[:vocab])

    bad = convert(between, tmp_path / "bad", "--worker", "2")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        f"export error: --worker 2: {reader.directory} holds workers 0..1", bad.stderr


def _meta(**changes) -> CheckpointMeta:
    from trainer.model.presets import PRESETS

    sizes = changes.pop("sizes", ParallelSizes(1, 1, 2, 2))
    fields = dict(step=3, sizes=sizes, model=PRESETS["tiny"], vocab_size=1000, padded_vocab_size=1024,
                  ranks=[coordinates(r, sizes) for r in range(sizes.world)], tokenizer_model=None, extra_state=[],
                  rank_files={f"rank_{r:05d}.safetensors": "0" * 64 for r in range(sizes.world)},
                  config={"batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "data_parallel": 1,
                                    "workers": 1}})
    return CheckpointMeta(**{**fields, **changes})


def _fits(meta: CheckpointMeta, sizes=ParallelSizes(1, 1, 2, 2), extra=()) -> bool:
    from trainer.model.presets import PRESETS

    return check_fits(meta, sizes, PRESETS["tiny"], 1024, global_batch=4 * sizes.workers, extra_state=list(extra))


def test_layout_checks_name_what_differs():
    assert _fits(_meta()) is False
    assert _fits(_meta(), ParallelSizes(1, 1, 2, 1)) is True  # resharded
    with pytest.raises(CheckpointError, match="checkpoint has K=1 workers, this run K=2"):
        _fits(_meta(), ParallelSizes(2, 1, 2, 2))
    muloco = _meta(extra_state=["muloco"])
    with pytest.raises(CheckpointError, match="checkpoint has T=2, this run T=1.*cannot be resharded"):
        _fits(muloco, ParallelSizes(1, 1, 2, 1), extra=["muloco"])
    with pytest.raises(CheckpointError, match="MuLoCo on one side only"):
        _fits(muloco)
    with pytest.raises(CheckpointError, match="num_layers: checkpoint 2, this run 4"):
        _fits(_meta(model=replace(_meta().model, num_layers=2)))
    with pytest.raises(CheckpointError, match="padded vocabulary 2048"):
        _fits(_meta(padded_vocab_size=2048))


def test_reader_refuses_a_missing_or_incomplete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="latest"):
        CheckpointReader(tmp_path)
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest").write_text("2\n")
    with pytest.raises(CheckpointError, match="incomplete"):
        CheckpointReader(tmp_path)


def _inner_run(optimizer: str, steps: int = 3) -> tuple[dict, dict, torch.optim.Optimizer, object]:
    """A run's saved state and own form with the param groups trainer/optim/inner.py builds for `optimizer`
    (Muon: an adamw group for the embedding and norms, a muon group for the hidden matrices; AdamW: one
    group), on torch's SGD with momentum (state shaped like the parameters, as the inner optimizer's) and
    LambdaLR, stepped `steps` times."""
    from trainer.checkpoint.state import capture_rng, optimizer_state

    params = {"embedding": torch.nn.Parameter(torch.ones(4, 2)), "hidden": torch.nn.Parameter(torch.ones(2, 2))}
    groups = [{"params": [params["embedding"]], "kind": "adamw"}, {"params": [params["hidden"]], "kind": "muon"}]
    if optimizer == "adamw":
        groups = [{"params": list(params.values()), "kind": "adamw"}]
    inner = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: (step + 1) / 10)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.ones_like(p)
        inner.step()
        schedule.step()
    name_of = {p: name for name, p in params.items()}
    saved = {"step": steps, "model": {n: p.detach().clone() for n, p in params.items()},
             "optimizer": optimizer_state(inner, name_of), "scheduler": schedule.state_dict(),
             "engine": {"global_steps": steps}, "rng": capture_rng(), "extra": {}}
    own = {"optimizer_groups": saved["optimizer"]["param_groups"], "scheduler": schedule.state_dict(),
           "engine": {"global_steps": steps}, "rng": capture_rng(), "extra": {}}
    return saved, own, inner, schedule


def test_a_change_of_inner_optimizer_is_named_and_no_load_optim_allows_it():
    """--optimizer adamw on a Muon checkpoint: one problem naming the change (not the param groups'
    count and the scheduler's lists it implies); with --no-load-optim the scheduler is not loaded either,
    so the other optimizer's per-group lr lists pass."""
    from trainer.checkpoint.schema import state_problems
    from trainer.checkpoint.state import with_run_hyperparameters

    muon, muon_form, muon_inner, muon_schedule = _inner_run("muon")
    adamw, adamw_form, adamw_inner, adamw_schedule = _inner_run("adamw")
    params = {name: value for name, value in muon["model"].items()}
    assert state_problems(muon, 3, params, muon_form) == []
    assert state_problems(muon, 3, params, adamw_form) == [
        "optimizer: the checkpoint's inner optimizer is muon, this run's adamw: resume with --optimizer muon, or with "
        "--no-load-optim to start adamw afresh at the loaded step"]
    assert state_problems(adamw, 3, params, muon_form)[0].startswith(
        "optimizer: the checkpoint's inner optimizer is adamw, this run's muon")
    without_optimizer = {k: v for k, v in muon.items() if k != "optimizer"}
    assert state_problems(without_optimizer, 3, params, adamw_form, skipped=("optimizer",)) == []
    with pytest.raises(CheckpointError, match="checkpoint's inner optimizer is muon, this run's adamw"):
        with_run_hyperparameters(muon, adamw_inner, adamw_schedule)  # --load-worker's start
    assert state_problems({**muon, "optimizer": {**muon["optimizer"], "param_groups": []}}, 3, params, muon_form) == [
        "optimizer.param_groups must be a list of 2 groups, got 0"]
