"""The select block: parsing, each rule, their fixed order, errors and warnings, finite and infinite tasksets."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from tandem.envs import IdxRange, SelectConfig, SelectError, SelectWarning, Task, apply_select, load_taskset, parse_idx


def rows(n: int) -> list[Task]:
    return [Task(idx=i, id=f"t{i}", name="even" if i % 2 == 0 else "odd", prompt=f"p{i}") for i in range(n)]


def idxs(tasks) -> list[int]:
    return [t.idx for t in tasks]


def select(tasks, **block) -> list[int]:
    return idxs(apply_select(tasks, SelectConfig.model_validate(block)))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, [IdxRange(7, 8)]),
        ("7", [IdxRange(7, 8)]),
        ("0:100:2", [IdxRange(0, 100, 2)]),
        ("1,5,9", [IdxRange(1, 2), IdxRange(5, 6), IdxRange(9, 10)]),
        ("0:10, 20:30", [IdxRange(0, 10), IdxRange(20, 30)]),
        ([0, "10:20", "3,4"], [IdxRange(0, 1), IdxRange(10, 20), IdxRange(3, 4), IdxRange(4, 5)]),
        ("10:", [IdxRange(10, None)]),
        (":5", [IdxRange(0, 5)]),
        ("::3", [IdxRange(0, None, 3)]),
        ([], []),
    ],
)
def test_parse_idx(value, expected):
    assert list(parse_idx(value)) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "'-1' is negative"),
        (-3, "'-3' is negative"),
        ("0:-5", "'0:-5' is negative"),
        ("5:5", "'5:5' is empty"),
        ("10:3", "'10:3' is empty"),
        ("0:10:0", "'0:10:0' has step 0"),
        ("0:10:-1", "'0:10:-1' has step -1"),
        ("a:b", "'a:b' is not an integer"),
        ("1:2:3:4", "'1:2:3:4' is not an integer"),
        ("1,,2", "'' is not an integer"),
        (True, "got True"),
        (1.5, "got 1.5"),
    ],
)
def test_bad_ranges_fail_at_config_load_naming_the_range(value, message):
    with pytest.raises(ValidationError, match=r"include\.idx") as e:
        SelectConfig.model_validate({"include": value})
    assert message in str(e.value)
    with pytest.raises(ValidationError, match=r"exclude\.idx"):
        SelectConfig.model_validate({"exclude": {"idx": value}})


def test_bad_keys_and_counts_fail_at_config_load():
    with pytest.raises(ValidationError, match="extra"):
        SelectConfig.model_validate({"limt": 3})
    with pytest.raises(ValidationError, match="skip"):
        SelectConfig(skip=-1)
    with pytest.raises(ValidationError, match="limit"):
        SelectConfig(limit=0)


def test_dump_loads_back():
    block = SelectConfig.model_validate(
        {"include": [1, "3:7", "10:", "0:9:3"], "exclude": {"ids": ["a"]}, "shuffle": True, "seed": 3, "limit": 4}
    )
    assert SelectConfig.model_validate(block.model_dump()) == block
    assert SelectConfig.model_validate_json(block.model_dump_json()) == block
    assert SelectConfig.model_validate(SelectConfig().model_dump()) == SelectConfig()


def test_default_selects_everything_in_load_order():
    assert select(rows(5)) == [0, 1, 2, 3, 4]


def test_include_by_idx_ids_and_names_is_a_union():
    assert select(rows(10), include="0:10:3") == [0, 3, 6, 9]
    assert select(rows(10), include=[8, "1,2"]) == [1, 2, 8]
    assert select(rows(10), include={"ids": ["t4", "t7"]}) == [4, 7]
    assert select(rows(10), include={"names": ["odd"]}) == [1, 3, 5, 7, 9]
    assert select(rows(10), include={"idx": "0:2", "ids": ["t5"], "names": ["even"]}) == [0, 1, 2, 4, 5, 6, 8]


def test_exclude_by_idx_ids_and_names():
    assert select(rows(6), exclude="1:6:2") == [0, 2, 4]
    assert select(rows(6), exclude={"ids": ["t0"], "names": ["odd"]}) == [2, 4]


def test_shuffle_is_seeded_and_a_permutation():
    first = select(rows(50), shuffle=True, seed=1)
    assert first == select(rows(50), shuffle=True, seed=1)
    assert first != select(rows(50), shuffle=True, seed=2)
    assert first != list(range(50)) and sorted(first) == list(range(50))


def test_skip_and_limit():
    assert select(rows(10), skip=7) == [7, 8, 9]
    assert select(rows(10), limit=3) == [0, 1, 2]
    assert select(rows(10), skip=2, limit=3) == [2, 3, 4]
    assert select(rows(10), skip=20) == []


def test_order_is_include_exclude_shuffle_skip_limit():
    block = {"include": "0:20", "exclude": "0:20:2", "shuffle": True, "seed": 7, "skip": 2, "limit": 3}
    kept = [i for i in range(20) if i % 2]  # include, then exclude
    shuffled = select(rows(40), include="0:20", exclude="0:20:2", shuffle=True, seed=7)
    assert sorted(shuffled) == kept  # the shuffle only sees what include/exclude kept
    assert select(rows(40), **block) == shuffled[2:5]  # skip and limit count after the shuffle


def test_include_matching_nothing_warns():
    with pytest.warns(SelectWarning, match=r"idx 50:60.*id 'nope'.*name 'gone'"):
        assert select(rows(5), include={"idx": ["50:60", 1], "ids": ["nope"], "names": ["gone"]}) == [1]


def test_task_idx_must_be_load_order():
    shuffled = [Task(idx=1, prompt="a"), Task(idx=0, prompt="b")]
    with pytest.raises(SelectError, match="idx must be the load order"):
        apply_select(shuffled, SelectConfig())


def infinite():
    return (Task(idx=i, id=f"t{i}", prompt="p") for i in itertools.count())


def test_infinite_without_limit_stays_lazy():
    out = apply_select(infinite(), SelectConfig.model_validate({"exclude": "0:10", "skip": 1}))
    assert not isinstance(out, list)
    assert idxs(itertools.islice(out, 3)) == [11, 12, 13]


def test_limit_and_bounded_include_bound_an_infinite_taskset():
    assert select(infinite(), limit=3, skip=2) == [2, 3, 4]
    assert select(infinite(), include="5:8,100", exclude={"ids": ["t6"]}) == [5, 7, 100]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"shuffle": True, "limit": 5}, "shuffle needs a finite taskset"),
        ({"include": {"ids": ["t1"]}, "limit": 5}, "include by ids or names needs a finite taskset"),
        ({"include": {"names": ["x"]}, "limit": 5}, "include by ids or names needs a finite taskset"),
    ],
)
def test_infinite_taskset_rejects_what_needs_all_rows(block, message):
    with pytest.raises(SelectError, match=message):
        apply_select(infinite(), SelectConfig.model_validate(block))


def test_eval_and_training_sources_pick_the_same_tasks():
    """There is one select implementation; whichever way a source hands over its tasks, the same block picks the same."""
    import tandem.envs
    import tandem.envs.select

    assert tandem.envs.apply_select is tandem.envs.select.apply_select
    block = SelectConfig.model_validate(
        {"include": "0:200", "exclude": "3,5", "shuffle": True, "seed": 11, "limit": 20}
    )
    taskset = load_taskset("arithmetic", seed=4, num_tasks=300)
    as_eval = apply_select(taskset, block)  # an eval source passes the taskset
    as_training = apply_select(list(taskset.tasks()), block)  # a training source may pass rows it already holds
    assert [t.model_dump() for t in as_eval] == [t.model_dump() for t in as_training]
    assert len(as_eval) == 20
