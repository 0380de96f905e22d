"""guess_number: a multi-turn game; the model guesses a secret integer and hears "higher" or "lower"."""

from __future__ import annotations

import random
from typing import Any

from tandem.envs.base import Message, Task, last_assistant_text, metric, reward
from tandem.envs.multiturn import MultiTurnTaskset
from tandem.envs.numbers import extract_final_number
from tandem.envs.synthetic import SyntheticTaskset


class GuessNumber(SyntheticTaskset, MultiTurnTaskset):
    """Guess a secret in [1, `max_value`] within `max_turns` guesses; fewer guesses earn more."""

    max_turns = 8

    def __init__(self, seed: int = 0, num_tasks: int | None = None, max_value: int = 100) -> None:
        super().__init__(seed, num_tasks)
        if max_value < 2:
            raise ValueError(f"max_value must be >= 2, got {max_value}")
        self.max_value = max_value

    def make_task(self, idx: int, rng: random.Random) -> Task:
        secret = rng.randint(1, self.max_value)
        return Task(
            idx=idx,
            id=f"guess_number-{self.seed}-{idx}",
            name="guess_number",
            prompt=(
                f"I am thinking of an integer between 1 and {self.max_value}. Guess it: reply with one integer. "
                "After each guess I will say 'higher', 'lower' or 'correct'."
            ),
            answer=str(secret),
        )

    def init_state(self, task: Task) -> dict[str, Any]:
        return {"guesses": [], "solved": False}

    def step(self, task: Task, messages: list[Message], state: dict[str, Any]) -> str | None:
        guess = extract_final_number(last_assistant_text(messages))
        if guess is None:
            return "Reply with a single integer."
        state["guesses"].append(guess)
        if guess == task.answer:
            state["solved"] = True
            return None
        return "higher" if float(guess) < int(task.answer) else "lower"

    @reward
    def solved(self, state: dict[str, Any]) -> float:
        return float(state.get("solved", False))

    @reward(weight=0.5)
    def efficiency(self, state: dict[str, Any]) -> float:
        """1 for a first-guess win, falling linearly to 0 for a win on the last allowed turn."""
        if not state.get("solved"):
            return 0.0
        return 1.0 - (len(state["guesses"]) - 1) / max(self.max_turns - 1, 1)

    @metric
    def guesses(self, state: dict[str, Any]) -> float:
        return float(len(state.get("guesses", [])))
