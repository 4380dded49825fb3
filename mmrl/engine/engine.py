"""The training engine: one class for actor, reference and critic.

An `Engine` wraps a built model: it shards it with FSDP2 (`fully_shard` on the family's
`shard_layers`, then the root) when several processes run, optionally turns on activation
checkpointing, owns the AdamW optimizer and LR schedule when it trains, and computes
per-token log-probs and entropy of given response tokens. Roles differ only in options:

    actor = Engine(built, dist, optim=recipe.optim, total_steps=100)       # trains
    ref = Engine(built_ref, dist)                                           # frozen
    critic = Engine(built_critic, dist, optim=..., value_head=True)         # values

Log-probs never need the batch's full-vocabulary logits: the model runs to the input of
its output embedding, and the positions that predict response tokens go through the
embedding, the model's logit post-processing (checked against the model's own logits on
the first call), the temperature and an fp32 log-softmax in chunks of tokens, recomputed
in backward (`mmrl.engine.logprobs`). `chunked_head=False`, or a model whose logits the
check cannot reproduce, takes the plain path: the model's logits for the last R + 1
positions (`logits_to_keep`), an fp32 log-softmax over checkpointed row chunks.

With `pack=True` (families that declare `padding_free`) the batch runs without padding:
whole sequences in rows of at most `pack_tokens` tokens, logits only for real response
tokens (`mmrl.engine.packing`), and on a GPU the flash varlen kernel wherever the mask is
document-causal (`mmrl.engine.varlen`). On a GPU in one process the text decoder's
layers run compiled in the log-prob and value forwards, packed or padded
(`compile_layers`, `mmrl.engine.compiled_layers`). Training engines switch dropout off
(`disable_dropout`; `dropout=True` keeps it).

With `dist.sequence_parallel` > 1 (Ulysses, `mmrl.parallel.ulysses`) the ranks of one SP
group run the same batch, each over its slice of the sequence; log-probs, entropy and
values come back whole on every rank, and each rank's gradients are partial sums that
FSDP2 adds up (its divide factor is the data-parallel size).

Half-precision weights (`model.dtype: bfloat16`) train through fp32 master weights by
default (`master_weights=True`): at RL learning rates most AdamW steps are smaller than
bf16's resolution and would round away in the weights themselves. In one process the
optimizer steps fp32 copies of the trainable half-precision parameters, with fp32
gradients and moments (`mmrl.engine.master_weights`), and after each step the model's
parameters are the masters rounded to bf16. Sharded, the masters are the
FSDP2 shards themselves: those parameters are upcast to fp32 before `fully_shard` and the
policy all-gathers them in bf16 and reduces gradients in fp32. Cost per trainable
parameter: +4 bytes (masters), AdamW's moments 8 bytes instead of 4, gradients 4 instead
of 2 (one process: 18 bytes with the bf16 weights; sharded: 16 bytes over the ranks, as
for fp32 weights). Checkpoints hold the masters; `full_state_dict` stays in bf16.

float16 weights (with masters, in one process or sharded) also get dynamic loss scaling
(`mmrl.engine.master_weights.LossScaler`): `engine.backward(loss)` runs the loss times
the scale (2**16 to start), `step` divides the fp32 gradients by it before clipping, and
skips the optimizer step where any gradient on any rank is inf or nan, halving the scale;
2000 good steps in a row double it. A skipped step still advances the LR schedule, as in
torch's AMP recipe (GradScaler skips only `optimizer.step`), so the schedule keeps
counting the run's steps. `loss.backward()` called directly runs unscaled, and `step`
then takes the gradients as they are. fp32 and bf16 engines scale nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from mmrl.config import OptimConfig
from mmrl.engine import vision_attention
from mmrl.engine.packing import PACK_TOKENS
from mmrl.engine.logprobs import LOGPROB_CHUNK_TOKENS, token_log_probs  # noqa: F401 (re-exported)
from mmrl.engine.master_weights import LossScaler, MasterWeights
from mmrl.engine.sequences import Sequences
from mmrl.parallel import Dist

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Real positions the model's own logits are computed for on an engine's first log-prob call,
# to check the chunked head's logit post-processing against (`mmrl.engine.logprobs`).
PROBE_TOKENS = 4
# The share of a GPU's memory (1 / this) whose worth of head outputs the chunked log-probs
# keep for the backward when memory is not short (`Engine.head_keep_bytes`).
HEAD_KEEP_SHARE = 16


# Names of the probabilities with which models drop activations, attention weights,
# whole layers (LayerDrop) or residual branches (stochastic depth) in training mode.
DROPOUT_NAMES = ("dropout", "pdrop", "drop_prob", "layerdrop", "drop_path")


def _is_drop_probability(name: str, value) -> bool:
    return isinstance(value, float) and value > 0 and any(part in name.lower() for part in DROPOUT_NAMES)


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability that `model` applies in training mode to 0, and
    return what was changed: `nn.Dropout` modules (LoRA's too), float probabilities that
    modules hold for functional dropout, LayerDrop and stochastic depth, and the configs'
    fields (some forwards read them there). The model stays in training mode, which
    gradient checkpointing is gated on.

    Policy-gradient updates weight the log-probs of sampled tokens against the rollout's
    and the old and reference policies' (all computed without dropout): dropout in the
    update alone makes the ratios noise, so RL trainers switch it off."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            changed.append(f"{name or 'model'}.p={module.p}")
            module.p = 0.0
            continue
        for attribute, value in list(vars(module).items()):
            if _is_drop_probability(attribute, value):
                changed.append(f"{name or 'model'}.{attribute}={value}")
                setattr(module, attribute, 0.0)
    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for attribute, value in list(vars(config).items()):
            if _is_drop_probability(attribute, value):
                setattr(config, attribute, 0.0)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                configs.append(value)  # a sub-config (text, vision, ...)
    return changed


def _lr_lambda(optim: OptimConfig, total_steps: int):
    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 1.0

    return factor


def packs_batches(pack: bool | str, adapter, dist: Dist) -> bool:
    """`model.pack` resolved: "auto" packs text families on a GPU in one process (the
    0.5B text update at RL lengths ran 4.01x the padded one there; the VL-3B recipe's update,
    rows of about one length, ran slower packed: docs/training.md)."""
    if pack not in (True, False, "auto"):
        raise ValueError(f"pack must be true, false or auto, got {pack!r}")
    if pack == "auto":
        return dist.device.type == "cuda" and not dist.distributed and not adapter.is_multimodal
    return pack


class Engine:
    def __init__(
        self,
        built,
        dist: Dist,
        *,
        optim: OptimConfig | None = None,
        lr: float | None = None,
        total_steps: int = 1,
        gradient_checkpointing: bool | str = False,
        value_head: bool = False,
        mixed_precision: bool = True,
        share_media: bool = True,
        dropout: bool = False,
        pack: bool | str = False,
        pack_tokens: int = PACK_TOKENS,
        compile_layers: bool | str = "auto",
        master_weights: bool = True,
        chunked_head: bool = True,
        loss_scale_growth_interval: int = 2000,
        trainable_only_checkpoints: bool = False,
    ):
        self.built = built
        # Checkpoints hold the trainable weights only (a LoRA run on a base checkpoint:
        # the frozen base is rebuilt from it on resume and by `mmrl export`).
        self.saves_trainable_only = trainable_only_checkpoints
        # Log-probs through the output embedding chunk by chunk (`mmrl.engine.logprobs`);
        # False: the model's own logits (the plain path). The logit post-processing it
        # reproduces is checked on the first call (None until then).
        self.chunked_head = chunked_head
        self.logit_transform = None
        # bf16 compute on GPUs (FSDP's policy when sharded, autocast in one process);
        # False keeps fp32 throughout, as the probes do to compare sharded with plain.
        self.mixed_precision = mixed_precision
        self.adapter = built.adapter
        self.dist = dist
        # Encode each repeated prompt's media once per batch, where the family's
        # encoders allow it (`mmrl.engine.media`).
        self.shares_media = share_media and self.adapter.is_multimodal and self.adapter.capabilities.media_sharing
        # Padding-free log-probs (`mmrl.engine.packing`), for families whose packed batches
        # are verified (`padding_free`): sequences in rows of at most `pack_tokens` tokens.
        # "auto": `packs_batches` says where.
        self.pack = packs_batches(pack, self.adapter, dist) and self.adapter.capabilities.padding_free
        self.pack_tokens = pack_tokens
        # A family that cannot take left padding (`ModelAdapter.left_padding`) runs every
        # batch as rows of one sequence each, starting at the row's first column.
        self.right_padded = not self.adapter.left_padding
        self.model = built.model.to(dist.device)
        # Dropout off unless asked for (`disable_dropout` says why); an engine that does
        # not train runs in eval mode anyway.
        self.dropout_disabled = [] if dropout else disable_dropout(self.model)
        self.value_head = None
        if value_head:
            hidden = self.model.config.get_text_config().hidden_size
            self.value_head = torch.nn.Linear(hidden, 1, device=dist.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        # Ulysses sequence parallelism over the ranks of dist's SP group (1: off).
        self.sequence_parallel = dist.sequence_parallel
        self._checkpoint_kwargs = {"use_reentrant": False}
        if self.sequence_parallel > 1:
            from mmrl.parallel import ulysses

            ulysses.install(self.model, self.adapter)
            self._checkpoint_kwargs["context_fn"] = ulysses.checkpoint_context
        # "auto": checkpointing only where memory needs it. One GPU process starts
        # without it and turns it on when an update runs out of memory (the trainer
        # redoes that optimizer step: `checkpoint_after_oom`); sharded ranks cannot
        # recover from one rank's OOM, so they keep it on; the CPU never needs it.
        if gradient_checkpointing not in (True, False, "auto"):
            raise ValueError(f"gradient_checkpointing must be true, false or auto, got {gradient_checkpointing!r}")
        self.checkpointing_auto = gradient_checkpointing == "auto"
        # Read once here and kept by `enable_checkpointing`: transformers' own flag walks
        # every module (0.7 ms for a 24-layer model), and the engine reads it each pass.
        self._checkpointing = bool(getattr(self.model, "is_gradient_checkpointing", False))
        if gradient_checkpointing is True or (self.checkpointing_auto and dist.distributed
                                               and dist.device.type == "cuda"):
            self.enable_checkpointing()
        # Packed rows on a GPU: flash varlen attention where the mask is document-causal.
        self.varlen = False
        if self.pack and dist.device.type == "cuda" and self.sequence_parallel == 1:
            from mmrl.engine import varlen

            self.varlen = varlen.available() and varlen.install(self.model, self._decoder_layers)
        # The text decoder's layers compiled in the log-prob and value forwards
        # (`mmrl.engine.compiled_layers`). "auto": on a GPU in one process, packed or padded
        # (measured both ways; sharded layers are not compiled unless asked).
        if compile_layers not in (True, False, "auto"):
            raise ValueError(f"compile_layers must be true, false or auto, got {compile_layers!r}")
        self.compiled_layers = None
        if compile_layers is True or (compile_layers == "auto" and dist.device.type == "cuda"
                                      and not dist.distributed):
            from mmrl.engine.compiled_layers import CompiledLayers

            if not self._decoder_layers and compile_layers is True:
                raise ValueError("compile_layers: cannot find the text decoder's layers to compile")
            self.compiled_layers = CompiledLayers(self._decoder_layers) if self._decoder_layers else None
        # The vision tower's per-image/per-window attention in one call per layer, where
        # the model code offers a sequence-boundaries path (`mmrl.engine.vision_attention`).
        self.vision_one_call = vision_attention.install(self.model)
        # Trainable half-precision parameters get fp32 masters (the module docstring).
        half = {p.dtype for p in self.parameters() if p.requires_grad and p.dtype in HALF_DTYPES}
        if len(half) > 1:
            raise ValueError(f"trainable parameters mix half-precision dtypes {sorted(map(str, half))}")
        # The dtype whose trainable weights step through fp32 masters (None: no masters).
        self.half_dtype = next(iter(half)) if optim is not None and master_weights and half else None
        self.sharded = dist.distributed
        # float16's narrow range needs a scaled loss; bf16 and fp32 never scale. Without
        # masters the unscaled gradients would be fp16 again, so no scaling there either.
        self.loss_scaler = (LossScaler(growth_interval=loss_scale_growth_interval)
                            if self.half_dtype == torch.float16 else None)
        self._scaled_backward = False  # whether the gradients held now are scaled
        self.step_skipped = False  # whether the last `step` skipped the optimizer (inf/nan)
        # fp32 masters in one process; none when sharded, where the upcast FSDP2 shards
        # are the masters.
        self._masters = MasterWeights()
        self._upcast_names: set[str] = set()
        if self.sharded:
            self._shard()
        self.optimizer = None
        self.scheduler = None
        if optim is not None:
            base_lr = lr if lr is not None else optim.lr
            groups = self._param_groups(base_lr, optim.lr_multipliers)
            if not groups:
                raise ValueError("nothing to train: every parameter is frozen")
            if self.half_dtype is not None and not self.sharded:
                groups = self._masters.replace(groups, self._needs_master)
            # One process on a GPU: the fused AdamW kernel (one launch over all parameters
            # instead of a dozen foreach passes): the 0.5B bf16 update of bench/packing.py
            # went from 0.460 s to 0.431 s a step on an H200. Sharded, the default.
            fused = {"fused": True} if self.dist.device.type == "cuda" and not self.sharded else {}
            self.optimizer = torch.optim.AdamW(groups, lr=base_lr, betas=optim.betas, weight_decay=optim.weight_decay,
                                               **fused)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(optim, total_steps))
            self.grad_clip = optim.grad_clip
        else:
            for p in self.parameters():
                p.requires_grad_(False)
            self.model.eval()

    # -- setup -----------------------------------------------------------------------------
    def _shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.half_dtype is not None:
            # FSDP2 over fp32 parameters with a half param_dtype is a master-weight scheme:
            # the fp32 shards are what AdamW steps, the all-gathered copies are half.
            mp = MixedPrecisionPolicy(param_dtype=self.half_dtype, reduce_dtype=torch.float32)
        elif self.dist.device.type == "cuda" and self.mixed_precision:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": self.dist.mesh, **({"mp_policy": mp} if mp else {})}
        layer_names = set(self.adapter.shard_layers)
        sharded = [module for module in self.model.modules() if type(module).__name__ in layer_names]
        sharded += [self.model] + ([self.value_head] if self.value_head is not None else [])
        if self.half_dtype is not None:
            self._upcast_names = {name for name, p in self._named_parameters() if self._needs_master(p)}
        upcast: set[int] = set()
        for module in sharded:
            if self.half_dtype is not None:
                # Module by module, just before its shard: one layer at a time exists in
                # fp32 unsharded, not the whole model.
                for param in module.parameters():
                    if id(param) not in upcast and self._needs_master(param):
                        param.data = param.data.float()
                        upcast.add(id(param))
            fully_shard(module, **kwargs)
        if self.sequence_parallel > 1:
            # Each rank of an SP group holds a partial gradient of the same batch: sum
            # them, and average over the data-parallel groups only.
            for module in sharded:
                module.set_gradient_divide_factor(float(self.dist.dp_size))
                if self.dist.device.type != "cuda":  # gloo has no pre-multiplied sum
                    module.set_force_sum_reduction_for_comms(True)
        # FSDP2 picks its root at the first forward it sees. HF generate may call a
        # submodule first (the vision encoder, before prefill), so settle the root now.
        self.model._get_fsdp_state()._lazy_init()

    @functools.cached_property
    def _decoder_layers(self) -> list[torch.nn.Module]:
        """The text decoder's layers (`mmrl.parts.decoder_layers`), found once; empty where not found."""
        from mmrl.parts import decoder_layers

        try:
            return decoder_layers(self.model, self.adapter)
        except ValueError:
            return []

    def _compiled(self):
        """The block in which the decoder layers run compiled: where the engine compiles
        them, and not under activation checkpointing, whose recomputation in backward has
        to save what the forward saved (it runs outside the block, and could pick another
        of the compiled graphs)."""
        if self.compiled_layers is None or self.checkpointing:
            return contextlib.nullcontext()
        return self.compiled_layers.active()

    def enable_checkpointing(self) -> None:
        """Recompute each layer's activations in the backward pass instead of keeping them."""
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=self._checkpoint_kwargs)
        if hasattr(self.model, "enable_input_require_grads"):
            self.model.enable_input_require_grads()
        self._checkpointing = bool(getattr(self.model, "is_gradient_checkpointing", False))

    @property
    def checkpointing(self) -> bool:
        """Whether the model recomputes activations in backward: as built, or since
        `enable_checkpointing` (the engine's switch; the model's own is not read again)."""
        return self._checkpointing

    @property
    def head_keep_bytes(self) -> int:
        """How many bytes of output-embedding outputs (logits before the log-softmax) the
        chunked log-probs keep from the forward for the backward, instead of computing
        them again there: a sixteenth of the GPU's memory where memory is not short (one
        process, no checkpointing), else none. The H200 profile of the packed 0.5B update
        put the head's recomputation at about 13 ms of matrix products a step."""
        if self.dist.device.type != "cuda" or self.sharded or self.checkpointing:
            return 0
        return torch.cuda.get_device_properties(self.dist.device).total_memory // HEAD_KEEP_SHARE

    def can_checkpoint_after_oom(self) -> bool:
        """Whether an update that ran out of GPU memory can be redone with checkpointing
        (`gradient_checkpointing: auto`, one process, checkpointing still off)."""
        return self.checkpointing_auto and not self.checkpointing and not self.sharded

    def checkpoint_after_oom(self) -> None:
        """Turn checkpointing on for a redo of the update that ran out of memory: the
        partial gradients dropped, the allocator's cached blocks released."""
        import gc

        self.drop_gradients()
        self.enable_checkpointing()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def drop_gradients(self) -> None:
        for parameter in self.parameters():
            parameter.grad = None
        self._masters.drop_gradients()
        self._scaled_backward = False

    def _needs_master(self, param: torch.Tensor) -> bool:
        return self.half_dtype is not None and param.requires_grad and param.dtype == self.half_dtype

    def _named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters under their state-dict names, tied ones under each of their names."""
        return self._modules_for_state().named_parameters(remove_duplicate=False)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by state-dict name (local shards when sharded); empty without."""
        if self.sharded:
            return {name: p for name, p in self._named_parameters() if name in self._upcast_names}
        return self._masters.by_name(self._named_parameters())

    def gather_root(self) -> None:
        """All-gather the root group's parameters (embeddings, patch embedding, norms)
        for code that calls submodules directly instead of the model's forward."""
        if self.sharded:
            self.model.unshard()

    def _param_groups(self, base_lr: float, multipliers: dict[str, float]) -> list[dict]:
        """Trainable parameters grouped by learning rate (one group without multipliers)."""
        from mmrl.parts import part_of

        by_lr: dict[float, list[torch.nn.Parameter]] = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for param in self.parameters():
            if not param.requires_grad:
                continue
            part = part_of(names[id(param)], self.adapter) if id(param) in names else None
            by_lr.setdefault(base_lr * multipliers.get(part, 1.0), []).append(param)
        return [{"params": params, "lr": rate} for rate, params in by_lr.items()]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self.model.parameters()
        if self.value_head is not None:
            yield from self.value_head.parameters()

    @property
    def trains(self) -> bool:
        return self.optimizer is not None

    # -- compute ---------------------------------------------------------------------------
    def log_probs(self, seqs: Sequences, temperature: float = 1.0, with_entropy: bool = True):
        """Per-token log-probs (B, R) of the response tokens, and entropy (B, R); 0 where
        the response mask is 0.

        Runs with autograd when the engine trains and grad mode is on."""
        with self._compiled():
            result = self._chunked_log_probs(seqs, temperature) if self.chunked_head else None
            if result is None:
                result = self._plain_log_probs(seqs, temperature)
        return result[0], (result[1] if with_entropy else None)

    def _plain_log_probs(self, seqs: Sequences, temperature: float):
        """`log_probs` from the model's own logits (fp32 log-softmax over row chunks)."""
        if self.sequence_parallel > 1:
            logp, entropy = self._sp_log_probs(seqs, temperature)
        elif self.packs(seqs):
            return self._packed_log_probs(seqs, temperature)
        else:
            length = seqs.response_ids.shape[1]
            out = self._forward(seqs, logits_to_keep=length + 1)
            logp, entropy = token_log_probs(out.logits[:, :-1], seqs.response_ids, temperature)
        padding = ~seqs.response_mask.bool()
        return logp.masked_fill(padding, 0.0), entropy.masked_fill(padding, 0.0)

    def _chunked_log_probs(self, seqs: Sequences, temperature: float):
        """`log_probs` with the output embedding applied chunk by chunk to the positions
        that predict response tokens (`mmrl.engine.logprobs`), in the layout `log_probs`
        runs (padded, packed or sequence-parallel); None when the first call's check finds
        that this model's logits cannot be reproduced (the plain path then runs)."""
        from mmrl.engine.logprobs import candidates, chunked_head

        mask = seqs.response_mask.bool()
        device = mask.device
        if self.sequence_parallel > 1:
            keep, columns, widths = self._sp_columns(seqs)
            mask = mask[:, columns]
            grid = torch.arange(mask.numel(), device=device).view(mask.shape)
            index, targets = grid[mask], seqs.response_ids[:, columns][mask]
            run = lambda: self._sp_forward(seqs, logits_to_keep=keep)  # noqa: E731
            place = lambda v: self._sp_gather(v.new_zeros(mask.shape).masked_scatter(mask, v), widths)  # noqa: E731
        elif self.packs(seqs):
            packed = self._packed(seqs)
            index, targets = packed.logit_index, seqs.response_ids[packed.response_mask]

            def run():
                # Media sharing matches the media tensors against the padded batch's.
                with self.autocast(), self.media_sharing(seqs.inputs, seqs.shared):
                    return self.model(**packed.inputs, use_cache=False, logits_to_keep=0)

            place = packed.to_padded
        else:
            # The last R + 1 positions reach the head; the first R of them predict the response.
            rows, length = mask.shape
            grid = torch.arange(rows * (length + 1), device=device).view(rows, length + 1)[:, :-1]
            index, targets = grid[mask], seqs.response_ids[mask]
            run = lambda: self._forward(seqs, logits_to_keep=length + 1)  # noqa: E731
            place = lambda v: v.new_zeros(mask.shape).masked_scatter(mask, v)  # noqa: E731
        checked = self.logit_transform is not None
        transforms = [self.logit_transform] if checked else candidates(self.model.config)
        with chunked_head(self.model, index, targets, temperature, transforms,
                          probe_tokens=0 if checked else PROBE_TOKENS, keep_bytes=self.head_keep_bytes) as call:
            out = run()
        if checked:
            logp, entropy = call.values[0]
        else:
            choice = self._check_logit_transform(call, out, transforms)
            if choice is None:
                return None
            logp, entropy = call.values[choice]
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            # An empty term that puts the model's output in the loss's graph, so hooks on
            # it (FSDP2's pre-backward of the root) run as on the plain path.
            tie = logits.reshape(-1)[:0].sum()
            logp, entropy = logp + tie, entropy + tie
        return place(logp), place(entropy)

    def _check_logit_transform(self, call, out, transforms) -> int | None:
        """Which of `transforms` maps the model's head output to its logits on the probe
        positions, the same on every rank. None (and the plain path from now on, with one
        warning) when none does or the head did not run exactly once."""
        import warnings

        from mmrl.engine.logprobs import mismatch

        logits = getattr(out, "logits", None)
        # Per transform, its largest difference in units of the logits' rounding (<= 1: same).
        errors = torch.zeros(len(transforms))
        reason = None
        if call.calls != 1:
            reason = f"the output embedding ran {call.calls} times in the forward, not once"
        elif call.probe_raw is None or not isinstance(logits, torch.Tensor) or logits.shape != call.probe_raw.shape:
            reason = "the model's logits are not its output embedding's output on the given positions"
        elif call.probe_raw.numel():
            errors = torch.tensor(mismatch(call.probe_raw, logits, transforms))
        checked = torch.tensor([float(reason is not None or call.probe_raw.numel() > 0)])
        if reason is not None:
            errors.fill_(math.inf)
        if self.dist.distributed:
            import torch.distributed as torch_dist

            errors, checked = errors.to(self.dist.device), checked.to(self.dist.device)
            torch_dist.all_reduce(errors, op=torch_dist.ReduceOp.MAX)
            torch_dist.all_reduce(checked, op=torch_dist.ReduceOp.MAX)
            errors, checked = errors.cpu(), checked.cpu()
        if not checked.item():  # no rank had a position to check: decide on a later call
            return 0
        choice = int(errors.argmin())
        if errors[choice] > 1.0:
            reason = reason or ("another rank's check failed" if errors[choice] == math.inf else
                                f"none of the logit post-processings {[t.source for t in transforms]} reproduces "
                                f"the model's logits (closest: {float(errors[choice]):.3g} x the rounding tolerance)")
            warnings.warn(f"chunked log-probs off for this engine, full logits instead: {reason}", stacklevel=3)
            self.chunked_head = False
            return None
        self.logit_transform = transforms[choice]
        return choice

    def packs(self, seqs: Sequences) -> bool:
        """Whether `log_probs` runs `seqs` packed: packing is on (or the family cannot take
        left padding), and the batch carries the adapter's position ids (a model that
        computes its own would count across sequences)."""
        positions = "position_ids" in seqs.inputs
        if self.right_padded and (self.sequence_parallel > 1 or not positions):
            why = "sequence parallelism splits rows" if self.sequence_parallel > 1 else "its adapter writes no position ids"
            raise ValueError(f"family {self.adapter.family!r} cannot take left padding (left_padding=False), and its "
                             f"batches cannot run a sequence a row here: {why}")
        return (self.pack or self.right_padded) and self.sequence_parallel == 1 and positions

    def _packed(self, seqs: Sequences):
        """`seqs` packed into rows of at most `pack_tokens` tokens (`mmrl.engine.packing`);
        one sequence a row where the family cannot take left padding."""
        from mmrl.engine.packing import pack_sequences

        row_tokens = 1 if self.right_padded else self.pack_tokens
        return pack_sequences(seqs.inputs, seqs.response_mask, row_tokens, seqs.pad_token_id or 0)

    def _value_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head on hidden states (..., H): fp32 values (...)."""
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def _packed_log_probs(self, seqs: Sequences, temperature: float):
        """`log_probs` over the batch packed without padding; logits only for response tokens."""
        from mmrl.engine.packing import keep_rows

        packed = self._packed(seqs)
        targets = seqs.response_ids[packed.response_mask]
        # Media sharing matches the media tensors against the padded batch's (the same objects).
        with self.autocast(), self.media_sharing(seqs.inputs, seqs.shared), keep_rows(self.model, packed.logit_index):
            logits = self.model(**packed.inputs, use_cache=False, logits_to_keep=0).logits
        logp, entropy = token_log_probs(logits[0].unsqueeze(1), targets.unsqueeze(1), temperature)
        return packed.to_padded(logp[:, 0]), packed.to_padded(entropy[:, 0])

    def values(self, seqs: Sequences) -> torch.Tensor:
        """Critic values (B, R): the value head on the hidden state before each response token."""
        if self.value_head is None:
            raise RuntimeError("this engine has no value head (build it with value_head=True)")
        with self._compiled():
            if self.sequence_parallel > 1:
                return self._sp_values(seqs)
            if self.packs(seqs):
                return self._packed_values(seqs)
            length = seqs.response_ids.shape[1]
            out = self._forward(seqs, logits_to_keep=1, output_hidden_states=True)
            hidden = out.hidden_states[-1][:, -(length + 1):-1]
            return self._value_of(hidden)

    def _packed_values(self, seqs: Sequences) -> torch.Tensor:
        """`values` over the batch packed without padding: the value head on the hidden
        states of the positions before real response tokens only."""
        packed = self._packed(seqs)
        with self.autocast(), self.media_sharing(seqs.inputs, seqs.shared):
            out = self.model(**packed.inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
        hidden = out.hidden_states[-1].flatten(0, 1)[packed.logit_index]
        return packed.to_padded(self._value_of(hidden))

    # -- Ulysses sequence parallelism ------------------------------------------------------------
    # Every rank of an SP group runs the same batch; each keeps the hidden states of its
    # slice of the sequence and computes the response columns that fall in it. The
    # per-token results are all-gathered, so every rank returns the whole (B, R) result.
    def _sp_columns(self, seqs: Sequences) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(local positions to keep, their response columns, columns per rank): the
        positions that predict response tokens are the global ones [S - R - 1, S - 1)."""
        from mmrl.parallel.ulysses import local_columns

        total, length = seqs.inputs["input_ids"].shape[1], seqs.response_ids.shape[1]
        first = total - length - 1
        keep, widths = local_columns(total, first, total - 1, self.dist.sp_rank, self.sequence_parallel)
        start = self.dist.sp_rank * (-(-total // self.sequence_parallel))
        return keep.to(self.dist.device), (keep + start - first).to(self.dist.device), widths

    def _sp_forward(self, seqs: Sequences, **kwargs):
        from mmrl.parallel import ulysses

        with ulysses.active(self.dist.sp_group, self.dist.sp_rank, self.sequence_parallel):
            return self._forward(seqs, **kwargs)

    def _sp_gather(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor:
        from mmrl.parallel.ulysses import gather_columns

        return gather_columns(local, widths, self.dist.sp_rank, self.dist.sp_group)

    def _sp_log_probs(self, seqs: Sequences, temperature: float):
        keep, columns, widths = self._sp_columns(seqs)
        out = self._sp_forward(seqs, logits_to_keep=keep)
        logp, entropy = token_log_probs(out.logits, seqs.response_ids[:, columns], temperature)
        return self._sp_gather(logp, widths), self._sp_gather(entropy, widths)

    def _sp_values(self, seqs: Sequences) -> torch.Tensor:
        keep, _, widths = self._sp_columns(seqs)
        out = self._sp_forward(seqs, logits_to_keep=keep[:0], output_hidden_states=True)
        hidden = out.hidden_states[-1][:, keep]
        values = self._value_of(hidden)
        return self._sp_gather(values, widths)

    def _forward(self, seqs: Sequences, **kwargs):
        with self.autocast(), self.media_sharing(seqs.inputs, seqs.shared):
            return self.model(**seqs.inputs, use_cache=False, **kwargs)

    def media_sharing(self, batch: dict, shared):
        """Context in which `batch`'s repeated prompts encode their media once (a no-op
        unless this engine shares media and `shared` says which rows repeat which)."""
        from mmrl.engine.media import sharing

        return sharing(self.model, batch, shared if self.shares_media else None)

    def autocast(self):
        """bf16 autocast for fp32 weights on a GPU when FSDP's mixed precision is not in
        charge (one process); a no-op elsewhere."""
        import contextlib

        weights_fp32 = next(self.model.parameters()).dtype == torch.float32
        if self.dist.device.type == "cuda" and not self.sharded and weights_fp32 and self.mixed_precision:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def loss_scale(self) -> float:
        """The factor `backward` multiplies the loss by now (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/nan gradients since the run began."""
        return self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by `loss_scale` on float16 engines (the module docstring)."""
        if self.loss_scaler is None:
            loss.backward()
            return
        (loss * self.loss_scaler.scale).backward()
        self._scaled_backward = True

    def step(self) -> float:
        """Clip gradients, take an optimizer and schedule step; returns the grad norm.
        With loss scaling the gradients are unscaled first, and a step with inf or nan
        gradients only drops them, backs the scale off and advances the schedule
        (`step_skipped`; it returns nan)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.step_skipped = False
        if self.loss_scaler is not None:
            grads = [p.grad for p in params if p.grad is not None]
            finite = self.loss_scaler.unscale(grads, self._scaled_backward, self.dist.device,
                                               across_ranks=self.sharded)
            self._scaled_backward = False
            self.loss_scaler.update(finite)
            if not finite:
                return self._skip_step()
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._masters.to_model()
        self.scheduler.step()
        return float(norm)

    def _skip_step(self) -> float:
        import warnings

        self.step_skipped = True
        self.drop_gradients()
        with warnings.catch_warnings():
            # The schedule advances as in torch's AMP loop; a skipped first step makes
            # torch warn that the scheduler stepped before the optimizer did.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return math.nan

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    # -- weights -----------------------------------------------------------------------------
    def full_state_dict(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """HF-named full weights on CPU, LoRA merged in when present. When sharded, only
        rank 0 gets them (the others an empty dict) unless `every_rank`, which gathers
        them on every rank's device first (a colocated rollout engine per rank)."""
        from mmrl.lora import merged_state_dict

        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank, broadcast_from_rank0=False)
            state = get_model_state_dict(self.model, options=options)
            if self._upcast_names:  # the fp32 masters leave as the half weights they train
                prefix = "" if self.value_head is None else "model."
                state = {k: v.to(self.half_dtype) if prefix + k in self._upcast_names else v
                         for k, v in state.items()}
            if every_rank:
                state = {k: v.detach().cpu() for k, v in state.items()}
        else:
            state = {k: v.detach() for k, v in self.model.state_dict().items()}
        return merged_state_dict(self.model, state)

    def save_checkpoint(self, path: Path) -> None:
        """Model (safetensors), optimizer, schedule and loss scale, so a run resumes exactly."""
        from safetensors.torch import save_file

        state = self._train_state()
        if self.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            # Tied weights (embeddings = lm_head) share storage; safetensors wants copies.
            tensors = {k: v.detach().clone().contiguous() for k, v in state["model"].items()}
            save_file(tensors, str(path / "model.safetensors"))
            rest = {"optimizer": state["optimizer"], "scheduler": state["scheduler"]}
            if self.loss_scaler is not None:
                rest["loss_scaler"] = self.loss_scaler.state_dict()
            torch.save(rest, path / "optimizer.pt")
        self.dist.barrier()

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        model_state = load_file(str(path / "model.safetensors"))
        rest = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        partial = self._check_partial_state(model_state, path)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(
                self._modules_for_state(), self.optimizer,
                model_state_dict=model_state, optim_state_dict=rest["optimizer"],
                options=StateDictOptions(full_state_dict=True, strict=not partial),
            )
        else:
            self._modules_for_state().load_state_dict(model_state, strict=not partial)
            # The file holds the fp32 masters (half weights from a run without them
            # are upcast, as at the start of a run).
            with torch.no_grad():
                for name, master in self.master_state_dict().items():
                    if name in model_state:
                        master.copy_(model_state[name])
            self._masters.to_model()
            if self.optimizer is not None:
                self.optimizer.load_state_dict(rest["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(rest["scheduler"])
        # Checkpoints from before loss scaling (or of bf16/fp32 runs) start from the default.
        if self.loss_scaler is not None and "loss_scaler" in rest:
            self.loss_scaler.load_state_dict(rest["loss_scaler"])

    def _check_partial_state(self, model_state: dict, path: Path) -> bool:
        """Whether `model_state` lacks weights (a trainable-only checkpoint); a missing
        weight that trains here is an error naming the checkpoint."""
        names = dict(self._named_parameters())
        unknown = sorted(set(model_state) - set(self._modules_for_state().state_dict()))
        if unknown:
            raise ValueError(f"{path}: the checkpoint holds {len(unknown)} weights this model lacks, e.g. {unknown[0]}")
        missing = [name for name in names if name not in model_state]
        lacking = [name for name in missing if names[name].requires_grad]
        if lacking:
            raise ValueError(f"{path}: the checkpoint lacks {len(lacking)} trained weights, e.g. {lacking[0]} "
                             "(it was saved by a run with other trainable parts)")
        return bool(missing)

    def _modules_for_state(self) -> torch.nn.Module:
        if self.value_head is None:
            return self.model
        return torch.nn.ModuleDict({"model": self.model, "value_head": self.value_head})

    def _train_state(self) -> dict:
        module = self._modules_for_state()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            model_state, optim_state = get_state_dict(
                module, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            masters = self.master_state_dict()
            model_state = {k: masters.get(k, v).detach().cpu() for k, v in module.state_dict().items()}
            optim_state = self.optimizer.state_dict() if self.optimizer else {}
        if self.saves_trainable_only:
            trained = {name for name, p in self._named_parameters() if p.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k in trained}
        return {"model": model_state, "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict() if self.scheduler else {}}
