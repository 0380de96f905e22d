"""Built-in single-turn tasksets: determinism, rewards on correct and incorrect answers, argument checks."""

from __future__ import annotations

import asyncio
import itertools
import operator

import pytest

from tandem.envs import load_taskset

SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def reward(taskset, task, completion) -> float:
    return asyncio.run(taskset.score(task, completion)).reward


@pytest.mark.parametrize("taskset_id", ["reverse_text", "arithmetic", "guess_number", "count_shapes"])
def test_synthetic_tasks_depend_only_on_seed_and_idx(taskset_id):
    finite = load_taskset(taskset_id, seed=3, num_tasks=10).tasks()
    infinite = list(itertools.islice(load_taskset(taskset_id, seed=3).tasks(), 10))
    assert isinstance(finite, list) and not isinstance(load_taskset(taskset_id).tasks(), list)
    assert finite == infinite
    assert load_taskset(taskset_id, seed=3).task(7) == finite[7]
    assert load_taskset(taskset_id, seed=4, num_tasks=10).tasks() != finite
    assert [t.idx for t in finite] == list(range(10))
    assert len({t.id for t in finite}) == 10


def test_synthetic_tasks_do_not_drift():
    """Golden rows: a change to task generation would silently change every eval set built on these ids."""
    assert load_taskset("arithmetic").task(0).prompt == "What is 86 * 73? Reply with the number only."
    assert load_taskset("guess_number").task(0).answer == "75"
    assert load_taskset("reverse_text", seed=1).task(5).info["text"] == "apple quiet quiet"


def test_num_tasks_must_be_positive():
    with pytest.raises(ValueError, match="num_tasks must be >= 1"):
        load_taskset("reverse_text", num_tasks=0)


def test_reverse_text_rewards_similarity():
    taskset = load_taskset("reverse_text", num_tasks=1)
    task = taskset.tasks()[0]
    assert task.prompt.endswith(task.info["text"]) and task.answer == task.info["text"][::-1]
    exact = asyncio.run(taskset.score(task, f"  {task.answer}\n"))
    assert exact.reward == 1.0 and exact.metrics["exact"] == 1.0
    near = asyncio.run(taskset.score(task, task.answer[:-2]))
    assert 0.5 < near.reward < 1.0 and near.metrics["exact"] == 0.0
    assert reward(taskset, task, task.info["text"]) < near.reward  # unreversed text
    assert reward(taskset, task, "") == 0.0


def test_reverse_text_checks_word_counts():
    with pytest.raises(ValueError, match="min_words"):
        load_taskset("reverse_text", min_words=4, max_words=2)


def test_arithmetic_exact_answer():
    taskset = load_taskset("arithmetic", num_tasks=30, operations=["sub"], max_operand=9)
    tasks = taskset.tasks()
    assert {t.name for t in tasks} == {"sub"}
    negative = next(t for t in tasks if t.answer.startswith("-"))
    assert reward(taskset, negative, negative.answer) == 1.0
    assert reward(taskset, negative, f"The answer is {negative.answer}.") == 1.0
    assert reward(taskset, negative, negative.answer.lstrip("-")) == 0.0
    assert reward(taskset, negative, "I cannot say") == 0.0


def test_arithmetic_names_are_operations():
    tasks = load_taskset("arithmetic", num_tasks=60).tasks()
    assert {t.name for t in tasks} == {"add", "sub", "mul"}
    for task in tasks:
        a, symbol, b = task.prompt.removeprefix("What is ").split("?")[0].split()
        assert str(SYMBOLS[symbol](int(a), int(b))) == task.answer


def test_arithmetic_checks_operations():
    with pytest.raises(ValueError, match="operations"):
        load_taskset("arithmetic", operations=["div"])


def test_count_shapes_shows_the_counted_shapes_inline():
    """The image is a PNG data URL part of the prompt; counting its pixels of the asked colour's shapes gives the
    answer; the reward checks the final number."""
    Image = pytest.importorskip("PIL.Image", reason="count_shapes draws with Pillow")
    from tandem.envs.builtin.count_shapes import COLOURS
    from tandem.images import image_refs, read_image

    taskset = load_taskset("count_shapes", seed=2, num_tasks=20)
    for task in taskset.tasks():
        (ref,) = image_refs(task.messages())
        image = read_image(ref)
        assert isinstance(image, Image.Image) and image.size == (64, 64)
        shapes = task.info["shapes"]
        assert task.answer == str(shapes.count(task.name)) and task.name in COLOURS
        present = {name for name, rgb in COLOURS.items() if rgb in {c for _, c in image.getcolors(4096)}}
        assert present == set(shapes)  # every drawn colour is in the picture, no other
        assert reward(taskset, task, f"There are {task.answer}") == 1.0
        assert reward(taskset, task, str(int(task.answer) + 1)) == 0.0
    with pytest.raises(ValueError, match="max_shapes"):
        load_taskset("count_shapes", max_shapes=0)
