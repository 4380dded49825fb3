"""Rollout with HF `generate` on the training engine's own weights.

Works everywhere the engine works (CPU, one GPU, FSDP2 shards), needs no weight sync
because it samples from the very model being trained, and is the reference the vLLM
backend is compared against.
"""

from __future__ import annotations

import torch

from mmrl.rollout.base import RolloutResult, SamplingParams, extend_prompts, trim_responses


class HFRollout:
    backend = "hf"  # the recipe's name for it (`rollout.backend`)

    @property
    def tempered_logprobs(self) -> bool:
        """Whether `SamplingParams.logprobs_temperature` is honoured: by `generate`'s own
        sampling, not by a subclass with a decode loop of its own (hf_compiled: raw log-probs)."""
        return type(self)._sample is HFRollout._sample

    def __init__(self, engine, processing):
        self.engine = engine
        self.processing = processing

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], params: SamplingParams) -> RolloutResult:
        from mmrl.engine.media import SharedMedia

        expanded = [c for c in conversations for _ in range(params.n)]
        prompt_index = torch.arange(len(conversations)).repeat_interleave(params.n)
        shared = SharedMedia.of(self.processing, expanded, prompt_index.tolist()) if self.engine.shares_media else None
        # With shared media each prompt is processed once and its rows collated.
        prompt_inputs = (shared.rows(self.processing, expanded, device=self.engine.dist.device) if shared is not None
                         else dict(self.processing(expanded)))
        return self._respond(prompt_inputs, shared, prompt_index, params)

    @torch.no_grad()
    def continue_from(self, conversations: list[list[dict]], prefixes: list[list[int]],
                      params: SamplingParams) -> RolloutResult:
        """One response per conversation, continuing after the response tokens it has
        (`prefixes`, possibly none) for at most `params.max_new_tokens` more: the prompt is
        processed again with them appended (no cache is kept between calls). The result
        holds the new tokens only, "length" meaning the budget ran out; `params.n` must be 1."""
        if params.n != 1:
            raise ValueError(f"continue_from generates one response per conversation, got n={params.n}")
        inputs = extend_prompts(dict(self.processing(conversations)), prefixes,
                                self.processing.tokenizer.pad_token_id)
        result = self._respond(inputs, None, torch.arange(len(conversations)), params)
        result.prompt_inputs = None  # the prompts with their prefixes: not a prompt batch to reuse
        return result

    def _respond(self, prompt_inputs: dict, shared, prompt_index: torch.Tensor,
                 params: SamplingParams) -> RolloutResult:
        """Generate from the processed (left-padded) prompt batch: the responses, trimmed at their stop tokens."""
        batch = {k: v.to(self.engine.dist.device) if isinstance(v, torch.Tensor) else v
                 for k, v in prompt_inputs.items()}
        model = self.sampling_model()
        was_training = model.training
        model.eval()
        try:
            generated, logprobs = self._sample(batch, shared, params)
        finally:
            model.train(was_training)
        tokenizer = self.processing.tokenizer
        ids, mask, reasons = trim_responses(generated, self.processing.stop_token_ids, tokenizer.pad_token_id)
        if logprobs is not None:
            logprobs = logprobs * mask
        return RolloutResult(response_ids=ids, response_mask=mask, finish_reasons=reasons,
                             prompt_index=prompt_index, logprobs=logprobs, prompt_inputs=prompt_inputs,
                             shared_media=shared)

    def sampling_model(self) -> torch.nn.Module:
        """The module whose weights the samples come from (set to eval mode while sampling)."""
        return self.engine.model

    def _sample(self, batch: dict, shared, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generated tokens (B, R) on the CPU, and with `params.logprobs` each token's
        log-prob under the raw logits (B, R); rows that stopped early are padded."""
        self.engine.gather_root()
        if not self.engine.adapter.left_padding:
            return self._sample_by_length(batch, shared, params)
        return self._generate(batch, shared, params)

    def _sample_by_length(self, batch: dict, shared, params: SamplingParams):
        """`_sample` for a family whose forward cannot take left padding: the rows of each
        prompt length generate together, without padding, and are put back in order."""
        rows, width = batch["attention_mask"].shape
        aligned = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and tuple(v.shape) == (rows, width)]
        others = sorted(set(batch) - set(aligned))
        if others or shared is not None:
            raise ValueError(f"family {self.engine.adapter.family!r} cannot take left padding (left_padding=False): "
                             f"HF rollout generates its prompts one length at a time from token ids alone, and these "
                             f"prompts also carry {', '.join(others) or 'shared media'}")
        lengths = batch["attention_mask"].sum(-1)
        groups = [((lengths == length).nonzero().flatten(), length) for length in lengths.unique().tolist()]
        # Every forward of sharded weights is collective: a rank with fewer prompt lengths
        # than another repeats its first group (result dropped) until every rank has called
        # `generate` as often (the counts are gathered before any call).
        calls = max(self.engine.dist.all_gather_objects(len(groups))) if self.engine.sharded else len(groups)
        parts = []
        for call in range(calls):
            index, length = groups[call if call < len(groups) else 0]
            tokens, values = self._generate({k: batch[k][index, width - length:] for k in aligned}, None, params)
            if call < len(groups):
                parts.append((index.cpu(), tokens, values))
        new_tokens = max(tokens.shape[1] for _, tokens, _ in parts)
        generated = parts[0][1].new_full((rows, new_tokens), self.processing.tokenizer.pad_token_id)
        logprobs = None if parts[0][2] is None else torch.zeros(rows, new_tokens)
        for index, tokens, values in parts:
            generated[index, :tokens.shape[1]] = tokens
            if logprobs is not None:
                logprobs[index, :values.shape[1]] = values
        return generated, logprobs

    def _generate(self, batch: dict, shared, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_sample` through one `generate` call over the (left-padded) batch."""
        model = self.engine.model
        tokenizer = self.processing.tokenizer
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        device = self.engine.dist.device
        with self.engine.autocast(), self.engine.media_sharing(batch, shared.on(device) if shared else None):
            out = model.generate(
                **batch,
                do_sample=not params.greedy,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=self.processing.stop_token_ids,
                pad_token_id=tokenizer.pad_token_id,
                suppress_tokens=self.processing.blocked_token_ids or None,
                # Sharded weights: every forward is collective, so a rank whose
                # sequences all stopped keeps stepping until every rank is done.
                synced_gpus=self.engine.sharded,
                **({"output_logits": True, "return_dict_in_generate": True} if params.logprobs else {}),
                **sampling,
            )
        sequences = out.sequences if params.logprobs else out
        generated = sequences[:, batch["input_ids"].shape[1]:].cpu()
        if not params.logprobs:
            return generated, None
        # The raw logits of each step (before temperature, top-p and blocked tokens),
        # as vLLM's raw log-probs and `Engine.log_probs` at temperature 1 see them;
        # divided by `logprobs_temperature` as `Engine.log_probs` divides them.
        logits = torch.stack(out.logits, dim=1).float().cpu()
        if params.logprobs_temperature != 1.0:
            logits = logits / params.logprobs_temperature
        return generated, torch.log_softmax(logits, -1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)

    def sync(self, engine) -> None:
        """Nothing to do: generation reads the engine's live weights."""
