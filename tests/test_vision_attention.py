"""Vision-tower attention in one call per layer (mmrl.engine.vision_attention) against the
plain per-chunk path: the function on random chunks, every zoo VLM's tower and full model
(outputs and gradients), the call counts, and the families it must leave alone. The GPU
test checks the bf16 varlen kernel the same way (`pytest -m gpu tests/test_vision_attention.py`)."""

import inspect

import pytest
import torch

from mmrl import build_model
from mmrl.checks import loss_and_backward, sample_conversations
from mmrl.engine import vision_attention
from conftest import VLM_FAMILIES

# The zoo towers that pack images and take transformers' cu_seqlens branch under flash.
PACKED_TOWERS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FP32 = {"atol": 1e-5, "rtol": 1e-4}


def _per_chunk(query, key, value, cu_seqlens):
    """The plain path: one SDPA call per chunk, (1, H, T, D) -> (1, T, H, D)."""
    bounds = cu_seqlens.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]).transpose(1, 2) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=1)


# Chunks of 3, 1, 7 and 5 tokens (padded to 7), and four equal chunks (no padding).
@pytest.mark.parametrize("bounds", [[0, 3, 4, 11, 16], [0, 4, 8, 12, 16]])
def test_one_call_equals_one_call_per_chunk_with_gradients(bounds):
    torch.manual_seed(0)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    expected = _per_chunk(q, k, v, cu_seqlens)
    grads_expected = torch.autograd.grad(expected.square().sum(), (q, k, v))
    module = torch.nn.Module()
    got, _ = vision_attention.vision_attention(module, q, k, v, None, scaling=8 ** -0.5, is_causal=False,
                                               cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                               max_length_q=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
    assert got.shape == expected.shape == (1, 16, 2, 8)
    torch.testing.assert_close(got, expected, **FP32)
    for g, e in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads_expected):
        torch.testing.assert_close(g, e, **FP32)
    # Chunks that see each other would differ: the chunking is real.
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert (whole - expected).abs().max() > 1e-2


def test_calls_it_cannot_serve_raise_and_calls_without_chunks_are_plain_sdpa():
    q = k = v = torch.randn(1, 2, 6, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError):
        vision_attention.vision_attention(module, q, k, v, None, is_causal=True, cu_seq_lens_q=cu_seqlens)
    with pytest.raises(NotImplementedError):
        vision_attention.vision_attention(module, q, k, v, torch.ones(1, 1, 6, 6, dtype=torch.bool),
                                          cu_seq_lens_q=cu_seqlens)
    module.is_causal = False
    plain, _ = vision_attention.vision_attention(module, q, k, v, None, is_causal=False)
    torch.testing.assert_close(plain, torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2))


def _tensors(output) -> list[torch.Tensor]:
    """Every tensor in an encoder output (tensor, tuple or ModelOutput), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else []
    return [t for value in values for t in _tensors(value)]


def _image_features(model, batch):
    base = model.model
    names = inspect.signature(base.get_image_features).parameters
    return _tensors(base.get_image_features(**{k: v for k, v in batch.items() if k in names}))


class _Counter:
    """Counts torch SDPA calls, vision attention module calls and the chunks those were
    given (`cu_seqlens`), while open."""

    def __init__(self, model, monkeypatch):
        self.sdpa = self.attention_calls = self.chunks = 0
        self.open = True
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.sdpa += self.open
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        self.hooks = [m.register_forward_pre_hook(self._seen, with_kwargs=True) for m in model.modules()
                      if "cu_seqlens" in inspect.signature(type(m).forward).parameters and hasattr(m, "qkv")]
        assert self.hooks, "no vision attention module found"

    def _seen(self, module, args, kwargs):
        cu_seqlens = kwargs.get("cu_seqlens", args[0] if args else None)
        self.attention_calls += 1
        self.chunks += len(cu_seqlens) - 1

    def close(self):
        self.open = False
        for hook in self.hooks:
            hook.remove()


@pytest.mark.parametrize("family", PACKED_TOWERS)
def test_installed_tower_and_model_match_the_plain_path(family, monkeypatch):
    built = build_model(family, random_init=True)
    model = built.model.eval()
    conversations = sample_conversations(built.adapter)  # two images of different sizes
    batch = built.inputs(conversations)

    def run():
        counter = _Counter(model, monkeypatch)
        with torch.no_grad():
            features = _image_features(model, batch)
        counter.close()
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits
        model.zero_grad(set_to_none=True)
        loss = loss_and_backward(built, conversations)
        model.eval()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return features, logits, loss, grads, counter

    plain = run()
    assert vision_attention.install(model) is True
    before = vision_attention.calls()
    installed = run()
    after = vision_attention.calls()

    for got, expected in zip(installed[0], plain[0], strict=True):
        torch.testing.assert_close(got, expected, **FP32)
    torch.testing.assert_close(installed[1], plain[1], **FP32)
    torch.testing.assert_close(installed[2], plain[2], **FP32)
    assert installed[3].keys() == plain[3].keys()
    assert any("visual" in n for n in plain[3]), "no gradient reached the vision tower"
    for name, grad in plain[3].items():
        torch.testing.assert_close(installed[3][name], grad, **FP32, msg=lambda m: f"{name}: {m}")

    plain_counts, counts = plain[4], installed[4]
    # Plain: one SDPA call per chunk, more than one per layer (several images, windows).
    assert plain_counts.sdpa == plain_counts.chunks > plain_counts.attention_calls
    # Installed: one call per attention layer, over the same chunks, padded on CPU.
    assert counts.sdpa == counts.attention_calls == plain_counts.attention_calls
    assert counts.chunks == plain_counts.chunks
    assert after["padded"] > before["padded"] and after["varlen"] == before["varlen"]


def test_installed_tower_under_activation_checkpointing_matches_the_plain_path():
    """Recomputed blocks reach the one-call path again with the same chunks."""
    built = build_model("qwen2_5_vl", random_init=True)
    conversations = sample_conversations(built.adapter)

    def grads():
        built.model.zero_grad(set_to_none=True)
        loss = loss_and_backward(built, conversations)
        return loss, {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}

    plain_loss, plain = grads()
    vision_attention.install(built.model)
    built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = vision_attention.calls()["padded"]
    loss, installed = grads()
    # Forward and recomputation: two calls per vision attention layer.
    assert vision_attention.calls()["padded"] - before == 2 * len(built.model.model.visual.blocks)
    torch.testing.assert_close(loss, plain_loss, **FP32)
    assert installed.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(installed[name], grad, **FP32, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_install_applies_to_packed_towers_only_and_is_idempotent(family):
    built = build_model(family, random_init=True)
    config = built.model.config
    names = {id(c): c._attn_implementation for c in vision_attention._configs(config)}
    applied = vision_attention.install(built.model)
    assert applied is (family in PACKED_TOWERS)
    now = {id(c): c._attn_implementation for c in vision_attention._configs(config)}
    changed = {k for k in names if names[k] != now[k]}
    if not applied:
        assert not changed
        return
    # Only the vision config moved; the text decoder keeps its SDPA.
    assert len(changed) == 1
    assert config.get_text_config()._attn_implementation == "sdpa"
    assert vision_attention.install(built.model) is True
    assert {id(c): c._attn_implementation for c in vision_attention._configs(config)} == now


@pytest.mark.gpu
@pytest.mark.parametrize("family", PACKED_TOWERS)
@pytest.mark.parametrize("mode", ["bf16_weights", "fp32_weights_autocast"])
def test_gpu_varlen_kernel_matches_the_plain_path_in_bf16(family, mode):
    if not torch.cuda.is_available() or not vision_attention.varlen_available():
        pytest.skip("needs CUDA and torch.nn.attention.varlen")
    built = build_model(family, random_init=True, dtype=torch.bfloat16 if mode == "bf16_weights" else None)
    model = built.model.cuda().train()
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in built.inputs(
        sample_conversations(built.adapter)).items()}
    if mode == "bf16_weights":
        batch["pixel_values"] = batch["pixel_values"].bfloat16()

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "bf16_weights"):
            features = _image_features(model, batch)
            loss = sum(t.float().square().mean() for t in features if t.requires_grad)
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return [t.detach().float() for t in features], grads

    plain_features, plain_grads = run()
    assert vision_attention.install(model) is True
    before = vision_attention.calls()
    features, grads = run()
    after = vision_attention.calls()
    assert after["varlen"] > before["varlen"] and after["padded"] == before["padded"]
    # bf16 kernels differ in rounding only: relative errors of a few 1e-3 (a wrong chunking
    # is off by order 1; the CPU tests check exactness in fp32).
    for got, expected in zip(features, plain_features, strict=True):
        assert ((got - expected).norm() / expected.norm()).item() < 2e-2
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        if grad.norm() > 0:
            assert ((grads[name] - grad).norm() / grad.norm()).item() < 5e-2, name
