"""The method comparison's selection on the selection seed (tools/compare/protocol.py): the inner then
the outer lr grid, extensions beyond an edge (at most three), an lr still at the edge marked, DP without
outer tuning, compressed variants inheriting their base's setting, and the test seeds (never the
selection seed)."""
from __future__ import annotations

import math

import pytest
from compare_fixtures import SETTINGS

from tools.compare.protocol import (
    Launch,
    Method,
    RunSpec,
    Settings,
    extension_lr,
    seed_launch,
    selection,
    selection_launch,
)


def test_extension_steps_beyond_the_edge_geometrically_at_most_three_times():
    grid = (0.01, 0.02, 0.04)
    assert extension_lr({0.01: 5.0, 0.02: 4.0, 0.04: 4.5}, grid, 2.0) is None  # bracketed
    assert extension_lr({0.01: 5.0, 0.02: 4.5, 0.04: 4.0}, grid, 2.0) == 0.08
    assert extension_lr({0.01: 4.0, 0.02: 4.5, 0.04: 5.0}, grid, 2.0) == 0.005
    assert extension_lr({0.5: 4.0, 0.7: 4.5, 1.0: 5.0}, (0.5, 0.7, 1.0), 2 ** 0.5) == 0.35
    assert extension_lr({0.5: 5.0, 0.7: 4.5, 1.0: 4.0}, (0.5, 0.7, 1.0), 2 ** 0.5) == 1.4
    walk = {0.01: 5.0, 0.02: 4.5, 0.04: 4.0, 0.08: 3.9, 0.16: 3.8, 0.32: 3.7}
    assert extension_lr(walk, grid, 2.0) is None  # three extensions spent


def _walk(method: Method, loss_of, settings=SETTINGS) -> tuple[list, dict]:
    losses, order = {}, []
    while (job := selection_launch(method, settings, losses)) is not None:
        order.append((job.spec.inner_lr, job.spec.outer_lr, job.spec.seed))
        losses[job.spec] = loss_of(job.spec.inner_lr, job.spec.outer_lr)
    return order, losses


def test_selection_tunes_the_inner_then_the_outer_lr_on_the_selection_seed_alone():
    method = Method.load("muloco_k2")  # the paper's K>1 outer point 1.0 is the top of the outer grid

    def loss_of(lr, outer):  # inner best at 0.04 (after one extension), outer best at 1.4 (one extension)
        return {0.01: 5.0, 0.02: 4.8, 0.04: 4.6, 0.08: 4.7}[lr] + {0.5: 0.3, 0.7: 0.2, 1.0: 0.1, 1.4: 0.0,
                                                                   2.0: 0.05}[outer]
    order, losses = _walk(method, loss_of)
    assert order == [(0.01, 1.0, 0), (0.02, 1.0, 0), (0.04, 1.0, 0), (0.08, 1.0, 0),
                     (0.04, 0.5, 0), (0.04, 0.7, 0), (0.04, 1.4, 0), (0.04, 2.0, 0)]
    chosen = selection(method, SETTINGS, losses)
    assert chosen.spec == RunSpec("muloco_k2", 0.04, 1.4, 0)
    assert not chosen.inner_at_edge and not chosen.outer_at_edge
    # Test seeds: the selected setting on each, never the selection seed; a DP baseline keeps its states.
    assert seed_launch(method, SETTINGS, losses, (1, 2, 3)) == Launch(RunSpec("muloco_k2", 0.04, 1.4, 1))
    assert seed_launch(method, SETTINGS, losses, (1, 2, 3), start_state_seeds=(1,)).start_states
    assert seed_launch(method, SETTINGS, {}, (1, 2, 3)) is None  # selection not done


def test_an_lr_still_at_the_edge_after_the_extensions_is_marked():
    method = Method.load("diloco_k1")
    order, losses = _walk(method, lambda lr, outer: 1 / lr + outer)  # ever larger lrs, ever smaller outer lrs
    chosen = selection(method, SETTINGS, losses)
    assert chosen.inner_at_edge and chosen.outer_at_edge
    assert chosen.spec.inner_lr == 0.32 and chosen.spec.outer_lr == 0.18
    assert len(order) == 3 + 3 + 2 + 3  # inner grid and 3 extensions, 2 more outer points and 3 extensions


def test_dp_has_no_outer_tuning_and_a_compressed_variant_inherits_its_setting():
    dp = Method.load("dp_muon")
    order, _ = _walk(dp, lambda lr, outer: abs(math.log(lr / 0.02)))
    assert order == [(0.01, None, 0), (0.02, None, 0), (0.04, None, 0)]
    variant, base = Method.load("muloco_k4_stat4"), Method.load("muloco_k4")
    assert selection_launch(variant, SETTINGS, {}) is None
    _, losses = _walk(base, lambda lr, outer: abs(math.log(lr / 0.02)) + abs(outer - 0.7))
    chosen = selection(variant, SETTINGS, losses)
    assert chosen.spec == RunSpec("muloco_k4_stat4", 0.02, 0.7, 0)
    assert seed_launch(variant, SETTINGS, losses, (1,)).spec == RunSpec("muloco_k4_stat4", 0.02, 0.7, 1)


def test_the_selection_seed_is_no_test_seed():
    with pytest.raises(ValueError, match="selection seed 0 cannot also be a test seed"):
        Settings(test_seeds=(0, 1, 2))
