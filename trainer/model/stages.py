"""How many transformer layers each pipeline stage holds.

Even when P divides the layers. Otherwise Megatron's uneven split: the P-2 middle stages hold the
same count and the first and last stages (which also hold the embedding and the output head) hold
what is left, split as evenly as possible between them. E.g. the 15B shape's 54 layers at P=4 are
13 + 14 + 14 + 13. The builder hands the first/last counts to Megatron's TransformerConfig, and the
planner uses the same split, so both agree on which layouts exist.
"""
from __future__ import annotations

import math


def stage_layers(num_layers: int, pipeline: int) -> tuple[int, ...]:
    if pipeline < 1 or num_layers < pipeline:
        raise ValueError(f"num-layers {num_layers} cannot be split over pipeline-model-parallel-size {pipeline} "
                         "(every stage needs at least one layer)")
    if num_layers % pipeline == 0:
        return (num_layers // pipeline,) * pipeline
    if pipeline == 2:
        first = num_layers // 2
        return first, num_layers - first
    middle = math.ceil(num_layers / pipeline)
    while num_layers - middle * (pipeline - 2) < 2:  # first and last need a layer each
        middle -= 1
    ends = num_layers - middle * (pipeline - 2)
    return (ends // 2,) + (middle,) * (pipeline - 2) + (ends - ends // 2,)


def uneven_stage_sizes(num_layers: int, pipeline: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts for Megatron's TransformerConfig; (None, None) when even."""
    layers = stage_layers(num_layers, pipeline)
    if len(set(layers)) == 1:
        return None, None
    return layers[0], layers[-1]
