"""--load-worker W: a run starts from worker W's weights, inner optimizer and schedule in a checkpoint
written with another number of workers K. Checked against the plain computation it stands for: a
K=2 checkpoint whose worker 1 holds a run's state at step 4 (worker 0 holds other weights) continues
that run exactly; and the refusals name what does not fit."""
import json
import shutil
from dataclasses import replace

import pytest
import torch
from _ckpt_runs import check, launch, losses

from trainer.checkpoint import CheckpointError, CheckpointMeta
from trainer.checkpoint.checkpointer import check_worker_start
from trainer.checkpoint.format import sha256_of
from trainer.checkpoint.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.model.presets import PRESETS
from trainer.topology import ParallelSizes, coordinates

pytestmark = pytest.mark.timeout(900)


def _as_two_workers(src, dst, step: int) -> None:
    """Iteration `step` of a one-worker checkpoint rewritten as K=2 with an outer loop: worker 1 holds
    the run's state, worker 0 the same with every weight negated."""
    directory = dst / f"iter_{step:07d}"
    shutil.copytree(src / f"iter_{step:07d}", directory)
    shutil.copyfile(directory / "rank_00000.safetensors", directory / "rank_00001.safetensors")
    state = to_plain(read_rank_file(directory / "rank_00001.safetensors"))  # memory-mapped: not the file rewritten
    state["model"] = {name: -w for name, w in state["model"].items()}
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


def test_worker_of_a_k2_checkpoint_continues_its_run(tmp_path):
    base = tmp_path
    check(launch(base, 1, tmp_path / "run", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"))
    _as_two_workers(tmp_path / "ckpt", tmp_path / "k2", 4)
    result = check(launch(base, 1, tmp_path / "from_worker1", "--load", str(tmp_path / "k2"), "--load-worker", "1"))
    assert "(worker 1 of K=2 D=1 P=1 T=1)" in result.stdout
    original, continued = losses(tmp_path / "run"), losses(tmp_path / "from_worker1")
    assert sorted(continued) == [5, 6]
    assert continued == {s: original[s] for s in (5, 6)}
    # Worker 0 (negated weights) is another starting point: the identity above can fail.
    check(launch(base, 1, tmp_path / "from_worker0", "--load", str(tmp_path / "k2"), "--load-worker", "0"))
    assert not torch.allclose(torch.tensor(losses(tmp_path / "from_worker0")[5]), torch.tensor(original[5]))


def _meta(**changes) -> CheckpointMeta:
    meta = CheckpointMeta(step=3, sizes=ParallelSizes(2, 1, 1, 1), model=PRESETS["tiny"], vocab_size=1000,
                          padded_vocab_size=1024, ranks=[], tokenizer_model=None, extra_state=["muloco"],
                          rank_files={}, config={"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1,
                                                           "data_parallel": 1, "workers": 2}})
    return replace(meta, **changes)


def test_refusals_name_what_does_not_fit():
    def start(meta=None, worker=1, batch=4, extra=()):
        check_worker_start(meta or _meta(), worker, PRESETS["tiny"], 1024, batch, list(extra))

    start()  # K=2 with an outer loop into a one-worker run without one
    with pytest.raises(CheckpointError, match="checkpoint has workers 0..1"):
        start(worker=2)
    with pytest.raises(CheckpointError, match="without an outer loop.*remove the ds_config's muloco block"):
        start(extra=["muloco"])
    with pytest.raises(CheckpointError, match="global batch is 4 sequences, this run 8"):
        start(batch=8)
    with pytest.raises(CheckpointError, match="padded vocabulary 2048"):
        start(_meta(padded_vocab_size=2048))


def test_flag_needs_load():
    from trainer.config import build_parser, resolve
    from trainer.errors import ConfigError

    args = build_parser().parse_args(["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x",
                                      "--load-worker", "0"])
    with pytest.raises(ConfigError, match="^--load-worker needs --load DIR$"):
        resolve(args, world_size=1)
