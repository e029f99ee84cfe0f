"""train/profile.py: the interval arithmetic behind comm_exposed_s, which steps are profiled,
and the config keys that choose them."""

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError
from shardwise.train.profile import clip, exposed, intersect, measure, profiled_range, union


def test_union_merges_overlapping_touching_and_nested_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 12), (10.5, 11), (8, 8)]) == [(0, 4), (5, 7), (10, 12)]
    assert measure([(0, 2), (1, 3), (10, 11)]) == 4  # 0-3 and 10-11
    assert union([]) == [] and measure([]) == 0


def test_intersection_of_two_unions():
    a = [(0, 10), (20, 30)]
    b = [(5, 25), (28, 40), (2, 3)]
    assert intersect(a, b) == [(2, 3), (5, 10), (20, 25), (28, 30)]
    assert intersect(a, []) == [] and intersect([(0, 1)], [(1, 2)]) == []  # touching is no overlap
    assert clip([(0, 5), (8, 12), (20, 30)], 3, 10) == [(3, 5), (8, 10)]


def test_exposed_is_comm_not_covered_by_compute():
    # comm: two collectives overlapping each other (0-4 and 3-6 -> 0-6) and one alone (10-14): 10 us in all.
    # compute: 1-2 and 5-12 (the second overlaps both comm spans) -> covers 1-2, 5-6, 10-12 = 4 us.
    comm = [(0, 4), (3, 6), (10, 14)]
    compute = [(1, 2), (5, 12), (7, 8)]
    assert exposed(comm, compute) == (10, 6)
    assert exposed(comm, []) == (10, 10)  # nothing hides it
    assert exposed(comm, [(-1, 20)]) == (10, 0)  # all of it hidden
    assert exposed([], compute) == (0, 0)


def test_profiled_range():
    assert profiled_range(0, 0, 100) == (0, -1)  # off
    assert profiled_range(2, 0, 10) == (9, 10)  # 0: the last steps of the run
    assert profiled_range(2, 4, 10) == (4, 5)
    assert profiled_range(5, 0, 3) == (1, 3) and profiled_range(3, 9, 10) == (9, 10)  # clamped to the run


def test_profile_keys_are_validated_naming_the_key():
    assert config.load_config(None, {}).cfg.profile_steps == 0  # off by default
    cfg = config.load_config(None, {"profile_steps": ("2", "flag --profile-steps"),
                                    "profile_start": ("5", "flag --profile-start")}).cfg
    assert (cfg.profile_steps, cfg.profile_start) == (2, 5)
    with pytest.raises(ShardwiseError, match="flag --profile-steps: profile_steps must be >= 0"):
        config.load_config(None, {"profile_steps": ("-1", "flag --profile-steps")})
    with pytest.raises(ShardwiseError, match="flag --profile-start: profile_start 9 .* runs past max_steps 10"):
        config.load_config(None, {"profile_steps": ("3", "flag --profile-steps"),
                                  "profile_start": ("9", "flag --profile-start"),
                                  "max_steps": ("10", "flag --max-steps")})
