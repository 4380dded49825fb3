"""The static-cache rollout (`rollout.backend: hf_compiled`, mmrl/rollout/compiled.py) on
tiny random-init models, fp32 on CPU: greedy tokens, finish reasons and log-probs equal
plain `generate`'s for a text family and for VLM families (images in the prefill, mrope
positions after it), also when finished rows are moved out of the batch mid-way and when
the decode step goes through `torch.compile` (dynamo, full graph); sampling follows the
filtered distribution; a model it cannot serve falls back to plain generate with one
warning. The compiled CUDA-graph path and its speed are checked in tests/test_gpu.py.
"""

import warnings

import pytest
import torch
from widened_models import prompt_conversations, widened_engine

from mmrl.rollout import SamplingParams, make_rollout
from mmrl.rollout import compiled
from mmrl.rollout.compiled import choose_tokens, decode_attention


def _assert_same(plain, fast):
    assert fast.response_ids.shape == plain.response_ids.shape
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.response_mask, plain.response_mask)
    assert fast.finish_reasons == plain.finish_reasons
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl", "qwen2_5_vl", "idefics3"])
def test_greedy_tokens_and_logprobs_equal_plain_generate(family, monkeypatch):
    built, engine = widened_engine(family)
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    calls = []
    monkeypatch.setattr(compiled, "decode_attention", lambda *a, **k: calls.append(1) or decode_attention(*a, **k))
    fast = rollout.generate(conversations, params)
    assert rollout.fallback_reason is None
    assert len(calls) >= 11 * engine.model.config.get_text_config().num_hidden_layers  # every decode step used it
    # The continuations are not one token repeated: a wrong position would show.
    assert len(set(plain.response_ids[0].tolist())) > 3
    _assert_same(plain, fast)


def test_decode_steps_take_decode_attention_beside_the_packed_updates_varlen(monkeypatch):
    """An engine that packs its updates on a GPU selects the varlen attention function for
    the model (`mmrl.engine.varlen.install`); the compiled rollout of that same model still
    runs its decode steps through `decode_attention` (before, only an "sdpa" model did, and
    a packed text run's decode steps fell back to SDPA with a mask), and leaves the varlen
    function selected afterwards."""
    from mmrl.engine import varlen
    from mmrl.parts import decoder_layers

    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    assert varlen.install(built.model, decoder_layers(built.model, built.adapter))
    config = built.model.config.get_text_config()
    assert config._attn_implementation == varlen.NAME
    calls = []
    monkeypatch.setattr(compiled, "decode_attention", lambda *a, **k: calls.append(1) or decode_attention(*a, **k))
    fast = make_rollout("hf_compiled", engine, built.processing, compile=False).generate(conversations, params)
    assert len(calls) >= 9 * config.num_hidden_layers
    assert config._attn_implementation == varlen.NAME
    _assert_same(plain, fast)


def _rows_that_stop(family):
    """A widened model, 4 prompts x 4 samples, 24 greedy tokens, and plain generate's output
    with a stop token that the first prompt's rows meet early and some other prompt's never."""
    built, engine = widened_engine(family)
    conversations = prompt_conversations(built, count=4)
    params = SamplingParams(n=4, max_new_tokens=24, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    for candidate in plain.response_ids[0, :6].tolist():
        built.processing.extra_stop_ids = [candidate]
        plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
        if plain.finish_reasons.count("length") >= 4:
            break
    assert plain.finish_reasons[:4] == ["stop"] * 4 and plain.finish_reasons.count("length") >= 4
    return built, engine, conversations, params, plain


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_finished_rows_leave_the_batch_without_changing_the_output(family):
    built, engine, conversations, params, plain = _rows_that_stop(family)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, min_compact_rows=2, check_every=2)
    fast = rollout.generate(conversations, params)
    assert rollout.stats["final_rows"] < 16  # rows were moved into a narrower batch
    _assert_same(plain, fast)


class _Mark:
    """A stand-in for a CUDA event on the CPU: done when the test says so."""

    done_upto = 0
    made = 0
    waits = 0

    def __init__(self):
        _Mark.made += 1
        self.number = _Mark.made

    def record(self):
        pass

    def query(self):
        return self.number <= _Mark.done_upto

    def synchronize(self):
        _Mark.waits += 1


_LOOKOUT = compiled._Lookout


def _queued_lookout(check_every=8, lead=2):
    lookout = _LOOKOUT(torch.device("cpu"), check_every, lead)
    lookout.queued, lookout.event = True, _Mark
    _Mark.done_upto = _Mark.made = _Mark.waits = 0
    return lookout


def test_a_gpu_loop_looks_at_counts_the_device_has_written_waiting_only_past_its_lead():
    """`_Lookout` on a GPU (its events stood in for): a look returns the newest count the
    device has written without waiting, None where none is new, and waits for the oldest
    count only where more than `lead` steps are queued behind it."""
    lookout = _queued_lookout(lead=2)
    running = torch.tensor([True, True, False, True])
    lookout.post(running)  # step 1: 3 running
    assert lookout.alive(running, 2) is None and _Mark.waits == 0  # nothing written yet, no wait
    running[0] = False
    lookout.post(running)  # step 2: 2 running
    _Mark.done_upto = 1
    assert lookout.alive(running, 3) == 3 and _Mark.waits == 1  # step 1's count, written: its wait returns at once
    assert lookout.alive(running, 3) is None  # nothing newer written
    for _ in range(3):
        lookout.post(running)  # steps 3-5, none written: past the lead, the oldest is waited for
    assert lookout.alive(running, 6) == 2 and len(lookout.pending) == 2
    running[:] = False
    lookout.post(running)
    _Mark.done_upto = _Mark.made
    assert lookout.alive(running, 7) == 0 and not lookout.pending
    cpu = _LOOKOUT(torch.device("cpu"), 4, 2)  # the CPU: a look every check_every steps, counted there
    assert cpu.alive(running, 3) is None and cpu.alive(torch.tensor([True, False]), 4) == 1


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_a_loop_that_looks_at_older_counts_gives_the_same_output(family, monkeypatch):
    """The decode loop with the GPU's lookout (counts some steps old, here never written
    before the lead forces a wait) stops, narrows and writes as plain generate."""
    built, engine, conversations, params, plain = _rows_that_stop(family)
    made = []
    monkeypatch.setattr(compiled, "_Lookout", lambda device, check_every, lead: made.append(
        _queued_lookout(check_every, lead)) or made[-1])
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, min_compact_rows=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to plain generate would warn
        fast = rollout.generate(conversations, params)
    assert made and _Mark.waits > 0
    assert rollout.stats["final_rows"] < 16  # rows were moved into a narrower batch on older counts
    _assert_same(plain, fast)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_fp32_weights_under_bf16_autocast_take_the_compiled_path(family):
    """The recipes' precision (fp32 weights, bf16 autocast): rope leaves some families'
    keys in fp32 while values are bf16; the static cache stores both in bf16 (what
    attention reads under autocast) instead of falling back. CPU autocast stands in for
    the GPU's."""
    built, engine = widened_engine(family)
    engine.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fast = rollout.generate(conversations, params)
    assert rollout.fallback_reason is None
    cache = next(iter(rollout.caches.values()))
    assert {layer.keys.dtype for layer in cache.layers} == {torch.bfloat16}
    # bf16 attention kernels round differently (one unit in the last place), and this
    # widened tiny model turns that into another token after a few steps: compare each
    # row up to where the two first differ, which must be at least 3 tokens in.
    same = (fast.response_ids == plain.response_ids).int().cumprod(-1).bool()
    assert int(same.sum(-1).min()) >= 3
    torch.testing.assert_close(fast.logprobs[same], plain.logprobs[same], atol=0.1, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_half_weights_under_autocast_give_the_same_tokens_to_the_bit(family):
    """`half_weights=True` (fp32 weights under bf16 autocast: the linear layers' weights
    cast once per rollout): the same tokens and log-probs, bit for bit, as casting at
    every step; the model's own fp32 parameters are back in place afterwards, and a
    second rollout after a weight change uses the new weights."""
    built, engine = widened_engine(family)
    engine.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)
    own = {name: p for name, p in engine.model.named_parameters()}
    results = {}
    for half in (False, True):
        rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, half_weights=half)
        results[half] = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None
    assert torch.equal(results[True].response_ids, results[False].response_ids)
    assert torch.equal(results[True].logprobs, results[False].logprobs)
    assert rollout._half_store and {p.dtype for p in rollout._half_store.values()} == {torch.bfloat16}
    assert all(p is own[name] for name, p in engine.model.named_parameters())
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # changed weights (as after training steps): the next rollout sees them
        for p in engine.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    changed = rollout.generate(conversations, params)
    reference = make_rollout("hf_compiled", engine, built.processing, compile=False).generate(conversations, params)
    assert torch.equal(changed.response_ids, reference.response_ids)
    assert torch.equal(changed.logprobs, reference.logprobs)
    assert not torch.equal(changed.response_ids, results[True].response_ids)


def test_decode_attention_equals_sdpa_on_grouped_heads():
    """The decode steps' attention (one query per row, grouped key heads, padded rows):
    SDPA's result in fp32; in bf16 no farther from the fp32 result than SDPA is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmrl.rollout.compiled import decode_attention

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 6, 1, 16, generator=generator) * 2
    key, value = torch.randn(2, 4, 2, 40, 16, generator=generator)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[:, ..., 30:] = False  # cache slots not written yet
    mask[1, ..., :7] = False  # a left-padded prompt
    ours, _ = decode_attention(module, query, key, value, mask)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert ours.shape == theirs.shape == (4, 1, 6, 16)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    low = [t.bfloat16() for t in (query, key, value)]
    ours_bf16, _ = decode_attention(module, *low, mask)
    theirs_bf16, _ = sdpa_attention_forward(module, *low, mask)
    assert (ours_bf16.float() - ours).abs().max() <= (theirs_bf16.float() - ours).abs().max()
    # Anything but one query per row goes to SDPA unchanged.
    prompt = torch.randn(4, 6, 5, 16, generator=generator)
    square = torch.ones(4, 1, 5, 40, dtype=torch.bool).tril(30)
    torch.testing.assert_close(decode_attention(module, prompt, key, value, square)[0],
                               sdpa_attention_forward(module, prompt, key, value, square)[0], atol=0, rtol=0)


@pytest.mark.slow
def test_compiled_decode_step_traces_as_one_graph():
    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing,
                           compile_options={"backend": "eager", "fullgraph": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fast = rollout.generate(conversations, params)
    assert rollout.fallback_reason is None
    _assert_same(plain, fast)
    sampled = rollout.generate(conversations, SamplingParams(n=2, max_new_tokens=10, temperature=0.8, top_p=0.9))
    assert sampled.response_ids.shape[0] == 4 and rollout.fallback_reason is None
    engine.model.generation_config.repetition_penalty = 1.8  # the penalty's mask in the graph too
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same(plain, rollout.generate(conversations, params))


def test_sampling_draws_from_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0]).repeat(40000, 1)
    blocked = torch.zeros(6)
    blocked[5] = float("-inf")  # the likeliest token is blocked: never drawn
    stops = torch.tensor([4])
    running = torch.ones(len(logits), dtype=torch.bool)
    running[:10] = False
    tokens, logprobs, still, seen = choose_tokens(logits, running, blocked, stops, pad_id=3, temperature=0.5,
                                                  top_p=0.95, want_logprobs=True)
    assert seen is None
    assert (tokens[:10] == 3).all() and not still[:10].any()
    drawn = tokens[10:]
    # At temperature 0.5 tokens 3 and 4 hold 1.7% of the mass together: top-p 0.95 drops them.
    probs = (torch.tensor([2.0, 1.0, 0.5]) / 0.5).softmax(-1)
    frequencies = torch.bincount(drawn, minlength=6)[:3].float() / len(drawn)
    assert set(drawn.unique().tolist()) == {0, 1, 2}
    torch.testing.assert_close(frequencies, probs, atol=0.01, rtol=0)
    # Log-probs are the raw logits' (temperature 1, nothing blocked).
    raw = logits[0].log_softmax(-1)
    torch.testing.assert_close(logprobs[10:], raw[drawn], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_the_generation_configs_repetition_penalty_is_applied_as_generate_does(family):
    """A checkpoint whose generation config sets `repetition_penalty` (prompt tokens,
    padding and image placeholders included, then each sampled token): the same greedy
    tokens and raw log-probs as plain generate, and other tokens than without it."""
    built, engine = widened_engine(family)
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=0, logprobs=True)
    unpenalized = make_rollout("hf", engine, built.processing).generate(conversations, params)
    engine.model.generation_config.repetition_penalty = 1.8
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    assert not torch.equal(plain.response_ids, unpenalized.response_ids)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False, min_compact_rows=2, check_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fast = rollout.generate(conversations, params)
    _assert_same(plain, fast)


def test_a_generation_config_it_cannot_follow_falls_back_with_one_warning():
    built, engine = widened_engine("qwen2")
    engine.model.generation_config.no_repeat_ngram_size = 2
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    with pytest.warns(UserWarning, match="no_repeat_ngram_size") as caught:
        fast = rollout.generate(conversations, params)
        rollout.generate(conversations, params)
    assert len([w for w in caught if "hf_compiled" in str(w.message)]) == 1
    _assert_same(plain, fast)


def test_an_exports_suppressed_tokens_keep_the_compiled_loop():
    """An mmrl export's generation config suppresses the blocked tokens (mmrl/export.py):
    the loop blocks those anyway, so a run from an export keeps the fast path; a token
    the rollout would not block still falls back."""
    built, engine = widened_engine("qwen2")
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0, logprobs=True)
    engine.model.generation_config.suppress_tokens = built.processing.blocked_token_ids
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same(plain, rollout.generate(conversations, params))
    engine.model.generation_config.suppress_tokens = [*built.processing.blocked_token_ids, 10]
    with pytest.warns(UserWarning, match="suppress_tokens"):
        make_rollout("hf_compiled", engine, built.processing, compile=False).generate(conversations, params)


def test_the_blocked_tokens_mask_is_laid_out_once_per_set_of_ids(monkeypatch):
    """The decode loop's mask of blocked tokens is made once and reused while the blocked
    ids, the vocabulary and the device stay the same (a turn of a multi-turn rollout is a
    call); ids past the vocabulary are left out; new ids make a new mask. Greedy rows with
    every token but a few blocked equal plain generate's."""
    built, engine = widened_engine("qwen2")
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    vocabulary = engine.model.config.get_text_config().vocab_size
    allowed = {5, 7, 11}
    blocked = sorted(set(range(vocabulary + 3)) - allowed)  # three ids past the vocabulary
    monkeypatch.setattr(type(built.processing), "blocked_token_ids", property(lambda self: blocked))
    mask = rollout._blocked_mask(vocabulary, torch.device("cpu"))
    assert mask.shape == (vocabulary,) and sorted(torch.nonzero(mask == 0).flatten().tolist()) == sorted(allowed)
    assert rollout._blocked_mask(vocabulary, torch.device("cpu")) is mask
    assert rollout._blocked_mask(vocabulary - 1, torch.device("cpu")) is not mask
    blocked = blocked[1:]  # id 0 sampled too now
    again = rollout._blocked_mask(vocabulary, torch.device("cpu"))
    assert again is not mask and again[0] == 0 and torch.equal(again[1:], mask[1:])
    conversations = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0, logprobs=True)
    plain = make_rollout("hf", engine, built.processing).generate(conversations, params)
    fast = rollout.generate(conversations, params)
    assert set(fast.response_ids[fast.response_mask.bool()].tolist()) <= allowed | {0}
    _assert_same(plain, fast)


def test_auto_takes_the_compiled_rollout_on_a_gpu_only():
    from types import SimpleNamespace

    from mmrl.parallel import Dist
    from mmrl.rollout import choose_backend

    def engine(device, sharded=False, left_padding=True):
        adapter = SimpleNamespace(left_padding=left_padding, family="fake")
        dist = Dist(rank=0, world_size=2 if sharded else 1, local_rank=0, device=torch.device(device), mesh=None)
        return SimpleNamespace(dist=dist, sharded=sharded, adapter=adapter)

    assert choose_backend("auto", engine("cuda")) == "hf_compiled"
    assert choose_backend("auto", engine("cuda", left_padding=False)) == "hf"
    assert choose_backend("auto", engine("cpu")) == "hf"
    assert choose_backend("auto", engine("cuda", sharded=True)) == "hf_compiled"  # on an inference copy
    assert choose_backend("auto", engine("cuda"), multi_turn=True) == "hf_compiled"
    for named in ("hf", "hf_compiled", "vllm"):
        assert choose_backend(named, engine("cpu")) == named
    built, cpu_engine = widened_engine("qwen2")
    assert type(make_rollout("auto", cpu_engine, built.processing)).__name__ == "HFRollout"


def test_the_recipe_names_the_backend():
    from mmrl.config import load_recipe

    recipe = load_recipe("recipes/tiny_vlm_count.yaml", ["rollout.backend=hf_compiled"])
    assert recipe.rollout.backend == "hf_compiled"
    with pytest.raises(ValueError, match="hf_compiled"):
        make_rollout("hf_fast", None, None)


@pytest.mark.slow
def test_a_spread_of_prompt_lengths_and_widths_compiles_at_most_two_graphs(monkeypatch):
    """Issue 28: rollouts over prompts of many lengths whose rows finish at different steps
    (the loop moves them into narrower batches) trace the decode step at most twice: the
    batch width is dynamic from the first trace, a shorter batch reuses the longest cache
    so far, and a longer one compiles the step once more, after which dynamo treats the
    length as dynamic. Before, each new width and the first new length were one more graph."""
    import random

    from mmrl.compile_watch import watch

    built, engine = widened_engine("qwen2")
    vocabulary = engine.model.config.vocab_size
    built.processing.extra_stop_ids = list(range(0, vocabulary, 12))  # rows stop at different steps
    rollout = make_rollout("hf_compiled", engine, built.processing, min_compact_rows=2, check_every=2,
                           compile_options={"backend": "eager", "fullgraph": True})
    shapes = []
    cache = rollout.static_cache
    monkeypatch.setattr(rollout, "static_cache", lambda rows, length, dtype=None: shapes.append((rows, length))
                        or cache(rows, length, dtype))
    torch._dynamo.reset()  # no shapes remembered from earlier tests' traces of the same step
    w = watch()
    w.take()
    pick = random.Random(0)
    words = "alpha beta gamma delta sea sky tree stone river cloud".split()
    for longest in (60, 120, 200, 300, 100):  # growing prompts (each a longer cache), then a short batch
        conversations = [[{"role": "user", "content": " ".join(pick.choices(words, k=pick.randint(5, longest)))}]
                         for _ in range(3)] + [[{"role": "user", "content": " ".join(pick.choices(words, k=longest))}]]
        rollout.generate(conversations, SamplingParams(n=4, max_new_tokens=24, temperature=1.0))
    assert rollout.fallback_reason is None
    _, graphs = w.take()
    assert len({rows for rows, _ in shapes}) >= 3 and len({length for _, length in shapes}) >= 3, shapes
    assert graphs <= 2


@pytest.mark.slow
def test_a_shorter_batch_reuses_the_longest_compiled_cache():
    """A batch of short prompts after a long one decodes on the long batch's cache (the
    extra positions masked) with the same tokens as on a cache of its own length, and the
    traced step is not traced again."""
    from mmrl.compile_watch import watch

    built, engine = widened_engine("qwen2")
    long = [[{"role": "user", "content": "sea sky " * 200}], [{"role": "user", "content": "tree"}]]
    short = prompt_conversations(built)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0, logprobs=True)
    eager = make_rollout("hf_compiled", engine, built.processing, compile=False).generate(short, params)
    rollout = make_rollout("hf_compiled", engine, built.processing,
                           compile_options={"backend": "eager", "fullgraph": True})
    lengths = []
    cache = rollout.static_cache
    rollout.static_cache = lambda rows, length, dtype=None: lengths.append(length) or cache(rows, length, dtype)
    torch._dynamo.reset()
    w = watch()
    w.take()
    rollout.generate(long, params)
    fast = rollout.generate(short, params)
    assert lengths[0] == lengths[-1] > compiled.CACHE_LENGTH_STEP  # the short batch took the long cache
    assert w.take()[1] == 1
    _assert_same(eager, fast)


def test_each_model_class_has_a_decode_step_of_its_own():
    from mmrl.rollout.compiled import decode_step_for

    class One(torch.nn.Module):
        pass

    class Two(torch.nn.Module):
        pass

    assert decode_step_for(One) is decode_step_for(One)
    assert decode_step_for(One).__code__ is not decode_step_for(Two).__code__
    assert decode_step_for(Two).__name__ == "decode_step_Two"


@pytest.mark.slow
def test_a_process_that_rolls_out_several_model_classes_stays_under_the_recompile_limit():
    """Dynamo counts a code object's compiled entries against one recompile limit and guards
    them on the model's class: with one shared step, the zoo's GPU test fell back to plain
    generate from its 8th family on. Here with a limit of 2 and three classes, each class's
    step keeps its own entries (a shared step fails: three classes need at least three)."""
    config = torch._dynamo.config
    limit = {"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": 2}
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0, logprobs=True)
    for family in ("qwen2", "llama", "mistral"):
        built, engine = widened_engine(family)
        conversations = prompt_conversations(built)
        rollout = make_rollout("hf_compiled", engine, built.processing,
                               compile_options={"backend": "eager", "fullgraph": True})
        with warnings.catch_warnings(), config.patch(**limit):
            warnings.simplefilter("ignore")
            fast = rollout.generate(conversations, params)
        assert rollout.fallback_reason is None, (family, rollout.fallback_reason)
        _assert_same(make_rollout("hf", engine, built.processing).generate(conversations, params), fast)


def test_a_cache_in_autocasts_dtype_stores_in_it_and_is_freed_when_let_go(collector_off):
    """A static cache made for autocast's dtype (fp32 weights under bf16 autocast) stores its
    keys and values in that dtype, and nothing in it refers back to itself: when the rollout
    lets it go (a longer cache replaces it) its tensors are freed at once, not at Python's
    next full collection, which never comes for what a run froze after compiling."""
    import weakref

    built, engine = widened_engine("qwen2")
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    cache = rollout.static_cache(2, 32, torch.bfloat16)
    config = engine.model.config
    shape = (2, config.num_key_value_heads, 3, config.hidden_size // config.num_attention_heads)
    cache.update(torch.ones(shape), torch.ones(shape), 0, {"cache_position": torch.arange(3)})
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.bfloat16 and bool(layer.keys[:, :, :3].eq(1).all())
    from transformers import StaticCache

    plain = StaticCache(config=config, max_cache_len=32).layers[0]
    assert isinstance(layer, type(plain)) and type(layer) is not type(plain)  # the layer's class, subclassed
    assert type(cache.layers[1]) is type(layer)  # one subclass per class and dtype
    keys = weakref.ref(layer.keys)
    with collector_off():
        del cache, layer
        rollout.static_cache(2, 64, torch.bfloat16)  # another length: the pool lets the first go
        assert keys() is None
