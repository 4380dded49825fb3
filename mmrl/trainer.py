"""The RL loop: rollout -> reward -> advantage -> update -> sync, driven by a recipe.

    mmrl train recipes/tiny_vlm_count.yaml                       # one process
    torchrun --nproc_per_node 2 -m mmrl.cli train RECIPE         # FSDP2 over 2 processes
    torchrun --nproc_per_node 4 -m mmrl.cli train RECIPE parallel.sequence_parallel=2
    torchrun --nproc_per_node 2 -m mmrl.cli train RECIPE parallel.rollout_ranks=1 algo.max_staleness=1

Each step takes `prompts_per_step` prompts (split across the data-parallel ranks; the
`parallel.sequence_parallel` ranks of one Ulysses group share their prompts, rollouts
and sequences), samples
`samples_per_prompt` responses each, scores them with the reward function, computes
advantages with the configured estimator, and updates the actor (and the critic for
GAE) in micro-batches; the rollout reaches the update through the trajectory buffer
(`mmrl.buffer`: `algo.max_staleness` 0 trains on it at once, 1 one step later). Metrics
go to `metrics.jsonl` and the `trainer.loggers` (TensorBoard by default, `mmrl.loggers`),
a few sampled completions every `trainer.samples_every` steps and at each validation to
`samples.jsonl` (`mmrl.samples`); checkpoints hold everything needed to resume exactly
(weights, optimizer, data position, RNG, the buffer's place).

The output folder belongs to one run (`mmrl.runs`): a second process is locked out, a
folder holding another run's results is refused unless `trainer.resume` (the same run)
or `trainer.overwrite` (remove them first). Checkpoints are written aside and renamed
into place with a manifest; resume takes the newest that verifies, cuts `metrics.jsonl`
and `samples.jsonl` back to its step and plots the whole run. SIGINT / SIGTERM finish the
step, save a checkpoint and exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from mmrl import prewarm
from mmrl.atomic import atomic_write_text
from mmrl.buffer import RolloutBatch, attach_behaviour, disaggregated, steps_for
from mmrl.build import build_recipe_model, recipe_config
from mmrl.checkpoint import load_checkpoint, save_checkpoint
from mmrl.compile_watch import BackgroundCompile, persistent_cache, start_compile_workers, watch
from mmrl.config import Recipe, RecipeError, dump_recipe, same_run
from mmrl.engine import Engine
from mmrl.evaluation import Evaluator, conversations_of, rollout_generator
from mmrl.export import export_policy
from mmrl.gc_watch import watch_gc
from mmrl.media_check import PassMemo, step_zero_media_check
from mmrl.logs import capped_threads
from mmrl.page_cache import library_files, read_ahead
from mmrl.parallel import Dist, LaunchError, init_distributed
from mmrl.recipe_checks import check_before_build, check_prompt_lengths, recipe_reward, unset_toy_defaults
from mmrl.rewards import get_reward, reward_name
from mmrl.rollout import SamplingParams, make_rollout, rollout_options
from mmrl.run_log import METRICS_FILE, RunLog, plot_rewards
from mmrl.runs import MANIFEST_FILE, RunFolder, RunFolderError
from mmrl.samples import sample_rows
from mmrl.scoring import score_rollout
from mmrl.settle import resolve
from mmrl.summary import run_summary
from mmrl.update import PolicyUpdate


class Trainer:
    def __init__(self, recipe: Recipe, dist: Dist | None = None, *, reward=None, datasets: dict | None = None):
        """`reward` (a function) and `datasets` (`PromptDataset`s by data field: "train",
        "validation", "eval") replace what the recipe names; `mmrl.api.train` passes them."""
        self.recipe = recipe
        self._given_reward = reward
        self._given_datasets = datasets or {}
        sequence_parallel = recipe.parallel.sequence_parallel
        if dist is None:
            try:
                dist = init_distributed(sequence_parallel=sequence_parallel)
            except LaunchError:
                raise
            except ValueError as exc:
                raise RecipeError(f"parallel.sequence_parallel: {exc}") from None
        if dist.sequence_parallel != sequence_parallel:
            raise RecipeError(f"parallel.sequence_parallel: {sequence_parallel}, but the given Dist has "
                              f"{dist.sequence_parallel}")
        self.dist = dist
        if dist.device.type == "cuda" and dist.local_rank == 0:  # one reader per machine: the page cache is shared
            read_ahead(library_files())  # the CUDA libraries' pages, read while the model builds (mmrl/page_cache.py)
        cfg = recipe.trainer
        if cfg.threads:
            torch.set_num_threads(capped_threads(cfg.threads))
        # The ranks of one sequence-parallel group sample alike (same seed, same prompts).
        torch.manual_seed(cfg.seed + self.dist.dp_rank)
        random.seed(cfg.seed + self.dist.dp_rank)
        self.output_dir = Path(cfg.output_dir)
        self.folder = RunFolder(self.output_dir)
        self.step = 0
        self.timings: dict[str, float] = defaultdict(float)
        self.log = RunLog(self.output_dir, main=self.dist.is_main, loggers=cfg.loggers)
        self._stop_signal: int | None = None
        # cheap checks, before the (slow) model build
        check_before_build(recipe, reward=reward, loaded=self._given_datasets)
        notice = unset_toy_defaults(recipe)
        if notice and self.dist.is_main:
            print(notice, file=sys.stderr, flush=True)
        self._environment = environment_factory(recipe)
        self._load_datasets()
        # Every "auto" settled once, before the build; what it built with is recorded in the
        # run folder's recipe.yaml and the summary (`mmrl.settle`).
        self.settled = resolve(recipe, self.dist)
        self.recipe = recipe = recipe.model_copy(update={"settled": self.settled.section()})
        self._claim_folder()
        if self.dist.device.type == "cuda":
            persistent_cache(self.dist.device)  # compiled kernels outlive the run (mmrl/compile_watch.py)
            if self.settled.compile_layers or self.settled.rollout_decode == "compiled":
                start_compile_workers()  # ready by the first compile; the build overlaps their start
        self.compile_watch = watch()
        self.compile_watch.take()  # this run's compiles only, not earlier ones of the process
        self.compile_watch.announce = self.dist.is_main
        self.gc_watch = watch_gc()
        self.gc_watch.take()
        ahead = self._compile_ahead()
        # The update's graphs compile in a helper process while this one builds and rolls out.
        self.compile_helper = prewarm.start(recipe, self.settled, self.dist,
                                            given_objects=reward is not None or bool(self._given_datasets))
        self.compile_helper_marks = prewarm.marks(self.settled, self.dist)
        self._update_compiled = False  # a step's update ran with compiling on (`prewarm.mark_done`)
        self._checkpointing_while_eager: list = []  # engines checkpointing since an eager step's OOM
        try:
            self._build()
        except BaseException:
            if self.compile_helper is not None:
                self.compile_helper.stop()
            self.folder.release()
            raise
        if ahead is not None:
            ahead.wait()  # before the model's first use: no compile beside a CUDA graph's recording
        self._check_helper_room()
        if recipe.trainer.gc_freeze and (self.settled.compile_layers or (
                self.dist.device.type == "cuda" and self.settled.rollout_backend == "hf_compiled")):
            # The first step compiles: its full collections walk only what the compiles make.
            self.gc_watch.freeze_now()
            self.gc_watch.take()  # the start's collection is not step 1's `time/gc`

    def _compile_ahead(self) -> BackgroundCompile | None:
        """On a GPU with `MMRL_COMPILE_AHEAD=head` or `all`, what the first update compiles
        (the chunked head's arithmetic; with `all` also the decoder layer's forward and
        backward: `mmrl.compile_ahead`), compiling in a thread while the model builds. Off by
        default: measured so far it did not pay (docs/performance.md, "The update's graphs
        compiled while the model builds")."""
        what = os.environ.get("MMRL_COMPILE_AHEAD", "0")
        if self.dist.device.type != "cuda" or what not in ("head", "all"):
            return None
        from mmrl.compile_ahead import CompileAhead

        processor, config = self._loaded
        work = CompileAhead(self.recipe, self.settled, config, processor, self.dist, layers=what == "all",
                            dataset=self.train_set)
        return BackgroundCompile(work, "the update's graphs", self.compile_watch)

    def _claim_folder(self) -> None:
        """Lock the output folder (rank 0) and refuse another run's results; every rank
        learns the outcome, so none waits for a rank that gave up."""
        cfg = self.recipe.trainer
        error = None
        if self.dist.is_main:
            try:
                self.folder.claim(resume=cfg.resume, overwrite=cfg.overwrite,
                                  same_run=lambda saved: same_run(self.recipe, saved))
            except RunFolderError as exc:
                error = str(exc)
        if self.dist.distributed and torch.distributed.is_initialized():
            error = self.dist.all_gather_objects(error)[0]
        if error:
            raise RunFolderError(error)

    # -- setup -------------------------------------------------------------------------------
    def _build(self) -> None:
        from mmrl.algos import get_advantage_estimator
        from mmrl.data import Position

        r = self.recipe
        m = r.model
        settled = self.settled
        attention = m.model_copy(update={"attn_implementation": settled.attn_implementation})

        def build(seed: int, processor):
            return build_recipe_model(attention, seed=seed, device=self.dist.device, processor=processor)

        # Every rank builds the same initial weights (same seed), so FSDP shards agree.
        built = build(r.trainer.seed, self._loaded[0])
        self._loaded = None
        if m.freeze:
            from mmrl.parts import freeze

            freeze(built.model, parts=m.freeze, adapter=built.adapter)
        if m.lora_scope != "none":
            from mmrl.lora import apply_lora

            try:
                built.model = apply_lora(built.model, scope=m.lora_scope, rank=m.lora_rank, alpha=m.lora_alpha,
                                         dropout=m.lora_dropout, targets=m.lora_targets, adapter=built.adapter)
            except ValueError as exc:
                raise RecipeError(f"model.lora_{'targets' if m.lora_targets else 'scope'}: {exc}") from None
        self.built = built
        self.processing = built.processing
        self.estimator = get_advantage_estimator(r.algo.advantage)
        passes = {"share_media": m.share_media, **settled.engine_options()}
        # A LoRA run on a base checkpoint saves its adapter only; a random-init base is
        # drawn differently on another device, so those checkpoints keep it.
        self.actor = Engine(built, self.dist, optim=r.optim, total_steps=r.trainer.steps,
                            gradient_checkpointing=settled.gradient_checkpointing,
                            trainable_only_checkpoints=m.lora_scope != "none" and not m.random_init, **passes)
        if m.lora_scope != "none":
            from mmrl.lora import AdapterFreeReference, keep_lora_dropout

            keep_lora_dropout(self.actor.model, m.lora_dropout)
        self.ref = None
        if r.algo.kl_coef > 0:
            # A LoRA actor with its adapters off is the starting model: no second copy.
            self.ref = AdapterFreeReference(self.actor) if m.lora_scope != "none" else \
                Engine(build(r.trainer.seed, built.processor), self.dist, **passes)
        self.critic = None
        if self.estimator.needs_critic:
            self.critic = Engine(build(r.trainer.seed, built.processor), self.dist, optim=r.optim,
                                 lr=r.optim.critic_lr, total_steps=r.trainer.steps, value_head=True, **passes)
        self.update = PolicyUpdate(r, self.dist, self.actor, self.ref, self.critic, self.estimator, self.processing,
                                   built.adapter)
        backend = settled.rollout_backend
        # The recipe's own name too: "auto" may still take plain generate (an inference copy that does not fit).
        self.rollout = make_rollout(backend, self.actor, self.processing, requested=r.rollout.backend,
                                    **rollout_options(r.rollout, backend, settled.rollout_decode))
        self.agent = None
        if self._environment is not None:
            from mmrl.rollout.agent import AgentRollout

            self.agent = AgentRollout(self.rollout, self.processing, self._environment,
                                      max_turns=r.rollout.max_turns, max_tokens=r.rollout.max_tokens,
                                      keep_cache=r.rollout.keep_cache)
        self.reward_fn = get_reward(self._given_reward) if self._given_reward is not None else recipe_reward(r)
        self.evaluator = Evaluator(r.eval, self.dist, max_new_tokens=r.rollout.max_new_tokens, score=self._score_in,
                                   generate=rollout_generator(self.rollout, self.agent, max_pixels=m.max_pixels),
                                   progress=r.trainer.progress)
        self.position = Position(0, 0)
        # Seconds of training steps before this process (a resumed run's earlier ones) and
        # when this process's steps began: `train_seconds` counts the whole run's steps.
        self._seconds_before, self._steps_started = 0.0, None
        self._batches = None
        # The batch each step trains on goes through the trajectory buffer (mmrl/buffer).
        self.trajectories = steps_for(self)

    def _load_datasets(self) -> None:
        """The splits (loaded once: `check_before_build` already did, `load_prompts` keeps
        them), and their prompts against the model's context, before the build."""
        from mmrl.data import load_prompts

        r, given = self.recipe, self._given_datasets
        self.train_set = given["train"] if "train" in given else load_prompts(r.data.train)
        self.eval_set = given["eval"] if "eval" in given else (
            load_prompts(r.data.eval, split="test") if r.data.eval else None)
        self.validation_set = given["validation"] if "validation" in given else (
            load_prompts(r.data.validation, split="validation") if r.data.validation else self.eval_set)
        # The processor and config the build reads, loaded once for the check and the build.
        self._loaded = recipe_config(r.model)
        check_prompt_lengths(r, {"train": self.train_set, "validation": self.validation_set, "eval": self.eval_set},
                             self._loaded)

    # -- one step -------------------------------------------------------------------------------
    def timed(self, name: str):
        """A context manager that adds its block's seconds to `timings[name]` (the step's
        split: "rollout", "logprob", "update", "sync"); the buffer's schedules time their
        rollouts with it too."""
        trainer = self

        class _Timer:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                trainer.timings[name] += time.perf_counter() - self.start

        return _Timer()

    def score(self, samples: list[dict], result, rows: list[int], dataset, where: str,
              conversations: list | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float]]]:
        """Rewards of the responses, the reward function's part of them alone (per-turn
        credit counts the environment's apart), and a combined reward's parts by name
        (`score_parts`); a failing reward or a NaN/inf score stops the run here, before any
        update, naming the reward, `where`, and the row of `dataset` (`rows`: the samples')."""
        outcomes, parts = score_rollout(self.reward_fn, self.processing, samples, result, rows=rows, dataset=dataset,
                                        where=where, conversations=conversations,
                                        max_pixels=self.recipe.model.max_pixels)
        rewards = outcomes + result.env_rewards.float() if result.env_rewards is not None else outcomes
        return rewards, outcomes, parts

    def next_prompts(self) -> tuple[list[dict], list[int]]:
        """This data-parallel rank's share of the next batch of prompts, and their source
        rows (as the dataset file counts them, for errors)."""
        r = self.recipe
        shards = self.dist.dp_size
        per_rank = max(1, r.data.prompts_per_step // shards)
        if self._batches is None:
            self._batches = self.train_set.batches(per_rank * shards, seed=r.data.shuffle_seed, start=self.position)
        batch = next(self._batches)
        self.position = batch.end
        rows = [self.train_set.source_rows[i] for i in batch.indices][self.dist.dp_rank::shards]
        return batch.samples[self.dist.dp_rank::shards], rows

    def _same_in_sp_group(self, result):
        """The rollout of the group's first rank on every rank of a sequence-parallel
        group: Ulysses needs the same sequences there, and sampling need not be
        bitwise reproducible across devices."""
        if self.dist.sequence_parallel == 1:
            return result
        from dataclasses import fields

        import torch.distributed as torch_dist

        box = [{f.name: getattr(result, f.name) for f in fields(result)} if self.dist.sp_rank == 0 else None]
        torch_dist.broadcast_object_list(box, src=self.dist.dp_rank * self.dist.sequence_parallel,
                                         group=self.dist.sp_group)
        return type(result)(**box[0])

    def roll_out_batch(self, prompts: tuple[list[dict], list[int]] | None = None,
                       generator_seed: int | None = None) -> RolloutBatch:
        """The next prompts' rollout, scored: what a step trains on, now or (one step off,
        `algo.max_staleness`) later; the buffer's schedules (mmrl/buffer) produce their
        batches with it. `prompts`: the samples and their source rows, chosen by the caller
        (a rollout rank, `mmrl.buffer.disaggregated`); `generator_seed`:
        `SamplingParams.generator_seed` (mmrl/buffer)."""
        r = self.recipe
        where = f"step {self.step + 1}"
        samples, source_rows = prompts if prompts is not None else self.next_prompts()
        # An environment opens each sample's conversation itself (from the row).
        conversations = None if self.agent else conversations_of(samples, source_rows, self.train_set, where,
                                                                max_pixels=r.model.max_pixels)
        # `algo.behaviour: sampler` takes a stale batch's behaviour log-probs from the sampler (mmrl/buffer).
        sampler = r.algo.behaviour == "sampler" and r.algo.max_staleness > 0
        params = SamplingParams(n=r.rollout.samples_per_prompt, max_new_tokens=r.rollout.max_new_tokens,
                                temperature=r.rollout.temperature, top_p=r.rollout.top_p, logprobs=sampler,
                                logprobs_temperature=r.rollout.temperature or 1.0, generator_seed=generator_seed)
        with self.timed("rollout"):
            generated = self.agent.generate(samples, params) if self.agent else \
                self.rollout.generate(conversations, params)
            result = self._same_in_sp_group(generated)
        if self.step == 0 and self.agent is None and self.built.adapter.is_multimodal and r.trainer.media_check:
            # Does the model read the first batch's images? (one line, or an error: trainer.strict_media)
            with self.timed("media_check"):
                reading = step_zero_media_check(self.actor, self.rollout, self.processing, conversations, result,
                                                strict=r.trainer.strict_media,
                                                passes=PassMemo.for_run(r, self.settled))
            for path, seconds in (reading.seconds.items() if reading is not None else ()):
                self.timings[f"media_check_{path}"] = seconds
        rewards, outcomes, reward_parts = self.score(samples, result, source_rows, self.train_set, where,
                                                      conversations)
        return RolloutBatch(samples=samples, rows=source_rows, conversations=conversations,
                            result=result, rewards=rewards, reward_parts=reward_parts, outcomes=outcomes,
                            version=self.step, data_end=tuple(self.position))

    def train_step(self) -> dict[str, float]:
        """One RL step: rollout, reward, advantages, update, weight sync."""
        from mmrl.algos import uniform_groups

        r = self.recipe
        batch, buffer_metrics = self.trajectories.next(done=self.step)
        samples, conversations, result = batch.samples, batch.conversations, batch.result
        rewards, reward_parts, source_rows = batch.rewards, batch.reward_parts, batch.rows
        group_size = r.rollout.samples_per_prompt
        keep = ~uniform_groups(rewards, group_size) if r.algo.filter_uniform_groups else \
            torch.ones_like(rewards).bool()
        metrics: dict[str, float] = {
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/accuracy": (rewards >= r.eval.correct_threshold).float().mean().item(),
            "response/length": result.lengths.mean().item(),
            "response/stopped": sum(f == "stop" for f in result.finish_reasons) / len(result.finish_reasons),
            "groups/kept": keep.float().mean().item(),
            **{f"reward/{name}": sum(scores) / len(scores) for name, scores in reward_parts.items()},
            **(result.stats or {}),
            **buffer_metrics,
        }
        self.step += 1
        rows = keep.nonzero().squeeze(-1)
        if self.dist.all_reduce_sum(float(len(rows))) == 0:
            self._write_samples(samples, source_rows, result, rewards, None, reward_parts)
            return metrics  # every rank filtered every group: nothing to learn from
        if len(rows) == 0:
            # Other ranks update, and FSDP's collectives need this rank too: its uniform
            # groups take part with the (zero) advantages GRPO gives them.
            rows = torch.arange(len(rewards))
        # While the compile helper is at work, this step's log-probs and update run through
        # the engines' eager layers (nothing compiled, nothing waited for); the first step after
        # it compiles them from the cache it filled (mmrl/prewarm.py).
        eager = self.compile_helper is not None and self.compile_helper.pending()
        if not eager:
            self._end_checkpointing_while_eager()
        # In an eager step, whether each engine that trains checkpoints before its update.
        trained = (self.actor, self.critic) if eager else ()
        before = {engine: engine.checkpointing for engine in trained if engine is not None}
        with self._eager_layers() if eager else contextlib.nullcontext():
            plan = self.update.plan(conversations, result, rows, rewards, group_size, r.rollout.temperature or 1.0,
                                    batch.outcomes)
            attach_behaviour(plan.batches, batch)  # the off-policy correction's behaviour log-probs (algo.off_policy)
            self.timings["logprob"] += plan.estimate_seconds
            metrics.update(plan.metrics)
            self._write_samples(samples, source_rows, result, rewards, plan.advantages, reward_parts)
            with self.timed("update"):
                metrics.update(self.update.run(plan))
        if eager:
            metrics["compile/helper_pending"] = 1.0
            # An eager update that ran out of memory turned checkpointing on (`Update._accumulate`);
            # the compiled layers keep fewer activations, so it lasts only while the steps are eager.
            self._checkpointing_while_eager += [engine for engine, was in before.items()
                                                if engine.checkpointing and not was]
        elif self.compile_helper_marks and not self._update_compiled:
            self._update_compiled = True
            prewarm.mark_done(r, self.settled)  # the next run of this recipe starts no helper
        with self.timed("sync"):
            self.rollout.sync(self.actor)
        if r.trainer.gc_freeze:
            self.gc_watch.freeze_after(self.compile_watch.graphs)
        metrics["lr"] = self._recipe_lr()
        return metrics

    def _end_checkpointing_while_eager(self) -> None:
        """Checkpointing turned on by an out-of-memory update in an eager step (the compile
        helper at work) goes off again at the first step whose layers compile: the eager
        layers' forward keeps more activations than the compiled one. If a compiled update runs
        out of memory too, `gradient_checkpointing: auto` turns it on again, for good."""
        if not self._checkpointing_while_eager:
            return
        for engine in self._checkpointing_while_eager:
            engine.disable_checkpointing()
        self._checkpointing_while_eager = []
        if self.dist.is_main:
            print("update: activation checkpointing off again: it was turned on in a step whose layers ran eagerly "
                  "beside the compile helper, and the compiled layers keep fewer activations", flush=True)

    def _check_helper_room(self) -> None:
        """Stop the compile helper where the GPU's memory after the build cannot hold the
        first update's training state beside the helper's model (`prewarm.room_problem`):
        the helper is worth seconds, an out-of-memory error the run."""
        layers = getattr(self.actor, "compiled_layers", None)
        if self.compile_helper is None or not self.compile_helper.pending() or layers is None:
            return
        from mmrl.rollout.inference_copy import free_memory, pending_training_bytes

        device = self.dist.device
        kept = max(1, len(prewarm.layer_kinds(self.built.model.config.get_text_config())))
        engines = [engine for engine in (self.actor, self.ref, self.critic) if engine is not None]
        pending = sum(sum(pending_training_bytes(engine)) for engine in engines)
        helper = sum(prewarm.helper_bytes(engine.model, getattr(getattr(engine, "compiled_layers", None), "layers", []),
                                          kept) for engine in engines)  # the helper builds the same engines
        problem = prewarm.room_problem(free_memory(device), torch.cuda.get_device_properties(device).total_memory,
                                       pending, helper)
        if problem is not None:
            self.compile_helper.give_up(problem)

    @contextlib.contextmanager
    def _eager_layers(self):
        """Within the block, every engine's compiled decoder layers run their eager forwards
        (`CompiledLayers.eager`, as the step-0 media check runs them)."""
        with contextlib.ExitStack() as stack:
            for engine in (self.actor, self.ref, self.critic):
                layers = getattr(engine, "compiled_layers", None)
                if layers is not None:
                    stack.enter_context(layers.eager())
            yield

    def _recipe_lr(self) -> float:
        """optim.lr as scheduled now: part multipliers (lr_multipliers) give other
        groups other rates, and the first group may be the vision tower's."""
        optimizer = self.actor.optimizer
        if optimizer is None:
            return 0.0
        group = optimizer.param_groups[0]
        return self.recipe.optim.lr * group["lr"] / group.get("initial_lr", group["lr"])

    # -- readable rollouts -------------------------------------------------------------------------
    def _samples_to_keep(self) -> int:
        """Rows of samples.jsonl a logging point writes (0: none, or not the main rank)."""
        cfg = self.recipe.trainer
        return cfg.samples_per_log if cfg.samples_every and self.dist.is_main else 0

    def _write_samples(self, samples: list[dict], source_rows: list[int], result, rewards: torch.Tensor,
                       advantages: dict[int, float] | None, reward_parts: dict[str, list[float]] | None = None) -> None:
        """This step's first responses into samples.jsonl and the loggers, every
        `trainer.samples_every` steps (`mmrl.samples`); `reward_parts`: a weighted
        reward's scores by part, one per response."""
        if self._samples_to_keep() and self.step % self.recipe.trainer.samples_every == 0:
            self.log.write_samples(self.step, self._sample_rows("train", samples, source_rows, self.train_set,
                                                                result, rewards, advantages, self._samples_to_keep(),
                                                                reward_parts))

    def _sample_rows(self, split: str, samples: list[dict], source_rows: list[int], dataset, result,
                     rewards: torch.Tensor, advantages: dict[int, float] | None, limit: int,
                     reward_parts: dict[str, list[float]] | None = None) -> list[dict]:
        texts = result.texts if result.texts is not None else self.processing.decode(result.response_ids)
        return sample_rows(step=self.step, split=split, samples=samples, source_rows=source_rows, result=result,
                           texts=texts, rewards=rewards.tolist(), advantages=advantages, reward_parts=reward_parts,
                           dataset=getattr(dataset, "name", "") or "", limit=limit)

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self, samples: list[dict], batch_size: int | None = None, dataset=None, *,
                 controls: bool = False, record=None) -> dict[str, float]:
        """`mmrl.evaluation`'s metrics of the policy on `samples` (rows of `dataset`),
        which the data-parallel ranks split between them: `accuracy`, `mean_reward`,
        pass@k with `eval.samples`, the controls with `controls`; `record` sees each scored
        chunk of greedy responses (`_sample_recorder`)."""
        return self.evaluator.run(samples, dataset, context=f"evaluation after step {self.step}", controls=controls,
                                  batch_size=batch_size, record=record)

    def _sample_recorder(self, split: str):
        """Rows of samples.jsonl for an evaluation's first greedy responses (labelled
        `split`), and the `record` callback of `evaluate` that fills them (None when
        nothing is kept)."""
        rows: list[dict] = []
        keep = self._samples_to_keep()
        if not keep:
            return rows, None

        def record(chunk, chunk_rows, dataset, result, scores) -> None:
            if len(rows) < keep:
                rows.extend(self._sample_rows(split, chunk, chunk_rows, dataset, result, scores, None,
                                              keep - len(rows)))

        return rows, record

    def _score_in(self, samples: list[dict], result, rows: list[int], dataset, context: str) -> torch.Tensor:
        """The evaluator's `score`: the rewards, errors naming `context` and the rows of `dataset`."""
        return self.score(samples, result, rows, dataset, context)[0]

    def _validate(self) -> dict[str, float]:
        """The validation metrics, named `validation/...` (`validation/accuracy` decides
        `trainer.target_accuracy`)."""
        rows, record = self._sample_recorder("validation")
        metrics = self.evaluate(list(self.validation_set), dataset=self.validation_set, record=record)
        self.log.write_samples(self.step, rows)
        return {f"validation/{name}": value for name, value in metrics.items()}

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        self.log.write(record)

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step:06d}"

    def _engines(self) -> dict[str, Engine | None]:
        return {"actor": self.actor, "critic": self.critic}

    def save(self) -> Path:
        """This step's checkpoint (`mmrl.checkpoint`), renamed into place whole; older
        ones beyond `trainer.keep_checkpoints` are removed after it."""
        return save_checkpoint(self.checkpoint_dir(self.step), self.dist, self._engines(),
                               {"step": self.step, "data_position": list(self.position),
                                "data_rows": len(self.train_set),
                                "data_fingerprint": getattr(self.train_set, "fingerprint", None),
                                "buffer": self.trajectories.state(), "train_seconds": self._train_seconds()},
                               keep=self.recipe.trainer.keep_checkpoints)

    def _step_saved(self) -> bool:
        """Whether a whole checkpoint (its manifest written last) holds this step, on this rank's disk."""
        return (self.checkpoint_dir(self.step) / MANIFEST_FILE).is_file()

    def _train_seconds(self) -> float:
        """The run's seconds of training steps so far, earlier processes' included."""
        now = 0.0 if self._steps_started is None else time.perf_counter() - self._steps_started
        return self._seconds_before + now

    def resume(self) -> bool:
        """Load the newest checkpoint under output_dir that verifies; False when none does."""
        found = load_checkpoint(self.output_dir / "checkpoints", self.dist, self._engines())
        if found is None:
            return False
        from mmrl.data import Position

        path, state = found
        rows = state.get("data_rows")  # absent in checkpoints written before it was recorded
        if rows is not None and rows != len(self.train_set):
            name = getattr(self.train_set, "name", "") or "data.train"
            raise RecipeError(f"trainer.resume: data.train ({name}) has {len(self.train_set)} rows now, {rows} when "
                              f"{path} was saved: the dataset changed, so its position cannot be continued; restore "
                              "the data, or start a new run")
        fingerprint = state.get("data_fingerprint")  # the rows' content (mmrl.data.loaders.PromptDataset)
        if fingerprint and fingerprint != getattr(self.train_set, "fingerprint", fingerprint):
            name = getattr(self.train_set, "name", "") or "data.train"
            raise RecipeError(f"trainer.resume: data.train ({name}) was edited since {path} was saved (as many rows, "
                              f"{len(self.train_set)}, but their content differs), so its position cannot be "
                              "continued; restore the data, or start a new run")
        self.step = state["step"]
        self.position = Position(*state["data_position"])
        self._batches = None
        self.trajectories.restore(state.get("buffer"))
        self._seconds_before = float(state.get("train_seconds", 0.0))  # absent in older checkpoints
        return True

    def export(self, path: Path) -> Path:
        """The trained policy as a HF checkpoint (LoRA merged) that decodes as trained
        (`mmrl.export`: blocked and stop tokens, pixel budget), written aside, fsynced and
        renamed into `path` whole: a failed export leaves no `final/` with a config and no
        weights, and raises on every rank."""
        return export_policy(self.actor, self.processing, path, self.dist, recipe=self.recipe)

    def _keep_weights(self, failure: Exception) -> None:
        """After `failure` at the end of a run that exports: if no checkpoint holds this
        step (the default save_every 0), save one so the trained weights are not lost, and
        say so in the error. Every rank gets here together (a failed write raises on all of
        them, `Dist.together`), so all save together."""
        if self.dist.all_gather_objects(self._step_saved())[0]:  # rank 0's disk decides for all
            return
        try:
            kept = self.save()
        except Exception:
            raise failure from None  # the disk that refused the export refused the checkpoint too
        failure.add_note(f"the trained weights are kept in checkpoint {kept}: once fixed, run again with "
                         f"trainer.resume=true to evaluate and export them")

    # -- the loop ----------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            if self.dist.is_main:
                print(self._stopped_at_once(signum), file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        self._stop_signal = signum
        if self.dist.is_main:
            print(f"\n{signal.Signals(signum).name}: saving a checkpoint once this step is done "
                  "(send it again to stop at once)", flush=True)

    def _stopped_at_once(self, signum: int) -> str:
        """What a second SIGINT/SIGTERM leaves: no checkpoint of this step; the newest saved."""
        saved = sorted(self.output_dir.glob("checkpoints/step_*/manifest.json"))
        newest = (f"the newest saved is {saved[-1].parent}: continue from it with trainer.resume=true" if saved
                  else "none was saved before, so this run's steps are lost")
        return (f"{signal.Signals(signum).name} again: stopped at once in step {self.step + 1}, without saving a "
                f"checkpoint; {newest}")

    def _install_signal_handlers(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}

    def fit(self) -> dict[str, Any]:
        try:
            return self._fit()
        except BaseException:
            self._forget_unrecorded_run()
            raise
        finally:
            self.folder.release()

    def _forget_unrecorded_run(self) -> None:
        """A new run that stopped before it recorded anything (no line in metrics.jsonl: its
        logger backends could not start, its reward failed in step 1) leaves its folder as
        a run whose build failed does, its recipe alone, so the same command runs again
        (`RunFolder.back_to_recipe`); what it began (TensorBoard's events, the buffer) goes."""
        if self.recipe.trainer.resume or not self.dist.is_main or (self.output_dir / METRICS_FILE).exists():
            return
        try:
            self._close()  # a rollout still running beside the step, the open files
        except BaseException:  # noqa: BLE001 - the run's own error is the one to show
            return
        self.folder.back_to_recipe()

    def _fit(self) -> dict[str, Any]:
        r = self.recipe
        cfg = r.trainer
        if cfg.resume and not self.resume():
            # `claim` saw a finished checkpoint write; none verified (named above): nothing
            # is rewritten, metrics.jsonl included.
            raise RunFolderError(f"trainer.resume: no checkpoint in {self.output_dir / 'checkpoints'} verifies; "
                                 "drop trainer.resume to start a new run")
        if self.dist.is_main:
            atomic_write_text(self.output_dir / "recipe.yaml", dump_recipe(r, self.settled.reasons()))
        self.dist.barrier()
        history: list[dict[str, Any]] = []
        if cfg.resume:
            if self.dist.is_main:
                history = self.log.history_until(self.step)
                print(f"resumed from step {self.step}", flush=True)
            self.log.purge_step = self.step + 1
        self.log.start(r.model_dump(mode="json"))
        with self.dist.together():  # a backend that cannot start: every rank stops here, before step 1
            self.log.open()
        if cfg.summary and self.dist.is_main:
            print("\n".join(run_summary(self)), file=sys.stderr, flush=True)
        progress = None
        if cfg.progress and self.dist.is_main:
            from tqdm.auto import tqdm

            progress = tqdm(total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True)
        if cfg.val_before_train and self.step == 0 and self.validation_set is not None:
            record = {"step": 0, **self._validate()}
            history.append(record)
            self._log(record)
        start = self._steps_started = time.perf_counter()
        stop_reason = None
        signalled = False
        previous_handlers = self._install_signal_handlers()
        try:
            while self.step < cfg.steps:
                step_start = time.perf_counter()
                metrics = self.train_step()
                elapsed = time.perf_counter() - step_start
                metrics["time/step"] = elapsed
                metrics["tokens_per_s"] = metrics.get("tokens", 0.0) / max(elapsed, 1e-9)
                for key in ("rollout", "logprob", "update", "sync"):
                    metrics[f"time/{key}"] = self.timings.pop(key, 0.0)
                for key in ("media_check", "media_check_rollout", "media_check_training"):  # step 0 of a VLM run
                    if key in self.timings:
                        metrics[f"time/{key}"] = self.timings.pop(key)
                metrics["time/compile"], metrics["compile/graphs"] = self.compile_watch.take()
                metrics["time/gc"] = self.gc_watch.take()[0]
                record = {"step": self.step, **metrics}
                reached = False
                if cfg.eval_every and self.validation_set is not None and self.step % cfg.eval_every == 0:
                    record.update(self._validate())
                    accuracy = record["validation/accuracy"]
                    reached = cfg.target_accuracy is not None and accuracy >= cfg.target_accuracy
                    if reached:
                        stop_reason = (f"validation accuracy {accuracy:.3f} reached trainer.target_accuracy "
                                       f"{cfg.target_accuracy} at step {self.step}")
                history.append(record)
                if self.step % cfg.log_every == 0 or reached:
                    self._log(record)
                if progress is not None:
                    progress.update(1)
                    labels = {"reward": f"{metrics['reward/mean']:.2f}",
                              "train_acc": f"{metrics['reward/accuracy']:.2f}"}
                    if "validation/accuracy" in record:
                        labels["val_acc"] = f"{record['validation/accuracy']:.2f}"
                    progress.set_postfix(labels)
                signalled = self.dist.all_reduce_sum(float(self._stop_signal is not None)) > 0
                if (cfg.save_every and self.step % cfg.save_every == 0) or signalled:
                    self.save()
                if signalled:
                    break
                if stop_reason is None and cfg.time_budget_s is not None \
                        and time.perf_counter() - start > cfg.time_budget_s:
                    stop_reason = f"trainer.time_budget_s {cfg.time_budget_s} s used up at step {self.step}"
                if stop_reason:
                    break
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            if progress is not None:
                progress.close()
        if signalled:
            self._interrupted(history)
        if stop_reason and self.dist.is_main:
            print(f"stopped early: {stop_reason}", flush=True)
        try:
            summary = self.finish(history, self._train_seconds())
        except KeyboardInterrupt:
            self._interrupted_at_the_end()
        if stop_reason:
            summary["stopped_early"] = stop_reason
        return summary

    def _interrupted(self, history: list[dict[str, Any]]) -> None:
        """After SIGINT / SIGTERM: the checkpoint is saved; plot, close and exit 128 + signal."""
        signum = self._stop_signal or signal.SIGTERM
        if self.dist.is_main:
            plot_rewards(history, self.output_dir / "reward_curve.png", self._plot_title())
            print(f"{signal.Signals(signum).name}: stopped after step {self.step}; checkpoint "
                  f"{self.checkpoint_dir(self.step)} saved; continue with trainer.resume=true", flush=True)
        self._close()
        self.folder.release()
        raise SystemExit(128 + int(signum))

    def _interrupted_at_the_end(self) -> None:
        """Ctrl-C in the final evaluation or export: the steps are done, so their weights go
        to a checkpoint (unless one holds this step) that `trainer.resume=true` evaluates
        and exports; exit 130. Under torchrun the interrupt stays as it was: the ranks may
        not all be at a point where they can save together."""
        if self.dist.distributed:
            raise KeyboardInterrupt
        kept = self.checkpoint_dir(self.step) if self._step_saved() else self.save()
        print(f"SIGINT: stopped in the final evaluation or export after step {self.step}; checkpoint {kept} "
              "holds the trained weights; run again with trainer.resume=true to evaluate and export them",
              file=sys.stderr, flush=True)
        self._close()
        raise SystemExit(130)

    def _plot_title(self) -> str:
        r = self.recipe
        return f"{self.output_dir.name}: {r.algo.advantage}, {reward_name(self.reward_fn)} reward, {self.step} steps"

    def _close(self) -> None:
        self.trajectories.drain()  # a rollout still running beside the last step (mmrl/buffer/overlap.py)
        self.log.close()

    def finish(self, history: list[dict[str, Any]], train_seconds: float) -> dict[str, Any]:
        """Final evaluation (with the majority baseline and, unless `eval.shuffled_images`
        is off, the shuffled-images control), plot, export."""
        summary: dict[str, Any] = {"steps": self.step, "train_seconds": round(train_seconds, 1)}
        if self.eval_set is not None:
            rows, record = self._sample_recorder("eval")
            metrics = self.evaluate(list(self.eval_set), dataset=self.eval_set, controls=True, record=record)
            self.log.write_samples(self.step, rows)
            summary.update({f"eval/{name}": value for name, value in metrics.items()})
        record = {"step": self.step, "final": True, **summary}
        try:
            with self.dist.together():  # rank 0 writes; a full disk there reaches every rank
                self._log(record)
                if self.dist.is_main:
                    plot_rewards(history, self.output_dir / "reward_curve.png", self._plot_title())
            if self.recipe.trainer.export:
                summary["export"] = str(self.export(self.output_dir / "final"))
        except Exception as exc:
            if self.recipe.trainer.export:
                self._keep_weights(exc)
            raise
        self._close()
        return summary


def environment_factory(recipe: Recipe):
    """The factory of `rollout.env`'s environments (None: single-turn rollouts); a name,
    path or option that does not resolve is a RecipeError naming the field."""
    rollout = recipe.rollout
    if rollout.env is None:
        return None
    from mmrl.envs import get_environment

    try:
        factory = get_environment(rollout.env, recipe.folder, **rollout.env_options)
        factory()  # options the constructor rejects (a bad value) fail here, not at step 1
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"rollout.env: {exc}") from None
    return factory


def train(recipe: Recipe, *, reward=None, datasets: dict | None = None) -> dict[str, Any]:
    """Run a recipe to the end; returns the final summary (rank 0's view). `reward` and
    `datasets` as for `Trainer`; `mmrl.train` (mmrl/api.py) is the documented entry."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if recipe.parallel.rollout_ranks:  # the last ranks only roll out (mmrl/buffer/disaggregated.py)
        return disaggregated.train(recipe, lambda part, dist: Trainer(part, dist, reward=reward, datasets=datasets))
    trainer = Trainer(recipe, reward=reward, datasets=datasets)
    summary = trainer.fit()
    if trainer.dist.distributed and torch.distributed.is_initialized():
        # No rank may leave while another still talks to it (gloo aborts the process
        # whose peer is gone), and the groups go down in order.
        trainer.dist.barrier()
        torch.distributed.destroy_process_group()
    return summary


__all__ = ["Trainer", "train"]
