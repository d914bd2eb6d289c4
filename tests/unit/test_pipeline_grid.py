"""The pipeline x data-parallel layout (pure): literal tables, inverse maps, bad sizes."""

from __future__ import annotations

import pytest

from syncline.comm.topology import PipelineLayout, pipeline_grid
from syncline.errors import ConfigError


@pytest.mark.parametrize(
    ("world", "stages", "pipelines", "replicas"),
    [
        (1, 1, ((0,),), ((0,),)),
        (4, 4, ((0, 1, 2, 3),), ((0,), (1,), (2,), (3,))),
        (4, 1, ((0,), (1,), (2,), (3,)), ((0, 1, 2, 3),)),
        (4, 2, ((0, 2), (1, 3)), ((0, 1), (2, 3))),
        (6, 3, ((0, 2, 4), (1, 3, 5)), ((0, 1), (2, 3), (4, 5))),
        (6, 2, ((0, 3), (1, 4), (2, 5)), ((0, 1, 2), (3, 4, 5))),
        (8, 4, ((0, 2, 4, 6), (1, 3, 5, 7)), ((0, 1), (2, 3), (4, 5), (6, 7))),
    ],
)
def test_literal_grids(world: int, stages: int, pipelines: tuple, replicas: tuple) -> None:
    assert pipeline_grid(world, stages) == (pipelines, replicas)


@pytest.mark.parametrize(("world", "stages"), [(1, 1), (4, 2), (6, 3), (8, 2), (12, 4)])
def test_every_rank_is_in_one_pipeline_and_one_replica_group_meeting_only_there(
    world: int, stages: int
) -> None:
    layout = PipelineLayout(world, stages)
    pipelines, replicas = pipeline_grid(world, stages)
    assert sorted(r for g in pipelines for r in g) == list(range(world))
    assert sorted(r for g in replicas for r in g) == list(range(world))
    for rank in range(world):
        stage, replica = layout.stage_of(rank), layout.replica_of(rank)
        assert rank == stage * layout.width + replica
        pipe, dp = pipelines[replica], replicas[stage]
        assert pipe.index(rank) == stage and dp.index(rank) == replica
        assert set(pipe) & set(dp) == {rank}
    for group in replicas:  # a stage's replicas are consecutive ranks (one node)
        assert list(group) == list(range(group[0], group[0] + layout.width))


@pytest.mark.parametrize(
    ("world", "stages", "message"),
    [
        (4, 3, "world_size=4 is not divisible by num_stages=3"),
        (6, 4, "world_size=6 is not divisible by num_stages=4"),
        (2, 4, "world_size=2 is not divisible by num_stages=4"),
        (4, 0, "num_stages=0 is invalid; valid: an integer >= 1"),
        (0, 1, "world_size=0 is invalid; valid: an integer >= 1"),
        (4, True, "num_stages=True is invalid; valid: an integer >= 1"),
    ],
)
def test_bad_layouts_raise_naming_the_values(world: int, stages: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pipeline_grid(world, stages)


def test_out_of_range_lookups_name_the_value() -> None:
    layout = PipelineLayout(4, 2)
    with pytest.raises(ConfigError, match="rank=4 out of range"):
        layout.stage_of(4)
    with pytest.raises(ConfigError, match="replica=2 out of range"):
        layout.pipeline_ranks(2)
    with pytest.raises(ConfigError, match="stage=-1 out of range"):
        layout.data_parallel_ranks(-1)
