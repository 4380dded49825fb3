"""The three layouts a batch runs in for log-probs and values, behind one interface.

- `Padded`: the batch as it is, prompt + response a row; the last R + 1 positions reach
  the output embedding and the first R of them predict the response.
- `Packed`: whole sequences without padding in rows of at most `pack_tokens` tokens (one
  a row for families that cannot take left padding; `mmrl.engine.packing`); only the
  positions before real response tokens reach the output embedding.
- `SequenceParallel`: Ulysses (`mmrl.parallel.ulysses`). Every rank of an SP group runs
  the same batch; each keeps the hidden states of its slice of the sequence and computes
  the response columns that fall in it, and the per-token results are all-gathered, so
  every rank returns the whole (B, R) result.

`Engine.log_probs` and `Engine.values` pick one (`Engine.layout`) and use only this
interface, whatever the layout:

    layout.head_positions()   # (index, targets): the flat positions of the output
                              # embedding's input that predict response tokens, and those
    layout.head_forward()     # the model's output with the embedding run on those positions
    layout.place(flat)        # per-token values (N,) -> (B, R), 0 where there is no token
    layout.plain_log_probs(temperature)   # (B, R) log-probs and entropy from the model's logits
    layout.values(value_of)   # (B, R) critic values from the last hidden states

A layout holds one batch for one call; the model runs under the engine's autocast and
media sharing (which matches media tensors against the padded batch's, the same objects).
Every layout asks for its positions with transformers' `logits_to_keep`; a model whose
forward does not take it (it computes the head on every position) gets it applied at its
output embedding instead (`kept_positions`), so the positions are the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from mmrl.engine.stateful_layers import packed_inputs
from mmrl.engine.logprobs import first_tensor, token_log_probs
from mmrl.engine.packing import keep_rows, pack_sequences
from mmrl.engine.sequences import Sequences, left_padded
from mmrl.parallel import ulysses
from mmrl.wrappers import unwrapped


def _zero_padding(seqs: Sequences, logp: torch.Tensor, entropy: torch.Tensor):
    padding = ~seqs.response_mask.bool()
    return logp.masked_fill(padding, 0.0), entropy.masked_fill(padding, 0.0)


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@contextlib.contextmanager
def kept_positions(model: torch.nn.Module, logits_to_keep):
    """Within the block, the output embedding of a model whose forward has no
    `logits_to_keep` (it passes it on in **kwargs, or drops it) sees only the positions
    the argument names, as transformers' models slice them: the last N for an int N (all
    for 0), the given sequence indices for a tensor. A head input that already has that
    length (an inner language model honoured the argument) is left as it is; for a tensor
    of sorted distinct indices that length means all of them, so nothing is lost."""
    base = unwrapped(model)  # PEFT wraps the HF model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if logits_to_keep is None or _takes_logits_to_keep(type(base)) or head is None:
        yield
        return

    def keep(module, args, kwargs):
        hidden, where = first_tensor(args, kwargs)
        if hidden.dim() != 3:
            return None
        if isinstance(logits_to_keep, torch.Tensor):
            if hidden.shape[1] == logits_to_keep.numel():
                return None
            hidden = hidden[:, logits_to_keep.to(hidden.device)]
        elif 0 < logits_to_keep < hidden.shape[1]:
            hidden = hidden[:, -logits_to_keep:]
        else:
            return None
        return ((hidden, *args[1:]), kwargs) if where == 0 else (args, {**kwargs, where: hidden})

    # First among the head's hooks: the chunked head's (mmrl.engine.logprobs) reads the kept positions.
    handle = head.register_forward_pre_hook(keep, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


class Layout:
    """What every layout shares: the batch, and the model's forward as the engine runs it."""

    def __init__(self, engine, seqs: Sequences) -> None:
        self.engine, self.seqs, self.model = engine, seqs, engine.model

    def forward(self, inputs: dict, also=contextlib.nullcontext(), **kwargs):
        """The model on `inputs` (this batch's, or a layout of them) under the engine's
        autocast and media sharing, and `also`."""
        engine, seqs = self.engine, self.seqs
        with (engine.autocast(), engine.media_sharing(seqs.inputs, seqs.shared), also,
              kept_positions(self.model, kwargs.get("logits_to_keep"))):
            return self.model(**inputs, use_cache=False, **kwargs)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """Where the (B, R) grid (this rank's columns of it) holds response tokens."""
        return self.seqs.response_mask.bool()

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.new_zeros(self.mask.shape).masked_scatter(self.mask, flat)


class Padded(Layout):
    @functools.cached_property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The batch as the model sees it: as it is, or, where the engine's compiled layers
        run, widened on the left to their aligned length (`ALIGNED_LENGTH`)."""
        layers, engine = self.engine.compiled_layers, self.engine
        multiple = 1 if layers is None or engine.checkpointing else layers.length_multiple
        return left_padded(self.seqs.inputs, multiple, self.seqs.pad_token_id)

    def head_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = self.mask.shape
        grid = torch.arange(rows * (length + 1), device=self.mask.device).view(rows, length + 1)[:, :-1]
        return grid[self.mask], self.seqs.response_ids[self.mask]

    def head_forward(self):
        return self.forward(self.inputs, logits_to_keep=self.seqs.response_ids.shape[1] + 1)

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        return self.scatter(flat)

    def plain_log_probs(self, temperature: float):
        length = self.seqs.response_ids.shape[1]
        out = self.forward(self.inputs, logits_to_keep=length + 1)
        logp, entropy = token_log_probs(out.logits[:, :-1], self.seqs.response_ids, temperature)
        return _zero_padding(self.seqs, logp, entropy)

    def values(self, value_of) -> torch.Tensor:
        length = self.seqs.response_ids.shape[1]
        out = self.forward(self.inputs, logits_to_keep=1, output_hidden_states=True)
        return value_of(out.hidden_states[-1][:, -(length + 1):-1])


class Packed(Layout):
    def __init__(self, engine, seqs: Sequences) -> None:
        super().__init__(engine, seqs)
        row_tokens = 1 if engine.right_padded else engine.pack_tokens
        self.packed = pack_sequences(seqs.inputs, seqs.response_mask, row_tokens, seqs.pad_token_id or 0)
        self.inputs = packed_inputs(self.model, self.packed)

    def head_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed.logit_index, self.seqs.response_ids[self.packed.response_mask]

    def head_forward(self):
        return self.forward(self.inputs, logits_to_keep=0)

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        return self.packed.to_padded(flat)

    def plain_log_probs(self, temperature: float):
        """Logits only for the positions before real response tokens (`keep_rows`)."""
        targets = self.seqs.response_ids[self.packed.response_mask]
        logits = self.forward(self.inputs, also=keep_rows(self.model, self.packed.logit_index),
                              logits_to_keep=0).logits
        logp, entropy = token_log_probs(logits[0].unsqueeze(1), targets.unsqueeze(1), temperature)
        return self.place(logp[:, 0]), self.place(entropy[:, 0])

    def values(self, value_of) -> torch.Tensor:
        out = self.forward(self.inputs, logits_to_keep=1, output_hidden_states=True)
        hidden = out.hidden_states[-1].flatten(0, 1)[self.packed.logit_index]
        return self.place(value_of(hidden))


class SequenceParallel(Layout):
    def __init__(self, engine, seqs: Sequences) -> None:
        super().__init__(engine, seqs)
        dist = self.dist = engine.dist
        # The positions that predict response tokens are the global ones [S - R - 1, S - 1):
        # this rank's local positions to keep, their response columns, columns per rank.
        total, length = seqs.inputs["input_ids"].shape[1], seqs.response_ids.shape[1]
        first = total - length - 1
        keep, self.widths = ulysses.local_columns(total, first, total - 1, dist.sp_rank, dist.sequence_parallel)
        start = dist.sp_rank * (-(-total // dist.sequence_parallel))
        self.keep, self.columns = keep.to(dist.device), (keep + start - first).to(dist.device)

    def forward(self, inputs: dict, also=contextlib.nullcontext(), **kwargs):
        with ulysses.active(self.dist.sp_group, self.dist.sp_rank, self.dist.sequence_parallel):
            return super().forward(inputs, also, **kwargs)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's response columns -> every column, on every rank of the group."""
        return ulysses.gather_columns(local, self.widths, self.dist.sp_rank, self.dist.sp_group)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        return self.seqs.response_mask.bool()[:, self.columns]

    def head_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        grid = torch.arange(self.mask.numel(), device=self.mask.device).view(self.mask.shape)
        return grid[self.mask], self.seqs.response_ids[:, self.columns][self.mask]

    def head_forward(self):
        return self.forward(self.seqs.inputs, logits_to_keep=self.keep)

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        return self.gather(self.scatter(flat))

    def plain_log_probs(self, temperature: float):
        out = self.forward(self.seqs.inputs, logits_to_keep=self.keep)
        logp, entropy = token_log_probs(out.logits, self.seqs.response_ids[:, self.columns], temperature)
        return _zero_padding(self.seqs, self.gather(logp), self.gather(entropy))

    def values(self, value_of) -> torch.Tensor:
        out = self.forward(self.seqs.inputs, logits_to_keep=self.keep[:0], output_hidden_states=True)
        return self.gather(value_of(out.hidden_states[-1][:, self.keep]))
