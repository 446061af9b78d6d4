"""The entry point under the real launcher: an impossible size stops every rank at once with one clear
message (no hang), and a short T=2 run writes config.json, metrics.jsonl and TensorBoard events
while the loss goes down."""
import json
import re

import pytest

from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import PRETRAIN, launch_ranks, read_metrics
from tools.trainer_runs import TINY_VOCAB, tiny_flags

# Far below LAUNCH_TIMEOUT_S: a rank waiting in a collective for a peer that already quit would hang.
FAIL_FAST_S = 120
STEPS = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_markov_dataset(str(tmp_path_factory.mktemp("cli") / "markov"), vocab_size=TINY_VOCAB)


@pytest.mark.launch
def test_impossible_size_exits_with_a_clear_message(data, tmp_path):
    result = launch_ranks(PRETRAIN, 2, tiny_flags(data, tmp_path / "run", "muon", "--tensor-model-parallel-size", "4"),
                          timeout_s=FAIL_FAST_S, omp_threads=None, launcher="deepspeed")
    assert result.returncode not in (0, 124), result.output[-4000:]
    # OMP_NUM_THREADS unset: the host's first rank says what share of the cores each of the 2 ranks took.
    assert len(re.findall(r"threads: \d+ intra-op threads per rank \(\d+ cores available / 2 ranks on this host",
                          result.output)) == 1, result.output[-4000:]
    assert ("configuration error: world size 2 is not divisible by workers x pipeline x tensor "
            "= 1 x 1 x 4 = 4") in result.output
    assert not (tmp_path / "run").exists(), "nothing may be written before the configuration is known good"


@pytest.mark.launch
def test_short_tensor_parallel_run_writes_its_run_dir_and_learns(data, tmp_path):
    run_dir = tmp_path / "run"
    launch_ranks(PRETRAIN, 2, tiny_flags(
        data, run_dir, "muon", "--tensor-model-parallel-size", "2", "--train-iters", str(STEPS),
        "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "2")).check("T=2 run")

    config = json.loads((run_dir / "config.json").read_text())
    assert (config["tensor_parallel"], config["batch"]["data_parallel"]) == (2, 1)
    assert config["optimizer"]["type"] == "muon" and config["schedule"]["train_iters"] == STEPS

    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    for r in train:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 4 * 128  # 4 sequences of 128 tokens per step
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    # The logged lr (after each step's schedule update): linear warm-up over 10 steps, cosine to 10% of the peak.
    peak = train[1]["lr"]
    assert [round(r["lr"] / peak, 9) for r in train] == [0.6, 1.0, 0.55, 0.1]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]

    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_without_a_launcher_the_entry_point_is_one_rank_of_a_world_of_one():
    """`python trainer/pretrain.py ...` alone: torchrun --nproc-per-node 1's variables with a free port
    (DeepSpeed fell back to MPI discovery and died on a missing mpi4py); a launched rank, or one an MPI
    launcher started, is left to its launcher."""
    import socket

    from muloco.core.comm import one_rank_without_launcher

    alone: dict[str, str] = {}
    assert one_rank_without_launcher(alone)
    assert {k: alone[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as rendezvous:  # the port is free for the rendezvous to bind
        rendezvous.bind(("127.0.0.1", int(alone["MASTER_PORT"])))
    for launched in ({"RANK": "1", "WORLD_SIZE": "2"}, {"OMPI_COMM_WORLD_SIZE": "4"}):
        environ = dict(launched)
        assert not one_rank_without_launcher(environ) and environ == launched
