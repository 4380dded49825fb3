"""The engine against the plain path: log-probs, LoRA-merged weights, checkpoints."""

import random

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join, token_log_probs
from mmrl.parallel import init_distributed


def test_chunked_log_probs_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (5, 7))
    logp, entropy = token_log_probs(logits, targets, temperature=0.7, chunk_tokens=14)  # 2 rows a chunk
    plain = torch.log_softmax(logits / 0.7, -1)
    expected = plain.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logp, expected, atol=1e-6)
    assert torch.allclose(entropy, -(plain.exp() * plain).sum(-1), atol=1e-5)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    assert torch.allclose(grad, expected_grad, atol=1e-6)


def _sequences(built, response_length=5):
    conversations = sample_conversations(built.adapter)
    prompts = dict(built.processing(conversations))
    torch.manual_seed(1)
    vocab = built.model.config.get_text_config().vocab_size
    responses = torch.randint(50, vocab, (len(conversations), response_length))
    mask = torch.ones_like(responses)
    mask[0, 3:] = 0  # a response that stopped early
    return join(prompts, responses, mask, built.adapter, built.model, built.tokenizer.pad_token_id)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_engine_log_probs_match_a_full_forward(family):
    built = build_model(family, random_init=True)
    engine = Engine(built, init_distributed("cpu"))
    seqs = _sequences(built)
    with torch.no_grad():
        logp, entropy = engine.log_probs(seqs, temperature=1.0)
        full = built.model(**seqs.inputs, use_cache=False).logits.float()
    start = seqs.prompt_length - 1
    plain = torch.log_softmax(full[:, start:start + seqs.response_ids.shape[1]], -1)
    expected = plain.gather(-1, seqs.response_ids.unsqueeze(-1)).squeeze(-1)
    mask = seqs.response_mask.bool()
    assert torch.allclose(logp[mask], expected[mask], atol=1e-4)
    assert entropy.shape == logp.shape


def test_lora_merged_state_dict_matches_merge_and_unload():
    from mmrl.lora import apply_lora, merged_state_dict

    built = build_model("qwen2", random_init=True)
    torch.manual_seed(0)
    peft_model = apply_lora(built.model, scope="language", rank=4, init_lora_weights=False)
    merged = merged_state_dict(peft_model, peft_model.state_dict())
    reference = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def test_checkpoint_round_trip_restores_model_and_optimizer(tmp_path):
    dist = init_distributed("cpu")
    built = build_model("qwen2", random_init=True)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-2), total_steps=10)
    seqs = _sequences(built)
    for _ in range(2):
        logp, _ = engine.log_probs(seqs)
        (-(logp * seqs.response_mask).sum()).backward()
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")

    other = Engine(build_model("qwen2", random_init=True, seed=7), dist, optim=OptimConfig(lr=1e-2), total_steps=10)
    other.load_checkpoint(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(engine.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.equal(a, b), name
    # One more identical step on both keeps them identical (optimizer moments restored).
    for e in (engine, other):
        logp, _ = e.log_probs(seqs)
        (-(logp * seqs.response_mask).sum()).backward()
        e.step()
    for (name, a), (_, b) in zip(engine.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-7), name
    assert engine.lr == other.lr


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", {"attention_dropout": 0.3}),
    ("smolvlm", {"text_config": {"attention_dropout": 0.3}, "vision_config": {"attention_dropout": 0.3}}),
])
def test_training_engine_log_probs_are_deterministic_in_training_mode(family, overrides):
    """Dropout is off in a training engine (rollout, old and reference log-probs have
    none), while the model stays in training mode: two forwards give the same log-probs.
    With `dropout=True` they differ, so the check has teeth."""
    results = {}
    for keep in (False, True):
        built = build_model(family, random_init=True, config_overrides=overrides)
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), dropout=keep)
        assert engine.model.training
        seqs = _sequences(built)
        first, _ = engine.log_probs(seqs)
        second, _ = engine.log_probs(seqs)
        results[keep] = (first - second).abs().max().item()
    assert results[False] == 0.0
    assert results[True] > 1e-4


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_disable_dropout_reaches_modules_attributes_and_configs(name):
    """HF classes with dropout by default (GPT-2: nn.Dropout modules; OPT: float
    probabilities in its layers and LayerDrop) compute the same logits twice in training
    mode once `disable_dropout` ran."""
    import transformers

    from mmrl.engine.engine import disable_dropout

    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                                        vocab_size=64, max_position_embeddings=32, word_embed_proj_dim=32,
                                        layerdrop=0.5, attention_dropout=0.1)
        model = transformers.OPTForCausalLM(config)
    model.train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(model(ids).logits, model(ids).logits)
    changed = disable_dropout(model)
    assert changed and model.training
    assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "qwen2_vl", "gemma3", "smolvlm"])
def test_packed_log_probs_and_gradients_match_the_padded_batch(family):
    """Padding-free log-probs (rows of several whole sequences, positions restarting per
    sequence, 3-D mrope for Qwen-VL; logits only for response tokens) against the padded
    batch: the same log-probs, entropy and gradients (fp32, CPU)."""
    from mmrl.engine.packing import pack_sequences

    results = []
    for pack in (False, True):
        built = build_model(family, random_init=True, seed=0)
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), pack=pack, pack_tokens=250)
        conversations = sample_conversations(built.adapter)
        rows = conversations + conversations[::-1]
        prompts = dict(built.processing(rows))
        vocab = built.model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(1)
        responses = torch.randint(min(50, vocab // 2), vocab, (len(rows), 7), generator=generator)
        mask = torch.ones_like(responses)
        mask[0, 3:] = 0
        mask[2, 5:] = 0
        seqs = join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id)
        assert engine.packs(seqs) == pack
        if pack:  # the budget puts several sequences in a row
            packed = pack_sequences(seqs.inputs, seqs.response_mask, engine.pack_tokens)
            assert len(packed.rows) < len(rows)
        logp, entropy = engine.log_probs(seqs)
        (logp * seqs.response_mask * torch.linspace(-1, 1, 7)).sum().backward()
        grads = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), grads))
    (padded, padded_entropy, padded_grads), (packed_logp, packed_entropy, packed_grads) = results
    real = seqs.response_mask.bool()
    assert torch.allclose(packed_logp[real], padded[real], atol=1e-5)
    assert torch.allclose(packed_entropy[real], padded_entropy[real], atol=1e-5)
    assert (packed_logp[~real] == 0).all()
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_packed_critic_values_and_gradients_match_the_padded_batch(family):
    """The critic packed like the actor (rows of several sequences, per-sequence positions,
    mrope for Qwen2-VL): the same values at real response tokens, zeros elsewhere, and the
    same gradients of a value loss in every parameter, value head included (fp32, CPU)."""
    results = []
    for pack in (False, True):
        built = build_model(family, random_init=True, seed=0)
        engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3), value_head=True, pack=pack,
                        pack_tokens=250)
        conversations = sample_conversations(built.adapter)
        rows = conversations + conversations[::-1]
        prompts = dict(built.processing(rows))
        vocab = built.model.config.get_text_config().vocab_size
        responses = torch.randint(min(50, vocab // 2), vocab, (len(rows), 7), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(responses)
        mask[0, 3:] = 0
        mask[2, 5:] = 0
        seqs = join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id)
        assert engine.packs(seqs) == pack
        values = engine.values(seqs)
        ((values - torch.linspace(-1, 1, 7)).square() * seqs.response_mask).sum().backward()
        named = [*engine.model.named_parameters(), *(("value_head." + n, p) for n, p in engine.value_head.named_parameters())]
        results.append((values.detach(), {n: p.grad for n, p in named if p.grad is not None}))
    (padded, padded_grads), (packed, packed_grads) = results
    real = seqs.response_mask.bool()
    assert torch.allclose(packed[real], padded[real], atol=1e-5)
    assert (packed[~real] == 0).all()
    assert packed_grads.keys() == padded_grads.keys() and any(k.startswith("value_head.") for k in packed_grads)
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_packed_log_probs_with_shared_media_match_the_padded_batch():
    """Packing and shared media encoding together (what the trainer combines)."""
    from mmrl.engine.media import SharedMedia

    built = build_model("qwen2_5_vl", random_init=True, seed=0)
    conversations = sample_conversations(built.adapter)
    owners = [0, 1, 0, 1, 1]
    rows = [conversations[o] for o in owners]
    responses = torch.randint(50, built.model.config.get_text_config().vocab_size, (len(rows), 6),
                              generator=torch.Generator().manual_seed(2))
    prompts = dict(built.processing(rows))
    shared = SharedMedia.of(built.processing, rows, owners)
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id, shared=shared)
    with torch.no_grad():
        plain, _ = Engine(built, init_distributed("cpu"), share_media=False).log_probs(seqs)
        packed, _ = Engine(built, init_distributed("cpu"), pack=True, pack_tokens=300).log_probs(seqs)
    assert torch.allclose(packed, plain, atol=1e-5)


def _document_mask(lengths, width):
    """The boolean (1, 1, T, T) mask transformers makes for sequences packed in one row."""
    document = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    document = torch.cat([document, torch.full((width - len(document),), len(lengths))])
    return ((document[:, None] == document[None, :]) & torch.ones(width, width, dtype=torch.bool).tril())[None, None]


def test_varlen_segments_come_from_document_causal_masks_only():
    from mmrl.engine.varlen import document_segments

    mask = _document_mask([3, 5, 2], 12)
    cu_seqlens, longest = document_segments(torch.cat([mask, _document_mask([12], 12)]))
    assert cu_seqlens.tolist() == [0, 3, 8, 10, 12, 24] and longest == 12
    padded = mask.clone()
    padded[..., 0] = False  # a left-padded row: its first token is seen by nobody
    window = mask & ~torch.ones(12, 12, dtype=torch.bool).tril(-3)  # a 3-token sliding window
    bidirectional = mask.clone()
    bidirectional[0, 0, 4, 6] = True  # a media block seen both ways
    for other in (padded, window, bidirectional, mask.float()):
        assert document_segments(other) is None


def test_varlen_segments_agree_with_comparing_the_whole_mask():
    """The banded check accepts exactly the masks a full comparison accepts: document-causal
    rows, the same with entries flipped anywhere (inside the band, above the diagonal, far
    below it in another sequence), and sliding windows."""
    from bench_scripts import load_bench

    from mmrl.engine.varlen import document_segments

    # The plain check it replaces: compare with the whole expected mask.
    full_comparison = load_bench("packed_mask").full_comparison
    rng = random.Random(0)
    accepted = 0
    for _ in range(400):
        rows, length = rng.choice([1, 1, 2, 3]), rng.randint(1, 40)
        masks = []
        for _ in range(rows):
            lengths, left = [], length
            while left:
                lengths.append(rng.randint(1, left))
                left -= lengths[-1]
            masks.append(_document_mask(lengths, length)[0, 0])
        mask = torch.stack(masks)[:, None].clone()
        kind = rng.random()
        if kind < 0.5:
            for _ in range(rng.randint(1, 2)):
                mask[rng.randrange(rows), 0, rng.randrange(length), rng.randrange(length)] ^= True
        elif kind < 0.6:
            mask &= ~torch.ones(length, length, dtype=torch.bool).tril(-rng.randint(1, 5))
        found = document_segments(mask)
        assert (found is not None) == (full_comparison(mask) is not None)
        accepted += found is not None
    assert 100 < accepted < 300  # both outcomes were exercised


def test_document_mask_is_the_document_causal_mask_of_packed_ids():
    from mmrl.engine.varlen import document_mask

    rng = random.Random(1)
    for _ in range(100):
        rows, length = rng.randint(1, 3), rng.randint(1, 50)
        ids, expected = [], []
        for _ in range(rows):
            lengths, left = [], length
            while left:
                lengths.append(rng.randint(1, left))
                left -= lengths[-1]
            ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
            expected.append(_document_mask(lengths, length))
        mask, (cu_seqlens, longest) = document_mask(torch.stack(ids))
        assert torch.equal(mask, torch.cat(expected))
        sizes = [n for row in ids for n in torch.unique_consecutive(row, return_counts=True)[1].tolist()]
        assert cu_seqlens.tolist() == [0, *torch.tensor(sizes).cumsum(0).tolist()] and longest == max(sizes)
    assert document_mask(torch.tensor([[0, 0, 1, 0]])) is None  # a sequence in two pieces


def test_the_packed_mask_is_transformers_mask_and_is_written_only_for_packed_causal_batches():
    """`packed_mask` (the mask function of "mmrl_varlen") against transformers' SDPA mask on
    the same calls: a packed batch's mask is written by mmrl (and its segments remembered),
    a padded batch's, a sliding window's and a plain causal one's come from transformers."""
    from transformers import Qwen2Config
    from transformers.masking_utils import (AttentionMaskInterface, create_causal_mask,
                                            create_sliding_window_causal_mask)

    from mmrl.engine import varlen

    AttentionMaskInterface.register(varlen.NAME, varlen.packed_mask)
    config = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                         num_hidden_layers=1, sliding_window=3, use_sliding_window=True)
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[0, :3] = 0
    embeds = torch.zeros(2, 10, 8)
    cases = [("packed", create_causal_mask, dict(attention_mask=None, position_ids=packed), True),
             ("padded", create_causal_mask, dict(attention_mask=padding, position_ids=None), False),
             ("sliding", create_sliding_window_causal_mask, dict(attention_mask=None, position_ids=packed), False),
             ("causal", create_causal_mask, dict(attention_mask=None, position_ids=None), False)]
    for name, create, inputs, written in cases:
        masks = {}
        for implementation in ("sdpa", varlen.NAME):
            config._attn_implementation = implementation
            before = varlen.varlen_calls()["packed_mask"]
            masks[implementation] = create(config=config, inputs_embeds=embeds, past_key_values=None, **inputs)
            assert (varlen.varlen_calls()["packed_mask"] > before) == (written and implementation == varlen.NAME), name
        ours, theirs = masks[varlen.NAME], masks["sdpa"]
        assert (ours is None and theirs is None) or torch.equal(ours, theirs), name
        if written:
            segments = varlen._segments(ours)  # remembered, not read back
            assert any(cached is ours for cached, _ in varlen._CACHE)
            assert segments[0].tolist() == [0, 3, 5, 10, 16, 20] and segments[1] == 6


def test_varlen_attention_falls_back_to_sdpa_where_the_kernel_does_not_apply():
    """On CPU (and for any mask that is not document-causal) the installed attention is
    transformers' SDPA: the packed forward's logits do not change."""
    from mmrl.checks import logits_of
    from mmrl.engine import varlen
    from mmrl.positions import pack

    built = build_model("qwen2", random_init=True)
    batch = built.inputs(sample_conversations(built.adapter))
    before = logits_of(built.model, pack(batch))
    calls = varlen.varlen_calls()["sdpa"]
    assert varlen.install(built.model)
    after = logits_of(built.model, pack(batch))
    assert torch.equal(before, after)
    assert varlen.varlen_calls()["sdpa"] > calls


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
@pytest.mark.slow
def test_a_packed_training_step_equals_the_padded_one(tmp_path, advantage):
    """The tiny VLM recipe (mrope, shared media, a KL reference; with GAE a critic too)
    takes the same step with `model.pack=true` as without: packing stays inside the engine."""
    from pathlib import Path

    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml"
    weights = []
    for pack in ("false", "true"):
        trainer = Trainer(load_recipe(recipe, [
            f"trainer.output_dir={tmp_path / pack}", "trainer.steps=1", "trainer.eval_every=0", "trainer.export=false",
            "trainer.progress=false", "data.eval=null", "algo.kl_coef=0.1", f"model.pack={pack}",
            "model.pack_tokens=200", f"algo.advantage={advantage}",
        ]))
        engines = [trainer.actor, trainer.ref] + ([trainer.critic] if advantage == "gae" else [])
        assert all(engine.pack == (pack == "true") for engine in engines)
        trainer.fit()
        weights.append({k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()})
        if trainer.critic is not None:
            weights[-1].update({f"critic.{k}": v.detach().clone() for k, v in trainer.critic.model.state_dict().items()})
            weights[-1].update({f"value_head.{k}": v.detach().clone()
                                for k, v in trainer.critic.value_head.state_dict().items()})
    # One AdamW step moves a weight by about lr (3e-4 here): Adam divides each gradient by
    # its own size, so where a gradient is nearly zero (rare embedding rows) summation-order
    # differences show; 10% of a step bounds them (seen: 1e-5).
    gaps = {name: (weights[1][name] - value).abs().max().item() for name, value in weights[0].items()}
    assert max(gaps.values()) <= 0.1 * 3e-4, max(gaps.items(), key=lambda kv: kv[1])


def test_pack_auto_packs_text_families_on_one_gpu_only():
    """`model.pack: auto` (the default): text families on a GPU in one process; VLMs, the
    CPU and sharded ranks stay padded unless asked; anything else is an error."""
    from mmrl.settle import packs_model as packs_batches
    from mmrl.parallel import Dist
    from mmrl.registry import get_adapter

    def dist(device: str, world: int = 1) -> Dist:
        return Dist(rank=0, world_size=world, local_rank=0, device=torch.device(device), mesh=None)

    text, vlm = get_adapter("qwen2"), get_adapter("qwen2_5_vl")
    assert packs_batches("auto", text, dist("cuda"))
    assert not packs_batches("auto", vlm, dist("cuda"))
    assert not packs_batches("auto", text, dist("cpu"))
    assert not packs_batches("auto", text, dist("cuda", world=2))
    assert packs_batches(True, vlm, dist("cpu")) and not packs_batches(False, text, dist("cuda"))
    with pytest.raises(ValueError, match="pack must be true, false or auto, got 'yes'"):
        packs_batches("yes", text, dist("cpu"))
    built = build_model("qwen2", random_init=True)
    assert not Engine(built, init_distributed("cpu"), pack="auto").pack  # CPU: padded


def test_engine_checkpointing_follows_its_switch_without_walking_the_model(monkeypatch):
    """`Engine.checkpointing` says what the model does (as built, and after
    `enable_checkpointing`), read from the engine's switch: transformers' own flag walks
    every module, and the engine reads it on every pass."""
    built = build_model("qwen2", random_init=True)
    engine = Engine(built, init_distributed("cpu"), optim=OptimConfig(lr=1e-3))
    model_class = type(engine.model)
    walks = []
    flag = model_class.is_gradient_checkpointing

    def counted(model):
        walks.append(1)
        return flag.fget(model)

    monkeypatch.setattr(model_class, "is_gradient_checkpointing", property(counted))
    assert not engine.checkpointing and not engine.model.is_gradient_checkpointing
    walks.clear()
    for _ in range(5):
        assert not engine.checkpointing
    assert walks == []
    engine.enable_checkpointing()
    assert engine.checkpointing and engine.model.is_gradient_checkpointing
    walks.clear()
    assert engine.checkpointing and walks == []
    # A model built with checkpointing on is seen as such.
    built = build_model("qwen2", random_init=True)
    built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert Engine(built, init_distributed("cpu")).checkpointing
