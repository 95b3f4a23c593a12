"""A partition the runtime's model cannot run is refused before anything moves (review of the empty
stage): `stage.check_partition_shapes` builds the partition's stages on the meta device and compares
what each would send with the home split's boundary shapes (what every receiver allocates). Without
it a layer list whose first stage is left no layer sends the data itself, and the next stage fails
mid-iteration ("mat1 and mat2 shapes cannot be multiplied")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from planner.errors import InvalidInputError
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.stage import check_partition_shapes, infer_shapes
from runtime_adapter.training import Training, layer_ranges_from_layers, stages_from_layers
from tests.test_runtime_empty_stage import layer_list_training

P = 3


def layer_list(layers: Callable[[], list[torch.nn.Module]], width: int) -> Training:
    """test_runtime_empty_stage's layer-list Training with other layers and data `width` wide."""
    return replace(
        layer_list_training(),
        stage=stages_from_layers(layers),
        data=lambda it, d, m: (torch.zeros(2, width), torch.zeros(2, 8)),
        layer_ranges=layer_ranges_from_layers(layers),
    )


def widening_training() -> Training:
    """Linear(4, 8), then three Linear(8, 8): the data (width 4) is not an activation (width 8)."""
    return layer_list(lambda: [torch.nn.Linear(4, 8), *(torch.nn.Linear(8, 8) for _ in range(3))], 4)


def ranges(*bounds: tuple[int, int]) -> list[range]:
    return [range(a, b) for a, b in bounds]


def test_an_empty_first_stage_that_would_send_the_data_is_refused_naming_the_stage() -> None:
    t = widening_training()
    shapes = infer_shapes(t, P)
    assert shapes == [(2, 8), (2, 8)]
    check_partition_shapes(t, P, shapes, ranges((0, 2), (2, 3), (3, 4)))  # home
    check_partition_shapes(t, P, shapes, ranges((0, 1), (1, 1), (1, 4)))  # an empty middle stage
    check_partition_shapes(t, P, shapes, ranges((0, 1), (1, 4), (4, 4)))  # an empty last stage
    with pytest.raises(InvalidInputError) as err:
        check_partition_shapes(t, P, shapes, ranges((0, 0), (0, 3), (3, 4)))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("partition [[0, 0], [0, 3], [3, 4]]: stage 0 holding layers [0, 0) would send")
    assert "[2, 4] (with no layer it sends its input: the data itself), but stage 1 receives [2, 8]" in msg


def test_a_moved_layer_that_changes_a_boundary_shape_is_refused() -> None:
    t = layer_list(lambda: [torch.nn.Linear(8, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)], 8)
    shapes = infer_shapes(t, P)  # [2, 8] then [2, 16]
    match = r"stage 0 holding layers \[0, 2\) would send shape \[2, 16\], but stage 1 receives \[2, 8\]"
    with pytest.raises(InvalidInputError, match=match):
        check_partition_shapes(t, P, shapes, ranges((0, 2), (2, 2), (2, 3)))


def test_the_reference_gpt_runs_any_partition() -> None:
    t = gpt_training(GPTConfig(num_layers=4))
    shapes = infer_shapes(t, P)
    for part in [((0, 0), (0, 4), (4, 4)), ((0, 4), (4, 4), (4, 4)), ((0, 0), (0, 0), (0, 4))]:
        check_partition_shapes(t, P, shapes, ranges(*part))  # the embedding stays on stage 0
