"""Rollout with HF `generate` on the training engine's own weights.

Works everywhere the engine works (CPU, one GPU, FSDP2 shards), needs no weight sync
because it samples from the very model being trained, and is the reference the vLLM
backend is compared against.
"""

from __future__ import annotations

import torch

from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses


class HFRollout:
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
        prompt_inputs = shared.rows(self.processing, expanded) if shared is not None else dict(self.processing(expanded))
        batch = {k: v.to(self.engine.dist.device) if isinstance(v, torch.Tensor) else v
                 for k, v in prompt_inputs.items()}
        model = self.engine.model
        was_training = model.training
        model.eval()
        self.engine.gather_root()
        tokenizer = self.processing.tokenizer
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        try:
            device = self.engine.dist.device
            with self.engine.autocast(), self.engine.media_sharing(batch, shared.to(device) if shared else None):
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
        finally:
            model.train(was_training)
        sequences = out.sequences if params.logprobs else out
        generated = sequences[:, batch["input_ids"].shape[1]:].cpu()
        ids, mask, reasons = trim_responses(generated, self.processing.stop_token_ids, tokenizer.pad_token_id)
        logprobs = None
        if params.logprobs:
            # The raw logits of each step (before temperature, top-p and blocked tokens),
            # as vLLM's raw log-probs and `Engine.log_probs` at temperature 1 see them.
            logits = torch.stack(out.logits, dim=1).float().cpu()
            logprobs = torch.log_softmax(logits, -1).gather(-1, generated.unsqueeze(-1)).squeeze(-1) * mask
        return RolloutResult(response_ids=ids, response_mask=mask, finish_reasons=reasons,
                             prompt_index=prompt_index, logprobs=logprobs, prompt_inputs=prompt_inputs,
                             shared_media=shared)

    def sync(self, engine) -> None:
        """Nothing to do: generation reads the engine's live weights."""
