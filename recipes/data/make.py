"""Write the tiny sample datasets under recipes/data/, each in its public dataset's layout,
with images drawn by Pillow. `mmrl train RECIPE --smoke` trains on them, so every recipe's
column mapping runs in CI against the layout it will meet on the hub.

    python recipes/data/make.py          # rewrites every folder below; deterministic

- geometry3k/data/{train,validation,test}-00000-of-00001.parquet: hiyouga/geometry3k's layout
  (`images`: a list of encoded images, `problem` with an `<image>` placeholder, `answer`)
- clevr_count/data/{train,test}-00000-of-00001.parquet: BUAADreamer/clevr_count_70k's
  layout (the same three columns; answers are counts)
- gsm8k/{train,test}.jsonl: GSM8K's JSON lines (`question`, `answer` ending "#### N")
- math12k/data/{train,test}-00000-of-00001.parquet: hiyouga/math12k's (`problem`, `answer`)
- multi_image/data/{train,test}-00000-of-00001.parquet: two images per row, each placed
  in the problem text by its own `<image>` (hiyouga/journeybench-multi-image-vqa's columns)
"""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLOURS = [(200, 40, 40), (40, 140, 60), (40, 70, 200), (220, 180, 30), (130, 50, 160)]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def triangle(size: tuple[int, int], rng: random.Random) -> bytes:
    """A right triangle with a marked angle, as geometry3k's diagrams are line drawings."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    w, h = size
    a, b, c = (6, h - 6), (w - 6, h - 6), (6, rng.randint(6, h // 2))
    draw.line([a, b, c, a], fill="black", width=2)
    draw.rectangle([a[0], a[1] - 6, a[0] + 6, a[1]], outline="black")
    draw.arc([b[0] - 16, b[1] - 16, b[0] + 16, b[1] + 16], 180, 210, fill="black")
    return png(image)


def scene(count: int, size: int, rng: random.Random) -> bytes:
    """A CLEVR-like scene: `count` shaded objects on a grey floor, none overlapping."""
    image = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range(9), count)
    step = size // 3
    for cell in cells:
        x, y = (cell % 3) * step + 3, (cell // 3) * step + 3
        colour = rng.choice(COLOURS)
        box = [x, y, x + step - 6, y + step - 6]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour, outline=(60, 60, 60))
    return png(image)


def circles(count: int, size: int, rng: random.Random) -> bytes:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(4), count):
        x, y = (cell % 2) * (size // 2) + 4, (cell // 2) * (size // 2) + 4
        draw.ellipse([x, y, x + size // 2 - 8, y + size // 2 - 8], fill=rng.choice(COLOURS))
    return png(image)


def write_parquet(folder: Path, split: str, rows: list[dict], image_column: str | None) -> None:
    import datasets

    columns = {key: [row[key] for row in rows] for key in rows[0]}
    features = {key: datasets.Value("string") for key in columns}
    if image_column:
        columns[image_column] = [[{"bytes": b, "path": None} for b in row[image_column]] for row in rows]
        features[image_column] = datasets.List(datasets.Image())
    (folder / "data").mkdir(parents=True, exist_ok=True)
    out = folder / "data" / f"{split}-00000-of-00001.parquet"
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).to_parquet(str(out))


GEOMETRY = [
    ("<image>Find x. Round to the nearest tenth.", "5.8"),
    ("<image>Find the measure of \\angle 2.", "60"),
    ("<image>Find y.", "2\\sqrt{3}"),
    ("<image>Find the area of the triangle.", "\\frac{25}{2}"),
    ("<image>Find x.", "4"),
    ("<image>Find the perimeter of the figure.", "12+4\\sqrt{2}"),
    ("<image>Find z.", "8"),
    ("<image>Find the measure of \\angle A to the nearest degree.", "37"),
]

WORD_PROBLEMS = [
    ("Ann has 3 boxes of 12 pencils. She gives away 9 pencils. How many pencils does she have left?",
     "Ann has 3 * 12 = <<3*12=36>>36 pencils.\nShe has 36 - 9 = <<36-9=27>>27 pencils left.\n#### 27"),
    ("A train travels 60 miles per hour for 2.5 hours. How far does it go?",
     "It goes 60 * 2.5 = <<60*2.5=150>>150 miles.\n#### 150"),
    ("Tom buys 4 apples at $0.50 each and a pie for $6. How much does he spend?",
     "The apples cost 4 * 0.5 = <<4*0.5=2>>2 dollars.\nHe spends 2 + 6 = <<2+6=8>>8 dollars.\n#### 8"),
    ("A class of 30 students splits into teams of 4, with the rest helping. How many students help?",
     "There are 30 // 4 = <<30//4=7>>7 teams of 4, or 28 students.\n30 - 28 = <<30-28=2>>2 help.\n#### 2"),
    ("Mia reads 15 pages a day. How many days does she need for a 120-page book?",
     "She needs 120 / 15 = <<120/15=8>>8 days.\n#### 8"),
    ("A shop sells 1,200 cups a week. How many cups does it sell in 3 weeks?",
     "It sells 1200 * 3 = <<1200*3=3600>>3600 cups.\n#### 3600"),
]

MATH = [
    ("What is the value of $\\sqrt{36} + \\sqrt{64}$?", "14"),
    ("Simplify $\\frac{6}{8}$.", "\\frac{3}{4}"),
    ("Solve for $x$: $2x + 3 = 11$.", "4"),
    ("What is $3^4$?", "81"),
    ("Find the hypotenuse of a right triangle with legs 5 and 12.", "13"),
    ("What is $\\frac{1}{2} + \\frac{1}{3}$?", "\\frac{5}{6}"),
]


def main() -> None:
    import datasets

    datasets.disable_progress_bars()
    rng = random.Random(0)
    geometry = [{"images": [triangle((56 + 28 * (i % 2), 56), rng)], "problem": p, "answer": a}
                for i, (p, a) in enumerate(GEOMETRY)]
    write_parquet(HERE / "geometry3k", "train", geometry[:4], "images")
    write_parquet(HERE / "geometry3k", "test", geometry[4:6], "images")
    write_parquet(HERE / "geometry3k", "validation", geometry[6:], "images")

    counts = [3, 1, 4, 2, 5, 3]
    clevr = [{"images": [scene(n, 56, rng)], "problem": "<image>How many items are there in the image?",
              "answer": str(n)} for n in counts]
    write_parquet(HERE / "clevr_count", "train", clevr[:4], "images")
    write_parquet(HERE / "clevr_count", "test", clevr[4:], "images")

    (HERE / "gsm8k").mkdir(exist_ok=True)
    for split, rows in (("train", WORD_PROBLEMS[:4]), ("test", WORD_PROBLEMS[4:])):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in rows]
        (HERE / "gsm8k" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")

    math_rows = [{"problem": p, "answer": a} for p, a in MATH]
    write_parquet(HERE / "math12k", "train", math_rows[:4], None)
    write_parquet(HERE / "math12k", "test", math_rows[4:], None)

    pairs = []
    for _ in range(6):
        left, right = rng.sample([1, 2, 3, 4], 2)
        pairs.append({"images": [circles(left, 56, rng), circles(right, 56, rng)],
                      "problem": "Image 1: <image> Image 2: <image> Which image shows more circles? Answer 1 or 2.",
                      "answer": "1" if left > right else "2"})
    write_parquet(HERE / "multi_image", "train", pairs[:4], "images")
    write_parquet(HERE / "multi_image", "test", pairs[4:], "images")
    total = sum(f.stat().st_size for f in HERE.rglob("*") if f.is_file() and f.suffix in (".parquet", ".jsonl"))
    print(f"wrote {HERE} ({total / 1024:.1f} KiB of data)", file=sys.stderr)


if __name__ == "__main__":
    main()
