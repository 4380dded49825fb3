"""mmrl's trainer against TRL's GRPOTrainer on the tiny-VLM counting recipe: same task, same start.

    HF_HUB_OFFLINE=1 /work/venv-trl/bin/python bench/trl_comparison.py \
        [--budget-s 400] [--runs mmrl mmrl_no_mult trl] [--out bench/results/trl_comparison.json]

Needs trl 1.16.0 next to mmrl (`pip install -e ".[bench]"`), in an environment of its own.

The parent process builds the recipe's random-init model ONCE (`mmrl.build_model` with the
recipe's config_overrides, tiny_vocabulary, pixel budget and seed), saves it with
`built.save(dir)`, then runs each trainer in a fresh child process of this script, one
after the other, starting from that directory:

  mmrl          mmrl's `Trainer` on recipes/tiny_vlm_count.yaml (lr 3e-4, vision/projector x10)
  mmrl_no_mult  the same without `optim.lr_multipliers` (one lr, as TRL's config allows)
  trl           TRL's `GRPOTrainer` given the directory, at the closest settings it allows
  trl_mult      (optional) TRL with the recipe's per-part lrs through a `create_optimizer`
                override: TRL's config has no such setting, a subclass can add it

Both see the same prompts in the same order (TRL's dataset is laid out in the order of
mmrl's batches, with `shuffle_dataset=False`), 16 prompts x 8 samples per step, 1 new token,
temperature 1, the recipe's counting reward (partial 0.2), no KL, torch threads 2, seed 0.

Every 25 steps one shared function (`greedy_accuracy`: the model's own HF `generate`,
greedy, on prompts made by mmrl's processing, answers parsed by mmrl's counting reward)
scores the 128 validation images; a run stops when that reaches 0.95 or its training
time passes the budget, and then the same function scores the 256 eval images. Evaluation
time is NOT training time for either trainer: it is excluded from `train_s`, seconds per
step, time to target and the budget, and included in `wall_s` (which also holds the
start-up: data, model load and trainer object up to the first step). Prints a table and
writes JSON, including every setting where the two differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_vlm_count.yaml"
COMMAND = ("HF_HUB_OFFLINE=1 /work/venv-trl/bin/python bench/trl_comparison.py "
           "[--budget-s 400] [--runs mmrl mmrl_no_mult trl] [--out bench/results/trl_comparison.json]")
RUNS = ("mmrl", "mmrl_no_mult", "trl", "trl_mult")
DEFAULT_RUNS = ("mmrl", "mmrl_no_mult", "trl")

# Where TRL cannot be set like mmrl, or is set away from its own default to match mmrl.
DIFFERENCES = [
    {"setting": "per-part learning rates",
     "mmrl": "recipe: lr 3e-4, vision and projector x10 (optim.lr_multipliers)",
     "trl": "GRPOConfig has one learning_rate (3e-4 on every parameter)",
     "handling": "run mmrl_no_mult compares at equal settings; optional run trl_mult gives TRL the "
                 "multipliers through a GRPOTrainer.create_optimizer override (not a TRL setting)"},
    {"setting": "group-std epsilon in the advantage",
     "mmrl": "(r - mean) / (std + 1e-6)", "trl": "(r - mean) / (std + 1e-4), hard-coded",
     "handling": "not settable in TRL; both use the unbiased std, so only near-uniform groups differ"},
    {"setting": "pixel budget (min_pixels = max_pixels = 3136)",
     "mmrl": "passed to the image processor on every call",
     "trl": "TRL calls the processor without it, so the saved defaults apply (3136..12544 pixels)",
     "handling": "a 56x56 image gives the same 4x4 patch grid either way; the run checks that TRL's "
                 "prompt ids and pixel values equal mmrl's (setup_check)"},
    {"setting": "processor object",
     "mmrl": "loads the saved processor with its own loader (mmrl.load_model)",
     "trl": "would load AutoProcessor itself (for this checkpoint the same TokenizersBackend and ids)",
     "handling": "TRL is given mmrl's loaded processor as processing_class, so one object serves both"},
    {"setting": "blocked special tokens",
     "mmrl": "every special token except the stop token is suppressed",
     "trl": "by default only <|image_pad|> is suppressed",
     "handling": "matched: GRPOConfig.generation_kwargs={'suppress_tokens': mmrl's list}"},
    {"setting": "loss aggregation",
     "mmrl": "token_mean over the batch", "trl": "loss_type='dapo' (tokens of the global batch)",
     "handling": "the same normalization; with 1 token per completion every TRL loss type agrees"},
    {"setting": "TRL defaults changed to match mmrl",
     "mmrl": "fp32, no gradient checkpointing, constant lr, AdamW (torch), clip 1.0, wd 0",
     "trl": "defaults bf16=True, gradient_checkpointing=True, lr_scheduler_type='linear'",
     "handling": "set bf16=False, gradient_checkpointing=False, lr_scheduler_type='constant', "
                 "optim='adamw_torch', max_grad_norm=1.0, weight_decay=0.0"},
    {"setting": "log-prob computation",
     "mmrl": "full logits of the response positions", "trl": "fused LM head (tiled log-probs, entropy)",
     "handling": "implementation detail, not settable"},
    {"setting": "per-step bookkeeping",
     "mmrl": "the bench drives Trainer.train_step() and logs each step with Trainer._log (as fit does)",
     "trl": "Trainer.train() with its own logging every 10 steps (logging_steps default), report_to none",
     "handling": "each trainer's usual logging cost stays in its step time"},
]


# -- shared pieces ----------------------------------------------------------------------------------
def load_recipe(overrides: list[str] | None = None):
    from mmrl.config import load_recipe as load

    return load(RECIPE, overrides or [])


def pixel_options(recipe) -> dict[str, int]:
    m = recipe.model
    return {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v is not None}


def weights_digest(model) -> str:
    """sha256 over the state dict (sorted names, raw bytes): equal digests, equal weights."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def greedy_accuracy(model, processing, samples: list[dict], reward_fn, batch_size: int = 128) -> float:
    """THE evaluation for every run: greedy HF `generate` (1 new token, mmrl's blocked tokens
    suppressed, its stop ids) on prompts made by mmrl's processing; a response is correct
    when mmrl's counting reward gives it >= 1."""
    import torch

    from mmrl.data import to_conversation

    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(samples), batch_size):
                chunk = samples[start:start + batch_size]
                batch = dict(processing([to_conversation(s) for s in chunk]))
                out = model.generate(
                    **batch, do_sample=False, max_new_tokens=1, eos_token_id=processing.stop_token_ids,
                    pad_token_id=processing.tokenizer.pad_token_id,
                    suppress_tokens=processing.blocked_token_ids or None,
                )
                texts = processing.decode(out[:, batch["input_ids"].shape[1]:])
                scores = reward_fn(texts, [s["answer"] for s in chunk])
                correct += sum(score >= 1.0 for score in scores)
    finally:
        model.train(was_training)
    return correct / max(len(samples), 1)


class Clock:
    """Training time only: steps are timed end to end (one step's end to the next), and the
    time spent in validation is taken out."""

    def __init__(self, budget_s: float, eval_every: int, target: float, validation, evaluate):
        self.budget_s = budget_s
        self.eval_every = eval_every
        self.target = target
        self.validation = validation
        self.evaluate = evaluate
        self.step_times: list[float] = []
        self.step_cpu: list[float] = []  # process CPU seconds (OpenMP spin-waits inflate them under load too)
        self.rewards: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.eval_s = 0.0
        self.reached_at: dict[str, Any] | None = None
        self.last = None

    def start(self) -> None:
        self.last = time.perf_counter()
        self.last_cpu = time.process_time()

    @property
    def train_s(self) -> float:
        return sum(self.step_times)

    def step_done(self, step: int, model, reward_mean: float | None) -> bool:
        """Record a finished step; True when training should stop."""
        now = time.perf_counter()
        self.step_times.append(now - self.last)
        self.step_cpu.append(time.process_time() - self.last_cpu)
        if reward_mean is not None:
            self.rewards.append(reward_mean)
        stop = False
        if self.eval_every and step % self.eval_every == 0:
            accuracy = self.evaluate(model, self.validation)
            window = self.rewards[-self.eval_every:]
            self.history.append({"step": step, "train_s": round(self.train_s, 2),
                                 "validation_accuracy": accuracy,
                                 "reward_mean_last_steps": round(sum(window) / len(window), 4) if window else None})
            if accuracy >= self.target and self.reached_at is None:
                self.reached_at = {"step": step, "train_s": round(self.train_s, 2)}
                stop = True
        if self.train_s > self.budget_s:
            stop = True
        self.eval_s += time.perf_counter() - now
        self.last = time.perf_counter()
        self.last_cpu = time.process_time()
        return stop

    def summary(self) -> dict[str, Any]:
        warm = self.step_times[1:] or self.step_times
        return {
            "steps": len(self.step_times),
            "train_s": round(self.train_s, 2),
            "s_per_step_median": round(statistics.median(self.step_times), 4) if self.step_times else None,
            "s_per_step_median_after_first": round(statistics.median(warm), 4) if warm else None,
            "s_per_step_mean": round(self.train_s / len(self.step_times), 4) if self.step_times else None,
            "cpu_s_per_step_median": round(statistics.median(self.step_cpu), 4) if self.step_cpu else None,
            "first_step_s": round(self.step_times[0], 3) if self.step_times else None,
            "validation_eval_s": round(self.eval_s, 2),
            "reached_target": self.reached_at is not None,
            "target_step": self.reached_at["step"] if self.reached_at else None,
            "target_train_s": self.reached_at["train_s"] if self.reached_at else None,
            # Steps hardly depend on machine load; this product is the figure to trust on a busy machine.
            "target_steps_x_median_s": (round(self.reached_at["step"] * statistics.median(self.step_times), 1)
                                        if self.reached_at else None),
            "validation_history": self.history,
        }


def common_data(recipe):
    """Validation and eval sets exactly as mmrl's Trainer loads them (its split seeds)."""
    from mmrl.data import load_prompts

    validation = list(load_prompts(recipe.data.validation, split="validation"))
    evaluation = list(load_prompts(recipe.data.eval, split="test"))
    return validation, evaluation


# -- mmrl ----------------------------------------------------------------------------------------------
def run_mmrl(model_dir: Path, args, multipliers: bool) -> dict[str, Any]:
    import torch

    from mmrl.rewards import get_reward
    from mmrl.trainer import Trainer

    out_dir = model_dir.parent / f"run_{args.worker}"  # inside the parent's temporary folder
    overrides = [f"model.path={model_dir}", "model.random_init=false", "model.config_overrides={}",
                 "model.tiny_vocabulary={}", f"trainer.output_dir={out_dir}", "trainer.progress=false",
                 "trainer.export=false", "trainer.eval_every=0", f"trainer.steps={args.max_steps}",
                 f"trainer.seed={args.seed}", f"trainer.threads={args.threads}"]
    if not multipliers:
        overrides.append("optim.lr_multipliers={}")
    recipe = load_recipe(overrides)
    torch.set_num_threads(args.threads)
    reward_fn = get_reward(recipe.reward.name, **recipe.reward.options)

    t0 = time.perf_counter()
    trainer = Trainer(recipe)
    out_dir.mkdir(parents=True, exist_ok=True)
    startup_s = time.perf_counter() - t0
    model = trainer.actor.model
    processing = trainer.processing
    first_answers: list[str] = []
    trainer_reward = trainer.reward_fn

    def recording_reward(texts, answers, **fields):
        if not first_answers:
            first_answers.extend(answers[::recipe.rollout.samples_per_prompt])
        return trainer_reward(texts, answers, **fields)

    trainer.reward_fn = recording_reward
    validation, evaluation = common_data(recipe)
    evaluate = lambda m, s: greedy_accuracy(m, processing, s, reward_fn)  # noqa: E731
    setup = {"weights_digest": weights_digest(model), "step0_validation_accuracy": evaluate(model, validation),
             "lr_groups": sorted({g["lr"] for g in trainer.actor.optimizer.param_groups})}

    clock = Clock(args.budget_s, args.eval_every, args.target, validation, evaluate)
    t_train = time.perf_counter()
    clock.start()
    while trainer.step < args.max_steps:
        step_start = time.perf_counter()
        metrics = trainer.train_step()
        metrics["time/step"] = time.perf_counter() - step_start
        for key in ("rollout", "logprob", "update", "sync"):
            metrics[f"time/{key}"] = trainer.timings.pop(key, 0.0)
        trainer._log({"step": trainer.step, **metrics})  # what Trainer.fit does each step
        if clock.step_done(trainer.step, model, metrics.get("reward/mean")):
            break
    wall_s = startup_s + (time.perf_counter() - t_train)
    final = evaluate(model, evaluation)
    own = trainer.evaluate(evaluation)["accuracy"]  # mmrl's own evaluator, as a cross-check of the shared one
    trainer.log.close()
    return {"startup_s": round(startup_s, 2), "wall_s": round(wall_s, 2), **clock.summary(),
            "final_eval_accuracy": final, "mmrl_own_eval_accuracy": own,
            "setup": {**setup, "first_step_answers": first_answers},
            "torch_threads": torch.get_num_threads()}


# -- TRL -----------------------------------------------------------------------------------------------
def run_trl(model_dir: Path, args, multipliers: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import mmrl
    from mmrl.data import load_prompts
    from mmrl.rewards import get_reward

    recipe = load_recipe([f"trainer.seed={args.seed}"])
    r = recipe
    # Start-up (imports excluded, as for mmrl): the data and the trainer object, which mmrl's
    # Trainer builds in its constructor, up to TRL's on_train_begin.
    t0 = time.perf_counter()
    loaded = mmrl.load_model(model_dir, processing_options=pixel_options(recipe))  # its processor and processing
    processing = loaded.processing
    train = load_prompts(r.data.train)
    per_step = r.data.prompts_per_step
    # TRL's prompts in mmrl's order: the rows of mmrl's first max_steps batches, unshuffled.
    # (PromptDataset.batches with drop_last, epoch by epoch, without building the batches.)
    order: list[int] = []
    per_epoch = train.batches_per_epoch(per_step) * per_step
    epoch = 0
    while len(order) < per_step * args.max_steps:
        order += train.epoch_order(r.data.shuffle_seed, epoch)[:per_epoch]
        epoch += 1
    rows = list(train)

    def to_rows(batch: dict[str, list]) -> dict[str, list]:
        chosen = [rows[i] for i in batch["row"]]
        return {"prompt": [s["prompt"] for s in chosen], "images": [s["images"] for s in chosen],
                "answer": [s["answer"] for s in chosen]}

    dataset = Dataset.from_dict({"row": order}).with_transform(to_rows)
    counting = get_reward(r.reward.name, **r.reward.options)
    step_rewards: list[float] = []
    first_answers: list[str] = []

    def counting_reward(prompts, completions, answer, **_):
        """mmrl's reward in TRL's signature (conversational completions)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = counting(texts, answer)
        if not step_rewards:
            first_answers.extend(answer[::r.rollout.samples_per_prompt])
        step_rewards.append(sum(scores) / len(scores))
        return scores

    counting_reward.__name__ = r.reward.name
    config = GRPOConfig(
        output_dir=str(model_dir.parent / f"run_{args.worker}"),
        per_device_train_batch_size=per_step * r.rollout.samples_per_prompt,
        gradient_accumulation_steps=1,
        num_generations=r.rollout.samples_per_prompt,
        max_completion_length=r.rollout.max_new_tokens,
        temperature=r.rollout.temperature, top_p=r.rollout.top_p, top_k=0,
        learning_rate=r.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=r.optim.weight_decay, adam_beta1=r.optim.betas[0], adam_beta2=r.optim.betas[1],
        max_grad_norm=r.optim.grad_clip, optim="adamw_torch",
        beta=r.algo.kl_coef, num_iterations=r.algo.epochs_per_rollout,
        epsilon=r.algo.clip_low, epsilon_high=r.algo.clip_high, loss_type="dapo", scale_rewards="group",
        generation_kwargs={"suppress_tokens": processing.blocked_token_ids},
        shuffle_dataset=False, seed=args.seed, data_seed=args.seed,
        max_steps=args.max_steps, bf16=False, gradient_checkpointing=False, use_cpu=True,
        model_init_kwargs={"dtype": r.model.dtype, "attn_implementation": r.model.attn_implementation},
        report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False,
    )

    trainer_cls = GRPOTrainer
    if multipliers:
        class GRPOTrainerWithPartLRs(GRPOTrainer):
            def create_optimizer(self, model=None):
                if self.optimizer is None:
                    from mmrl.parts import part_of

                    rates: dict[float, list] = {}
                    for name, param in self.model.named_parameters():
                        if param.requires_grad:
                            part = part_of(name, loaded.adapter)
                            rates.setdefault(r.optim.lr * r.optim.lr_multipliers.get(part, 1.0), []).append(param)
                    self.optimizer = torch.optim.AdamW(
                        [{"params": p, "lr": lr} for lr, p in rates.items()], lr=r.optim.lr,
                        betas=r.optim.betas, weight_decay=r.optim.weight_decay)
                return self.optimizer

        trainer_cls = GRPOTrainerWithPartLRs

    validation, evaluation = common_data(recipe)
    evaluate = lambda m, s: greedy_accuracy(m, processing, s, counting)  # noqa: E731
    clock = Clock(args.budget_s, args.eval_every, args.target, validation, evaluate)
    marks: dict[str, Any] = {}

    class Bench(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            marks["startup_s"] = time.perf_counter() - t0
            # Setup checks stay out of every clock: they stop it and restart it.
            pause = time.perf_counter()
            marks["setup"] = {"weights_digest": weights_digest(model),
                              "step0_validation_accuracy": evaluate(model, validation),
                              "lr_groups": sorted({g["lr"] for g in trainer.optimizer.param_groups}),
                              "eos_token_ids": list(trainer.eos_token_ids),
                              "suppress_tokens": list(trainer.generation_config.suppress_tokens or []),
                              **setup_check(trainer, processing, rows[:8])}
            marks["setup_s"] = time.perf_counter() - pause
            marks["t_train"] = time.perf_counter()
            clock.start()

        def on_step_end(self, targs, state, control, model=None, **kw):
            reward = step_rewards[-1] if step_rewards else None
            if clock.step_done(state.global_step, model, reward):
                control.should_training_stop = True

    trainer = trainer_cls(model=str(model_dir), reward_funcs=counting_reward, args=config, train_dataset=dataset,
                          processing_class=loaded.processor, callbacks=[Bench()])
    trainer.train()
    wall_s = marks["startup_s"] + (time.perf_counter() - marks["t_train"])
    final = evaluate(trainer.model, evaluation)
    return {"startup_s": round(marks["startup_s"], 2), "wall_s": round(wall_s, 2), **clock.summary(),
            "final_eval_accuracy": final, "setup": {**marks["setup"], "first_step_answers": first_answers},
            "torch_threads": torch.get_num_threads()}


def setup_check(trainer, processing, samples: list[dict]) -> dict[str, Any]:
    """Do TRL's prompts equal mmrl's? Token ids (padding removed) and pixel values of a few
    training prompts, through TRL's own tokenization and mmrl's processing."""
    import torch
    from trl.data_utils import prepare_multimodal_messages

    from mmrl.data import to_conversation

    prompts = [prepare_multimodal_messages(s["prompt"], images=s["images"]) for s in samples]
    trl_ids, _, trl_fields = trainer._tokenize_prompts(prompts)
    ours = processing([to_conversation(s) for s in samples])
    our_ids = [row[mask.bool()].tolist() for row, mask in zip(ours["input_ids"], ours["attention_mask"])]
    return {"prompt_ids_equal": [list(map(int, x)) for x in trl_ids] == our_ids,
            "pixel_values_equal": bool(torch.equal(trl_fields["pixel_values"], ours["pixel_values"])),
            "image_grid_thw_equal": bool(torch.equal(trl_fields["image_grid_thw"], ours["image_grid_thw"])),
            "prompt_tokens": len(our_ids[0])}


# -- the parent --------------------------------------------------------------------------------------------
def build_start(model_dir: Path, seed: int) -> dict[str, Any]:
    import mmrl

    recipe = load_recipe([f"trainer.seed={seed}"])
    m = recipe.model
    built = mmrl.build_model(m.path, random_init=True, seed=recipe.trainer.seed, dtype=m.dtype,
                             attn_implementation=m.attn_implementation, config_overrides=m.config_overrides or None,
                             tiny_vocabulary=m.tiny_vocabulary or None, processing_options=pixel_options(recipe))
    built.save(model_dir)
    return {"family": m.path, "parameters": sum(p.numel() for p in built.model.parameters()),
            "vocabulary": len(built.tokenizer), "weights_digest": weights_digest(built.model)}


def versions() -> dict[str, str]:
    from mmrl.platform_info import versions as installed

    return installed(("torch", "transformers", "trl", "accelerate", "datasets", "mmrl"), missing="missing")


def settings(args) -> dict[str, Any]:
    r = load_recipe()
    return {
        "recipe": str(RECIPE.relative_to(REPO)), "task_train": r.data.train, "validation": r.data.validation,
        "eval": r.data.eval, "prompts_per_step": r.data.prompts_per_step,
        "samples_per_prompt": r.rollout.samples_per_prompt, "max_new_tokens": r.rollout.max_new_tokens,
        "temperature": r.rollout.temperature, "lr": r.optim.lr, "lr_multipliers_recipe": r.optim.lr_multipliers,
        "reward": {"name": r.reward.name, **r.reward.options}, "kl": r.algo.kl_coef, "clip": r.algo.clip_low,
        "seed": args.seed, "torch_threads": args.threads, "eval_every": args.eval_every,
        "target_accuracy": args.target, "budget_s": args.budget_s, "max_steps": args.max_steps,
        "timing": "validation every eval_every steps is excluded from train_s, s/step, time to target and the "
                  "budget for every run; wall_s = start-up + training + those validations (not the final eval)",
        "order": "each run in its own child process, one after the other, in the order listed",
    }


def print_table(runs: dict[str, dict]) -> None:
    """s/step is the median, mean the mean (far above the median: other load on the machine);
    steps*s/step is steps to target times the median, the time to target to trust on a busy machine."""
    head = (f"{'run':<13} {'lr mult':>8} {'start s':>8} {'s/step':>7} {'mean':>6} {'steps':>6} {'train s':>8} {'wall s':>7} "
            f"{'0.95 at':>8} {'to 0.95 s':>9} {'steps*s/step':>12} {'final acc':>9}")
    print(head)
    print("-" * len(head))
    for name, res in runs.items():
        if "error" in res:
            print(f"{name:<13} failed: {res['error'][:90]}")
            continue
        print(f"{name:<13} {res['lr_multipliers']:>8} {res['startup_s']:>8.1f} {res['s_per_step_median']:>7.3f} "
              f"{res['s_per_step_mean']:>6.3f} {res['steps']:>6} {res['train_s']:>8.1f} {res['wall_s']:>7.1f} "
              f"{str(res['target_step'] or '-'):>8} {str(res['target_train_s'] or '-'):>9} "
              f"{str(res['target_steps_x_median_s'] or '-'):>12} {res['final_eval_accuracy']:>9.3f}")


def checks(runs: dict[str, dict], start: dict[str, Any]) -> dict[str, Any]:
    """Did every run start from the same weights and see the same first prompts, and did
    TRL's inputs equal mmrl's?"""
    done = {n: r for n, r in runs.items() if "error" not in r}
    firsts = {n: r["setup"]["first_step_answers"] for n, r in done.items()}
    reference = next(iter(firsts.values()), None)
    out = {"same_start_weights": all(r["setup"]["weights_digest"] == start["weights_digest"] for r in done.values()),
           "same_step0_validation_accuracy": len({r["setup"]["step0_validation_accuracy"] for r in done.values()}) <= 1,
           "same_first_step_prompts": all(f == reference for f in firsts.values()),
           "trl_inputs_equal_mmrl": all(r["setup"].get(k, True) for r in done.values()
                                        for k in ("prompt_ids_equal", "pixel_values_equal", "image_grid_thw_equal")),
           "shared_eval_equals_mmrl_own_eval": all(r["final_eval_accuracy"] == r["mmrl_own_eval_accuracy"]
                                                   for r in done.values() if "mmrl_own_eval_accuracy" in r)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(DEFAULT_RUNS))
    parser.add_argument("--budget-s", type=float, default=400.0, help="training seconds per run (eval excluded)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--max-steps", type=int, default=20000, help="a ceiling; the budget or target stops first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "trl_comparison.json")
    parser.add_argument("--note", default="", help="stored in the JSON (e.g. what else ran on the machine)")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.worker:
        run = run_mmrl if args.worker.startswith("mmrl") else run_trl
        load_before = os.getloadavg()
        result = run(args.model_dir, args, multipliers=args.worker in ("mmrl", "trl_mult"))
        # Other work on the machine shows here: a load above the thread count slows every step.
        result["load_average_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
        args.result.write_text(json.dumps(result, indent=2))
        return

    with tempfile.TemporaryDirectory(prefix="trl_cmp_") as tmp:
        model_dir = Path(tmp) / "start"
        start = build_start(model_dir, args.seed)
        print(f"start model: {start}", flush=True)
        runs: dict[str, dict] = {}
        for name in args.runs:
            result_file = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model-dir", str(model_dir),
                   "--result", str(result_file), "--budget-s", str(args.budget_s), "--target", str(args.target),
                   "--eval-every", str(args.eval_every), "--max-steps", str(args.max_steps),
                   "--seed", str(args.seed), "--threads", str(args.threads)]
            print(f"running {name} ...", flush=True)
            began = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0 or not result_file.is_file():
                text = (proc.stderr or proc.stdout).strip()
                runs[name] = {"error": text.splitlines()[-1] if text else f"exit {proc.returncode}",
                              "stderr_tail": proc.stderr[-4000:]}
                print(proc.stderr[-4000:], file=sys.stderr)
                continue
            res = json.loads(result_file.read_text())
            res["lr_multipliers"] = "x10 v/p" if name in ("mmrl", "trl_mult") else "none"
            res["process_s"] = round(time.perf_counter() - began, 1)
            runs[name] = res
            print(f"  {name}: {res['steps']} steps, final accuracy {res['final_eval_accuracy']:.3f}", flush=True)

    print()
    print_table(runs)
    checked = checks(runs, start)
    print(f"\nchecks: {checked}")
    print("\nsettings that differ (TRL vs mmrl):")
    for d in DIFFERENCES:
        print(f"- {d['setting']}: {d['handling']}")
    report = {"command": COMMAND, "argv": sys.argv[1:], "note": args.note, "machine": platform.platform(),
              "processor": platform.processor(), "cpu_count": os.cpu_count(), "versions": versions(),
              "start_model": start, "checks": checked, "settings": settings(args), "differences": DIFFERENCES,
              "runs": runs}
    from mmrl.platform_info import write_report

    write_report(args.out, report, lead="\n")


if __name__ == "__main__":
    main()
