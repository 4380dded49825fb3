"""The update's graphs compiled while the model builds (issue 28).

A GPU run's first step compiles the graphs its update needs: the decoder layer's forward
and backward (`mmrl.engine.compiled_layers`) and the chunked head's arithmetic
(`mmrl.engine.logprobs`). None of them depends on the weights: dynamo traces the layer with
its parameters as inputs and guards on their shapes and dtypes, so any layer of the same
config, on the same device, under the same engine settings, compiles the graph the run's
layers then run. So the trainer can compile them in a thread while it builds the model
(`mmrl.compile_watch.BackgroundCompile`; `MMRL_COMPILE_AHEAD=all`, or `head` for the head's
arithmetic alone; off by default, as measured so far it did not pay: docs/performance.md):

    work = CompileAhead(recipe, settled, config, processor, dist, dataset=train_set)
    work()       # the head's arithmetic, then one micro-batch's forward and backward
                 # through a one-layer model of the run's config

The one-layer model is built on the meta device and given zeroed storage on the run's
device: no random draw, so the run's random numbers are those of a run without it. It goes
through the engine the run's actor is (same options, same freezing), on a stand-in for the
run's first micro-batch: its first prompts with responses of `rollout.max_new_tokens`. The
rows and lengths are dynamic in the layer's graph (tests/test_compiled_layers_shapes.py),
but a dimension of 1 is not, so the stand-in must pack into one row where the run's first
micro-batch does, and into several where it does. What it cannot match (a LoRA
run's layers, sharded engines) it leaves to the run: the head's arithmetic alone then.
"""

from __future__ import annotations

import torch

from mmrl.compile_watch import compile_workers_ready


def empty_layered_model(config, adapter, dtype: torch.dtype, device: torch.device):
    """`adapter`'s model of `config` with one decoder layer of each layer type
    (`mmrl.prewarm.shrunk_layers`), its parameters and buffers zeros on `device`, drawn from
    no random generator; None where the text config has no layer count to shrink."""
    from mmrl.build import customized_config
    from mmrl.prewarm import shrunk_layers

    shrink = shrunk_layers(config)
    if not shrink:
        return None
    config = customized_config(config, adapter, shrink)
    with torch.device("meta"):
        model = adapter.model_class()._from_config(config, dtype=dtype)
    model = adapter.prepare_model(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.zero_()
    return adapter.on_load(model)


class CompileAhead:
    """What a run's update compiles, compiled when called (in a thread: `BackgroundCompile`):
    the chunked head's arithmetic (`precompile_head`), then, where the run's layers compile
    (`layers_match`), one micro-batch's log-probs and their backward through a one-layer
    model under the run's engine settings. Made in the run's thread, which processes the
    stand-in prompts here (the processor is not shared with the build's thread); the call
    returns what it compiled: {"head": calls, "layers": compiled layer calls}."""

    def __init__(self, recipe, settled, config, processor, dist, layers: bool = True, dataset=None) -> None:
        from mmrl.settle import model_adapter

        self.recipe, self.settled, self.config, self.dist = recipe, settled, config, dist
        self.adapter = model_adapter(recipe)
        self.processing = self.prompts = None
        if layers and self.layers_match() and processor is not None:
            from mmrl.build import make_processing, pixel_options

            self.processing = make_processing(self.adapter, processor, pixel_options(recipe.model))
            self.prompts = dict(self.processing(self.stand_in_conversations(dataset)))

    def stand_in_conversations(self, dataset) -> list:
        """The stand-in micro-batch's prompts: the run's first micro-batch as the update will
        see it (its first prompts, each repeated `samples_per_prompt` times, up to
        `algo.micro_batch_size` rows), so that it packs into as many rows as the run's; a
        dimension of 1 is a constant in the compiled graph, of 2 and more a symbol. The
        family's sample conversations where there is no dataset to read."""
        from mmrl.checks import sample_conversations
        from mmrl.evaluation import conversations_of

        r = self.recipe
        if not hasattr(dataset, "batches") or not len(dataset):
            return sample_conversations(self.adapter)
        first = next(dataset.batches(min(r.data.prompts_per_step, len(dataset)), seed=r.data.shuffle_seed))
        conversations = conversations_of(first.samples, [dataset.source_rows[i] for i in first.indices], dataset,
                                         "compiling ahead", max_pixels=r.model.max_pixels)
        repeated = [each for each in conversations for _ in range(r.rollout.samples_per_prompt)]
        return repeated[:max(1, r.algo.micro_batch_size)]

    def layers_match(self) -> bool:
        """Whether a one-layer model here compiles the run's layer graphs: the layers compile,
        in one unsharded process, without LoRA (its modules are inside the layers) and
        without checkpointing from the start (the layers then run eagerly)."""
        r, settled = self.recipe, self.settled
        return (bool(settled.compile_layers) and not self.dist.distributed and r.model.lora_scope == "none"
                and settled.gradient_checkpointing is not True)

    def __call__(self) -> dict[str, int]:
        from mmrl.engine.logprobs import candidates, head_dtype, precompile_head

        r, device = self.recipe, self.dist.device
        done = {"head": 0, "layers": 0}
        vocab = getattr(self.config.get_text_config(), "vocab_size", None)
        if isinstance(vocab, int):
            done["head"] = precompile_head(vocab, head_dtype(getattr(torch, r.model.dtype), device), device,
                                           candidates(self.config), r.rollout.temperature or 1.0,
                                           bool(r.algo.entropy_coef))
        if self.prompts is not None:
            # The head's few kernels compile in this process while inductor's workers start; the
            # layer's are many: compiled one after another here they would take longer than the
            # build, so they wait for the workers.
            compile_workers_ready()
            done["layers"] = self._update_layers()
        return done

    def _update_layers(self) -> int:
        from mmrl.build import BuiltModel
        from mmrl.engine import Engine, join

        r, adapter = self.recipe, self.adapter
        model = empty_layered_model(self.config, adapter, getattr(torch, r.model.dtype), self.dist.device)
        if model is None:
            return 0
        if r.model.freeze:
            from mmrl.parts import freeze

            freeze(model, parts=r.model.freeze, adapter=adapter)
        engine = Engine(BuiltModel(model=model, processing=self.processing, adapter=adapter), self.dist,
                        optim=r.optim, total_steps=1, share_media=r.model.share_media,
                        gradient_checkpointing=self.settled.gradient_checkpointing, **self.settled.engine_options())
        if engine.compiled_layers is None:
            return 0
        rows, new_tokens = self.prompts["input_ids"].shape[0], max(2, r.rollout.max_new_tokens)
        responses = torch.zeros(rows, new_tokens, dtype=torch.long)
        mask = torch.ones_like(responses)
        mask[0, new_tokens // 2:] = 0  # one row stopped early, as in any batch
        seqs = join(self.prompts, responses, mask, adapter, engine.model,
                    self.processing.tokenizer.pad_token_id).to(self.dist.device)
        temperature = r.rollout.temperature or 1.0
        algo = r.algo
        try:
            if algo.kl_coef > 0 or algo.epochs_per_rollout > 1 or algo.mini_batches > 1:
                with torch.no_grad():  # old-policy or reference log-probs (`PolicyUpdate._estimate`)
                    engine.log_probs(seqs, temperature, with_entropy=False)
            logp, entropy = engine.log_probs(seqs, temperature)
            engine.backward(logp.sum() + (entropy.sum() if algo.entropy_coef else 0.0))
            return engine.compiled_layers.compiled_calls
        finally:
            # The model's device memory goes now, whatever still refers to the module (its
            # compiled forwards refer back to it): the run's own model is being built beside it.
            model.to("meta")
