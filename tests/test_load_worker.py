"""--load-worker W: a run starts from worker W's weights, inner optimizer state and step in a checkpoint
written with another number of workers K, with this run's hyperparameters. Checked against the plain
computation it stands for: a K=2 checkpoint whose worker 1 holds a run's state at step 4 (worker 0
holds other weights) continues that run exactly; a MuLoCo run started from a data-parallel checkpoint
begins its outer loop at the loaded weights (the outer Nesterov step's identity) at its own lr; the
hyperparameters of a start against a plain torch optimizer and LambdaLR; the refusals name what does
not fit."""
import json
import shutil
from pathlib import Path
from dataclasses import replace

import pytest
import torch
from _ckpt_runs import REPO_ROOT, check, launch, losses, rank_files

from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointReader
from trainer.checkpoint.checkpointer import check_worker_start
from trainer.checkpoint.format import sha256_of
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.checkpoint.state import with_run_hyperparameters
from trainer.model.presets import PRESETS
from muloco.core.topology import ParallelSizes, coordinates

pytestmark = pytest.mark.timeout(900)


def _as_two_workers(src, dst, step: int) -> None:
    """Iteration `step` of a one-worker checkpoint rewritten as K=2 with an outer loop: worker 1 holds
    the run's state, worker 0 the same with every weight negated."""
    directory = dst / f"iter_{step:07d}"
    shutil.copytree(src / f"iter_{step:07d}", directory)
    shutil.copyfile(directory / "rank_00000.safetensors", directory / "rank_00001.safetensors")
    state = to_plain(read_rank_file(directory / "rank_00001.safetensors"))  # memory-mapped: not the file rewritten
    state["model"] = {name: -w for name, w in state["model"].items()}
    state["probe"] = None  # the recorded logits are of the run's weights, not these (a load would refuse them)
    with open(directory / "rank_00000.safetensors", "wb") as f:
        write_rank_file(f, state)
    meta = json.loads((directory / "meta.json").read_text())
    sizes = ParallelSizes(2, 1, 1, 1)
    meta["sizes"] = {"workers": 2, "data": 1, "pipeline": 1, "tensor": 1}
    meta["ranks"] = [coordinates(r, sizes).__dict__ for r in range(2)]
    meta["extra_state"] = ["muloco"]
    batch = meta["config"]["batch"]
    batch.update(micro_batch_size=batch["micro_batch_size"] // 2, workers=2)  # the same global batch
    meta["rank_files"] = {p.name: sha256_of(p) for p in sorted(directory.glob("rank_*.safetensors"))}
    (directory / "meta.json").write_text(json.dumps(meta))
    (dst / "latest").write_text(f"{step}\n")


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """A one-worker Muon run of 6 steps saving at steps 2, 4 and 6; returns its base folder."""
    base = tmp_path_factory.mktemp("load_worker")
    check(launch(base, 1, base / "run", "--save", str(base / "ckpt"), "--save-interval", "2"))
    return base


def _root_at(src: Path, dst: Path, step: int) -> Path:
    """A checkpoint root whose `latest` is iteration `step` of `src`."""
    dst.mkdir()
    (dst / f"iter_{step:07d}").symlink_to((src / f"iter_{step:07d}").resolve())
    (dst / "latest").write_text(f"{step}\n")
    return dst


@pytest.mark.launch
def test_worker_of_a_k2_checkpoint_continues_its_run(dp_run, tmp_path):
    base = dp_run
    _as_two_workers(base / "ckpt", tmp_path / "k2", 4)
    result = check(launch(base, 1, tmp_path / "from_worker1", "--load", str(tmp_path / "k2"), "--load-worker", "1"))
    assert "(worker 1 of K=2 D=1 P=1 T=1)" in result.stdout
    original, continued = losses(base / "run"), losses(tmp_path / "from_worker1")
    assert sorted(continued) == [5, 6]
    assert continued == {s: original[s] for s in (5, 6)}
    # Worker 0 (negated weights) is another starting point: the identity above can fail.
    check(launch(base, 1, tmp_path / "from_worker0", "--load", str(tmp_path / "k2"), "--load-worker", "0"))
    assert not torch.allclose(torch.tensor(losses(tmp_path / "from_worker0")[5]), torch.tensor(original[5]))


def _logged_lrs(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


@pytest.mark.launch
def test_muloco_run_starts_its_outer_loop_at_the_loaded_weights(dp_run, tmp_path):
    """K=2 workers from the DP run's step 4, half its lr, sync at step 6: from zero momentum the outer
    Nesterov step is theta_new = theta_start - outer_lr (1 + mu) m with m the averaged pseudogradient,
    which holds only if the outer loop began at the loaded weights theta_start."""
    base = dp_run
    ds = json.loads((REPO_ROOT / "ds_configs" / "cpu_tiny_muon.json").read_text())
    ds["train_micro_batch_size_per_gpu"] //= 2  # the DP run's global batch, over two workers
    outer_lr, mu = 0.7, 0.6
    ds["muloco"] = {"workers": 2, "sync_interval": 2, "outer_lr": outer_lr, "outer_momentum": mu, "nesterov": True}
    config = tmp_path / "k2.json"
    config.write_text(json.dumps(ds))
    lr = ds["optimizer"]["params"]["lr"] / 2
    check(launch(base, 2, tmp_path / "k2_run", "--load", str(_root_at(base / "ckpt", tmp_path / "start", 4)),
                 "--load-worker", "0", "--lr", str(lr), "--save", str(tmp_path / "k2_ckpt"), "--save-interval", "2",
                 ds_config=str(config)))
    start = to_plain(read_rank_file(rank_files(base / "ckpt", 4)[0]))["model"]
    after = to_plain(read_rank_file(rank_files(tmp_path / "k2_ckpt", 6)[0]))
    # Saved right after the sync at step 6: both workers hold the global weights, one model.
    assert CheckpointReader(tmp_path / "k2_ckpt").meta.workers_hold_one_model is True
    momentum = after["extra"]["muloco"]["momentum"]
    assert set(momentum) == set(start)
    for name, theta in start.items():
        assert momentum[name].abs().max() > 0
        torch.testing.assert_close(theta - after["model"][name], outer_lr * (1 + mu) * momentum[name],
                                   rtol=1e-4, atol=1e-6)
    # This run's lr at the loaded position of the schedule: half of what the DP run used there.
    dp_lrs, k2_lrs = _logged_lrs(base / "run"), _logged_lrs(tmp_path / "k2_run")
    assert sorted(k2_lrs) == [5, 6]
    for step in (5, 6):
        assert k2_lrs[step] == pytest.approx(dp_lrs[step] / 2, rel=1e-6)


def test_a_start_takes_this_runs_hyperparameters_at_the_loaded_position():
    """Reference: torch.optim.AdamW and LambdaLR as this run would build them, stepped to the position."""
    def run(lr: float, weight_decay: float):
        p = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([{"params": [p], "kind": "adamw"}], lr=lr, weight_decay=weight_decay)
        return p, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 10)

    p, other, other_schedule = run(0.5, 0.1)
    for _ in range(3):
        p.grad = torch.ones(3)
        other.step()
        other_schedule.step()
    saved = {"optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in other.param_groups],
                           "state": {"w": dict(other.state[p])}},
             "scheduler": other_schedule.state_dict(), "step": 3}
    _, mine, my_schedule = run(0.02, 0.01)
    started = with_run_hyperparameters(saved, mine, my_schedule)
    (group,) = started["optimizer"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (pytest.approx(0.02 * 4 / 10), 0.01)
    assert started["scheduler"]["last_epoch"] == 3 and started["scheduler"]["base_lrs"] == [0.02]
    assert started["optimizer"]["state"] is saved["optimizer"]["state"]  # the moments are the other run's
    my_schedule.load_state_dict(started["scheduler"])
    my_schedule.step()
    assert my_schedule.get_last_lr() == [pytest.approx(0.02 * 5 / 10)]
    saved["optimizer"]["param_groups"][0]["kind"] = "muon"
    with pytest.raises(CheckpointError, match="param groups \\['muon'\\], this run \\['adamw'\\]"):
        with_run_hyperparameters(saved, mine, my_schedule)


def _meta(**changes) -> CheckpointMeta:
    sizes = ParallelSizes(2, 1, 1, 1)
    meta = CheckpointMeta(step=3, sizes=sizes, model=PRESETS["tiny"], vocab_size=1000, padded_vocab_size=1024,
                          ranks=[coordinates(r, sizes) for r in range(2)], tokenizer_model=None, extra_state=["muloco"],
                          rank_files={f"rank_{r:05d}.safetensors": "0" * 64 for r in range(2)}, config={"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1,
                                                           "data_parallel": 1, "workers": 2}})
    return replace(meta, **changes)


def test_refusals_name_what_does_not_fit():
    def start(meta=None, worker=1, batch=4):
        check_worker_start(meta or _meta(), worker, PRESETS["tiny"], 1024, batch)

    start()  # K=2 with an outer loop into a run of any K
    with pytest.raises(CheckpointError, match="checkpoint has workers 0..1"):
        start(worker=2)
    with pytest.raises(CheckpointError, match="global batch is 4 sequences, this run 8"):
        start(batch=8)
    start(batch=None)  # --load-worker-new-batch: any batch
    with pytest.raises(CheckpointError, match="padded vocabulary 2048"):
        start(_meta(padded_vocab_size=2048))


def test_flag_needs_load():
    from trainer.config import build_parser, resolve
    from muloco.core.errors import ConfigError

    args = build_parser().parse_args(["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x",
                                      "--load-worker", "0"])
    with pytest.raises(ConfigError, match="^--load-worker needs --load DIR$"):
        resolve(args, world_size=1)


def test_new_batch_needs_load_worker():
    from trainer.config import build_parser, resolve
    from muloco.core.errors import ConfigError

    args = build_parser().parse_args(["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x",
                                      "--load", "ckpt", "--load-worker-new-batch"])
    with pytest.raises(ConfigError, match="--load-worker-new-batch needs --load-worker W"):
        resolve(args, world_size=1)
