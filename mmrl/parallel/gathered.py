"""Sequence parallelism for decoders whose sequence mixing Ulysses cannot split by heads:
attention written without transformers' attention interface, and recurrent, state-space
or convolution layers, which carry a state along the sequence. A family opts in with
`SequenceParallel(gather_mixers=True)`; the engine then installs this instead of Ulysses:

    install(model, adapter)              # once, before FSDP wraps the model
    with ulysses.active(group):          # the same context, columns and gathers as Ulysses
        out = model(**inputs, logits_to_keep=ulysses.local_columns(...))

- The decoder stack runs its preamble (embeddings, masks, position embeddings, biases) on
  the whole sequence, as in one process. A pre-hook on the first decoder layer cuts its
  hidden states to this rank's positions (`ulysses.owned_range`, the sequence padded to a
  multiple of P), so the layers' norms and MLPs run on S/P positions. The last layer's
  output is gathered again, for what the stack does after its layers (a final norm, a
  reshape to the input's shape), and a hook on the stack cuts its output to this rank's
  positions, where the LM head runs.
- Each sequence-mixing child of a decoder layer (its forward takes a mask, positions, a
  cache or a state: read from its signature, `is_mixer`) all-gathers its inputs that are
  along this rank's positions, runs on the whole sequence with the preamble's
  whole-sequence arguments, and keeps this rank's positions of its output. So each mixer
  computes exactly what it computes in one process. The layer's other children get their
  per-position inputs beside the hidden states (e.g. token ids a router reads) cut to
  this rank's positions.
- Backward: the gather's gradient is summed over the group and cut to this rank's
  positions; each rank's mixer parameters get the gradient of its own positions' outputs,
  a partial sum that FSDP's reduction completes, as under Ulysses.

What this saves is the position-wise part's activations and compute (and the logits');
the mixers run whole on every rank. Ulysses (mmrl.parallel.ulysses) splits attention too,
where a family's attention goes through transformers' attention interface.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as torch_dist

from mmrl.parallel.ulysses import current, owned_range
from mmrl.parts import decoder_layers, decoder_stack

# Parameter names (after the first, the hidden states) that say a module mixes along the
# sequence: what it is handed to do so (transformers' names for masks, positions, caches,
# recurrent states, packed-sequence boundaries).
_MIXER_ARGUMENT = re.compile(r"mask|position|alibi|rotary|past|cache|state|seq_idx|cu_seqlens")


def is_mixer(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward takes, beyond its first argument, a mask, positions, a
    cache or a state: what a module needs to mix along the sequence (a norm or an MLP
    takes the hidden states alone)."""
    try:
        names = list(inspect.signature(module.forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return any(_MIXER_ARGUMENT.search(name) for name in names)


def layer_children(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's children, those held in a ModuleList or ModuleDict (a layer with
    two attention blocks) taken one by one."""
    found = []
    for child in layer.children():
        found += list(child.children()) if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [child]
    return found


def mixers(model: torch.nn.Module, adapter) -> list[torch.nn.Module]:
    """The sequence-mixing children of the text decoder's layers."""
    return [child for layer in decoder_layers(model, adapter) for child in layer_children(layer) if is_mixer(child)]


def install(model: torch.nn.Module, adapter) -> torch.nn.Module:
    """Hook the first decoder layer (cut to this rank's positions), every mixer (gathered
    around), the last layer (gathered after) and the stack (its output cut); returns the
    stack. Idempotent."""
    if adapter.sequence_parallel is None:
        raise ValueError(f"{adapter.family}: the adapter opts out of sequence parallelism "
                         "(sequence_parallel = None)")
    layers = decoder_layers(model, adapter)
    if not layers:
        raise ValueError(f"{adapter.family}: sequence parallelism found no decoder layers")
    found = mixers(model, adapter)
    if not found:
        raise ValueError("sequence parallelism (gathered mixers) found no module of a decoder layer that takes a "
                         "mask, positions, a cache or a state: nothing says where the layers mix the sequence")
    stack = decoder_stack(model, adapter)
    if not getattr(stack, "_mmrl_gathered_hooked", False):
        layers[0].register_forward_pre_hook(_cut_first_layer, with_kwargs=True)
        for module in found:
            module.register_forward_pre_hook(_gather_inputs, with_kwargs=True)
            module.register_forward_hook(_keep_own_positions)
        for layer in layers:
            for child in layer_children(layer):
                if not is_mixer(child):
                    child.register_forward_pre_hook(_cut_position_inputs, with_kwargs=True)
        layers[-1].register_forward_hook(_gather_output)
        stack.register_forward_hook(_cut_stack_output)
        stack._mmrl_gathered_hooked = True
    return stack


def _hidden(module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a layer (or its mixer) of `module` is called with; a ValueError
    naming the module where there are none."""
    value = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"sequence parallelism (gathered mixers) needs the hidden states of {type(module).__name__}")
    return value


def _own_positions(value, ctx):
    """A (B, S, ...) tensor over the whole sequence -> this rank's positions (the sequence
    padded to a multiple of P: zeros, or the last id for integer tensors); else `value`."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != ctx.length:
        return value
    start, stop = owned_range(ctx.length, ctx.rank, ctx.size)
    extra = ctx.padded(ctx.length) - ctx.length
    if extra:
        tail = (value.new_zeros if value.is_floating_point() else lambda shape: value[:, -1:].expand(shape))(
            (value.shape[0], extra, *value.shape[2:]))
        value = torch.cat([value, tail], dim=1)
    return value.narrow(1, start, stop - start).contiguous()  # a model may .view() it


def _cut_position_inputs(module, args, kwargs):
    """A position-wise child of a layer (not a mixer): its inputs over the whole sequence
    beside the hidden states -> this rank's positions."""
    ctx = current()
    if ctx is None or ctx.length is None or ctx.padded(ctx.length) // ctx.size == ctx.length:
        return None
    return tuple(_own_positions(a, ctx) for a in args), {k: _own_positions(v, ctx) for k, v in kwargs.items()}


def _cut_first_layer(module, args, kwargs):
    ctx = current()
    if ctx is None:
        return None
    hidden = _hidden(module, args, kwargs)
    ctx.length = hidden.shape[1]
    mine = _own_positions(hidden, ctx)
    if args:
        return (mine, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": mine}


class _GatherSequence(torch.autograd.Function):
    """(B, S/P, ...) on each rank -> (B, S_padded, ...) on every rank; backward sums the
    gradient over the group and keeps this rank's positions."""

    @staticmethod
    def forward(ctx, local, rank, size, group):
        ctx.args = (rank, local.shape[1], group)
        parts = [torch.empty_like(local) for _ in range(size)]
        torch_dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        rank, width, group = ctx.args
        grad = grad.contiguous()
        torch_dist.all_reduce(grad, group=group)
        return grad.narrow(1, rank * width, width), None, None, None


def _gather_inputs(module, args, kwargs):
    ctx = current()
    if ctx is None:
        return None
    hidden = _hidden(module, args, kwargs)
    if ctx.length is None:  # set by the first layer's hook (`_cut_first_layer`)
        raise ValueError(f"sequence parallelism (gathered mixers) needs the hidden states of {type(module).__name__}")
    local = hidden.shape[:2]

    def whole(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == local:
            return _GatherSequence.apply(value, ctx.rank, ctx.size, ctx.group)[:, :ctx.length].contiguous()
        return value

    return tuple(whole(a) for a in args), {name: whole(value) for name, value in kwargs.items()}


def _keep_own_positions(module, args, output):
    ctx = current()
    if ctx is None:
        return None
    first = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[1] != ctx.length:
        raise ValueError(f"sequence parallelism (gathered mixers): {type(module).__name__} returned no hidden states "
                         f"over the whole sequence ({ctx.length} positions)")
    mine = _own_positions(first, ctx)
    if isinstance(output, (tuple, list)):
        return type(output)((mine, *output[1:]))
    return mine


def _gather_output(module, args, output):
    """The last layer's hidden states -> the whole sequence, on every rank."""
    ctx = current()
    if ctx is None:
        return None
    first = output[0] if isinstance(output, (tuple, list)) else output
    whole = _GatherSequence.apply(first, ctx.rank, ctx.size, ctx.group)[:, :ctx.length].contiguous()
    return type(output)((whole, *output[1:])) if isinstance(output, (tuple, list)) else whole


def _cut_stack_output(module, args, output):
    """The stack's hidden states (the last, and each of `output_hidden_states`) -> this
    rank's positions, the columns the LM head and the engine's gathers take."""
    ctx = current()
    if ctx is None:
        return None

    def mine(value):
        return _own_positions(value, ctx)

    if isinstance(output, tuple):
        return tuple(mine(v) if i == 0 else v for i, v in enumerate(output))
    output["last_hidden_state"] = mine(output["last_hidden_state"])
    if output.get("hidden_states") is not None:
        output["hidden_states"] = tuple(mine(v) for v in output["hidden_states"])
    return output


__all__ = ["install", "is_mixer", "layer_children", "mixers"]
