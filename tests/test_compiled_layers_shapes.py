"""The compiled decoder layers compile once per grad mode over micro-batches of varied
shapes (`mmrl.engine.compiled_layers.mark_varying_dims`, issue 28): padded batches of
varied lengths and row counts, one packed row of varied length, and packed rows with the
GPU's varlen segments (cumulative lengths and the longest document, through a CPU stand-in
for the flash varlen kernel). The compiled log-probs and gradients equal the eager ones.

Graphs are compiled with dynamo's `aot_eager` backend: dynamo decides what recompiles, and
AOTAutograd traces forward and backward with the symbolic shapes inductor would get, without
inductor's C++ builds (tests/test_compiled_layers.py compiles with inductor)."""

import functools

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_images
from mmrl.config import OptimConfig
from mmrl.engine import Engine, varlen
from mmrl.engine.sequences import join
from mmrl.parallel import init_distributed
from mmrl.parts import decoder_layers

# (rows, prompt words, response tokens): the length changes alone, the rows alone, both.
MICRO_BATCHES = [(2, 3, 4), (2, 7, 6), (3, 7, 6), (4, 2, 3), (2, 10, 5)]
WORDS = "red green blue shape circle square count the shapes in this picture and answer".split()


def _built(family):
    return build_model(family, random_init=True, seed=0)  # the zoo's tiny config: 2 decoder layers


def _assert_same_gradients(compiled, eager, logp, logp_eager, mask) -> None:
    """Backpropagate (log-probs * mask).sum() through each engine; every parameter's
    gradient must match the eager engine's."""
    for engine, out in ((compiled, logp), (eager, logp_eager)):
        engine.drop_gradients()
        (out * mask).sum().backward()
    named = dict(eager.built.model.named_parameters())
    for name, parameter in compiled.built.model.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(parameter.grad, named[name].grad, atol=1e-5, rtol=1e-4)


def _micro_batch(built, rows, words, response_tokens):
    """`rows` prompts of different lengths (padding in every padded batch), an image of
    one of two sizes each for image models, random responses, the first stopped early."""
    images = sample_images()
    conversations = []
    for row in range(rows):
        text = " ".join(WORDS[: words + row])
        if "image" in built.adapter.modalities:
            content = [{"type": "image", "image": images[row % len(images)]}, {"type": "text", "text": text}]
        else:
            content = text
        conversations.append([{"role": "user", "content": content}])
    prompts = dict(built.processing(conversations))
    generator = torch.Generator().manual_seed(rows * 100 + words)
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(50, vocab, (rows, response_tokens), generator=generator)
    mask = torch.ones_like(responses)
    mask[0, response_tokens // 2:] = 0
    return join(prompts, responses, mask, built.adapter, built.model, built.tokenizer.pad_token_id)


# A stand-in for torch's flash varlen kernel, which needs CUDA: an opaque op that takes the
# segments as the kernel does (cumulative lengths, the longest document as an int), so the
# compiled layer's inputs are the GPU's, and computes document-causal attention.
KERNEL_CALLS = [0]


def _document_causal(query, key, value, cu_seqlens, scale):
    tokens = query.shape[0]
    position = torch.arange(tokens)
    document = torch.bucketize(position, cu_seqlens[1:].long(), right=True)
    mask = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1).contiguous()


@torch.library.custom_op("mmrl_tests::varlen_attn", mutates_args=())
def _varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                 longest: int, scale: float) -> torch.Tensor:
    assert int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) == longest  # the int the graph was handed
    KERNEL_CALLS[0] += 1
    return _document_causal(query, key, value, cu_seqlens, scale)


@_varlen_attn.register_fake
def _(query, key, value, cu_seqlens, longest, scale):
    return torch.empty_like(query)


def _keep_inputs(ctx, inputs, output):
    query, key, value, cu_seqlens, _, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.scale = scale


def _varlen_backward(ctx, grad):
    query, key, value, cu_seqlens = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    with torch.enable_grad():
        out = _document_causal(*leaves, cu_seqlens, ctx.scale)
    return (*torch.autograd.grad(out, leaves, grad), None, None, None)


_varlen_attn.register_autograd(_varlen_backward, setup_context=_keep_inputs)


def _cpu_varlen(monkeypatch):
    """mmrl's varlen attention on the CPU through the stand-in kernel."""
    import torch.nn.attention.varlen as torch_varlen

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False,
                    enable_gqa=False):
        return _varlen_attn(query, key, value, cu_seq_q, max_q, scale)

    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn, raising=False)
    monkeypatch.setattr(varlen, "_OPTIONS", [frozenset({"scale", "is_causal", "enable_gqa"})])
    monkeypatch.setattr(varlen, "kernel_dtype", lambda query: query.dtype)
    monkeypatch.setattr(varlen, "_usable", lambda module, query, key, attention_mask, dropout, kwargs:
                        attention_mask is not None and attention_mask.shape[-1] == key.shape[2])


def _engines(family, layout, monkeypatch):
    """A compiled and an eager engine on the same weights."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    if layout == "varlen":
        _cpu_varlen(monkeypatch)
    engines = []
    for compile_layers in (True, False):
        built = _built(family)
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), compile_layers=compile_layers,
                        pack=layout != "padded", pack_tokens=4096)
        if layout == "varlen":  # as `apply_varlen` does on a GPU
            assert varlen.install(built.model, decoder_layers(built.model, built.adapter))
        engines.append(engine)
    return engines


@pytest.mark.parametrize(("family", "layout"), [
    ("qwen2", "padded"), ("qwen2", "packed"), ("qwen2", "varlen"),
    ("qwen2_5_vl", "padded"), ("qwen2_5_vl", "packed"), ("qwen2_5_vl", "varlen"),
])
def test_varied_micro_batches_compile_each_grad_mode_once(family, layout, monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    KERNEL_CALLS[0] = 0
    compiled, eager = _engines(family, layout, monkeypatch)
    new_graphs = {False: [], True: []}
    for grad in (False, True):
        for shape in MICRO_BATCHES:
            seqs = _micro_batch(compiled.built, *shape)
            if layout != "padded":  # one packed row whatever the rows: its length varies
                assert compiled.packs(seqs) and compiled.layout(seqs).packed.inputs["input_ids"].shape[0] == 1
            graphs = counters["stats"]["unique_graphs"]
            with torch.set_grad_enabled(grad):
                logp, entropy = compiled.log_probs(seqs)
                logp_eager, entropy_eager = eager.log_probs(seqs)
            new_graphs[grad].append(counters["stats"]["unique_graphs"] - graphs)
            assert torch.allclose(logp, logp_eager, atol=1e-5) and torch.allclose(entropy, entropy_eager, atol=1e-5)
            if grad:
                _assert_same_gradients(compiled, eager, logp, logp_eager, seqs.response_mask)
    # The first micro-batch of each grad mode compiles the layer's graph; no other recompiles.
    assert new_graphs == {False: [1, 0, 0, 0, 0], True: [1, 0, 0, 0, 0]}
    assert not counters["graph_break"]
    layers = compiled.compiled_layers
    assert layers.failed is None and layers.compiled_calls == 2 * len(layers.layers) * len(MICRO_BATCHES)
    if layout == "varlen":  # the kernel ran in every compiled and eager layer call
        assert KERNEL_CALLS[0] == 2 * layers.compiled_calls


def test_marked_dims_are_the_rows_and_lengths_not_the_model_constants():
    """The hidden states' rows and length are marked wherever they occur, and a 1-D integer
    tensor's length; a feature dim (hidden size, rotary dim) is not, even where it happens
    to equal the length, and neither are size-1 dims."""
    from mmrl.engine.compiled_layers import mark_varying_dims

    rows, length, hidden, rotary = 3, 32, 64, 32  # the length equals the rotary dim
    states = torch.randn(rows, length, hidden)
    mask = torch.ones(rows, 1, length, length, dtype=torch.bool)
    additive = torch.zeros(rows, 1, length, length)
    cos = torch.randn(rows, length, rotary)
    mrope_ids = torch.zeros(3, rows, length, dtype=torch.long)
    cu_seqlens = torch.tensor([0, 5, 9], dtype=torch.int32)
    mark_varying_dims((states,), {"attention_mask": mask, "position_embeddings": (cos, cos.clone()),
                                  "additive": additive, "position_ids": mrope_ids, "segments": (cu_seqlens, 5)})

    def marked(tensor):
        return getattr(tensor, "_dynamo_weak_dynamic_indices", set())

    assert marked(states) == {0, 1}
    assert marked(mask) == {0, 2, 3} and marked(additive) == {0, 2, 3}
    assert marked(cos) == {0, 1}
    assert marked(mrope_ids) == {0, 1, 2}  # its 3 equals the rows here: a coincidence (module docstring)
    assert marked(cu_seqlens) == {0}
    single = torch.randn(1, 7, hidden)  # one packed row: its row dim stays dynamo's (specialized)
    mark_varying_dims((), {"hidden_states": single})
    assert marked(single) == {1}


def test_the_longest_document_is_a_dynamic_source_in_the_layer_calls_only():
    """Within the compiled layers' block the packed segments' longest document (and the
    attention's layer index) is a dynamic source, beside the user's own; around it, the user's
    setting stands."""
    from mmrl.engine.compiled_layers import LAYER_INDEX_SOURCES, LONGEST_SEGMENT_SOURCES, CompiledLayers

    with torch.compiler.config.patch(dynamic_sources="L['x']"):
        layers = CompiledLayers([torch.nn.Linear(2, 2)])
        with layers.active():
            inside = torch.compiler.config.dynamic_sources
        assert torch.compiler.config.dynamic_sources == "L['x']"
    assert inside == ",".join(("L['x']", *LONGEST_SEGMENT_SOURCES, *LAYER_INDEX_SOURCES))


def _unpadded_micro_batch(built, rows, words, response_tokens):
    """`rows` copies of one prompt (and image) with full responses: no padding anywhere."""
    images = sample_images()
    text = " ".join(WORDS[:words])
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": text}] \
        if "image" in built.adapter.modalities else text
    prompts = dict(built.processing([[{"role": "user", "content": content}]] * rows))
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(50, vocab, (rows, response_tokens), generator=torch.Generator().manual_seed(rows))
    return join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_a_micro_batch_without_padding_runs_the_padded_graph(family, monkeypatch):
    """transformers skips an all-visible causal mask (SDPA's is_causal then runs), which gave
    the compiled layers None where padded batches give a tensor: a second graph per grad mode
    (issue 28). The engine keeps the mask (`masks_kept`), so none is added, and the log-probs
    equal the eager engine's, whose batch without padding still skips its mask."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, eager = _engines(family, "padded", monkeypatch)
    new_graphs = {False: [], True: []}
    for grad in (False, True):
        for seqs in (_micro_batch(compiled.built, 2, 3, 4), _unpadded_micro_batch(compiled.built, 3, 5, 4)):
            graphs = counters["stats"]["unique_graphs"]
            with torch.set_grad_enabled(grad):
                logp, entropy = compiled.log_probs(seqs)
                logp_eager, entropy_eager = eager.log_probs(seqs)
            new_graphs[grad].append(counters["stats"]["unique_graphs"] - graphs)
            assert torch.allclose(logp, logp_eager, atol=1e-5) and torch.allclose(entropy, entropy_eager, atol=1e-5)
    assert bool(seqs.inputs["attention_mask"].all())  # the second batch has no padding
    assert new_graphs == {False: [1, 0], True: [1, 0]}
    assert compiled.compiled_layers.failed is None and not counters["graph_break"]


def test_masks_are_kept_only_inside_the_block():
    """Inside `masks_kept` an all-visible causal mask is built; around it transformers skips it
    again, and the mask functions registered before are back."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from mmrl.engine.compiled_layers import masks_kept

    before = dict(AttentionMaskInterface._global_mapping)

    def sdpa_mask():
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](batch_size=2, q_length=4, kv_length=4,
                                                    attention_mask=torch.ones(2, 4, dtype=torch.bool),
                                                    allow_is_causal_skip=True)

    assert sdpa_mask() is None
    with masks_kept():
        kept = sdpa_mask()
    assert kept.shape == (2, 1, 4, 4) and torch.equal(kept[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert sdpa_mask() is None and AttentionMaskInterface._global_mapping == before
