"""Public dataset layouts mapped onto the row schema (mmrl/data/layouts.py): placeholders,
templates, answer patterns, kept columns, every source kind, and one-line errors."""

import json
from pathlib import Path

import pytest
from PIL import Image

from mmrl.data import load_prompts, to_conversation
from mmrl.data.layouts import DataSource, LayoutError, map_row

REPO = Path(__file__).resolve().parents[1]
RED = Image.new("RGB", (28, 28), "red")


def source(**kwargs) -> DataSource:
    return DataSource.model_validate({"path": "unused", **kwargs})


def kinds(sample) -> list[str]:
    return [p["type"] for p in sample["prompt"][-1]["content"]]


def test_placeholders_put_each_image_where_the_row_puts_it():
    spec = source(columns={"prompt": "q", "images": "imgs"})
    row = {"q": "Compare <image> with <image>: which is red?", "answer": "1", "imgs": [RED, RED], "id": 7}
    sample = map_row(row, spec)
    assert kinds(sample) == ["text", "image", "text", "image", "text"]
    assert sample["images"] == [RED, RED] and sample["id"] == 7 and "q" not in sample and "imgs" not in sample


def test_images_without_placeholders_go_first_and_a_single_image_becomes_a_list():
    spec = source(columns={"prompt": "q", "images": "image"})
    sample = map_row({"q": "How many?", "answer": 3, "image": RED}, spec)
    assert kinds(sample) == ["image", "text"]
    assert sample["answer"] == "3" and sample["images"] == [RED]


def test_videos_and_a_custom_placeholder():
    spec = source(columns={"prompt": "q", "videos": "clip"}, video_placeholder="[VIDEO]")
    sample = map_row({"q": "Watch [VIDEO] then answer.", "answer": "a", "clip": [[RED, RED]]}, spec)
    assert kinds(sample) == ["text", "video", "text"] and sample["videos"] == [[RED, RED]]


def test_template_system_and_answer_pattern():
    spec = source(columns={"prompt": "question"}, system="Be brief.", answer_pattern=r"####\s*(.+)",
                  template="{{ prompt }} (level {{ level }})")
    sample = map_row({"question": "1+1?", "answer": "1+1=2\n#### 2", "level": 1}, spec)
    assert sample["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert sample["prompt"][1]["content"] == [{"type": "text", "text": "1+1? (level 1)"}]
    assert sample["answer"] == "2" and sample["level"] == 1


def test_a_conversation_column_is_kept_as_it_is():
    conversation = [{"role": "user", "content": "hi"}]
    sample = map_row({"messages": conversation, "answer": "x"}, source(columns={"prompt": "messages"}))
    assert sample["prompt"] == conversation


@pytest.mark.parametrize("row, spec, message", [
    ({"q": "<image><image> two?", "answer": "1", "imgs": [RED]}, {"columns": {"prompt": "q", "images": "imgs"}},
     "row 0: q: 2 <image> placeholder(s) for 1 image(s) in column 'imgs'"),
    ({"q": "x", "answer": "no hashes"}, {"columns": {"prompt": "q"}, "answer_pattern": "####(.+)"},
     "row 0: answer: answer_pattern '####(.+)' does not match 'no hashes'"),
    ({"q": "x", "answer": "1"}, {"columns": {"prompt": "q"}, "template": "{{ prompt }} {{ missing }}"},
     "row 0: template: 'missing' is undefined"),
    ({"q": None, "answer": "1"}, {"columns": {"prompt": "q"}}, "row 0: q: expected text or a conversation, got null"),
    ({"q": "x", "answer": None}, {"columns": {"prompt": "q"}}, "row 0: answer: missing answer"),
])
def test_row_errors_name_the_row_and_column(row, spec, message):
    with pytest.raises(LayoutError) as error:
        map_row(row, source(**spec))
    assert str(error.value) == message


def test_jsonl_with_image_paths_and_a_missing_column(tmp_path):
    RED.save(tmp_path / "a.png")
    rows = [{"question": "<image>Colour?", "label": "red", "pics": ["a.png"]}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = {"path": str(tmp_path / "train.jsonl"), "columns": {"prompt": "question", "answer": "label", "images": "pics"}}
    loaded = load_prompts(spec)
    assert loaded[0]["images"] == [str(tmp_path / "a.png")]  # resolved against the file's folder
    assert to_conversation(loaded[0])[0]["content"][0]["image"].size == (28, 28)
    with pytest.raises(LayoutError, match=r"columns.images: no column 'images'; columns: label, pics, question"):
        load_prompts({**spec, "columns": {"prompt": "question", "answer": "label", "images": "images"}})
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "pics": ["gone.png"]}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: images\[0\]: image file not found"):
        load_prompts({**spec, "path": str(tmp_path / "bad.jsonl")})


def test_save_to_disk_dataset_dict_picks_the_split(tmp_path):
    import datasets  # heavy: imported by the one test that builds a dataset, not at collection

    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image())})
    split = lambda n: datasets.Dataset.from_dict(  # noqa: E731
        {"problem": ["<image>Find x."] * n, "answer": ["4"] * n, "images": [[RED]] * n}, features=features)
    datasets.DatasetDict({"train": split(3), "test": split(1)}).save_to_disk(str(tmp_path / "saved"))
    spec = {"path": str(tmp_path / "saved"), "columns": {"prompt": "problem", "images": "images"}}
    assert len(load_prompts(spec, "train")) == 3 and len(load_prompts(spec, "test")) == 1
    # Images stay encoded until a batch is drawn.
    assert set(load_prompts(spec, "test")[0]["images"][0]) == {"bytes", "path"}
    with pytest.raises(LayoutError, match="no split 'validation'; splits: train, test"):
        load_prompts(spec, "validation")
    assert len(load_prompts({**spec, "limit": 2}, "train")) == 2


def test_hub_layout_folder_and_bad_sources(monkeypatch):
    monkeypatch.chdir(REPO)
    spec = {"path": "recipes/data/clevr_count", "columns": {"prompt": "problem", "images": "images"}}
    train = load_prompts(spec, "train")
    assert len(train) == 4 and all(s["answer"].isdigit() for s in train)
    with pytest.raises(FileNotFoundError, match="dataset not found"):
        load_prompts({**spec, "path": "./recipes/data/nowhere"})
    with pytest.raises(LayoutError, match="data source: columns.promt: Extra inputs are not permitted"):
        load_prompts({**spec, "columns": {"promt": "problem"}})


# A recipe is shared as data: its template must not run code or exhaust the machine (issue 30).
HOSTILE_TEMPLATES = [
    ("{{ cycler.__init__.__globals__.os.system('touch PWNED') }}", "refused by the sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    ("{{ prompt.__class__ }}", "refused by the sandbox"),
    ("{% set xs = [] %}{{ xs.append(1) }}", "refused by the sandbox"),
    ("{{ prompt * 100000000 }}", "repetition builds"),
    ("{{ 10 ** 100000000 }}", "exponent 100000000 is too large"),
    ("{{ prompt }}{% for i in range(100000) %}{{ prompt }}{% endfor %}", "more than 1,000,000"),
    ("{{ prompt | int / 0 }}", "ZeroDivisionError"),
]


@pytest.mark.parametrize("template, words", HOSTILE_TEMPLATES)
def test_a_hostile_template_is_one_layout_error_and_runs_nothing(tmp_path, monkeypatch, template, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayoutError) as error:
        map_row({"q": "0123456789", "answer": "1"}, source(columns={"prompt": "q"}, template=template), index=3)
    message = str(error.value)
    assert message.startswith("row 3: template: ") and words in message and "\n" not in message
    assert not (tmp_path / "PWNED").exists()


def test_the_sandbox_still_formats_values():
    spec = source(columns={"prompt": "q"},
                  template="{{ prompt | trim | upper }} {{ '%.1f' % level }} {{ tags | join(',') }} {{ 'ab' * 3 }}")
    sample = map_row({"q": " hi ", "answer": "1", "level": 2, "tags": ["x", "y"]}, spec)
    assert sample["prompt"][0]["content"] == [{"type": "text", "text": "HI 2.0 x,y ababab"}]
