"""The data layer: schema errors, loaders (jsonl, parquet, saved folders, synthetic),
resumable batches and the synthetic tasks' ground truth. CPU, a few seconds:

    python -m pytest -q tests/test_data.py
"""

import io
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from mmrl.data import Position, load_prompts, synthetic, to_conversation, validate_sample

RED, BLUE = (220, 30, 30), (30, 60, 220)


def _png(colour=RED, size=8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _sample(**overrides):
    sample = {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
        ],
        "answer": "3",
        "images": [Image.new("RGB", (8, 8), RED)],
    }
    sample.update(overrides)
    return sample


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


IMAGE, TEXT = {"type": "image"}, {"type": "text", "text": "q"}

# (sample, the exact error)
SCHEMA_ERRORS = [
    (["not", "a", "row"], "row 3: sample: expected a mapping of columns, got list"),
    ({"answer": "1"}, "row 3: prompt: missing"),
    (_sample(prompt="How many?"),
     'row 3: prompt: expected a list of messages, got a string (write [{"role": "user", "content": ...}])'),
    (_sample(prompt={"role": "user"}), "row 3: prompt: expected a list of messages, got dict"),
    (_sample(prompt=[]), "row 3: prompt: empty conversation"),
    (_sample(prompt=["hi"]), "row 3: prompt[0]: expected a message mapping, got str"),
    (_sample(prompt=[{"role": "robot", "content": "hi"}]),
     "row 3: prompt[0].role: expected one of system, user, assistant, tool, got 'robot'"),
    (_sample(prompt=[{"role": "user", "content": 7}]),
     "row 3: prompt[0].content: expected a string or a list of parts, got int"),
    (_sample(prompt=[{"role": "user"}]),
     "row 3: prompt[0].content: expected a string or a list of parts, got null"),
    (_sample(prompt=_user(IMAGE, "q")), "row 3: prompt[0].content[1]: expected a part mapping, got str"),
    (_sample(prompt=_user(IMAGE, {"type": "audio"})),
     "row 3: prompt[0].content[1].type: unknown part type 'audio' (expected text, image or video)"),
    (_sample(prompt=_user(IMAGE, {"type": "text", "text": None})),
     "row 3: prompt[0].content[1].text: expected a string, got null"),
    (_sample(prompt=_user(TEXT, IMAGE), images=[]),
     "row 3: prompt[0].content[1]: image part without an image"),
    (_sample(prompt=_user(IMAGE, IMAGE)), "row 3: prompt[0].content[1]: image part without an image"),
    (_sample(prompt=_user(TEXT, {"type": "video"}), images=[]),
     "row 3: prompt[0].content[1]: video part without a video"),
    (_sample(prompt=[*_user(IMAGE), {"role": "assistant", "content": "3"}]),
     "row 3: prompt[1].role: the prompt ends with an assistant message; the answer belongs in `answer`"),
    (_sample(answer=None), "row 3: answer: missing"),
    (_sample(answer=3), "row 3: answer: expected a string, got int (quote it in the data)"),
    (_sample(images="a.png"), "row 3: images: expected a list, got str"),
    (_sample(images=[b"x", b"y"]), "row 3: images: 2 image(s) for 1 image part(s) without a payload"),
    (_sample(images=[7]), "row 3: images[0]: cannot read an image from int"),
    (_sample(images=[None]), "row 3: images[0]: cannot read an image from null"),
    (_sample(images=[{"bytes": None, "path": None}]), "row 3: images[0]: image dict without bytes or path"),
    (_sample(images=[b""]), "row 3: images[0]: empty image bytes"),
    (_sample(prompt=_user({"type": "image", "image": 1.5})),
     "row 3: prompt[0].content[0]: cannot read an image from float"),
    (_sample(prompt=_user(TEXT, {"type": "video"}), images=[], videos=[[]]),
     "row 3: videos[0]: a video is a file path or a non-empty list of frames, got list"),
    (_sample(prompt=_user(TEXT, {"type": "video"}), images=[], videos=[[b"frame", 3]]),
     "row 3: videos[0][1]: cannot read an image from int"),
]


@pytest.mark.parametrize("sample, message", SCHEMA_ERRORS,
                         ids=[m.split(": ", 1)[1][:40] for _, m in SCHEMA_ERRORS])
def test_validate_sample_names_row_and_field(sample, message):
    with pytest.raises(ValueError) as error:
        validate_sample(sample, 3)
    assert str(error.value) == message
    assert "\n" not in str(error.value)


def test_valid_samples_pass():
    validate_sample(_sample(), 0)
    validate_sample({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2", "level": 1}, 0)
    # Arrow fills absent struct keys with None: a text part read back carries "image": None.
    arrow_like = _user({"type": "text", "text": "q", "image": None},
                       {"type": "image", "text": None, "image": None})
    validate_sample(_sample(prompt=arrow_like, videos=None), 0)


def test_missing_image_file_is_checked_against_root(tmp_path):
    with pytest.raises(ValueError, match=rf"^row 0: images\[0\]: image file not found: {tmp_path}/nope.png$"):
        validate_sample(_sample(images=["nope.png"]), 0, root=tmp_path)
    validate_sample(_sample(images=["nope.png"]), 0)  # without a root, files are not looked at


def test_to_conversation_resolves_every_image_form(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), BLUE).save(tmp_path / "img" / "blue.png")
    sources = [Image.new("RGB", (8, 8), RED), "img/blue.png", _png(RED),
               {"bytes": None, "path": "img/blue.png"}, {"bytes": _png(BLUE), "path": "ignored.png"}]
    parts = [IMAGE] * len(sources) + [{"type": "text", "text": "q", "image": None},
                                      {"type": "image", "image": _png(BLUE)}]
    prompt = [{"role": "system", "content": "Be brief.", "name": None}, {"role": "user", "content": parts}]
    sample = _sample(prompt=prompt, images=sources)
    validate_sample(sample, 0, root=tmp_path)
    conversation = to_conversation(sample, root=tmp_path)
    assert conversation[0] == {"role": "system", "content": "Be brief."}
    parts = conversation[1]["content"]
    assert [p["type"] for p in parts] == ["image"] * 5 + ["text", "image"]
    assert parts[5] == {"type": "text", "text": "q"}
    colours = [p["image"].getpixel((0, 0)) for p in parts if p["type"] == "image"]
    assert colours == [RED, BLUE, RED, BLUE, BLUE, BLUE]
    assert all(p["image"].mode == "RGB" for p in parts if p["type"] == "image")
    # A PIL RGB image within the decode budget is the sample's own object, not a copy: the
    # samples of one prompt share it (a rollout processes its pixels once by object).
    assert parts[0]["image"] is sources[0]
    grey = Image.new("L", (8, 8), 7)
    (part,) = to_conversation(_sample(prompt=_user(IMAGE), images=[grey]))[0]["content"]
    assert part["image"] is not grey and part["image"].mode == "RGB" and part["image"].getpixel((0, 0)) == (7, 7, 7)


def test_to_conversation_fills_videos():
    sample = _sample(prompt=_user({"type": "video"}, TEXT), images=[],
                     videos=[[_png(RED), _png(BLUE)], "/abs/clip.mp4"])
    sample["prompt"][0]["content"].append({"type": "video"})
    validate_sample(sample, 0)
    parts = to_conversation(sample)[0]["content"]
    assert [f.getpixel((0, 0)) for f in parts[0]["video"]] == [RED, BLUE]
    assert parts[2] == {"type": "video", "video": "/abs/clip.mp4"}


# -- loaders --------------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _image_rows(n=4):
    rows = []
    for i in range(n):
        # Mixed content types (string and parts) in one column: datasets must keep both.
        prompt = [{"role": "system", "content": "Count."},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"q{i}"}]}]
        rows.append({"prompt": prompt, "answer": str(i), "images": [f"img/{i}.png"], "level": i})
    return rows


def _write_images(folder, n=4):
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (8, 8), (i * 60, 0, 0)).save(folder / "img" / f"{i}.png")


def test_jsonl_with_relative_image_paths(tmp_path, monkeypatch):
    data = tmp_path / "data"
    _write_images(data)
    _write_jsonl(data / "train.jsonl", _image_rows())
    monkeypatch.chdir(tmp_path)  # paths resolve against the file's folder, not the cwd
    for source in (data / "train.jsonl", "data/train.jsonl", data):
        prompts = load_prompts(source)
        assert len(prompts) == 4
        sample = prompts[2]
        assert sample["answer"] == "2" and sample["level"] == 2
        assert sample["images"] == [str(data.resolve() / "img" / "2.png")]
        conversation = prompts.conversation(2)
        assert conversation[0] == {"role": "system", "content": "Count."}
        assert conversation[1]["content"][0]["image"].getpixel((0, 0)) == (120, 0, 0)
        assert conversation[1]["content"][1] == {"type": "text", "text": "q2"}


def test_a_reload_of_an_unchanged_source_is_the_same_dataset(tmp_path):
    """The recipe check before the build and the trainer share one load; a changed file,
    another split or other options load afresh, and a failed load is not kept."""
    import os

    data = tmp_path / "data"
    _write_images(data)
    path = data / "train.jsonl"
    _write_jsonl(path, _image_rows())
    first = load_prompts(path)
    assert load_prompts(str(path)) is first
    assert load_prompts(path, split="test") is not first and load_prompts(path, limit=2) is not first
    _write_jsonl(path, _image_rows()[:3])
    os.utime(path, ns=(1, 1))  # another modification time even within the clock's resolution
    assert len(load_prompts(path)) == 3
    spec = "synthetic:arithmetic?n=8&seed=0"
    assert load_prompts(spec) is load_prompts(spec)
    path.write_text("{broken\n")
    for _ in range(2):
        with pytest.raises(ValueError, match="not valid JSON"):
            load_prompts(path)


def test_folder_picks_the_split_file(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [{"prompt": _user(TEXT), "answer": "train"}])
    _write_jsonl(tmp_path / "test.jsonl", [{"prompt": _user(TEXT), "answer": "test"}])
    assert load_prompts(tmp_path)[0]["answer"] == "train"
    assert load_prompts(tmp_path, "test")[0]["answer"] == "test"
    with pytest.raises(FileNotFoundError, match="no validation.jsonl"):
        load_prompts(tmp_path, "validation")


def test_parquet_with_image_bytes(tmp_path):
    import datasets

    features = datasets.Features({
        "prompt": datasets.List({"role": datasets.Value("string"),
                                 "content": datasets.List({"type": datasets.Value("string"),
                                                           "text": datasets.Value("string")})}),
        "answer": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
    })
    colours = [RED, BLUE, (0, 200, 0)]
    table = {"prompt": [_user(IMAGE, TEXT)] * 3, "answer": ["red", "blue", "green"],
             "images": [[{"bytes": _png(c), "path": None}] for c in colours]}
    datasets.Dataset.from_dict(table, features=features).to_parquet(tmp_path / "rows.parquet")
    prompts = load_prompts(tmp_path / "rows.parquet")
    assert [s["answer"] for s in prompts] == ["red", "blue", "green"]
    assert [prompts.conversation(i)[0]["content"][0]["image"].getpixel((0, 0)) for i in range(3)] == colours

    # A bad row is found at load, through the undecoded image column.
    table["images"][1] = []
    datasets.Dataset.from_dict(table, features=features).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError,
                       match=r"bad\.parquet: row 1: prompt\[0\]\.content\[0\]: image part without an image$"):
        load_prompts(tmp_path / "bad.parquet")


def test_saved_to_disk_folder(tmp_path):
    import datasets

    _write_images(tmp_path / "saved")
    rows = _image_rows()
    # "use_json" keeps the string and list message contents apart, as the json loader does.
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3], on_mixed_types="use_json"),
                                   "test": datasets.Dataset.from_list(rows[3:], on_mixed_types="use_json")})
    splits.save_to_disk(tmp_path / "saved")
    assert len(load_prompts(tmp_path / "saved")) == 3
    test = load_prompts(tmp_path / "saved", "test")
    assert test[0]["answer"] == "3"
    assert test.conversation(0)[1]["content"][0]["image"].getpixel((0, 0)) == (180, 0, 0)
    with pytest.raises(ValueError, match="no split 'dev'; splits: train, test"):
        load_prompts(tmp_path / "saved", "dev")

    datasets.Dataset.from_list(rows[:2], on_mixed_types="use_json").save_to_disk(tmp_path / "single")
    _write_images(tmp_path / "single")
    assert len(load_prompts(tmp_path / "single")) == 2


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"dataset not found: {tmp_path}/missing.jsonl"):
        load_prompts(tmp_path / "missing.jsonl")
    rows = [{"prompt": _user(TEXT), "answer": "1"}, {"prompt": [], "answer": "2"}]
    _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: prompt: empty conversation$"):
        load_prompts(tmp_path / "bad.jsonl")
    _write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": _user(TEXT), "answer": 1}])
    with pytest.raises(ValueError, match=r"numbers\.jsonl: row 0: answer: expected a string, got int"):
        load_prompts(tmp_path / "numbers.jsonl")
    # Mixed types: datasets would read "1" back as 1, so the file is blamed, not a row.
    _write_jsonl(tmp_path / "mixed.jsonl",
                 [{"prompt": _user(TEXT), "answer": "1"}, {"prompt": _user(TEXT), "answer": 2}])
    with pytest.raises(ValueError, match=r"mixed.jsonl: answer: values of several types across rows"):
        load_prompts(tmp_path / "mixed.jsonl")
    _write_jsonl(tmp_path / "missing_image.jsonl",
                 [{"prompt": _user(IMAGE), "answer": "1", "images": ["x.png"]}])
    with pytest.raises(ValueError,
                       match=rf"missing_image\.jsonl: row 0: images\[0\]: image file not found: {tmp_path}/x.png$"):
        load_prompts(tmp_path / "missing_image.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_prompts(tmp_path / "rows.csv")


def test_limit_and_shuffle_seed():
    samples = synthetic.arithmetic(20, seed=0)
    assert [s["answer"] for s in load_prompts(samples, limit=5)] == [s["answer"] for s in samples[:5]]
    first = [s["prompt"] for s in load_prompts(samples, limit=5, shuffle_seed=1)]
    assert first == [s["prompt"] for s in load_prompts(samples, limit=5, shuffle_seed=1)]
    assert first != [s["prompt"] for s in samples[:5]]
    with pytest.raises(ValueError, match="no rows"):
        load_prompts(samples, limit=0)


def test_synthetic_source_spec():
    prompts = load_prompts("synthetic:count_shapes?n=12&seed=3&max_count=3")
    expected = synthetic.count_shapes(12, 3, max_count=3)
    assert [s["answer"] for s in prompts] == [s["answer"] for s in expected]
    assert prompts[0]["images"][0].tobytes() == expected[0]["images"][0].tobytes()
    test = load_prompts("synthetic:count_shapes?n=12&seed=3&max_count=3", "test")
    assert [s["images"][0].tobytes() for s in test] != [s["images"][0].tobytes() for s in expected]
    assert len(load_prompts("synthetic:arithmetic")) == 256
    with pytest.raises(ValueError, match="unknown synthetic task 'count'"):
        load_prompts("synthetic:count?n=4")
    with pytest.raises(ValueError, match="takes n, seed, image_size, max_count; got colour"):
        load_prompts("synthetic:count_shapes?colour=red")


# -- batches --------------------------------------------------------------------------------


def test_batches_resume_at_the_exact_position():
    prompts = load_prompts(synthetic.arithmetic(10, seed=0))
    run = list(zip(range(7), prompts.batches(3, seed=5)))
    batches = [b for _, b in run]
    assert [b.end for b in batches[:4]] == [(0, 3), (0, 6), (1, 0), (1, 3)]  # 10 // 3 full batches
    assert sorted(i for b in batches[:3] for i in b.indices) != list(range(9))  # shuffled, not the first 9
    assert len({i for b in batches[:3] for i in b.indices}) == 9
    assert batches[0].indices != batches[3].indices  # each epoch has its own order
    saved = json.loads(json.dumps(batches[3].end))  # a checkpoint round trip
    resumed = prompts.batches(3, seed=5, start=Position(*saved))
    for expected in batches[4:]:
        got = next(resumed)
        assert (got.indices, got.start, got.end) == (expected.indices, expected.start, expected.end)
        assert [s["prompt"] for s in got.samples] == [prompts[i]["prompt"] for i in expected.indices]
    again = [b.indices for _, b in zip(range(7), prompts.batches(3, seed=5))]
    assert again == [b.indices for b in batches]
    assert [b.indices for _, b in zip(range(3), prompts.batches(3, seed=6))] != again[:3]


def test_batches_without_drop_last_and_epoch_limit():
    prompts = load_prompts(synthetic.arithmetic(5, seed=0))
    batches = list(prompts.batches(2, seed=0, epochs=2, drop_last=False))
    assert [len(b.indices) for b in batches] == [2, 2, 1, 2, 2, 1]
    assert [b.end for b in batches[1:3]] == [(0, 4), (1, 0)]
    assert list(prompts.batches(2, shuffle=False, epochs=1))[0].indices == [0, 1]
    assert prompts.batches_per_epoch(2) == 2 and prompts.batches_per_epoch(2, drop_last=False) == 3
    with pytest.raises(ValueError, match="batch_size 6 exceeds the 5 samples"):
        next(prompts.batches(6))


# -- synthetic tasks ------------------------------------------------------------------------


def _blobs(image: Image.Image, background=synthetic.BACKGROUND) -> int:
    """Connected (8-neighbour) regions of non-background pixels."""
    mask = (np.asarray(image) != background).any(axis=2)
    seen = np.zeros_like(mask)
    height, width = mask.shape
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny in range(max(cy - 1, 0), min(cy + 2, height)):
                for nx in range(max(cx - 1, 0), min(cx + 2, width)):
                    if mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
    return count


IMAGE_TASKS = ["count_shapes", "read_digit", "compare_colours", "name_colour"]


def _fingerprint(samples):
    return [(s["answer"], str(s["prompt"]), [i.tobytes() for i in s.get("images", [])]) for s in samples]


@pytest.mark.parametrize("task", [*IMAGE_TASKS, "arithmetic"])
def test_synthetic_tasks_are_deterministic_valid_and_balanced(task):
    samples = synthetic.generate(task, 40, seed=0)
    again = synthetic.generate(task, 40, seed=0)
    other = synthetic.generate(task, 40, seed=1)
    assert _fingerprint(samples) == _fingerprint(again)
    assert _fingerprint(samples) != _fingerprint(other)
    for i, sample in enumerate(samples):
        validate_sample(sample, i)
        assert sample["task"] == task
    counts = Counter(s["answer"] for s in samples)
    assert set(counts) <= set(synthetic.answer_words(task))
    if task != "arithmetic":
        assert set(counts) == set(synthetic.answer_words(task))
        assert max(counts.values()) - min(counts.values()) <= 1
        assert synthetic.majority_baseline(samples) == pytest.approx(max(counts.values()) / 40)


VOCABULARY_CASES = [("count_shapes", {"max_count": 6}), ("arithmetic", {"max_operand": 5}),
                    ("name_colour", {}), ("read_digit", {}), ("compare_colours", {})]


@pytest.mark.parametrize("task, params", VOCABULARY_CASES)
def test_vocabulary_holds_every_prompt_and_answer_word(task, params):
    words = set()
    for sample in synthetic.generate(task, 60, seed=0, **params):
        for message in sample["prompt"]:
            content = message["content"]
            texts = [content] if isinstance(content, str) else [p["text"] for p in content
                                                                if p["type"] == "text"]
            words.update(w for text in texts for w in synthetic.split_words(text))
        words.add(sample["answer"])
    vocabulary = synthetic.vocabulary(task, **params)
    assert words <= set(vocabulary)
    assert len(vocabulary) <= 60


@pytest.mark.parametrize("max_count, image_size", [(4, 84), (9, 84)])
def test_count_shapes_images_hold_the_stated_count(max_count, image_size):
    for sample in synthetic.count_shapes(3 * max_count, seed=2, image_size=image_size, max_count=max_count):
        image = sample["images"][0]
        assert image.size == (image_size, image_size)
        assert _blobs(image) == int(sample["answer"])


def test_name_colour_and_compare_colours_ground_truth():
    for sample in synthetic.name_colour(12, seed=0):
        pixels = Counter(map(tuple, np.asarray(sample["images"][0]).reshape(-1, 3).tolist()))
        del pixels[synthetic.BACKGROUND]
        assert pixels.most_common(1)[0][0] == synthetic.PALETTE[sample["answer"]]
    for sample in synthetic.compare_colours(12, seed=0):
        pixels = np.asarray(sample["images"][0]).astype(float)
        half = pixels.shape[1] // 2
        patch = lambda p: p[(p != 255).any(axis=2)].sum(axis=1).mean()  # noqa: E731
        assert (patch(pixels[:, :half]) < patch(pixels[:, half:])) == (sample["answer"] == "yes")


def _read_seven_segment(image: Image.Image) -> str:
    """Decode a `read_digit` image: probe the middle of each segment inside the ink's box."""
    ink = (np.asarray(image) != 255).any(axis=2)
    ys, xs = np.nonzero(ink)
    x, y, right, bottom = xs.min(), ys.min(), xs.max(), ys.max()
    height = bottom - y + 1
    if right - x + 1 < height // 4:  # only the right column is lit
        return "1"
    t = max(2, height // 8) // 2
    centre_x, mid = (x + right) // 2, y + height // 2
    probes = {"a": (centre_x, y + t), "g": (centre_x, mid), "d": (centre_x, bottom - t),
              "f": (x + t, y + height // 4), "b": (right - t, y + height // 4),
              "e": (x + t, y + 3 * height // 4), "c": (right - t, y + 3 * height // 4)}
    lit = {segment for segment, (px, py) in probes.items() if ink[py, px]}
    return next(d for d, segments in synthetic.SEGMENTS.items() if set(segments) == lit)


def test_read_digit_images_show_the_answer():
    for sample in synthetic.read_digit(30, seed=0):
        assert _read_seven_segment(sample["images"][0]) == sample["answer"]


def test_shuffle_images_keeps_answers_and_moves_images():
    samples = synthetic.count_shapes(12, seed=0) + synthetic.arithmetic(2, seed=0)
    shuffled = synthetic.shuffle_images(samples, seed=0)
    assert [s["answer"] for s in shuffled] == [s["answer"] for s in samples]
    assert [s["prompt"] for s in shuffled] == [s["prompt"] for s in samples]
    before = [id(s["images"][0]) for s in samples[:12]]
    after = [id(s["images"][0]) for s in shuffled[:12]]
    assert sorted(before) == sorted(after)
    assert all(a != b for a, b in zip(before, after))  # nobody keeps its own image
    assert "images" not in shuffled[12] and samples[0]["images"][0] is not shuffled[0]["images"][0]
    assert [id(s["images"][0]) for s in synthetic.shuffle_images(samples, seed=0)[:12]] == after
    with pytest.raises(ValueError, match="at least two samples"):
        synthetic.shuffle_images(samples[12:], seed=0)


def test_majority_baseline():
    rows = [{"answer": a} for a in "aab"]
    assert synthetic.majority_baseline(rows) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        synthetic.majority_baseline([])


def test_import_loads_neither_datasets_nor_torch():
    code = "import sys, mmrl.data; print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
