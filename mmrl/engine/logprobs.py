"""Per-token log-probs and entropy without full-vocabulary logits for the batch.

A plain forward turns every kept position's hidden state into a (V,) row of logits; at
16 x 4096 response tokens and a 152k vocabulary that is 20 GB in bf16, as much again for
its gradient, and twice that once upcast to fp32. Here the model runs to the input of its
output embedding (`model.get_output_embeddings()`) and no further:

    with chunked_head(model, index, targets, temperature, [transform]) as call:
        out = model(**inputs, use_cache=False, logits_to_keep=R + 1)
    logp, entropy = call.values[0]                   # (N,) each, for the N targets

A forward pre-hook on the output embedding takes the hidden states the model hands it,
keeps the flat positions `index` (those that predict `targets`), and computes, chunk by
chunk of tokens, head(hidden) -> the model's logit post-processing -> / temperature ->
fp32 log-softmax gather and entropy (`head_log_probs`). Backward recomputes each chunk's
logits once and differentiates the log-softmax by hand (`_ChunkedHead`), so one chunk's
logits and their gradient exist at a time. The model
itself gets an empty slice, so its own logits are (1, 0, V). Everything runs inside the
model's forward: FSDP2's root parameters are unsharded there, autocast is the forward's.

What a model does to its logits after the output embedding (soft-capping, a scale) is
not visible from outside its forward. `candidates(config)` lists the post-processings
that config fields name (`LOGIT_FIELDS`) plus none at all; on an engine's first call the
model is also handed a few real positions (`probe_tokens`), and the engine picks the
candidate that reproduces the model's own logits there from its own head output
(`mismatch`). It falls back to full logits when none does, or when the head did not run exactly
once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mmrl.engine.fusion import on_cuda, precompile

LOGPROB_CHUNK_TOKENS = 4096
# Elements of one chunk's (tokens, vocabulary) logits. Eagerly a chunk's backward holds ~3
# fp32 buffers of this size: 2^27 is 1.5 GiB of them, about 880 tokens at a 152k vocabulary.
HEAD_CHUNK_ELEMENTS = 2**27
# Fused (CUDA, below) a chunk holds the head's output and its gradient in the head's dtype,
# 4 bytes an element in bf16, so the same memory takes 4x the chunk: 2^29, 2 GiB. Larger
# chunks pay for themselves: each chunk adds its head-weight gradient into an fp32 sum, a
# pass over vocabulary x hidden elements whatever the chunk's tokens (the step times at
# 2^27 and 2^29: docs/performance.md, "Log-probs without full-vocabulary logits").
FUSED_HEAD_CHUNK_ELEMENTS = 2**29


# -- the plain path: log-probs from given logits ------------------------------------------------
def _chunk_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (F.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` (B, R) under `logits` (B, R, V), and the entropy, in fp32."""
    batch, length = targets.shape
    rows_per_chunk = max(1, chunk_tokens // max(length, 1))
    logps, entropies = [], []
    for start in range(0, batch, rows_per_chunk):
        chunk = (logits[start:start + rows_per_chunk], targets[start:start + rows_per_chunk])
        if torch.is_grad_enabled() and logits.requires_grad:
            logp, entropy = checkpoint(_chunk_log_probs, *chunk, temperature, use_reentrant=False)
        else:
            logp, entropy = _chunk_log_probs(*chunk, temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


# -- what models do to their logits after the output embedding ----------------------------------
@dataclass(frozen=True, slots=True)
class LogitTransform:
    """logits = scale * softcap * tanh(head_output / softcap) (no tanh when softcap is None)."""

    softcap: float | None = None
    scale: float = 1.0
    source: str = "none"  # the config field it came from, for messages

    def apply(self, raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """fp32 logits / temperature, in a new tensor (callers work on it in place)."""
        z = raw.to(torch.float32, copy=True)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        factor = self.scale / temperature
        return z.mul_(factor) if factor != 1.0 else z

    def chain(self, grad: torch.Tensor, raw: torch.Tensor, temperature: float) -> torch.Tensor:
        """d loss / d head_output from d loss / d (logits / temperature), in place on `grad`."""
        factor = self.scale / temperature
        if factor != 1.0:
            grad.mul_(factor)
        if self.softcap is not None:
            slope = raw.to(torch.float32, copy=True).div_(self.softcap).tanh_()
            grad.mul_(slope.square_().neg_().add_(1.0))
        return grad


# Config fields (of the model's config or its text config) that name a post-processing of
# the output embedding's logits in some model's forward, and what it may be. A field whose
# meaning differs between models lists each reading; the first-call check picks.
LOGIT_FIELDS = {
    "final_logit_softcapping": lambda v: [LogitTransform(softcap=v)],
    "logit_scale": lambda v: [LogitTransform(scale=v)],
    "logits_scaling": lambda v: [LogitTransform(scale=1.0 / v), LogitTransform(scale=v)],
    "lm_head_multiplier": lambda v: [LogitTransform(scale=v)],
    "output_multiplier": lambda v: [LogitTransform(scale=v)],
}


def candidates(config) -> list[LogitTransform]:
    """The post-processings `config`'s fields suggest, then none."""
    found: list[LogitTransform] = []
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for name, readings in LOGIT_FIELDS.items():
        for each in configs:
            value = getattr(each, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
                for transform in readings(float(value)):
                    transform = LogitTransform(transform.softcap, transform.scale, f"{name}={value}")
                    if transform not in found:
                        found.append(transform)
    return [*found, LogitTransform()]


def mismatch(raw: torch.Tensor, logits: torch.Tensor, transforms: list[LogitTransform]) -> list[float]:
    """Per transform, the largest difference between it applied to the model's head output
    `raw` and the model's `logits`, in units of the logits' rounding (8 ulps of their
    largest magnitude): at most 1 where the transform is what the model does."""
    target = logits.detach().float()
    tolerance = 8 * torch.finfo(logits.dtype).eps * max(1.0, target.abs().max().item())
    return [(transform.apply(raw.detach()) - target).abs().max().item() / tolerance for transform in transforms]


# -- the chunked head -----------------------------------------------------------------------------
# On CUDA a chunk's softmax arithmetic (below) runs through torch.compile: eagerly it is
# about eight passes over the chunk's fp32 logits, which took more time than the head's
# matrix products (bench/results/packing_profile_gpu.json; docs/performance.md, "Log-probs
# without full-vocabulary logits"); compiled, a pass or two. Elsewhere it runs eagerly.
FUSE_ON_CUDA = True


_fused = on_cuda("chunked log-probs", enabled=lambda: FUSE_ON_CUDA)


@_fused
def _stats(raw: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, temperature: float):
    """(log p(target), entropy, log-normalizer) of softmax(transform(raw) / temperature), fp32."""
    z = transform.apply(raw, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    p = z.sub(lse.unsqueeze(-1)).exp_()
    entropy = lse - p.mul_(z).sum(-1)
    return logp, entropy, lse


@_fused
def _raw_grad(raw, targets, lse, entropy, grad_logp, grad_entropy, transform, temperature) -> torch.Tensor:
    """d loss / d raw from the log-probs' and entropies' gradients (either may be None),
    rebuilding the probabilities from the saved log-normalizer, in place where it can."""
    log_p = transform.apply(raw, temperature).sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    # d entropy / d z_j = -p_j (log p_j + entropy); d log p_t / d z_j = [j = t] - p_j.
    if grad_entropy is not None:
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
    else:
        grad = log_p.zero_()
    if grad_logp is not None:
        grad.sub_(p.mul_(grad_logp.unsqueeze(-1)))
        if torch.compiler.is_compiling():
            # Pointwise, so the whole gradient is one fused kernel that writes `raw`'s dtype;
            # a scatter would end the kernel and leave an fp32 chunk and a cast behind it.
            hit = torch.arange(grad.shape[-1], device=grad.device) == targets.unsqueeze(-1)
            grad = grad + torch.where(hit, grad_logp.unsqueeze(-1), 0.0)
        else:
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    del p
    return transform.chain(grad, raw, temperature).to(raw.dtype)


def head_dtype(weights: torch.dtype, device: torch.device, mixed_precision: bool = True) -> torch.dtype:
    """The dtype of the head outputs the chunked arithmetic gets: bf16 for fp32 weights on a
    GPU under the engine's mixed precision (`Engine.autocast`, FSDP2's policy), else the
    weights' own."""
    return torch.bfloat16 if weights == torch.float32 and device.type == "cuda" and mixed_precision else weights


PRECOMPILE_ROWS = 8  # the stand-in chunk's rows: dim 0 is dynamic, so any count above 1 serves


def precompile_head(vocab: int, dtype: torch.dtype, device: torch.device, transforms: list[LogitTransform],
                    temperature: float, entropy_in_loss: bool = False) -> int:
    """Compile the chunked head's fused arithmetic (`_stats` for every transform, `_raw_grad`
    for a loss with or without the entropy term) for a head of `vocab` outputs in `dtype`,
    on stand-in chunks, as the engine's calls will run them; the number of calls compiled
    (0 where the calls run eagerly: off CUDA, fusion off). Calls from another thread are
    meant: the trainer's while the model builds (the graphs do not depend on the weights)."""
    raw = torch.zeros(PRECOMPILE_ROWS, vocab, dtype=dtype, device=device)
    targets = torch.zeros(PRECOMPILE_ROWS, dtype=torch.long, device=device)
    compiled = 0
    # As the engine calls them: gradients off (inside the autograd function), autocast off.
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for transform in transforms:
            stats = precompile(_stats, raw, targets, transform, temperature)
            if stats is None:
                break
            logp, entropy, lse = stats
            grad_entropy = torch.ones_like(entropy) if entropy_in_loss else None
            precompile(_raw_grad, raw, targets, lse, entropy, torch.ones_like(logp), grad_entropy, transform,
                       temperature)
            compiled += 2
    return compiled


class _ChunkedHead(torch.autograd.Function):
    """(log-probs, entropy) of `targets` under transform(project(hidden)) / temperature,
    `chunk_tokens` rows at a time. Saved for backward: the hidden states and two numbers
    per token; backward recomputes each chunk's head output once, takes the gradient of
    the log-softmax by hand and the head's by autograd, and sums the head parameters'
    gradients over the chunks in fp32 (one rounding to their dtype, as one matmul has).
    The chunks within the first `keep_tokens` tokens keep their head output and its
    autograd graph from the forward instead, and backward skips their recomputation."""

    @staticmethod
    def forward(ctx, hidden, targets, project, transform, temperature, chunk_tokens, keep_tokens, *params):
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        training = any(ctx.needs_input_grad[:1] + ctx.needs_input_grad[7:])
        need_hidden = ctx.needs_input_grad[0]
        results, kept, end = [], [], 0
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
            end += h.shape[0]
            keep = h.detach().requires_grad_(need_hidden) if training and end <= keep_tokens else None
            if keep is not None:
                with torch.enable_grad():
                    raw = project(keep)
                kept.append((keep, raw))
            else:
                raw = project(h)
                kept.append(None)
            with torch.autocast(device, enabled=False):
                results.append(_stats(raw.detach(), t, transform, temperature))
            del raw
        logp, entropy, lse = (torch.cat(parts) for parts in zip(*results))
        ctx.save_for_backward(hidden, targets, lse, entropy)
        ctx.args = (project, transform, temperature, chunk_tokens, params)
        ctx.kept = kept
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, targets, lse, entropy = ctx.saved_tensors
        # Saved outputs come back requiring grad where the loss used them: plain tensors for the
        # fused arithmetic, whose compiled graph would otherwise differ by that (`precompile_head`).
        lse, entropy = lse.detach(), entropy.detach()
        project, transform, temperature, chunk_tokens, params = ctx.args
        kept, ctx.kept = ctx.kept, None
        need_hidden = ctx.needs_input_grad[0]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[7:]) if need]
        nothing = (None,) * (7 + len(params))
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or wanted):
            return nothing
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        device, enabled, dtype = ctx.autocast
        for chunk, start in enumerate(range(0, hidden.shape[0], chunk_tokens)):
            rows = slice(start, start + chunk_tokens)
            if kept[chunk] is not None:
                h, raw = kept[chunk]
                kept[chunk] = None
            else:
                h = hidden[rows].detach().requires_grad_(need_hidden)
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    raw = project(h)
            with torch.autocast(device, enabled=False):
                grad_raw = _raw_grad(raw.detach(), targets[rows], lse[rows], entropy[rows],
                                     None if grad_logp is None else grad_logp[rows],
                                     None if grad_entropy is None else grad_entropy[rows], transform, temperature)
            grads = list(torch.autograd.grad(raw, [h] * need_hidden + [params[i] for i in wanted], grad_raw))
            del raw, grad_raw
            if need_hidden:
                grad_hidden[rows] = grads.pop(0)
            for k, grad in enumerate(grads):
                sums[k] = grad.float() if sums[k] is None else sums[k].add_(grad)
        param_grads = [None] * len(params)
        for k, i in enumerate(wanted):
            # Zeros, not None, without tokens (a sequence-parallel rank may own no response
            # column): every rank then reduces the same gradients.
            param_grads[i] = torch.zeros_like(params[i]) if sums[k] is None else sums[k].to(params[i].dtype)
        return (grad_hidden, *nothing[1:7], *param_grads)


def chunk_elements(hidden: torch.Tensor) -> int:
    """Logit elements of one chunk of the head for `hidden`'s device: larger where the
    chunk's arithmetic runs fused."""
    fused = FUSE_ON_CUDA and hidden.is_cuda and not (_stats.state.get("failed") or _raw_grad.state.get("failed"))
    return FUSED_HEAD_CHUNK_ELEMENTS if fused else HEAD_CHUNK_ELEMENTS


def head_log_probs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
    transform: LogitTransform, chunk_tokens: int | None = None, project=None, keep_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` (N,) under transform(head(hidden)) / temperature, `hidden`
    (N, H), and the entropy: (N,) each in fp32, chunk by chunk of tokens, each chunk's
    logits recomputed in backward, except for the chunks whose head outputs fit in
    `keep_bytes` together, which are kept from the forward. `project` calls the head
    (default: `head` itself)."""
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = max(1, chunk_elements(hidden) // vocab)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    keep_tokens = keep_bytes // (vocab * dtype.itemsize)
    params = [p for p in head.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    return _ChunkedHead.apply(hidden, targets, project or head, transform, temperature, chunk_tokens, keep_tokens,
                              *params)


@dataclass
class HeadCall:
    """What `chunked_head` saw: per transform, (log-probs, entropy) of the targets; how
    often the model called its output embedding; its output on the probe positions."""

    values: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    calls: int = 0
    probe_raw: torch.Tensor | None = None


def first_tensor(args: tuple, kwargs: dict) -> tuple[torch.Tensor, object]:
    if args:
        return args[0], 0
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return value, key
    raise ValueError("the output embedding was called without a tensor")


@contextlib.contextmanager
def chunked_head(
    model: torch.nn.Module, index: torch.Tensor | None, targets: torch.Tensor, temperature: float,
    transforms: list[LogitTransform], probe_tokens: int = 0, chunk_tokens: int | None = None, keep_bytes: int = 0,
) -> Iterator[HeadCall]:
    """Within the block, the model's output embedding computes the chunked log-probs of
    `targets` at the flat positions `index` of its input (all positions when None), once
    per transform, into the yielded `HeadCall`, and then runs on the first `probe_tokens`
    of those positions only, as one (1, probe_tokens, H) row: the model's logits are those.
    With a single transform, head outputs up to `keep_bytes` are kept for the backward
    (`head_log_probs`)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("the model has no output embedding")
    call = HeadCall()
    own = [False]  # our own calls of the head (recomputations too) pass through the hooks

    def project(h):
        own[0] = True
        try:
            return head(h)
        finally:
            own[0] = False

    def before(module, args, kwargs):
        if own[0]:
            return None
        call.calls += 1
        hidden, where = first_tensor(args, kwargs)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if index is not None:
            flat = flat[index]
        call.values = [head_log_probs(head, flat, targets, temperature, transform, chunk_tokens, project,
                                      keep_bytes if len(transforms) == 1 else 0)
                       for transform in transforms]
        probe = flat[:probe_tokens].unsqueeze(0)
        if where == 0:
            return (probe, *args[1:]), kwargs
        return args, {**kwargs, where: probe}

    def after(module, args, kwargs, output):
        if not own[0] and probe_tokens:
            call.probe_raw = output.detach()

    handles = [head.register_forward_pre_hook(before, with_kwargs=True),
               head.register_forward_hook(after, with_kwargs=True)]
    try:
        yield call
    finally:
        for handle in handles:
            handle.remove()
