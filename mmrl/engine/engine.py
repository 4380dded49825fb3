"""The training engine: one class for actor, reference and critic.

An `Engine` wraps a built model and computes per-token log-probs and entropy of given
response tokens (and a critic's values); one that trains also takes optimizer steps.
Roles differ only in options:

    actor = Engine(built, dist, optim=recipe.optim, total_steps=100)       # trains
    ref = Engine(built_ref, dist)                                           # frozen
    critic = Engine(built_critic, dist, optim=..., value_head=True)         # values

`Engine` is thin: each of its jobs is a part of `mmrl/engine/` that owns its state.

- `mmrl.engine.surgery`: the options settled once (`resolve`), then every change made to
  the HF model as an ordered list of `apply_*` steps: device, dropout off, Ulysses,
  activation checkpointing, varlen attention, compiled layers, vision attention, FSDP2
  (`fully_shard` on the family's `shard_layers`, then the root) and freezing.
- `mmrl.engine.optimizer`: AdamW, its LR schedule, fp32 master weights and float16 loss
  scaling, as one object (`Engine.stepper`; `backward` and `step` go through it).
- `mmrl.engine.layouts`: the batch padded, packed (`pack`) or sequence-parallel, behind
  one interface that `log_probs` and `values` use.
- `mmrl.engine.state`: weights and training state out and back in (checkpoints, the
  HF-named full weights).

Log-probs never need the batch's full-vocabulary logits: the model runs to the input of
its output embedding, and the positions that predict response tokens go through the
embedding, the model's logit post-processing (checked against the model's own logits on
the first call), the temperature and an fp32 log-softmax in chunks of tokens, recomputed
in backward (`mmrl.engine.logprobs`). `chunked_head=False`, or a model whose logits the
check cannot reproduce, takes the plain path: the model's own logits for the positions
that predict response tokens, an fp32 log-softmax over checkpointed row chunks.

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
default (`master_weights=True`), and float16 weights also through dynamic loss scaling:
`mmrl.engine.optimizer` says how and what it costs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mmrl.config import OptimConfig
import mmrl.engine.state as state
import mmrl.engine.surgery as surgery
from mmrl.engine.layouts import Layout, Packed, Padded, SequenceParallel
from mmrl.engine.logprobs import LOGPROB_CHUNK_TOKENS, token_log_probs  # noqa: F401 (re-exported)
from mmrl.engine.logprobs import candidates, chunked_head, mismatch
from mmrl.engine.optimizer import Optimizer
from mmrl.engine.packing import PACK_TOKENS
from mmrl.engine.surgery import disable_dropout  # noqa: F401 (re-exported)
from mmrl.engine.sequences import Sequences
from mmrl.parallel import Dist
from mmrl.settle import pack_rule, packs_model

# Real positions the model's own logits are computed for on an engine's first log-prob call,
# to check the chunked head's logit post-processing against (`mmrl.engine.logprobs`).
PROBE_TOKENS = 4
# The share of a GPU's memory (1 / this) whose worth of head outputs the chunked log-probs
# keep for the backward when memory is not short (`Engine.head_keep_bytes`).
HEAD_KEEP_SHARE = 16


class Engine:
    def __init__(
        self,
        built,
        dist: Dist,
        *,
        optim: OptimConfig | None = None,
        lr: float | None = None,
        total_steps: int = 1,
        gradient_checkpointing: bool | str = False,  # or "auto", or "after_oom" (`mmrl.settle`)
        value_head: bool = False,
        mixed_precision: bool = True,
        share_media: bool = True,
        dropout: bool = False,
        pack: bool | str = False,
        pack_tokens: int = PACK_TOKENS,
        compile_layers: bool | str = "auto",
        # A model whose decoder layers cannot be found to compile is an error (None: when
        # compile_layers is True); a trainer passes its recipe's wish, the value settled.
        require_compiled_layers: bool | None = None,
        master_weights: bool = True,
        chunked_head: bool = True,
        loss_scale_growth_interval: int = 2000,
        trainable_only_checkpoints: bool = False,
    ):
        self.built = built
        self.trainable_only = trainable_only_checkpoints  # `mmrl.engine.state.train_state`
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
        # "auto": `mmrl.settle.pack_choice` says where; never a model with stateful layers (convolution,
        # linear attention) that the family's verified tiny model lacks (`mmrl.boundaries`).
        self.pack = packs_model(pack, self.adapter, dist, built.model.config)
        self.pack_tokens = pack_tokens
        # A family that cannot take left padding (`ModelAdapter.left_padding`) runs every
        # batch as rows of one sequence each, starting at the row's first column.
        self.right_padded = not self.adapter.left_padding
        self.model = built.model
        self.value_head = None
        if value_head:
            hidden = self.model.config.get_text_config().hidden_size
            self.value_head = torch.nn.Linear(hidden, 1, device=dist.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        self.sequence_parallel = dist.sequence_parallel
        self.sharded = dist.distributed
        # Every "auto" settled, then every change to the model in one ordered list
        # (`mmrl.engine.surgery`), its results kept where the engine reads them.
        self.settings = surgery.resolve(
            self.model, self.adapter, dist, trains=optim is not None, pack=self.pack, dropout=dropout,
            gradient_checkpointing=gradient_checkpointing, compile_layers=compile_layers,
            require_compiled_layers=require_compiled_layers, master_weights=master_weights,
            mixed_precision=mixed_precision)
        changes = surgery.apply_all(self.model, self.settings, self.value_head)
        self.dropout_disabled = changes.dropout_off
        self.checkpointing_auto = self.settings.checkpointing_auto
        self._checkpointing = changes.checkpointing
        self.varlen = changes.varlen
        self.compiled_layers = changes.compiled_layers
        self.vision_one_call = changes.vision_attention
        # The dtype whose trainable weights step through fp32 masters (None: no masters).
        self.half_dtype = self.settings.half_dtype
        # AdamW, its schedule, fp32 masters and loss scaling (`mmrl.engine.optimizer`);
        # None for an engine that does not train.
        self.stepper = None
        if optim is not None:
            prefix = "" if self.value_head is None else "model."  # as in the engine's state dict
            self.stepper = Optimizer(
                self.parameters(), {id(p): n for n, p in self.model.named_parameters()}, self.adapter, optim,
                dist=dist, lr=lr, total_steps=total_steps, half_dtype=self.half_dtype,
                upcast_names={prefix + name for name in changes.upcast},
                loss_scale_growth_interval=loss_scale_growth_interval)
        # The optimizer's parts, read by the trainer, benches and tests.
        self.optimizer = self.stepper.optimizer if self.stepper else None
        self.scheduler = self.stepper.scheduler if self.stepper else None
        self.loss_scaler = self.stepper.loss_scaler if self.stepper else None
        if self.stepper:
            self.grad_clip = self.stepper.grad_clip

    # -- setup -----------------------------------------------------------------------------
    def _compiled(self):
        """The block in which the decoder layers run compiled: where the engine compiles
        them, and not under activation checkpointing, whose recomputation in backward has
        to save what the forward saved (it runs outside the block, and could pick another
        of the compiled graphs). Masks are kept (`masks_kept`): a micro-batch without
        padding runs the padded ones' graph."""
        if self.compiled_layers is None or self.checkpointing:
            return contextlib.nullcontext()
        return self.compiled_layers.active(keep_masks=True)

    def enable_checkpointing(self) -> None:
        """Recompute each layer's activations in the backward pass instead of keeping them."""
        self._checkpointing = surgery.enable_checkpointing(self.model, self.settings)

    def disable_checkpointing(self) -> None:
        """Keep activations again (`Trainer._end_checkpointing_while_eager`)."""
        self.model.gradient_checkpointing_disable()
        self._checkpointing = surgery.checkpoints(self.model)

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
        process, no checkpointing), else none. What the recomputation costs: the profile
        in docs/performance.md, "Log-probs without full-vocabulary logits"."""
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
        self.drop_gradients()
        self.enable_checkpointing()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def drop_gradients(self) -> None:
        for parameter in self.parameters():
            parameter.grad = None
        if self.stepper:
            self.stepper.drop_gradients()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by state-dict name (local shards when sharded); empty without."""
        return state.masters(self._modules_for_state(), self.stepper)

    def gather_root(self) -> None:
        """All-gather the root group's parameters (embeddings, patch embedding, norms)
        for code that calls submodules directly instead of the model's forward."""
        if self.sharded:
            self.model.unshard()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self.model.parameters()
        if self.value_head is not None:
            yield from self.value_head.parameters()

    @property
    def trains(self) -> bool:
        return self.stepper is not None

    # -- compute ---------------------------------------------------------------------------
    def log_probs(self, seqs: Sequences, temperature: float = 1.0, with_entropy: bool = True):
        """Per-token log-probs (B, R) of the response tokens, and entropy (B, R); 0 where
        the response mask is 0.

        Runs with autograd when the engine trains and grad mode is on."""
        layout = self.layout(seqs)
        with self._compiled():
            result = self._chunked_log_probs(layout, temperature) if self.chunked_head else None
            if result is None:
                result = layout.plain_log_probs(temperature)
        return result[0], (result[1] if with_entropy else None)

    def layout(self, seqs: Sequences) -> Layout:
        """The layout `seqs` runs in (`mmrl.engine.layouts`): sequence-parallel, packed
        (`packs`) or padded."""
        if self.sequence_parallel > 1:
            return SequenceParallel(self, seqs)
        return Packed(self, seqs) if self.packs(seqs) else Padded(self, seqs)

    def _chunked_log_probs(self, layout: Layout, temperature: float):
        """`log_probs` with the output embedding applied chunk by chunk to the positions
        that predict response tokens (`mmrl.engine.logprobs`), in `layout`; None when the
        first call's check finds that this model's logits cannot be reproduced (the plain
        path then runs)."""
        index, targets = layout.head_positions()
        checked = self.logit_transform is not None
        transforms = [self.logit_transform] if checked else candidates(self.model.config)
        with chunked_head(self.model, index, targets, temperature, transforms,
                          probe_tokens=0 if checked else PROBE_TOKENS, keep_bytes=self.head_keep_bytes) as call:
            out = layout.head_forward()
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
        return layout.place(logp), layout.place(entropy)

    def _check_logit_transform(self, call, out, transforms) -> int | None:
        """Which of `transforms` maps the model's head output to its logits on the probe
        positions, the same on every rank. None (and the plain path from now on, with one
        warning) when none does or the head did not run exactly once."""
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
            torch_dist.all_reduce(errors, op=torch_dist.ReduceOp.MAX, group=self.dist.group)
            torch_dist.all_reduce(checked, op=torch_dist.ReduceOp.MAX, group=self.dist.group)
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

    def _value_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head on hidden states (..., H): fp32 values (...)."""
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def values(self, seqs: Sequences) -> torch.Tensor:
        """Critic values (B, R): the value head on the hidden state before each response token."""
        if self.value_head is None:
            raise RuntimeError("this engine has no value head (build it with value_head=True)")
        layout = self.layout(seqs)
        with self._compiled():
            return layout.values(self._value_of)

    def media_sharing(self, batch: dict, shared):
        """Context in which `batch`'s repeated prompts encode their media once (a no-op
        unless this engine shares media and `shared` says which rows repeat which)."""
        from mmrl.engine.media import sharing

        return sharing(self.model, batch, shared if self.shares_media else None)

    def autocast(self):
        """bf16 autocast for fp32 weights on a GPU when FSDP's mixed precision is not in
        charge (one process); a no-op elsewhere."""
        weights_fp32 = next(self.model.parameters()).dtype == torch.float32
        if self.dist.device.type == "cuda" and not self.sharded and weights_fp32 and self.mixed_precision:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def loss_scale(self) -> float:
        """The factor `backward` multiplies the loss by now (1.0 without loss scaling)."""
        return self.stepper.loss_scale if self.stepper else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/nan gradients since the run began."""
        return self.stepper.skipped_steps if self.stepper else 0

    @property
    def step_skipped(self) -> bool:
        """Whether the last `step` skipped the optimizer (inf/nan gradients)."""
        return self.stepper.step_skipped if self.stepper else False

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by `loss_scale` on float16 engines (the module docstring)."""
        if self.stepper is None:
            loss.backward()
            return
        self.stepper.backward(loss)

    def step(self) -> float:
        """Clip gradients, take an optimizer and schedule step; returns the grad norm
        (nan for a step skipped for inf/nan gradients: `Optimizer.step`)."""
        return self.stepper.step()

    @property
    def lr(self) -> float:
        return self.stepper.lr if self.stepper else 0.0

    # -- weights (`mmrl.engine.state`) -------------------------------------------------------
    def full_state_dict(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """HF-named full weights on CPU, LoRA merged in when present. When sharded, only
        rank 0 gets them (the others an empty dict) unless `every_rank`, which gathers
        them on every rank's device first (a colocated rollout engine per rank)."""
        return state.full_weights(self.model, self.dist, self.stepper, value_head=self.value_head,
                                  every_rank=every_rank)

    def save_checkpoint(self, path: Path) -> None:
        """Model (safetensors), optimizer, schedule and loss scale, so a run resumes exactly."""
        state.save(path, self._modules_for_state(), self.stepper, self.dist, trainable_only=self.trainable_only)

    def load_checkpoint(self, path: Path) -> None:
        state.load(path, self._modules_for_state(), self.stepper, self.dist)

    def _modules_for_state(self) -> torch.nn.Module:
        return state.state_module(self.model, self.value_head)

    def _train_state(self) -> dict:
        return state.train_state(self._modules_for_state(), self.stepper, self.dist, trainable_only=self.trainable_only)
