"""A rank's intra-op threads: its share of the cores it may run on when OMP_NUM_THREADS is unset,
the user's value when set, and one line that says which."""
import torch

from trainer.threads import apply_thread_default, available_cores, choose_threads


def test_each_rank_takes_its_share_of_the_cores():
    assert choose_threads({"LOCAL_WORLD_SIZE": "2"}, cores=2, current_threads=2).threads == 1  # torchrun
    assert choose_threads({"LOCAL_SIZE": "3"}, cores=16, current_threads=16).threads == 5  # DeepSpeed's launcher
    assert choose_threads({"LOCAL_WORLD_SIZE": "8"}, cores=2, current_threads=2).threads == 1  # never 0
    assert choose_threads({}, cores=4, current_threads=4).threads == 4  # alone on the host
    line = choose_threads({"LOCAL_SIZE": "2"}, cores=8, current_threads=8).line
    assert line == ("threads: 4 intra-op threads per rank (8 cores available / 2 ranks on this host; "
                    "set OMP_NUM_THREADS to choose)")


def test_the_users_value_wins():
    choice = choose_threads({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}, cores=8, current_threads=3)
    assert choice.threads is None
    assert choice.line == "threads: 3 intra-op threads per rank (OMP_NUM_THREADS=3, as set)"


def test_applying_sets_torch_and_the_environment_for_child_processes():
    before = torch.get_num_threads()
    environ = {"LOCAL_WORLD_SIZE": str(available_cores())}
    try:
        choice = apply_thread_default(environ)
        assert choice.threads == 1 and torch.get_num_threads() == 1 and environ["OMP_NUM_THREADS"] == "1"
        assert apply_thread_default(environ).threads is None  # now set: left alone
    finally:
        torch.set_num_threads(before)
