"""count_shapes: how many shapes of one colour an image shows; reward 1 when the final number is the count.

A visual task for vision-language models (Qwen3-VL, Qwen2.5-VL): each task draws 1 to `max_shapes` squares and discs
in 2 to 4 colours at random places on a white `size` x `size` PNG and asks for the count of one colour. The image
travels inline in the prompt as an OpenAI `image_url` part with a data URL (`tandem.images`), so a rollout, a
dataset row and a training batch all carry the same bytes. Every choice comes from the task's own seeded RNG:
task `idx` is the same image whenever it is drawn. Needs Pillow (`pip install tandem[vision]`).
"""

from __future__ import annotations

import base64
import io
import random

from tandem.envs.base import Task, reward
from tandem.envs.numbers import extract_final_number
from tandem.envs.synthetic import SyntheticTaskset

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (50, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 170),
}


class CountShapes(SyntheticTaskset):
    """Count the shapes of one colour in a generated image; each task's `name` is the asked colour."""

    def __init__(self, seed: int = 0, num_tasks: int | None = None, max_shapes: int = 5, size: int = 64) -> None:
        super().__init__(seed, num_tasks)
        if not 1 <= max_shapes <= 12:
            raise ValueError(f"max_shapes must be in [1, 12], got {max_shapes}")
        if not 32 <= size <= 1024:
            raise ValueError(f"size must be in [32, 1024] pixels, got {size}")
        self.max_shapes, self.size = max_shapes, size

    def make_task(self, idx: int, rng: random.Random) -> Task:
        palette = rng.sample(sorted(COLOURS), rng.randint(2, 4))
        colours = [rng.choice(palette) for _ in range(rng.randint(1, self.max_shapes))]
        asked = rng.choice(palette)
        image = {"type": "image_url", "image_url": {"url": self._draw(colours, rng)}}
        question = {"type": "text", "text": f"How many {asked} shapes are in the image? Reply with the number only."}
        return Task(
            idx=idx,
            id=f"count_shapes-{self.seed}-{idx}",
            name=asked,
            prompt=[{"role": "user", "content": [image, question]}],
            answer=str(colours.count(asked)),
            info={"shapes": colours},
        )

    def _draw(self, colours: list[str], rng: random.Random) -> str:
        """A PNG data URL: each shape a square or disc of its colour, in its own cell of a grid (never overlapping)."""
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        cells = 4
        cell = self.size // cells
        for colour, slot in zip(colours, rng.sample(range(cells * cells), len(colours)), strict=True):
            x, y = (slot % cells) * cell, (slot // cells) * cell
            margin = rng.randint(1, max(1, cell // 4))
            box = (x + margin, y + margin, x + cell - margin, y + cell - margin)
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=COLOURS[colour])
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(extract_final_number(completion) == answer)
