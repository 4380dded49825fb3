"""Compiled decoder layers (`mmrl.engine.compiled_layers`) against the eager layers, and the
varlen segments hook that keeps the varlen kernel's setup out of the compiled graph.

On the CPU inductor compiles C++ kernels, so these compare the compiled path with the
plain one on the same inputs; the CUDA check (varlen kernel, bf16) is in tests/test_gpu.py."""

import warnings

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine
from mmrl.engine.compiled_layers import CompiledLayers
from mmrl.parallel import init_distributed
from test_engine import _sequences  # the sample prompts, random responses, one stopped early


def _built(layers=4):
    # Four layers: one compiled graph serving all of them shows no per-layer recompiles.
    return build_model("qwen2", random_init=True, seed=0, config_overrides={"num_hidden_layers": layers})


def _step(compile_layers, pack, checkpointing=False, lora=False):
    """Log-probs, entropy and every gradient of one loss, from a fresh engine on the same weights."""
    built = _built()
    if lora:  # LoRA adapters inside the compiled layers (non-zero B, so they change the output)
        from mmrl.lora import apply_lora

        torch.manual_seed(0)
        built.model = apply_lora(built.model, scope="language", rank=4, init_lora_weights=False,
                                 adapter=built.adapter)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), compile_layers=compile_layers,
                    pack=pack, pack_tokens=64, gradient_checkpointing=checkpointing)
    seqs = _sequences(built)
    logp, entropy = engine.log_probs(seqs)
    ((logp - 0.1 * entropy) * seqs.response_mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in built.model.named_parameters() if p.grad is not None}
    return engine, logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.slow
def test_compiled_layers_give_the_eager_log_probs_and_gradients(pack):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    _, logp, entropy, grads = _step(False, pack)
    engine, logp_c, entropy_c, grads_c = _step(True, pack)
    assert engine.compiled_layers is not None and engine.compiled_layers.failed is None
    assert engine.compiled_layers.compiled_calls == 4  # every layer, through the compiled forward
    assert torch.allclose(logp_c, logp, atol=1e-5) and torch.allclose(entropy_c, entropy, atol=1e-5)
    assert grads.keys() == grads_c.keys() and len(grads) > 10
    for name in grads:
        assert torch.allclose(grads_c[name], grads[name], atol=1e-5, rtol=1e-4), name
    # One graph for the four layers, none broken: each layer does not compile its own.
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    for _ in range(2):  # the same batch again: no recompile (nothing in the layer guards on a count)
        engine.log_probs(_sequences(engine.built))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_compiled_layers_with_lora_give_the_eager_log_probs_and_gradients():
    _, logp, _, grads = _step(False, pack=True, lora=True)
    engine, logp_c, _, grads_c = _step(True, pack=True, lora=True)
    assert engine.compiled_layers.failed is None and engine.compiled_layers.compiled_calls == 4
    assert torch.allclose(logp_c, logp, atol=1e-5)
    assert grads.keys() == grads_c.keys() and all("lora_" in name for name in grads)
    for name in grads:
        assert torch.allclose(grads_c[name], grads[name], atol=1e-5, rtol=1e-4), name


def test_activation_checkpointing_keeps_the_layers_eager():
    """A checkpointed layer is recomputed in backward, outside the engine's forward: it runs
    eagerly both times (a compiled forward and an eager recompute would save different tensors)."""
    _, logp, _, grads = _step(False, pack=False, checkpointing=True)
    engine, logp_c, _, grads_c = _step(True, pack=False, checkpointing=True)
    assert engine.checkpointing and engine.compiled_layers.compiled_calls == 0
    assert torch.equal(logp_c, logp) and all(torch.equal(grads_c[n], grads[n]) for n in grads)


def test_compiled_layers_run_eagerly_outside_the_engines_forwards():
    """Generation (growing caches) and direct model calls keep the eager layers."""
    built = _built(layers=2)
    engine = Engine(built, init_distributed("cpu"), compile_layers=True)
    batch = built.inputs(sample_conversations(built.adapter))
    with torch.no_grad():
        built.model(**batch)
        built.model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert engine.compiled_layers.compiled_calls == 0


def test_a_compile_that_fails_warns_once_and_leaves_the_layers_eager(monkeypatch):
    class Refused(torch._dynamo.exc.TorchDynamoException):
        pass

    def refuse(*args, **kwargs):
        raise Refused("this layer cannot be traced\nsecond line")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: refuse)
    _, logp, _, grads = _step(False, pack=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, logp_c, _, grads_c = _step(True, pack=False)
    messages = [str(w.message) for w in caught if "compiled decoder layers" in str(w.message)]
    assert messages == ["compiled decoder layers: off, eager from now on (Refused: this layer cannot be traced)"]
    assert engine.compiled_layers.failed and engine.compiled_layers.compiled_calls == 0
    # The failed call's batch was widened for the compiled layers before the compile failed
    # (`ALIGNED_LENGTH`): the eager results to rounding; later calls take the batch as it is.
    torch.testing.assert_close(logp_c, logp, atol=1e-5, rtol=0)
    assert all(torch.allclose(grads_c[n], grads[n], atol=1e-5) for n in grads)
    with torch.no_grad():
        assert torch.equal(engine.log_probs(_sequences(engine.built))[0], logp)


def test_compile_layers_auto_is_off_on_the_cpu_and_other_values_are_refused():
    built = _built(layers=2)
    assert Engine(built, init_distributed("cpu"), pack=True).compiled_layers is None  # auto: a GPU only
    assert Engine(built, init_distributed("cpu"), compile_layers=False).compiled_layers is None
    with pytest.raises(ValueError, match="compile_layers must be true, false or auto, got 'yes'"):
        Engine(built, init_distributed("cpu"), compile_layers="yes")


def test_the_segments_hook_hands_each_layer_its_masks_segments(monkeypatch):
    """A packed forward: every decoder layer's attention call receives the segments of its
    own document-causal mask as a keyword, so nothing inside the layer reads the mask."""
    from mmrl.engine import varlen
    from mmrl.parts import decoder_layers
    from mmrl.positions import pack

    built = _built(layers=2)
    seen = []
    real = varlen.varlen_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get(varlen.SEGMENTS)))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attention", spy)
    packed = pack(built.inputs(sample_conversations(built.adapter)))
    packed.pop("cu_seqlens", None)  # as the engine's packed rows: boundaries from the positions alone
    with torch.no_grad():
        reference = built.model(**packed, use_cache=False).logits  # SDPA, transformers' mask
    layers = decoder_layers(built.model, built.adapter)
    assert len(layers) == 2 and varlen.install(built.model, layers)
    assert varlen.install(built.model, layers)  # idempotent: one hook per layer
    assert sum(len(layer._forward_pre_hooks) for layer in layers) == 2
    written = varlen.varlen_calls()["packed_mask"]
    with torch.no_grad():
        logits = built.model(**packed, use_cache=False).logits  # with no cache transformers reads the boundaries
    # The mask was written by mmrl (`packed_mask`), and on the CPU attention ran SDPA with it.
    assert varlen.varlen_calls()["packed_mask"] == written + 1 and torch.equal(logits, reference)
    assert len(seen) == 2
    for mask, segments in seen:
        expected = varlen.document_segments(mask)
        assert expected is not None and segments is not None
        assert torch.equal(segments[0], expected[0]) and segments[1] == expected[1]


def test_a_compiled_layer_call_may_keep_more_graphs_and_leaves_the_settings_alone():
    """A compiled layer call may keep more graphs per layer forward than dynamo's default 8
    (grad and no grad, one packed row and several, padded and packed) and fails loudly at
    its limit; around it, the user's settings stand."""
    from mmrl.engine.compiled_layers import RECOMPILE_LIMIT, _recompile_limit

    settings = _recompile_limit()
    name = next(iter(settings))
    before = {key: getattr(torch._dynamo.config, key) for key in settings}
    assert settings[name] == max(RECOMPILE_LIMIT, before[name]) >= 64
    assert settings.get("fail_on_recompile_limit_hit", True) is True
    layer = torch.nn.Linear(2, 2)
    layers = CompiledLayers([layer])
    with layers.active():
        layer(torch.randn(3, 2))
        assert getattr(torch._dynamo.config, name) == settings[name]
        with layers.active():  # nested: the same settings, kept when the inner block ends
            layer(torch.randn(3, 2))
        assert getattr(torch._dynamo.config, name) == settings[name]
    assert layers.compiled_calls == 2
    assert {key: getattr(torch._dynamo.config, key) for key in settings} == before


def test_reaching_the_recompile_limit_warns_and_leaves_the_layers_eager(monkeypatch):
    """Past the limit dynamo would run the layers eagerly without a word; here it is a
    compile failure: one warning, eager from then on, the same results."""
    from mmrl.engine import compiled_layers

    monkeypatch.setattr(compiled_layers, "RECOMPILE_LIMIT", 1)
    name = next(iter(compiled_layers._recompile_limit()))
    torch._dynamo.reset()
    layer = torch.nn.Linear(3, 3)
    eager = torch.nn.Linear(3, 3)
    eager.load_state_dict(layer.state_dict())
    inputs = [torch.randn(2, 3), torch.randn(5, 3)]
    # (torch's own patch: monkeypatch's restore would delete the aliased config name; the
    # engine reads the settings when it is built)
    with torch._dynamo.config.patch(**{name: 1}), warnings.catch_warnings(record=True) as caught:
        layers = CompiledLayers([layer])
        warnings.simplefilter("always")
        with layers.active():  # the second without gradients: a second graph (rows are dynamic)
            outs = [layer(x) for x in inputs[:1]]
            with torch.no_grad():
                outs.append(layer(inputs[1]))
    assert layers.compiled_calls == 1 and layers.failed
    assert [str(w.message) for w in caught if "compiled decoder layers" in str(w.message)] == [
        f"compiled decoder layers: off, eager from now on ({layers.failed})"[:300]]
    for x, out in zip(inputs, outs):
        torch.testing.assert_close(out, eager(x))
