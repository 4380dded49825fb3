"""Scores of a policy on a dataset: the trainer's validation and final evaluation, and
`mmrl eval RECIPE --checkpoint DIR` (`mmrl.eval_checkpoint`).

    evaluator = Evaluator(recipe.eval, dist, generate=rollout_generator(rollout, agent=None),
                          score=reward_scorer(reward_fn, processing), max_new_tokens=4)
    evaluator.run(samples, dataset, context="evaluation after step 30")
    # {"accuracy": 0.75, "mean_reward": 0.81}; with eval.samples: 8 also
    # {"pass@1": 0.62, "pass@2": 0.77, "pass@4": 0.88, "pass@8": 0.94, "mean@8": 0.7}
    evaluator.run(samples, dataset, context=..., controls=True)
    # also "majority_baseline" and, for image tasks, "shuffled_images_accuracy"

What the numbers mean (`recipe.eval`, docs/training.md "Evaluation"):
- `accuracy`: the share of greedy responses whose reward is at least
  `eval.correct_threshold` (1.0 by default); `mean_reward`: their mean reward.
- with `eval.samples` n > 1, n more responses per prompt at `eval.temperature`, drawn from
  a generator of their own (`eval.seed`), so an evaluation changes no training RNG:
  `pass@k` for k = 1, 2, 4, ... and n is the mean over prompts of 1 - C(n - c, k) / C(n, k)
  (c of the n correct: the unbiased estimator of Chen et al., 2021, "Evaluating Large
  Language Models Trained on Code"); `mean@n` is the sampled responses' mean reward.
- controls: `majority_baseline`, the accuracy of always giving the most common answer,
  and `shuffled_images_accuracy`, greedy accuracy with the images moved among the
  questions (`eval.shuffled_images`; chance when the policy reads the image).

The data-parallel ranks split the samples; every rank takes part in every generate call
(sharded weights make each forward collective), and sums are reduced over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mmrl.data import to_conversation
from mmrl.data.synthetic import majority_baseline, shuffle_images
from mmrl.rollout import SamplingParams
from mmrl.scoring import score_rollout

if TYPE_CHECKING:
    from mmrl.config import EvalConfig
    from mmrl.parallel import Dist

# generate(samples, rows, dataset, params, context) -> RolloutResult
Generate = Callable[..., object]
# score(samples, result, rows, dataset, context) -> a float tensor, one reward per response
Score = Callable[..., torch.Tensor]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that at least one of k responses drawn without replacement from n,
    `correct` of them correct, is correct: 1 - C(n - c, k) / C(n, k), as a product so
    large n does not overflow."""
    if not 0 <= correct <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 0 < k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / m for m in range(n - correct + 1, n + 1))


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def conversations_of(samples: list[dict], rows: list[int], dataset, context: str, *,
                     max_pixels: int | None = None) -> list:
    """The samples as conversations with their media decoded; an image that cannot be
    read is one line naming the row, the dataset and the file."""
    out = []
    for sample, row in zip(samples, rows):
        try:
            out.append(to_conversation(sample, max_pixels=max_pixels))
        except (OSError, ValueError) as exc:
            name = getattr(dataset, "name", "") if dataset is not None else ""
            where = f"row {row}" + (f" of {name}" if name else "")
            raise ValueError(f"{where} ({context}): {exc}") from None
    return out


def rollout_generator(rollout, agent, *, max_pixels: int | None = None) -> Generate:
    """`generate` through a rollout backend, or a multi-turn `agent` when there is one."""

    def generate(samples, rows, dataset, params, context):
        if agent is not None:
            return agent.generate(samples, params)
        return rollout.generate(conversations_of(samples, rows, dataset, context, max_pixels=max_pixels), params)

    return generate


def reward_scorer(reward_fn, processing) -> Score:
    """`score` by the reward function, plus a multi-turn rollout's environment rewards."""

    def score(samples, result, rows, dataset, context):
        scores, _ = score_rollout(reward_fn, processing, samples, result, rows=rows, dataset=dataset, where=context)
        return scores + result.env_rewards.float() if result.env_rewards is not None else scores

    return score


class Evaluator:
    def __init__(self, settings: EvalConfig, dist: Dist, *, generate: Generate, score: Score, max_new_tokens: int,
                 progress: bool = False):
        self.settings = settings
        # A progress bar over each pass's batches on the main rank (left when it is done).
        self.progress = progress
        self.dist = dist
        self.generate = generate
        self.score = score
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def run(self, samples: list[dict], dataset=None, *, context: str = "evaluation", controls: bool = False,
            batch_size: int | None = None, record: Callable | None = None) -> dict[str, float]:
        """The metrics of the module docstring on `samples` (rows of `dataset`, named in
        errors); `controls` adds the majority baseline and the shuffled-images accuracy.
        `record(chunk, rows, dataset, result, scores)` is called with each scored chunk of
        this rank's greedy responses (the trainer keeps some for samples.jsonl)."""
        settings = self.settings
        threshold = settings.correct_threshold
        greedy = SamplingParams(n=1, max_new_tokens=self.max_new_tokens, temperature=0.0)
        rewards = self._rewards(samples, dataset, greedy, context, batch_size, record)[:, 0]
        count = self._sum(len(rewards))
        metrics = {"accuracy": self._sum((rewards >= threshold).sum()) / max(count, 1),
                   "mean_reward": self._sum(rewards.sum()) / max(count, 1)}
        n = settings.samples
        if n > 1:
            sampled = SamplingParams(n=n, max_new_tokens=self.max_new_tokens, temperature=settings.temperature,
                                     seed=settings.seed)
            device = self.dist.device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
                # Ranks of one sequence-parallel group share a data-parallel rank, and so
                # their samples.
                torch.manual_seed(settings.seed + self.dist.dp_rank)
                drawn = self._rewards(samples, dataset, sampled, context, batch_size)
            correct = (drawn >= threshold).sum(-1).tolist()
            for k in pass_k_values(n):
                metrics[f"pass@{k}"] = self._sum(sum(pass_at_k(n, c, k) for c in correct)) / max(count, 1)
            metrics[f"mean@{n}"] = self._sum(drawn.mean(-1).sum()) / max(count, 1)
        if controls and samples:
            metrics["majority_baseline"] = majority_baseline(samples)
            if settings.shuffled_images and any(s.get("images") for s in samples):
                shuffled = self._rewards(shuffle_images(samples, seed=0), dataset, greedy, context, batch_size)
                metrics["shuffled_images_accuracy"] = self._sum((shuffled >= threshold).sum()) / max(count, 1)
        return metrics

    def _sum(self, value) -> float:
        """`value` summed over the data-parallel ranks (the ranks of one sequence-parallel
        group hold the same share, so it is counted once)."""
        return self.dist.all_reduce_sum(float(value)) / self.dist.sequence_parallel

    def _rewards(self, samples: list[dict], dataset, params: SamplingParams, context: str,
                 batch_size: int | None, record: Callable | None = None) -> torch.Tensor:
        """This rank's share of `samples` scored: (its prompts, params.n) rewards."""
        dist = self.dist
        size = batch_size or self.settings.batch_size
        mine = samples[dist.dp_rank::dist.dp_size]
        # Every rank takes part in every generate call, so all run as many batches as the
        # largest share needs.
        batches = math.ceil(math.ceil(len(samples) / dist.dp_size) / size)
        rows = list(dataset.source_rows) if dataset is not None else list(range(len(samples)))
        my_rows = rows[dist.dp_rank::dist.dp_size]
        out = [torch.zeros(0, params.n)]
        from tqdm.auto import tqdm

        shown = self.progress and dist.is_main and batches > 1
        for index in tqdm(range(batches), desc=context if params.n == 1 else f"{context}, {params.n} samples",
                          disable=not shown, leave=False, dynamic_ncols=True, unit="batch"):
            chunk = mine[index * size:(index + 1) * size]
            chunk_rows = my_rows[index * size:(index + 1) * size]
            # A rank whose share ran out generates for a stand-in and drops the result.
            result = self.generate(chunk or samples[:1], chunk_rows or rows[:1], dataset, params, context)
            if chunk:
                scores = self.score(chunk, result, chunk_rows, dataset, context).float().cpu()
                if record is not None:
                    record(chunk, chunk_rows, dataset, result, scores)
                order = torch.argsort(result.prompt_index.cpu(), stable=True)
                out.append(scores[order].view(len(chunk), params.n))
        return torch.cat(out)


__all__ = ["Evaluator", "conversations_of", "pass_at_k", "pass_k_values", "reward_scorer", "rollout_generator"]
