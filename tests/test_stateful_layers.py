"""Packed rows for hybrid models (issue 31): each stateful mixer runs one packed sequence a
row (`mmrl.engine.stateful_layers`), so a short sample packed right behind a long one gets
what it gets alone, in fp32 at a tight bound; without it the state leaks.

One tiny transformers model per kind of state: a short convolution (Lfm2, which hands
`seq_idx` to its convolution itself), a Mamba-2 state-space scan (Bamba, through the
layer's keywords) and a gated delta rule (Qwen3.5's linear attention, whose own packed
argument is `cu_seq_lens_q`). Their torch paths ignore those arguments (the CPU stack
here and the GPU image lack the kernels that read them).
"""

from types import SimpleNamespace

import pytest
import torch
import transformers

from mmrl.adapter import DECODER_PARTS
from mmrl.engine import stateful_layers
from mmrl.engine.packing import pack_sequences

TIGHT = 1e-5  # fp32 last hidden states of a sample packed against alone (a tiny head hides a leak in logits)
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {  # (config class, model class, decoder layer class, config values)
    "short_convolution": ("Lfm2Config", "Lfm2ForCausalLM", "Lfm2DecoderLayer",
                          dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1])),
    "state_space": ("BambaConfig", "BambaForCausalLM", "BambaDecoderLayer",
                    dict(mamba_n_heads=2, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16, attn_layer_indices=[1])),
    "gated_delta_rule": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5DecoderLayer",
                         dict(layer_types=["linear_attention", "full_attention"], head_dim=16, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2)),
}
LENGTHS = (40, 9)  # a long neighbour (past the scan's 16-token chunks), then a short sample


def _model(kind: str):
    config_class, model_class, layer_class, extra = CASES[kind]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    adapter = SimpleNamespace(shard_layers=(layer_class,), parts=DECODER_PARTS)
    return model, adapter


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=generator) for n in LENGTHS]


def _packed_row(samples):
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    seq_idx = torch.cat([torch.full((len(s),), i, dtype=torch.int32) for i, s in enumerate(samples)])[None]
    return ids, positions, seq_idx


def _hidden(model, ids, positions, **kwargs) -> torch.Tensor:
    return model.model(ids, position_ids=positions, use_cache=False, **kwargs).last_hidden_state[0]


def _gap(model, samples, packed) -> float:
    worst, start = 0.0, 0
    for sample in samples:
        alone = _hidden(model, sample[None], torch.arange(len(sample))[None])
        worst = max(worst, (packed[start:start + len(sample)] - alone).abs().max().item())
        start += len(sample)
    return worst


@pytest.mark.parametrize("kind", CASES)
@torch.no_grad()
def test_a_packed_sample_equals_itself_alone(kind):
    model, adapter = _model(kind)
    samples = _samples()
    ids, positions, seq_idx = _packed_row(samples)
    leaking = _hidden(model, ids, positions)
    assert _gap(model, samples, leaking) > 100 * TIGHT  # without the per-sequence mixers: the state leaks
    mixers = stateful_layers.install(model, adapter)
    assert len(mixers) == 1 and stateful_layers.installed(model)
    packed = _hidden(model, ids, positions, seq_idx=seq_idx)
    assert _gap(model, samples, packed) < TIGHT
    # Outside a packed forward (no seq_idx: generation, padded batches) the hooks change nothing.
    assert torch.equal(_hidden(model, ids, positions), leaking)


def test_gradients_of_a_packed_row_are_those_of_its_samples_with_checkpointing():
    """Backward through the per-sequence batch, under activation checkpointing (the layer is
    recomputed with the same keywords, so the segments come again)."""
    model, adapter = _model("state_space")
    stateful_layers.install(model, adapter)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    samples = _samples()
    weights = torch.randn(sum(LENGTHS), 64, generator=torch.Generator().manual_seed(2))

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ids, positions, seq_idx = _packed_row(samples)
    packed = grads((model(ids, position_ids=positions, seq_idx=seq_idx).logits[0] * weights).sum())
    alone_loss, start = 0.0, 0
    for sample in samples:
        logits = model(sample[None], position_ids=torch.arange(len(sample))[None]).logits[0]
        alone_loss = alone_loss + (logits * weights[start:start + len(sample)]).sum()
        start += len(sample)
    alone = grads(alone_loss)
    assert packed.keys() == alone.keys() and any("mamba" in n for n in packed)
    for name, grad in packed.items():
        assert torch.allclose(grad, alone[name], atol=1e-4, rtol=1e-4), name


def test_segments_map_several_rows_to_one_sequence_a_row_and_back():
    """Two packed rows of two and one sequences, the first row with an unused tail (its
    last sequence's, as `pack_sequences` writes it)."""
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    segments = stateful_layers.Segments(seq_idx)
    assert (segments.count, segments.longest, segments.separates) == (3, 6, True)
    value = torch.arange(12.0).reshape(2, 6, 1)
    per_sequence = segments.to_sequences(value)
    assert per_sequence[..., 0].tolist() == [[0, 1, 2, 0, 0, 0], [3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11]]
    assert torch.equal(segments.to_packed(per_sequence), value)
    assert not stateful_layers.Segments(torch.zeros(2, 4, dtype=torch.int32)).separates  # a sequence a row


def test_pack_sequences_writes_each_rows_sequence_index():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    inputs = {"input_ids": torch.arange(12).reshape(3, 4) * mask, "attention_mask": mask,
              "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    packed = pack_sequences(inputs, mask[:, :0], row_tokens=7)
    assert packed.rows == [[0, 1], [2]]
    assert packed.seq_idx.tolist() == [[0, 0, 0, 1, 1, 1, 1], [0] * 7]  # row 1's unused tail: its sequence's
    assert stateful_layers.sequence_index(torch.tensor([0, 3, 7, 9]), 9).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2]]


@torch.no_grad()
def test_the_hooks_compile_into_one_graph_outside_packed_forwards():
    """The compiled rollout compiles the whole model with fullgraph: the hooks of a model that
    packs must not break its graph when no seq_idx comes (a decode step, a prefill)."""
    model, adapter = _model("state_space")
    stateful_layers.install(model, adapter)
    ids = _samples()[1][None]
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out = compiled(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    assert torch.allclose(out, model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits)
