"""How many graphs the compiled decoder layers compile over a CPU stand-in of the VL-3B GRPO
run's first steps (issue 28): a `rollout.decode: graphs` rollout (its first decode step, then
later steps), the step-0 media check's training log-probs, training micro-batches of several
lengths (with gradients), and a no-grad log-prob pass (the old log-probs of recipes with several
epochs or mini-batches). CPU bf16 autocast stands in for the engine's GPU autocast, and the
decode step's uncached autocast covers the CPU too. Inductor's CUDA-only guards (SDPA's mask
alignment) do not show here; tests/test_compiled_layers_stalls.py checks the aligned lengths.

    .venv/bin/python bench/layer_graphs_cpu.py                      # aot_eager: dynamo's recompiles
    .venv/bin/python bench/layer_graphs_cpu.py --backend inductor --out /tmp/layer_graphs.json
    PYTHONPATH=<another checkout> .venv/bin/python bench/layer_graphs_cpu.py   # that checkout's count
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

import torch

from mmrl.platform_info import write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

WORDS = "red green blue shape circle square count the shapes in this picture and answer".split()
# (rows, prompt words, response tokens) of the training micro-batches: several lengths, 120 of
# them a multiple of 8.
MICRO_BATCHES = [(2, 3, 4), (2, 7, 6), (3, 10, 5), (3, 7, 6)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, inductor)")
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args()

    from torch._dynamo.utils import counters
    from widened_models import prompt_conversations, widened_model

    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.engine.sequences import join
    from mmrl.media_check import training_logprobs
    from mmrl.parallel import init_distributed
    from mmrl.rollout import SamplingParams, graphs, make_rollout

    torch.compile = functools.partial(torch.compile, backend=args.backend)
    Engine.autocast = lambda self: torch.autocast("cpu", dtype=torch.bfloat16)

    def uncached():
        if torch.is_autocast_enabled("cpu"):
            return torch.autocast("cpu", dtype=torch.get_autocast_dtype("cpu"), cache_enabled=False)
        return contextlib.nullcontext()

    graphs._uncached_autocast = uncached
    built = widened_model("qwen2_5_vl")
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), compile_layers=True,
                    share_media=False, pack=False)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=True, decode="graphs")
    vocab = built.model.config.get_text_config().vocab_size
    conversations = prompt_conversations(built, count=2)

    def micro_batch(rows, words, response_tokens):
        images = [conversation[0]["content"][0] for conversation in conversations]
        prompts = dict(built.processing([[{"role": "user", "content": [
            images[row % len(images)], {"type": "text", "text": " ".join(WORDS[: words + row])}]}]
            for row in range(rows)]))
        responses = torch.randint(50, vocab, (rows, response_tokens), generator=torch.Generator().manual_seed(words))
        return join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                    built.tokenizer.pad_token_id)

    rows, last = [], [0]

    def note(phase: str) -> None:
        total = counters["stats"]["unique_graphs"]
        rows.append({"phase": phase, "new_graphs": total - last[0], "total": total})
        last[0] = total

    with torch.no_grad():
        rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=2, temperature=0))
        note("decode, first step")
        rollout.generate(conversations, SamplingParams(n=1, max_new_tokens=4, temperature=0))
        note("decode, later steps")
    ids = torch.randint(50, vocab, (2, 3), generator=torch.Generator().manual_seed(0))
    training_logprobs(engine, built.processing, conversations, ids, torch.ones_like(ids))
    note("step-0 media check (no grad)")
    for shape in MICRO_BATCHES:
        seqs = micro_batch(*shape)
        logp, _ = engine.log_probs(seqs)
        (logp * seqs.response_mask).sum().backward()
        note(f"update (grad), {seqs.inputs['input_ids'].shape[1]} columns")
    with torch.no_grad():
        engine.log_probs(micro_batch(*MICRO_BATCHES[1]))
    note("old log-probs (no grad)")

    width = max(len(row["phase"]) for row in rows)
    for row in rows:
        print(f"{row['phase']:{width}s}  +{row['new_graphs']} graphs (total {row['total']})")
    if args.out:
        write_report(args.out, {"backend": args.backend, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
