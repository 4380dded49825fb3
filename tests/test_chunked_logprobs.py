"""The chunked output embedding (`mmrl.engine.logprobs`) against the plain path: log-probs,
entropy and gradients of the engine with `chunked_head=True` (default) and False on the same
inputs (fp32, CPU), padded, packed, shared media, LoRA, soft-capped logits; the first-call
check that falls back; the size of the largest logits tensor."""

import inspect

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.engine.logprobs import LogitTransform, candidates, head_log_probs
from mmrl.parallel import init_distributed
from conftest import FAMILIES

TEMPERATURE = 0.7


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=0.8), LogitTransform(scale=0.25)])
@pytest.mark.parametrize("chunk", [3, 10])
def test_chunked_head_matches_autograd_through_the_plain_formula(transform, chunk):
    """Log-probs, entropy and the gradients of hidden states and head weight (chunks of 3
    of 10 tokens, and one chunk), against autograd through full logits; with only the
    log-probs' gradient too (entropy unused)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 29, bias=True)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 29, (10,))
    weights = torch.randn(10), torch.randn(10)

    def plain(h):
        x = head(h)
        z = x if transform.softcap is None else transform.softcap * torch.tanh(x / transform.softcap)
        log_p = torch.log_softmax(z * transform.scale / TEMPERATURE, -1)
        return log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)

    def chunked(h):
        return head_log_probs(head, h, targets, TEMPERATURE, transform, chunk)

    for use_entropy in (True, False):
        results = []
        for function in (chunked, plain):
            logp, entropy = function(hidden)
            loss = (logp * weights[0]).sum()
            if use_entropy:
                loss = loss + (entropy * weights[1]).sum()
            results.append((logp, entropy, *torch.autograd.grad(loss, [hidden, *head.parameters()])))
        for ours, reference in zip(*results):
            assert torch.allclose(ours, reference, atol=1e-5), (ours, reference)


@pytest.mark.parametrize("kept_chunks", [0, 2, 4])
def test_kept_head_outputs_give_the_recomputed_results_with_fewer_head_calls(kept_chunks):
    """Chunks kept from the forward (`keep_bytes`: here 0, 2 or all 4 chunks of 3 of 10
    tokens) give the same log-probs, entropy and gradients as recomputing them, and the
    head runs once less per kept chunk."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 29, bias=True)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 29, (10,))
    calls = []

    def project(h):
        calls.append(h.shape[0])
        return head(h)

    results = []
    for keep_bytes in (0, kept_chunks * 3 * 29 * 4):  # fp32 outputs: 4 bytes each
        calls.clear()
        logp, entropy = head_log_probs(head, hidden, targets, TEMPERATURE, LogitTransform(softcap=0.8), 3,
                                       project, keep_bytes=keep_bytes)
        grads = torch.autograd.grad((logp * 0.3).sum() + (entropy * 0.1).sum(), [hidden, *head.parameters()])
        results.append(((logp, entropy, *grads), len(calls)))
    (recomputed, calls_recomputing), (kept, calls_keeping) = results
    assert calls_recomputing == 8 and calls_keeping == 8 - kept_chunks
    for ours, reference in zip(kept, recomputed):
        assert torch.equal(ours, reference)


def test_chunked_head_without_gradients_or_tokens():
    head = torch.nn.Linear(8, 29)
    with torch.no_grad():
        logp, entropy = head_log_probs(head, torch.randn(5, 8), torch.randint(0, 29, (5,)), 1.0, LogitTransform(), 2)
    assert logp.shape == entropy.shape == (5,) and not logp.requires_grad
    # No tokens (a sequence-parallel rank may own no response column): zero gradients, not
    # None, so every rank reduces the same parameters.
    hidden = torch.randn(0, 8, requires_grad=True)
    logp, entropy = head_log_probs(head, hidden, torch.zeros(0, dtype=torch.long), 1.0, LogitTransform())
    assert logp.shape == (0,)
    (logp.sum() + entropy.sum() + hidden.sum()).backward()
    assert head.weight.grad is not None and not head.weight.grad.any()


def test_candidates_come_from_config_fields_then_none():
    from transformers import Gemma2Config, Qwen2Config

    assert candidates(Qwen2Config()) == [LogitTransform()]
    gemma = candidates(Gemma2Config())
    assert gemma[0].softcap == 30.0 and gemma[-1] == LogitTransform()


def _batch(built, engine, rows=None, response_length=7, shared=None):
    conversations = sample_conversations(built.adapter)
    rows = rows or conversations + conversations[::-1]
    prompts = dict(built.processing(rows))
    vocab = built.model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    responses = torch.randint(min(50, vocab // 2), vocab, (len(rows), response_length), generator=generator)
    mask = torch.ones_like(responses)
    mask[0, 3:] = 0
    mask[-1, 5:] = 0
    return join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id, shared=shared)


def _run(family, chunked, *, pack=False, overrides=None, lora=False, shared_media=False, prepare=None):
    """Log-probs, entropy (temperature 0.7) and the gradients of a weighted sum of both."""
    built = build_model(family, random_init=True, seed=0, config_overrides=overrides)
    if lora:
        from mmrl.lora import apply_lora

        torch.manual_seed(0)
        built.model = apply_lora(built.model, scope="language", rank=4, init_lora_weights=False,
                                 adapter=built.adapter)
    if prepare:
        prepare(built.model)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), pack=pack, pack_tokens=250,
                    chunked_head=chunked)
    shared = None
    if shared_media:
        from mmrl.engine.media import SharedMedia

        conversations = sample_conversations(built.adapter)
        owners = [0, 1, 0, 1, 1]
        rows = [conversations[o] for o in owners]
        shared = SharedMedia.of(built.processing, rows, owners)
        seqs = _batch(built, engine, rows=rows, shared=shared)
    else:
        seqs = _batch(built, engine)
    assert engine.packs(seqs) == pack
    logp, entropy = engine.log_probs(seqs, temperature=TEMPERATURE)
    weights = torch.linspace(-1, 1, seqs.response_ids.shape[1])
    ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
    grads = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
    return engine, seqs, logp.detach(), entropy.detach(), grads


CASES = {
    "text": dict(family="qwen2"),
    "text_packed": dict(family="qwen2", pack=True),
    "vlm_padded": dict(family="qwen2_vl"),
    "vlm_packed": dict(family="qwen2_vl", pack=True),
    "vlm_tied_embeddings": dict(family="smolvlm"),
    "shared_media_packed": dict(family="qwen2_5_vl", pack=True, shared_media=True),
    "lora": dict(family="qwen2", lora=True),
    # A cap small enough that tanh bends the tiny model's logits.
    "softcap": dict(family="gemma3_text", overrides={"final_logit_softcapping": 0.05}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_head_equals_the_plain_path(case):
    engine, seqs, logp, entropy, grads = _run(chunked=True, **CASES[case])
    _, _, plain_logp, plain_entropy, plain_grads = _run(chunked=False, **CASES[case])
    assert engine.chunked_head and engine.logit_transform is not None
    real = seqs.response_mask.bool()
    assert torch.allclose(logp, plain_logp, atol=1e-5)
    assert torch.allclose(entropy, plain_entropy, atol=1e-5)
    assert (logp[~real] == 0).all() and (entropy[~real] == 0).all()
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5, rtol=1e-4), name
    if case == "softcap":
        assert engine.logit_transform.softcap == 0.05
        # The cap matters here: without it the log-probs are far off.
        built = engine.built
        with torch.no_grad():
            uncapped = Engine(built, init_distributed("cpu"))
            uncapped.logit_transform = LogitTransform()
            assert not torch.allclose(uncapped.log_probs(seqs, temperature=TEMPERATURE)[0], logp, atol=1e-2)


def test_the_check_falls_back_where_the_model_changes_its_logits_unseen():
    """A forward that transforms its logits in a way no config field names: the first call
    warns once, returns the plain path's values, and the engine stays on the plain path."""
    def prepare(model):
        model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out.logits * 1.5 + 0.1))

    with pytest.warns(UserWarning, match="chunked log-probs off"):
        engine, seqs, logp, entropy, grads = _run("qwen2", True, prepare=prepare)
    _, _, plain_logp, _, plain_grads = _run("qwen2", False, prepare=prepare)
    assert not engine.chunked_head
    assert torch.allclose(logp, plain_logp, atol=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_the_check_falls_back_where_the_head_is_bypassed():
    """A forward that never calls its output embedding module (0 calls seen)."""
    def prepare(model):
        head = model.get_output_embeddings()
        model.get_output_embeddings = lambda: torch.nn.Linear(head.in_features, head.out_features)

    with pytest.warns(UserWarning, match="ran 0 times"):
        engine, _, logp, _, _ = _run("qwen2", True, prepare=prepare)
    _, _, plain_logp, _, _ = _run("qwen2", False)
    assert not engine.chunked_head and torch.allclose(logp, plain_logp, atol=1e-5)


def _largest_logits(engine, seqs, vocab):
    """The most elements of any tensor with a vocabulary-sized last dimension that the
    log-prob pass and its backward allocate."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        size = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # views (the head weight's transpose among them) allocate nothing
                return out
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == vocab:
                    self.size = max(self.size, tensor.numel())
            return out

    with Largest() as mode:
        logp, entropy = engine.log_probs(seqs)
        (logp.sum() + entropy.sum()).backward()
    return mode.size


def test_only_one_chunk_of_logits_exists_at_a_time(monkeypatch):
    from mmrl.engine import logprobs

    built = build_model("qwen2", random_init=True, seed=0)
    vocab = built.model.config.vocab_size
    chunk_tokens = 4
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", chunk_tokens * vocab)
    sizes = {}
    for chunked in (True, False):
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), chunked_head=chunked)
        seqs = _batch(built, engine, response_length=12)
        engine.log_probs(seqs)  # the first call (with its check) aside
        engine.drop_gradients()
        sizes[chunked] = _largest_logits(engine, seqs, vocab)
    tokens = int(seqs.response_mask.sum())
    assert sizes[True] == chunk_tokens * vocab
    assert sizes[False] >= tokens * vocab > 4 * sizes[True]


def test_chunks_are_larger_only_where_the_chunk_arithmetic_runs_fused(monkeypatch):
    """CUDA tensors get the fused chunk, CPU tensors the eager one, and so do CUDA tensors
    once the fused arithmetic has given up (its eager buffers are fp32, 3x per element)."""
    from types import SimpleNamespace

    from mmrl.engine import logprobs

    cuda, cpu = SimpleNamespace(is_cuda=True), torch.zeros(1)
    assert logprobs.FUSED_HEAD_CHUNK_ELEMENTS > logprobs.HEAD_CHUNK_ELEMENTS
    assert logprobs.chunk_elements(cuda) == logprobs.FUSED_HEAD_CHUNK_ELEMENTS
    assert logprobs.chunk_elements(cpu) == logprobs.HEAD_CHUNK_ELEMENTS
    monkeypatch.setitem(logprobs._raw_grad.state, "failed", True)
    assert logprobs.chunk_elements(cuda) == logprobs.HEAD_CHUNK_ELEMENTS
    monkeypatch.setattr(logprobs, "FUSE_ON_CUDA", False)
    monkeypatch.delitem(logprobs._raw_grad.state, "failed")
    assert logprobs.chunk_elements(cuda) == logprobs.HEAD_CHUNK_ELEMENTS


@pytest.mark.slow
def test_compiled_head_gradient_is_one_pointwise_pass_equal_to_the_eager_one():
    """Compiled (as on CUDA), the gradient of a chunk's log-softmax adds the target's term
    through a one-hot mask instead of a scatter, so that it fuses into one pass: on the same
    inputs (bf16 head outputs, soft-capped and scaled logits, with and without the entropy's
    gradient) it equals the eager scatter's result, in the head outputs' dtype."""
    from mmrl.engine import logprobs

    torch.manual_seed(0)
    raw = (torch.randn(7, 50) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 50, (7,))
    transform = LogitTransform(softcap=4.0, scale=0.5)
    z = transform.apply(raw, TEMPERATURE)
    lse = torch.logsumexp(z, -1)
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1)
    eager_fn = logprobs._raw_grad.__wrapped__
    compiled_fn = torch.compile(eager_fn, backend="inductor", fullgraph=True)
    for grad_entropy in (torch.randn(7), None):
        args = (targets, lse, entropy, torch.randn(7), grad_entropy, transform, TEMPERATURE)
        eager = eager_fn(raw, *args)
        compiled = compiled_fn(raw, *args)
        assert compiled.dtype == eager.dtype == torch.bfloat16
        torch.testing.assert_close(compiled.float(), eager.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=30.0, scale=0.5)])
def test_fused_chunk_math_on_the_gpu_equals_the_eager_math(transform, monkeypatch):
    """On CUDA the chunks' softmax arithmetic runs compiled (`FUSE_ON_CUDA`): log-probs,
    entropy and the gradients of hidden states and head weight equal the eager arithmetic's
    on the same bf16 head outputs, over chunks of 1000 and a last chunk of 500 (two
    shapes), at a 152k vocabulary."""
    from mmrl.engine import logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 151936, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(2500, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 151936, (2500,), device="cuda")
    weights = torch.randn(2, 2500, device="cuda")
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(logprobs, "FUSE_ON_CUDA", fused)
        logp, entropy = head_log_probs(head, hidden, targets, 0.7, transform, 1000)
        loss = (logp * weights[0]).sum() + (entropy * weights[1]).sum()
        results[fused] = (logp, entropy, *torch.autograd.grad(loss, [hidden, head.weight]))
    for ours, eager in zip(results[True], results[False]):
        torch.testing.assert_close(ours.float(), eager.float(), rtol=1e-3, atol=1e-4)
    for fn in (logprobs._stats, logprobs._raw_grad):  # both took the compiled path, without failing
        assert "compiled" in fn.state and not fn.state.get("failed"), fn.state


@pytest.mark.gpu
def test_chunked_head_peak_memory_on_the_gpu(monkeypatch):
    """bf16 weights, a 152k vocabulary, 4 x 2048 response tokens, chunks of 220 tokens: with
    no head outputs kept (as when memory is short), the chunked pass's extra peak is a
    fraction of the plain path's; keeping head outputs for the backward
    (`Engine.head_keep_bytes`) adds at most its budget to that. Log-probs agree within bf16
    rounding. (At the default fused chunk, 3.5k tokens here, a chunk alone holds ~2 GiB:
    this batch is too small to show the difference.)"""
    from mmrl.engine import engine as engine_module
    from mmrl.engine import logprobs

    monkeypatch.setattr(logprobs, "FUSED_HEAD_CHUNK_ELEMENTS", 2**25)
    device = torch.device("cuda")
    dist = init_distributed("cuda")
    overrides = {"vocab_size": 151936, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    ids = torch.randint(100, 151936, (4, 1))
    responses = torch.randint(100, 151936, (4, 2048))
    peaks, values, budgets = {}, {}, {}
    for mode, chunked, share in (("plain", False, 2**62), ("chunked", True, 2**62),
                                 ("kept", True, engine_module.HEAD_KEEP_SHARE)):
        monkeypatch.setattr(engine_module, "HEAD_KEEP_SHARE", share)  # 2**62: nothing kept
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=overrides, dtype="bfloat16",
                            device=device)
        engine = Engine(built, dist, optim=OptimConfig(lr=1e-6), chunked_head=chunked)
        budgets[mode] = engine.head_keep_bytes
        seqs = join({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, responses,
                    torch.ones_like(responses), built.adapter, engine.model, 0).to(device)
        engine.log_probs(seqs)
        engine.drop_gradients()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        logp, entropy = engine.log_probs(seqs)
        (logp.sum() + entropy.sum()).backward()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        values[mode] = logp.detach().float()
        engine.drop_gradients()
    full_logits = 4 * 2048 * 151936 * 2  # one bf16 copy of the batch's logits
    assert budgets["chunked"] == 0 < budgets["kept"]
    assert peaks["plain"] > full_logits
    assert peaks["chunked"] < full_logits / 2, peaks
    assert peaks["chunked"] < peaks["kept"] <= peaks["chunked"] + budgets["kept"], (peaks, budgets)
    for mode in ("chunked", "kept"):
        assert (values[mode] - values["plain"]).abs().max() < 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_takes_the_chunked_path(family):
    """Each registered family passes the first-call check (no fallback warning) and its
    chunked log-probs and entropy equal the plain path's (no gradients: cheap)."""
    import warnings

    built = build_model(family, random_init=True, seed=0)
    results = []
    for chunked in (True, False):
        engine = Engine(built, init_distributed("cpu"), chunked_head=chunked)
        seqs = _batch(built, engine)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="chunked log-probs off")
            with torch.no_grad():
                results.append(engine.log_probs(seqs, temperature=TEMPERATURE))
        assert engine.chunked_head == chunked
    (logp, entropy), (plain_logp, plain_entropy) = results
    assert torch.allclose(logp, plain_logp, atol=1e-5) and torch.allclose(entropy, plain_entropy, atol=1e-5)


@pytest.mark.parametrize("name, field, expected", [
    ("Cohere", {"logit_scale": 3.0}, LogitTransform(scale=3.0)),
    ("Granite", {"logits_scaling": 0.25}, LogitTransform(scale=4.0)),  # the forward divides
    ("Gemma2", {"final_logit_softcapping": 0.05}, LogitTransform(softcap=0.05)),
])
def test_the_check_finds_each_config_named_post_processing(name, field, expected):
    """transformers models outside the zoo that scale or soft-cap their logits: the
    candidate that reproduces their logits is the one their forward applies, and the
    chunked log-probs with it equal a log-softmax of the model's own logits."""
    import transformers

    from mmrl.engine.logprobs import chunked_head, mismatch

    config = getattr(transformers, f"{name}Config")(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, **field)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    ids = torch.randint(0, 97, (2, 9))
    targets = ids[:, 1:].reshape(-1)
    index = (torch.arange(2)[:, None] * 9 + torch.arange(8)).reshape(-1)
    transforms = candidates(config)
    with torch.no_grad():
        with chunked_head(model, index, targets, TEMPERATURE, transforms, probe_tokens=4) as call:
            out = model(ids)
        errors = mismatch(call.probe_raw, out.logits, transforms)
        choice = min(range(len(errors)), key=errors.__getitem__)
        plain = torch.log_softmax(model(ids).logits[:, :-1].float() / TEMPERATURE, -1)
    assert transforms[choice].softcap == expected.softcap and transforms[choice].scale == expected.scale
    assert errors[choice] <= 1.0 < errors[-1]  # none at all (last) does not reproduce them
    expected_logp = plain.gather(-1, ids[:, 1:, None])[..., 0].reshape(-1)
    assert torch.allclose(call.values[choice][0], expected_logp, atol=1e-5)


def _logits_everywhere(model):
    """The model as transformers writes some VLMs (VideoLlama3, the Qwen Omni thinkers,
    MiniCPM-V 4.6): a forward without `logits_to_keep` that makes logits for every position."""
    computes = type(model)

    class EveryPosition(computes):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            kwargs.pop("logits_to_keep", None)
            return computes.forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, logits_to_keep=0, **kwargs)

    model.__class__ = EveryPosition


@pytest.mark.parametrize("chunked", [True, False])
def test_a_forward_without_logits_to_keep_gives_the_same_log_probs_and_gradients(chunked):
    """The layouts' `logits_to_keep` is applied at the output embedding where the forward
    does not take it: the chunked and the plain path then read the positions before the
    response, as for the model that honours it (without: other positions, or a crash)."""
    engine, seqs, logp, entropy, grads = _run("qwen2", chunked, prepare=_logits_everywhere)
    _, _, honoured_logp, honoured_entropy, honoured_grads = _run("qwen2", chunked)
    assert "logits_to_keep" not in inspect.signature(type(engine.model).forward).parameters
    assert engine.chunked_head == chunked
    assert torch.allclose(logp, honoured_logp, atol=1e-5)
    assert torch.allclose(entropy, honoured_entropy, atol=1e-5)
    for name, grad in honoured_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_kept_positions_slices_like_transformers_and_leaves_kept_inputs():
    """An int keeps the last N positions (0: all), a tensor the indices it names (as the
    sequence-parallel layout asks); a head input that already has that many positions (an
    inner language model honoured the argument) passes as it is."""
    from mmrl.engine.layouts import kept_positions

    class Wrapper(torch.nn.Module):  # a forward without logits_to_keep
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Identity()

        def get_output_embeddings(self):
            return self.head

        def forward(self, hidden, **kwargs):
            return self.head(hidden)

    model, hidden = Wrapper(), torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    cases = [(2, hidden[:, -2:]), (0, hidden), (torch.tensor([1, 4]), hidden[:, [1, 4]]),
             (torch.tensor([], dtype=torch.long), hidden[:, :0])]
    for keep, expected in cases:
        with kept_positions(model, keep):
            assert torch.equal(model(hidden, logits_to_keep=keep), expected), keep
    for keep, already in ((3, hidden[:, -3:]), (torch.tensor([0, 2]), hidden[:, :2])):
        with kept_positions(model, keep):
            assert torch.equal(model(already), already)
    assert not model.head._forward_pre_hooks  # removed on leaving
