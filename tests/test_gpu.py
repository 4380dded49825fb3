"""GPU checks, run on the device machine: `pytest -q -m gpu tests/test_gpu.py`.

bf16 autocast log-probs against fp32 on the same inputs, a short training run on CUDA, and
the compiled static-cache rollout against plain generate.
"""

import pytest
import torch

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.parallel import init_distributed

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "gemma3"])
def test_bf16_autocast_log_probs_match_fp32(family):
    built = build_model(family, random_init=True)
    dist = init_distributed("cuda")
    engine = Engine(built, dist)
    conversations = sample_conversations(built.adapter)
    prompts = dict(built.processing(conversations))
    responses = torch.randint(30, built.model.config.get_text_config().vocab_size, (len(conversations), 6))
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id).to(dist.device)
    with torch.no_grad():
        mixed, _ = engine.log_probs(seqs)
        with torch.autocast("cuda", enabled=False):
            full = built.model(**seqs.inputs, use_cache=False).logits.float()
    start = seqs.prompt_length - 1
    plain = torch.log_softmax(full[:, start:start + 6], -1).gather(-1, seqs.response_ids.unsqueeze(-1)).squeeze(-1)
    assert mixed.dtype == torch.float32
    assert (mixed - plain).abs().max() < 5e-2, "bf16 log-probs drift from fp32"


def test_tiny_recipe_trains_on_cuda(tmp_path):
    from pathlib import Path

    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.steps=3", "trainer.eval_every=0", "trainer.progress=false",
        "data.eval=synthetic:count_shapes?n=16&seed=1",
    ])
    trainer = Trainer(recipe)
    assert trainer.actor.dist.device.type == "cuda"
    summary = trainer.fit()
    assert 0.0 <= summary["eval/accuracy"] <= 1.0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm"])
def test_shared_media_under_bf16_autocast_matches_the_plain_forward(family):
    """Shared media encoding on CUDA with the engine's bf16 autocast: the same log-probs
    as the plain forward (bf16 noise at most), and gradients flow through the shared
    features. The fp32 comparison is the media_sharing probe (`--device cuda`)."""
    from mmrl.engine.media import SharedMedia

    built = build_model(family, random_init=True)
    dist = init_distributed(DEVICE)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-4))
    assert engine.shares_media
    conversations = sample_conversations(built.adapter)
    owners = [0, 1, 0, 1, 1, 0]
    rows = [conversations[o] for o in owners]
    responses = torch.randint(30, built.model.config.get_text_config().vocab_size, (len(rows), 6))
    prompts = dict(built.processing(rows))
    shared = SharedMedia.of(built.processing, rows, owners)
    results = []
    for sharing in (None, shared):
        seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                    built.tokenizer.pad_token_id, shared=sharing).to(dist.device)
        logp, _ = engine.log_probs(seqs)
        logp.sum().backward()
        grad = sum(p.grad.float().norm() ** 2 for p in built.model.parameters() if p.grad is not None) ** 0.5
        built.model.zero_grad(set_to_none=True)
        results.append((logp.detach().float(), float(grad)))
    (plain, plain_grad), (ours, our_grad) = results
    assert (plain - ours).abs().max() < 5e-2
    assert abs(plain_grad - our_grad) <= 5e-2 * plain_grad


def _packing_case(family):
    """A random-init model of `family`, its sample prompts twice (once reversed) and 6 random
    response tokens each: (built, dist, prompts, responses)."""
    built = build_model(family, random_init=True)
    conversations = sample_conversations(built.adapter)
    rows = conversations + conversations[::-1]
    prompts = dict(built.processing(rows))
    responses = torch.randint(30, built.model.config.get_text_config().vocab_size, (len(rows), 6))
    return built, init_distributed(DEVICE), prompts, responses


def _log_probs_and_gradient_norm(engine, seqs):
    """The engine's log-probs (fp32, detached) and the norm of the gradient of their sum,
    which is then dropped."""
    logp, _ = engine.log_probs(seqs)
    logp.sum().backward()
    model = engine.model
    grad = sum(p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
    model.zero_grad(set_to_none=True)
    return logp.detach().float(), float(grad)


@pytest.mark.parametrize("family, causal_text", [("qwen2", True), ("qwen2_5_vl", True), ("gemma3", False)])
def test_packed_log_probs_under_bf16_autocast_match_the_padded_batch(family, causal_text):
    """Padding-free log-probs on CUDA (bf16 autocast; the flash varlen kernel where the
    packed-sequence mask transformers derives from the position ids is document-causal,
    SDPA elsewhere, e.g. Gemma 3's bidirectional image blocks) against the padded batch:
    bf16 noise at most, and gradients of the same size. The exact fp32 comparison is
    tests/test_engine.py."""
    from mmrl.engine.varlen import varlen_calls

    built, dist, prompts, responses = _packing_case(family)
    results = []
    for pack in (False, True):
        calls = varlen_calls()["varlen"]
        # Eager layers: the compiled ones are the next test's (the counter counts eager calls).
        engine = Engine(built, dist, optim=OptimConfig(lr=1e-4), pack=pack, pack_tokens=250, compile_layers=False)
        seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                    built.tokenizer.pad_token_id).to(dist.device)
        assert engine.packs(seqs) == pack
        results.append(_log_probs_and_gradient_norm(engine, seqs))
        if causal_text:  # a causal text decoder runs packed rows through the varlen kernel
            assert (varlen_calls()["varlen"] > calls) == pack
    (padded, padded_grad), (packed, packed_grad) = results
    assert (padded - packed).abs().max() < 5e-2
    assert abs(padded_grad - packed_grad) <= 5e-2 * padded_grad


def test_kept_head_outputs_on_cuda_give_the_recomputed_update(monkeypatch):
    """One GPU process without checkpointing keeps the chunked head's outputs for the
    backward (`Engine.head_keep_bytes`); the log-probs and gradients equal those of
    recomputing them (keeping nothing), and the packed mask was written by mmrl."""
    import mmrl.engine.engine as engine_module
    from mmrl.engine.varlen import varlen_calls

    built, dist, prompts, responses = _packing_case("qwen2")
    results = []
    for share in (engine_module.HEAD_KEEP_SHARE, 2**62):  # 2**62: nothing kept
        monkeypatch.setattr(engine_module, "HEAD_KEEP_SHARE", share)
        engine = Engine(built, dist, optim=OptimConfig(lr=1e-4), pack=True, pack_tokens=250, compile_layers=False)
        assert (engine.head_keep_bytes > 0) == (share != 2**62)
        seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                    built.tokenizer.pad_token_id).to(dist.device)
        written = varlen_calls()["packed_mask"]
        logp, _ = engine.log_probs(seqs)
        logp.sum().backward()
        grads = {name: p.grad.clone() for name, p in built.model.named_parameters() if p.grad is not None}
        built.model.zero_grad(set_to_none=True)
        results.append((logp.detach(), grads))
        assert varlen_calls()["packed_mask"] > written
    (kept, kept_grads), (recomputed, recomputed_grads) = results
    assert torch.equal(kept, recomputed)
    assert kept_grads.keys() == recomputed_grads.keys()
    for name, grad in kept_grads.items():
        assert torch.allclose(grad, recomputed_grads[name], rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_compiled_layers_on_cuda_match_the_eager_packed_update(family):
    """Packed rows through the varlen kernel with the decoder layers compiled (the engine's
    default here) against the same engine's eager layers: bf16 noise at most, gradients of
    the same size, the kernel inside the compiled graph and no graph break."""
    from torch._dynamo.utils import counters

    from mmrl.engine.varlen import varlen_calls

    torch._dynamo.reset()
    counters.clear()
    built, dist, prompts, responses = _packing_case(family)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-4), pack=True, pack_tokens=250)
    assert engine.varlen and engine.compiled_layers is not None
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id).to(dist.device)
    results = []
    for compiled in (False, True, True):  # the second compiled pass: no recompile
        engine.compiled_layers.enabled = compiled
        calls = varlen_calls()["varlen"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            results.append(_log_probs_and_gradient_norm(engine, seqs))
        # The kernel ran (inside the compiled graph the eager counter does not count).
        assert any("varlen_attn" in event.name for event in profile.events())
        assert (varlen_calls()["varlen"] > calls) == (not compiled)
    (eager, eager_grad), (ours, our_grad), _ = results
    assert engine.compiled_layers.failed is None and engine.compiled_layers.compiled_calls > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    engine.log_probs(seqs)
    assert counters["stats"]["unique_graphs"] == graphs  # the same inputs again: no recompile
    assert (eager - ours).abs().max() < 5e-2
    assert abs(eager_grad - our_grad) <= 5e-2 * eager_grad


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "gemma3"])
def test_compiled_layers_on_cuda_match_the_eager_padded_update(family):
    """Padded rows (no packing) with the decoder layers compiled, the engine's default on a
    GPU, against the same engine's eager layers: bf16 noise at most, gradients of the same
    size, no graph break, no recompile on the same inputs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    built, dist, prompts, responses = _packing_case(family)
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-4))
    assert engine.compiled_layers is not None and not engine.pack
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id).to(dist.device)
    results = []
    for compiled in (False, True):
        engine.compiled_layers.enabled = compiled
        results.append(_log_probs_and_gradient_norm(engine, seqs))
    (eager, eager_grad), (ours, our_grad) = results
    assert engine.compiled_layers.failed is None and engine.compiled_layers.compiled_calls > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    engine.log_probs(seqs)
    assert counters["stats"]["unique_graphs"] == graphs
    assert (eager - ours).abs().max() < 5e-2
    assert abs(eager_grad - our_grad) <= 5e-2 * eager_grad


def test_one_process_engine_steps_with_fused_adamw_like_the_plain_one():
    """On a GPU in one process the engine's AdamW is the fused kernel; its step from the same
    gradients matches torch's default (foreach) AdamW on a copy of the same parameters."""
    built, dist, prompts, responses = _packing_case("qwen2")
    engine = Engine(built, dist, optim=OptimConfig(lr=1e-3, weight_decay=0.1))
    assert engine.optimizer.defaults["fused"] is True
    seqs = join(prompts, responses, torch.ones_like(responses), built.adapter, built.model,
                built.tokenizer.pad_token_id).to(dist.device)
    groups = engine.optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    copy_of = {id(p): p.detach().clone().requires_grad_(True) for p in params}
    copies = [copy_of[id(p)] for p in params]
    plain = torch.optim.AdamW([{"params": [copy_of[id(p)] for p in group["params"]],
                                "weight_decay": group["weight_decay"], "betas": group["betas"]} for group in groups])
    for _ in range(2):
        logp, _ = engine.log_probs(seqs)
        logp.sum().backward()
        for p, c in zip(params, copies):
            c.grad = None if p.grad is None else p.grad.clone()
        torch.nn.utils.clip_grad_norm_(copies, engine.grad_clip)
        for mine, theirs in zip(plain.param_groups, groups):
            mine["lr"] = theirs["lr"]  # the engine's schedule
        plain.step()
        engine.step()
    assert max((p.detach() - c.detach()).abs().max().item() for p, c in zip(params, copies)) < 1e-5


def test_varlen_attention_matches_sdpa_with_the_document_mask():
    """The varlen kernel against transformers' SDPA function on the same packed rows and
    document-causal mask (GQA heads, bf16): outputs and input gradients."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmrl.engine.varlen import varlen_attention, varlen_calls

    torch.manual_seed(0)
    segments = [[40, 100, 20, 96], [256]]
    width = 256
    documents = []
    for lengths in segments:
        document = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        documents.append(torch.cat([document, torch.full((width - len(document),), len(lengths))]))
    document = torch.stack(documents).to(DEVICE)
    causal = torch.ones(width, width, dtype=torch.bool, device=DEVICE).tril()
    mask = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 4
    shapes = [(2, 8, width, 64), (2, 2, width, 64), (2, 2, width, 64)]
    inputs = [torch.randn(s, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    outputs = []
    for attention in (sdpa_attention_forward, varlen_attention):
        out, _ = attention(module, *inputs, mask, scaling=0.125)
        grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, 64, device=DEVICE)).sum(), inputs)
        outputs.append((out.float(), [g.float() for g in grads]))
    (plain, plain_grads), (ours, our_grads) = outputs
    assert varlen_calls()["varlen"] > 0
    assert (plain - ours).abs().max() < 2e-2
    for a, b in zip(plain_grads, our_grads):
        assert (a - b).abs().max() < 5e-2 * max(1.0, a.abs().max().item())


def test_token_budget_micro_batches_on_cuda_match_the_row_micro_batches(tmp_path):
    """The tiny VLM recipe's first update on CUDA (bf16 autocast; packed rows through the
    varlen kernel) by token budget against one micro-batch of rows: the same rollout, and
    loss and gradient norm equal up to bf16 noise. The fp32 comparison is tests/test_trainer.py."""
    from pathlib import Path

    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    runs = []
    for name, extra in (("rows", []), ("tokens", ["algo.micro_batch_tokens=64", "model.pack=true",
                                                  "model.pack_tokens=64"])):
        trainer = Trainer(load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
            f"trainer.output_dir={tmp_path / name}", "trainer.steps=1", "trainer.eval_every=0",
            "trainer.progress=false", "trainer.export=false", "data.eval=null", "data.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "model.tiny_vocabulary={}",
            "reward.name=test_trainer:length_reward", "reward.options={}", *extra]))
        norms = []
        step = trainer.actor.step
        trainer.actor.step = lambda: (norms.append(float(sum(p.grad.float().norm() ** 2 for p in
                                                               trainer.actor.model.parameters()
                                                               if p.grad is not None) ** 0.5)), step())[1]
        metrics = trainer.train_step()
        runs.append((metrics, norms[0]))
    (rows, rows_norm), (tokens, tokens_norm) = runs
    assert rows["update/micro_batches"] == 1 and tokens["update/micro_batches"] > 1
    assert tokens["reward/mean"] == rows["reward/mean"]
    assert abs(tokens["loss/policy"] - rows["loss/policy"]) <= 5e-2 * max(abs(rows["loss/policy"]), 1e-3)
    assert abs(tokens_norm - rows_norm) <= 5e-2 * rows_norm


def test_compiled_rollout_on_cuda_equals_plain_generate():
    """`rollout.backend: hf_compiled` on CUDA (inductor + CUDA graphs) with a 0.5B-shaped
    Qwen2 (random init, 152k vocabulary) in fp32: plain generate's greedy tokens, finish
    reasons and log-probs, from the compiled graph (no fallback), twice (the second call
    replays the captured graph on the kept cache). Speed: bench/rollout_speed.py."""
    from mmrl.rollout import SamplingParams, make_rollout

    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936)
    with torch.device(DEVICE):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape)
    engine = Engine(built, init_distributed(DEVICE), mixed_precision=False)
    conversations = [[{"role": "user", "content": text}] for text in
                     ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
    params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing)
    for _ in range(2):
        fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None
        assert torch.equal(fast.response_ids, plain.response_ids)
        assert fast.finish_reasons == plain.finish_reasons
        torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-3, rtol=0)


def test_decode_attention_on_cuda_reads_a_bf16_cache_as_sdpa_does():
    """On CUDA the decode attention multiplies the bf16 cache as stored (fp32 results, no
    fp32 copy): eager and compiled, no farther from the fp32 result than SDPA's bf16
    kernels are (within a factor of 2), with padded rows and unwritten cache slots."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmrl.rollout.compiled import _low_precision_products, decode_attention

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 7
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    query = torch.randn(64, 14, 1, 64, generator=generator, device=DEVICE) * 2
    key, value = torch.randn(2, 64, 2, 512, 64, generator=generator, device=DEVICE)
    mask = torch.ones(64, 1, 1, 512, dtype=torch.bool, device=DEVICE)
    mask[..., 300:] = False
    mask[::3, ..., :40] = False
    exact, _ = sdpa_attention_forward(module, query, key, value, mask)
    low = [t.bfloat16() for t in (query, key, value)]
    assert _low_precision_products(low[0], torch.bfloat16)
    theirs = (sdpa_attention_forward(module, *low, mask)[0].float() - exact).abs().max()
    compiled = torch.compile(decode_attention, fullgraph=True)
    for attend in (decode_attention, compiled):
        ours, _ = attend(module, *low, mask)
        assert ours.dtype == torch.bfloat16 and ours.shape == exact.shape
        assert (ours.float() - exact).abs().max() <= 2 * theirs, ((ours.float() - exact).abs().max(), theirs)


def test_compiled_rollout_on_cuda_in_bf16_follows_plain_generate():
    """bf16 weights, the compiled graph (no fallback): greedy rows follow plain generate's
    tokens until bf16 rounding first picks another token (kernels round differently), at
    least 4 tokens in every row (7-23 on the H200), with log-probs within bf16 tolerance up to there."""
    from mmrl.rollout import SamplingParams, make_rollout

    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936)
    with torch.device(DEVICE):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, dtype="bfloat16")
    engine = Engine(built, init_distributed(DEVICE))
    conversations = [[{"role": "user", "content": text}] for text in
                     ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
    params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing)
    fast = rollout.generate(conversations, params)
    assert rollout.fallback_reason is None
    same = (fast.response_ids == plain.response_ids).int().cumprod(-1).bool()
    assert int(same.sum(-1).min()) >= 4, same.sum(-1)  # a wrong attention parts at token 1
    torch.testing.assert_close(fast.logprobs[same], plain.logprobs[same], atol=0.1, rtol=0)


def test_half_weights_on_cuda_give_the_tokens_of_per_step_casting():
    """fp32 weights under the engine's bf16 autocast, compiled with CUDA graphs: casting the
    linear layers once per rollout (`half_weights=True`) gives the greedy tokens of casting
    them at every step, and log-probs within bf16 rounding; twice (the second call replays
    the graph on the refreshed copies). Speed: bench/rollout_speed.py (--no-half-weights for per-step casting)."""
    from mmrl.rollout import SamplingParams, make_rollout

    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936)
    with torch.device(DEVICE):
        built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape)
    engine = Engine(built, init_distributed(DEVICE))
    conversations = [[{"role": "user", "content": text}] for text in
                     ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
    params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
    per_step_rollout = make_rollout("hf_compiled", engine, built.processing, half_weights=False)
    per_step = per_step_rollout.generate(conversations, params)
    assert not per_step_rollout._half_store
    rollout = make_rollout("hf_compiled", engine, built.processing)  # half_weights is the default
    for _ in range(2):
        once = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None and rollout._half_store
        assert torch.equal(once.response_ids, per_step.response_ids)
        torch.testing.assert_close(once.logprobs, per_step.logprobs, atol=1e-3, rtol=0)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}


@pytest.mark.parametrize("decode", ["compiled", "graphs"])
def test_merged_projections_on_cuda_give_the_tokens_of_separate_products(decode):
    """The decode steps' merged q/k/v and gate/up products (`rollout.merge_projections`,
    mmrl/rollout/merged.py) on CUDA, through each decode mode's graphs: in fp32 the greedy
    tokens of separate products and log-probs within 1e-4; in bf16 weights ("auto" merges
    there) each row agrees for at least 8 tokens, log-probs within bf16 rounding where they
    agree, twice (the second call replays on the refreshed merged weights)."""
    from mmrl.rollout import SamplingParams, make_rollout

    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936)
    conversations = [[{"role": "user", "content": text}] for text in
                     ("What is it?", "And this one here, a longer one?", "no", "Say something about the sea")]
    params = SamplingParams(n=2, max_new_tokens=32, temperature=0, logprobs=True)
    for dtype in ("float32", "bfloat16"):
        with torch.device(DEVICE):
            built = build_model("qwen2", random_init=True, seed=0, config_overrides=shape, dtype=dtype)
        engine = Engine(built, init_distributed(DEVICE))
        separate = make_rollout("hf_compiled", engine, built.processing, decode=decode, merge_projections=False)
        reference = separate.generate(conversations, params)
        merged = make_rollout("hf_compiled", engine, built.processing, decode=decode,
                              merge_projections=True if dtype == "float32" else "auto")
        for _ in range(2):
            out = merged.generate(conversations, params)
            assert merged.fallback_reason is None and merged.stats["merged_groups"] == 2 * 4
            if dtype == "float32":
                assert torch.equal(out.response_ids, reference.response_ids)
                torch.testing.assert_close(out.logprobs, reference.logprobs, atol=1e-4, rtol=0)
            else:
                same = (out.response_ids == reference.response_ids).int().cumprod(-1).bool()
                assert int(same.sum(-1).min()) >= 8, same.sum(-1)
                torch.testing.assert_close(out.logprobs[same], reference.logprobs[same], atol=5e-2, rtol=0)
        del engine, built, separate, merged
        torch.cuda.empty_cache()


def test_compile_helper_fills_the_cache_the_first_update_reads(tmp_path, monkeypatch):
    """The compile helper (mmrl/prewarm.py) runs the recipe with one decoder layer; the run's
    first step (two layers, rollout uncompiled) then compiles nothing that is not in the cache."""
    from pathlib import Path

    from mmrl.compile_watch import cache_counts
    from mmrl.config import load_recipe
    from mmrl.trainer import Trainer

    torch._dynamo.reset()  # no compiled layer code kept from an earlier test: it would serve without the cache
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("MMRL_COMPILE_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false",
        "data.validation=null", "data.eval=null", "data.train=synthetic:count_shapes?n=64&seed=0&image_size=56",
        "model.compile_layers=true", "rollout.backend=hf", "model.compile_prewarm=auto",
    ])
    trainer = Trainer(recipe)
    assert trainer.compile_helper is not None
    # A run updates eagerly while the helper is at work; here it is joined before the step,
    # so that the step's graphs (the media check's log-prob graph too) are the helper's.
    trainer.compile_helper.join()
    assert trainer.compile_helper.outcome == "done", trainer.compile_helper.log.read_text()[-2000:]
    before = cache_counts()
    trainer.train_step()
    hits, misses = (after - b for after, b in zip(cache_counts(), before))
    assert trainer.actor.compiled_layers.compiled_calls > 0
    assert hits > 0 and misses == 0, (hits, misses)
    # the run's first update marks the recipe: the next run starts no helper
    again = Trainer(recipe.model_copy(update={"trainer": recipe.trainer.model_copy(
        update={"output_dir": str(tmp_path / "again")})}))
    assert again.compile_helper is None


def _helper_recipe(tmp_path, monkeypatch):
    """The tiny VLM recipe with compiled layers and the compile helper, its compile cache empty
    under `tmp_path`; dynamo reset, so no compiled layer code kept from an earlier test serves
    without the cache."""
    from pathlib import Path

    from mmrl.config import load_recipe

    torch._dynamo.reset()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("MMRL_COMPILE_CACHE", str(tmp_path / "cache"))
    return load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.eval_every=0", "trainer.progress=false",
        "data.validation=null", "data.eval=null", "data.train=synthetic:count_shapes?n=64&seed=0&image_size=56",
        "model.compile_layers=true", "rollout.backend=hf", "model.compile_prewarm=auto", "trainer.media_check=false",
    ])


def test_a_run_updates_eagerly_while_its_compile_helper_works_then_compiles_from_its_cache(tmp_path, monkeypatch):
    """The run does not wait for the compile helper (mmrl/prewarm.py): a step while it is at
    work compiles nothing for its update (the layers' eager forwards); once it is done, the next step
    compiles the update's graphs, finding them in the cache, and marks the recipe."""
    from mmrl.compile_watch import cache_counts
    from mmrl.trainer import Trainer

    recipe = _helper_recipe(tmp_path, monkeypatch)
    trainer = Trainer(recipe)
    helper = trainer.compile_helper
    assert helper is not None and helper.pending()  # just started: a step now does not wait for it
    layers = trainer.actor.compiled_layers
    first = trainer.train_step()
    assert first.get("compile/helper_pending") == 1.0
    assert layers.compiled_calls == 0  # the update's layers ran eagerly
    helper.join()
    assert helper.outcome == "done", helper.log.read_text()[-2000:]
    before = cache_counts()
    second = trainer.train_step()
    hits, misses = (after - b for after, b in zip(cache_counts(), before))
    assert "compile/helper_pending" not in second and layers.compiled_calls > 0 and layers.failed is None
    assert hits > 0 and misses == 0, (hits, misses)
    again = Trainer(recipe.model_copy(update={"trainer": recipe.trainer.model_copy(
        update={"output_dir": str(tmp_path / "again")})}))
    assert again.compile_helper is None  # marked by the first compiled update


def test_checkpointing_an_eager_oom_turned_on_goes_off_and_the_layers_compile_on_cuda(tmp_path, monkeypatch, capsys):
    """An eager update beside the compile helper that runs out of memory (simulated) is redone
    with checkpointing; at the first step after the helper, checkpointing goes off and the
    update's layers run compiled, as on the H200's geometry3k rows where it stayed on for good."""
    from mmrl.trainer import Trainer

    recipe = _helper_recipe(tmp_path, monkeypatch)
    trainer = Trainer(recipe)
    helper = trainer.compile_helper
    assert helper is not None and helper.pending() and not trainer.actor.checkpointing
    layers, log_probs, passes = trainer.actor.compiled_layers, trainer.actor.log_probs, []

    def short_of_memory(*args, **kwargs):
        if torch.is_grad_enabled():
            passes.append(trainer.actor.checkpointing)
            if len(passes) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return log_probs(*args, **kwargs)

    trainer.actor.log_probs = short_of_memory
    first = trainer.train_step()
    assert first.get("compile/helper_pending") == 1.0 and passes[:2] == [False, True] and trainer.actor.checkpointing
    assert layers.compiled_calls == 0
    helper.join()
    second = trainer.train_step()
    assert "compile/helper_pending" not in second and not trainer.actor.checkpointing and not passes[-1]
    assert layers.compiled_calls > 0 and layers.failed is None
    assert "activation checkpointing off again" in capsys.readouterr().out


def _one_step_recipe(tmp_path, monkeypatch):
    """The tiny VLM recipe for one step with compiled layers and plain generate, its compile
    cache empty under `tmp_path`."""
    from pathlib import Path

    from mmrl.config import load_recipe

    monkeypatch.setenv("MMRL_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=1", "trainer.eval_every=0", "trainer.progress=false",
        "data.validation=null", "data.eval=null", "model.compile_layers=true", "rollout.backend=hf"])


def test_compile_workers_start_before_the_model_build_on_cuda(tmp_path, monkeypatch):
    """A run that compiles on a GPU starts inductor's compile workers before its model build
    (`mmrl.compile_watch.start_compile_workers`), so the pool is ready by the first compile,
    and reads the CUDA libraries ahead before that (`mmrl.page_cache`); its step trains as before."""
    import mmrl.trainer as trainer_module
    from mmrl.trainer import Trainer

    order = []
    real_start, real_build, real_read = trainer_module.start_compile_workers, Trainer._build, trainer_module.read_ahead
    monkeypatch.setattr(trainer_module, "start_compile_workers", lambda: order.append("workers") or real_start())
    monkeypatch.setattr(trainer_module, "read_ahead",
                        lambda paths: order.append(("read", any("cuda" in p.name for p in paths))) or real_read(paths))
    monkeypatch.setattr(Trainer, "_build", lambda self: order.append("build") or real_build(self))
    recipe = _one_step_recipe(tmp_path, monkeypatch)
    trainer = Trainer(recipe)
    assert order == [("read", True), "workers", "build"]  # the CUDA libraries read ahead too (mmrl/page_cache.py)
    from torch._inductor.async_compile import AsyncCompile

    assert AsyncCompile._ready_future is not None
    trainer.train_step()
    assert trainer.actor.compiled_layers.compiled_calls > 0 and trainer.compile_watch.take()[1] > 0


def test_the_update_graphs_compile_in_the_background_during_the_build_on_cuda(tmp_path, monkeypatch):
    """With `MMRL_COMPILE_AHEAD=all`, a GPU run compiles its update's graphs in a thread while
    its model builds (`mmrl.compile_ahead`: the chunked head's arithmetic, the decoder layer's forward and
    backward on an empty one-layer model): they compile there, counted apart, and the run's
    first step compiles none of them itself; the step trains."""
    import threading
    import mmrl.compile_watch as compile_watch
    from mmrl.engine import logprobs
    from mmrl.trainer import Trainer

    compiled = []  # (thread, function) of every compile
    real = compile_watch.compiling_code
    monkeypatch.setattr(compile_watch, "compiling_code",
                        lambda: compiled.append((threading.get_ident(), real())) or compiled[-1][1])
    for function in (logprobs._stats, logprobs._raw_grad):
        function.state.clear()
    torch._dynamo.reset()
    monkeypatch.setenv("MMRL_COMPILE_AHEAD", "all")
    recipe = _one_step_recipe(tmp_path, monkeypatch)
    trainer = Trainer(recipe)
    main = threading.get_ident()
    ahead = [str(name) for thread, name in compiled if thread != main]
    update_graphs = ("_stats", "_raw_grad", "DecoderLayer.forward")
    for name in update_graphs:
        assert any(name in each for each in ahead), (name, ahead)
    assert trainer.compile_watch.background_graphs >= 3
    compiled.clear()
    weights = [p.detach().clone() for p in trainer.actor.model.parameters() if p.requires_grad][:4]
    trainer.train_step()
    in_step = [str(name) for _, name in compiled]
    assert not any(name in each for each in in_step for name in update_graphs), in_step
    assert trainer.actor.compiled_layers.compiled_calls > 0
    assert any(not torch.equal(w, p) for w, p in
               zip(weights, [p for p in trainer.actor.model.parameters() if p.requires_grad][:4]))
