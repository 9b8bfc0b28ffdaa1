"""Shapes: a synthetic visual task drawn with PIL, for vision-language RL on a CPU.

Each image is 32x32 pixels on a grey background with 1 to 4 shapes (circle, square, triangle) of
one colour, at most one per quadrant. With the tiny VLM's 8-pixel patches and 2x2 merging an image
is 4 image tokens, one per quadrant, so "is there a shape here" is local to a token (at 48x48 the
3x3 tokens straddle the quadrants, and a linear probe of the untrained tower reads the count less
well: 76% against 92%). The question is one of:

- ``count``: "How many shapes?" -> ``"3"``
- ``colour``: "What colour are the shapes?" -> ``"red"``

The image is drawn from a seed kept in the row (``image_seed``) and stored as a PNG data URL under
``images``, so rows are plain JSON and the same row always gives the same pixels. Train and test
images come from disjoint seed ranges.
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

__all__ = ["COLOURS", "DESCRIPTION", "REWARD", "corrupt_answer", "draw", "make_rows", "sft_rows"]

REWARD = "exact_match"
DESCRIPTION = "count the shapes or name their colour in a 32x32 PIL image (vision-language)"
SIDE = 32
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 220),
    "yellow": (230, 200, 30),
}
KINDS = ("circle", "square", "triangle")
QUESTIONS = {"count": "How many shapes?", "colour": "What colour are the shapes?"}
MAX_SHAPES = 4
_TEST_OFFSET = 1 << 40


def draw(seed: int, side: int = SIDE) -> tuple[Any, int, str]:
    """The image of `seed`: (PIL image, number of shapes, colour name). Shapes do not overlap."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    count = rng.randint(1, MAX_SHAPES)
    colour = rng.choice(sorted(COLOURS))
    img = Image.new("RGB", (side, side), (128, 128, 128))
    pen = ImageDraw.Draw(img)
    cell = side // 2
    cells = rng.sample([(0, 0), (0, 1), (1, 0), (1, 1)], count)  # one shape per quadrant
    for r, c in cells:
        size = rng.randint(cell // 2, cell - 4)
        x0 = c * cell + rng.randint(1, cell - size - 1)
        y0 = r * cell + rng.randint(1, cell - size - 1)
        box = [x0, y0, x0 + size, y0 + size]
        kind = rng.choice(KINDS)
        if kind == "circle":
            pen.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            pen.rectangle(box, fill=COLOURS[colour])
        else:
            pen.polygon(
                [(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)],
                fill=COLOURS[colour],
            )
    return img, count, colour


def _data_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _row(seed: int, question: str) -> dict[str, Any]:
    img, count, colour = draw(seed)
    answer = str(count) if question == "count" else colour
    return {
        "prompt": QUESTIONS[question],
        "images": [_data_url(img)],
        "answer": answer,
        "question": question,
        "image_seed": seed,
        "task": "shapes",
    }


def make_rows(
    split: str, n: int, seed: int, *, questions: str = "count,colour"
) -> list[dict[str, Any]]:
    """`n` rows of `split` ("train" or "test"); `questions` is a comma-separated subset of
    ``count,colour``, asked in turn. The same (split, n, seed, questions) gives the same rows."""
    if split not in ("train", "test"):
        raise ValueError(f"shapes: split must be 'train' or 'test', got {split!r}")
    kinds = [q.strip() for q in questions.split(",") if q.strip()]
    bad = sorted(set(kinds) - set(QUESTIONS))
    if not kinds or bad:
        raise ValueError(
            f"shapes: questions must be a subset of {sorted(QUESTIONS)}, got {questions!r}"
        )
    rng = random.Random(f"shapes:{split}:{seed}")
    base = _TEST_OFFSET if split == "test" else 0
    return [_row(base + rng.randrange(_TEST_OFFSET), kinds[i % len(kinds)]) for i in range(n)]


def corrupt_answer(question: str, answer: str) -> str:
    """The systematic error used for corrupted SFT targets: the next answer in a fixed cycle,
    ``1 -> 2 -> 3 -> 4 -> 1`` for counts and ``blue -> green -> red -> yellow -> blue`` for colours.

    A fixed rule (not a random other answer) keeps the corrupted targets a function of the image,
    so SFT still has to read the pixels to learn them: the warm-started policy's mode is wrong, yet
    it gives the right answer the rest of the time, which GRPO can then reinforce."""
    cycle = [str(n) for n in range(1, MAX_SHAPES + 1)] if question == "count" else sorted(COLOURS)
    return cycle[(cycle.index(answer) + 1) % len(cycle)]


def sft_rows(
    n: int, seed: int, *, corrupt: float = 0.0, questions: str = "count,colour"
) -> list[dict[str, Any]]:
    """`n` train rows with ``"response"`` = the answer; ``corrupt=f`` makes ``round(f * n)`` of
    the targets wrong by `corrupt_answer`, chosen by a seeded RNG, not by content; those rows carry
    ``"corrupted": True`` and keep the true ``"answer"``."""
    if not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"shapes: corrupt must be in [0, 1], got {corrupt}")
    rows = make_rows("train", n, seed, questions=questions)
    rng = random.Random(f"shapes-corrupt:{seed}")
    bad = set(rng.sample(range(n), round(corrupt * n)))
    for i, row in enumerate(rows):
        row["corrupted"] = i in bad
        row["response"] = (
            corrupt_answer(row["question"], row["answer"]) if i in bad else row["answer"]
        )
    return rows
