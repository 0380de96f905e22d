"""arithmetic: integer +, -, * questions; reward 1 when the final number equals the answer."""

from __future__ import annotations

import operator
import random

from tandem.envs.base import Task, reward
from tandem.envs.numbers import extract_final_number
from tandem.envs.synthetic import SyntheticTaskset

OPERATIONS = {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul)}


class Arithmetic(SyntheticTaskset):
    """`a <op> b` with operands in [0, max_operand]; each task's `name` is its operation."""

    def __init__(
        self,
        seed: int = 0,
        num_tasks: int | None = None,
        max_operand: int = 100,
        operations: tuple[str, ...] | list[str] = tuple(OPERATIONS),
    ) -> None:
        super().__init__(seed, num_tasks)
        unknown = sorted(set(operations) - OPERATIONS.keys())
        if unknown or not operations:
            raise ValueError(f"operations must be a non-empty subset of {list(OPERATIONS)}, got {list(operations)}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.max_operand, self.operations = max_operand, tuple(operations)

    def make_task(self, idx: int, rng: random.Random) -> Task:
        op = rng.choice(self.operations)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        symbol, fn = OPERATIONS[op]
        return Task(
            idx=idx,
            id=f"arithmetic-{self.seed}-{idx}",
            name=op,
            prompt=f"What is {a} {symbol} {b}? Reply with the number only.",
            answer=str(fn(a, b)),
        )

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(extract_final_number(completion) == answer)
