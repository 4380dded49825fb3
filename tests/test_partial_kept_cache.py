"""Partial rollouts on the compiled rollout's kept cache (mmrl/buffer/partial.py over
mmrl/rollout/sessions.py), tiny qwen2 in fp32, the decode loop run eagerly: with the
weights unchanged, rounds continued on each response's kept cache row give the tokens and
log-probs of one uninterrupted generation and of the re-prefill path, while a carried
response prefills only its last sampled token (text, and images with mrope positions
on the tiny Qwen2-VL); with the weights changed between rounds,
the continued response reads the older weights' keys and values (a plain forward over a
cache the old weights filled gives its log-probs; re-prefilling gives others); a run
trains on the kept cache; where the cache cannot be kept the rounds re-prefill and say
why in one line."""

import torch

from mmrl.buffer.partial import kept_cache_session
from mmrl.config import load_recipe
from mmrl.evaluation import conversations_of
from mmrl.rollout.base import SamplingParams
from mmrl.rollout.compiled import CompiledHFRollout
from mmrl.rollout.sessions import session_for
from mmrl.trainer import Trainer
from test_buffer import REPO, _rows, _weights
from test_partial_rollouts import FIXED, PARTIAL, _recipe, _responses, _sharpen

ROUND = 3  # tokens per round
LONGEST = 10  # tokens per response


def _setup(tmp_path):
    trainer = Trainer(_recipe(tmp_path / "run", f"rollout.max_new_tokens={LONGEST}"))
    rollout = CompiledHFRollout(trainer.actor, trainer.processing, compile=False)
    samples = [trainer.train_set[i] for i in range(6)]
    conversations = conversations_of(samples, list(range(6)), trainer.train_set, "test")
    _sharpen(trainer)
    return trainer, rollout, conversations


def _in_rounds(conversations, continue_round, joining=3):
    """Rounds of ROUND tokens as `mmrl.buffer.partial` runs them, conversations
    `joining` and on entering at the second round (new prompts beside carried ones):
    each response's tokens, log-probs and finish reason."""
    count = len(conversations)
    tokens, logprobs, reasons = [[] for _ in range(count)], [[] for _ in range(count)], [None] * count
    rounds = 0
    while None in reasons:
        entered = joining if rounds == 0 else count
        active = [i for i in range(entered) if reasons[i] is None]
        part = continue_round(active, [conversations[i] for i in active], [list(tokens[i]) for i in active])
        for row, i in enumerate(active):
            made = int(part.response_mask[row].sum())
            kept = min(made, LONGEST - len(tokens[i]))
            tokens[i] += part.response_ids[row, :kept].tolist()
            logprobs[i] += part.logprobs[row, :kept].tolist()
            if part.finish_reasons[row] == "stop" and kept == made:
                reasons[i] = "stop"
            elif len(tokens[i]) == LONGEST:
                reasons[i] = "length"
        rounds += 1
    return tokens, logprobs, reasons


def _greedy(new_tokens):
    return SamplingParams(max_new_tokens=new_tokens, temperature=0, logprobs=True)


def test_kept_cache_rounds_are_the_one_round_generation_and_the_reprefill_rounds(tmp_path):
    trainer, rollout, conversations = _setup(tmp_path)
    whole = rollout.generate(conversations, _greedy(LONGEST))
    lengths = whole.response_mask.sum(-1).long().tolist()
    assert sorted(lengths)[0] < ROUND and sorted(lengths)[-1] == LONGEST  # some stop in round 1, some run out
    session = session_for(rollout, reserve=LONGEST)
    calls = []

    def kept(active, asked, prefixes):
        calls.append((list(active), [len(p) for p in prefixes]))
        return session.generate(active, asked, _greedy(ROUND), prefixes=prefixes)

    tokens, logprobs, reasons = _in_rounds(conversations, kept)
    again, again_logprobs, again_reasons = _in_rounds(
        conversations, lambda active, asked, prefixes: rollout.continue_from(asked, prefixes, _greedy(ROUND)))
    assert rollout.fallback_reason is None and session.stats["turn_by_turn"] is None
    # The session counts a new sample as prefilled whole: the three that joined in round 2.
    assert session.stats["reprefilled_samples"] == 3
    expected = [whole.response_ids[i, :lengths[i]].tolist() for i in range(len(conversations))]
    assert tokens == expected == again and reasons == whole.finish_reasons == again_reasons
    for ours, plain, reprefilled in zip(logprobs, whole.logprobs.tolist(), again_logprobs):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(plain[:len(ours)]), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(reprefilled), atol=1e-5, rtol=0)
    # A carried response prefilled its last sampled token only; a new one its prompt.
    prompts = [len(ids) for ids in _prompt_ids(trainer, conversations)]
    expected_prefill = sum(prompts[i] if done == 0 else 1 for active, dones in calls
                           for i, done in zip(active, dones))
    assert session.stats["prefill_tokens"] == expected_prefill
    assert session.stats["prefill_tokens"] < 0.5 * session.stats["whole_tokens"]
    # Finished responses left: the session holds the rows of its last call only.
    assert set(session.samples) == set(calls[-1][0]) and session.rows == calls[-1][0]


def test_kept_cache_rounds_with_images_are_the_one_round_generation(tmp_path):
    """The same with images and 3-D (mrope) positions: the tiny Qwen2-VL of the CPU demo,
    rounds of 2 tokens on the kept cache against one call of 6; no image is processed
    again after the first round (only the last sampled token is prefilled)."""
    trainer = Trainer(load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml", [
        "trainer.eval_every=0", "data.eval=null", "trainer.progress=false", f"trainer.output_dir={tmp_path}"]))
    _sharpen(trainer)
    rollout = CompiledHFRollout(trainer.actor, trainer.processing, compile=False)
    samples = [trainer.train_set[i] for i in range(3)]
    conversations = conversations_of(samples, list(range(3)), trainer.train_set, "test")
    whole = rollout.generate(conversations, _greedy(6))
    session = session_for(rollout, reserve=6)
    tokens, logprobs = [[] for _ in conversations], [[] for _ in conversations]
    for _ in range(3):
        part = session.generate([0, 1, 2], conversations, _greedy(2), prefixes=[list(t) for t in tokens])
        for row in range(len(tokens)):
            made = int(part.response_mask[row].sum())
            tokens[row] += part.response_ids[row, :made].tolist()
            logprobs[row] += part.logprobs[row, :made].tolist()
    assert rollout.fallback_reason is None and session.stats["reprefill_reason"] is None
    assert tokens == whole.response_ids.tolist() and len({tuple(t) for t in tokens}) > 1
    torch.testing.assert_close(torch.tensor(logprobs), whole.logprobs, atol=1e-4, rtol=0)
    first = sum(len(ids) for ids in _prompt_ids(trainer, conversations))
    assert session.stats["prefill_tokens"] == first + 2 * len(conversations)


def _prompt_ids(trainer, conversations):
    inputs = trainer.processing(conversations)
    return [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]


def test_with_new_weights_a_carried_response_reads_the_older_weights_keys_and_values(tmp_path):
    """Round 1 under weights W0, round 2 under W1: the kept-cache round's log-probs are a
    plain forward of W1 over a cache W0 filled with the prompt and round 1's tokens (the
    documented semantics), and differ from re-prefilling everything under W1."""
    trainer, rollout, conversations = _setup(tmp_path)
    model = trainer.actor.model
    session = session_for(rollout, reserve=LONGEST)
    keys = list(range(len(conversations)))
    first = session.generate(keys, conversations, _greedy(ROUND), prefixes=[[] for _ in keys])
    carried = [i for i in keys if first.finish_reasons[i] == "length"]
    assert len(carried) >= 2
    prefixes = [first.response_ids[i, :ROUND].tolist() for i in carried]
    old = _weights(trainer)
    draw = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.3 * torch.randn(weight.shape, generator=draw))
    new = _weights(trainer)
    asked = [conversations[i] for i in carried]
    kept = session.generate(carried, asked, _greedy(ROUND), prefixes=prefixes)
    reprefilled = rollout.continue_from(asked, prefixes, _greedy(ROUND))
    assert session.stats["prefill_tokens"] == sum(len(ids) for ids in _prompt_ids(trainer, conversations)) + \
        len(carried)
    prompts = _prompt_ids(trainer, asked)
    gaps = []
    for row, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
        made = int(kept.response_mask[row].sum())
        sampled = kept.response_ids[row, :made].tolist()
        reference = _old_cache_then_new_weights(model, old, new, prompt + prefix, sampled)
        torch.testing.assert_close(kept.logprobs[row, :made], reference, atol=1e-4, rtol=0)
        same = min(made, int(reprefilled.response_mask[row].sum()))
        if reprefilled.response_ids[row, :same].tolist() == sampled[:same]:
            gaps.append(float((kept.logprobs[row, :same] - reprefilled.logprobs[row, :same]).abs().max()))
        else:
            gaps.append(float("inf"))  # the kept cache even chose other tokens
    assert min(gaps) > 1e-3


@torch.no_grad()
def _old_cache_then_new_weights(model, old: dict, new: dict, context: list[int], sampled: list[int]):
    """Each of `sampled`'s raw log-probs with `context` minus its last token in a cache
    filled by weights `old`, and everything after fed by weights `new`."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model.load_state_dict(old)
    model(input_ids=torch.tensor([context[:-1]]), past_key_values=cache, use_cache=True)
    model.load_state_dict(new)
    fed = torch.tensor([context[-1:] + sampled[:-1]])
    logits = model(input_ids=fed, past_key_values=cache, use_cache=True).logits[0].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1)


def _compiled_run(tmp_path, name, *extra):
    trainer = Trainer(_recipe(tmp_path / name, "rollout.backend=hf_compiled", *extra))
    trainer.rollout.compile = False  # eager on the CPU, as the compiled rollout's CPU tests run it
    return trainer


def test_a_partial_run_on_the_kept_cache_trains_and_matches_re_prefill_with_fixed_weights(tmp_path):
    """Weights that do not move: the kept-cache run trains on the re-prefill run's
    responses; weights that move: it trains, each step's rounds prefilling far fewer
    tokens than re-prefilling would."""
    kept = _compiled_run(tmp_path, "kept", "trainer.steps=3", *FIXED, *PARTIAL)
    _sharpen(kept)
    kept.fit()
    again = _compiled_run(tmp_path, "again", "trainer.steps=3", "rollout.keep_cache=false", *FIXED, *PARTIAL)
    _sharpen(again)
    again.fit()
    assert _responses(tmp_path / "kept") == _responses(tmp_path / "again")
    assert not any(k.startswith("partial/prefill") for k in _rows(tmp_path / "again")[0])

    trains = _compiled_run(tmp_path, "trains", "trainer.steps=3", *PARTIAL)
    before = _weights(trains)
    trains.fit()
    assert trains.rollout.fallback_reason is None
    metrics = [r for r in _rows(tmp_path / "trains") if not r.get("final")]
    assert len(metrics) == 3 and all(torch.isfinite(torch.tensor(r["loss/policy"])) for r in metrics)
    assert all(r["partial/carried_in"] > 0 for r in metrics[1:])
    assert all(0 < r["partial/prefill_tokens"] < r["partial/prefill_tokens_whole"] for r in metrics[1:])
    assert any(not torch.equal(v, before[k]) for k, v in _weights(trains).items())


def test_where_the_cache_cannot_be_kept_rounds_re_prefill_and_say_why_once(tmp_path, capsys):
    plain = Trainer(_recipe(tmp_path / "hf", *PARTIAL))
    assert plain.trajectories is not None
    said = capsys.readouterr().err
    assert said.count("rollout.partial_tokens: carried samples re-prefill their tokens each round (rollout "
                      "backend 'hf' keeps no cache between calls; hf_compiled does)") == 1
    off = _compiled_run(tmp_path, "off", "rollout.keep_cache=false", *PARTIAL)
    assert "each round (rollout.keep_cache is false)" in capsys.readouterr().err
    rollout = off.rollout
    assert kept_cache_session(rollout, keep_cache=True, reserve=6)[0] is not None
    rollout.session_unsupported = lambda: "sliding-window cache layers (their slots wrap around)"
    session, reason = kept_cache_session(rollout, keep_cache=True, reserve=6)
    assert session is None and reason == ("hf_compiled cannot keep a cache here: sliding-window cache layers "
                                          "(their slots wrap around)")
    on = _compiled_run(tmp_path, "on", *PARTIAL)
    assert "re-prefill" not in capsys.readouterr().err and on.rollout.backend == "hf_compiled"


def test_the_kept_cache_survives_another_rollout_call_between_rounds(tmp_path):
    """A validation between two rounds runs on the same rollout and its pool of caches
    (reset for reuse): the session's cache is out of that pool between calls."""
    trainer, rollout, conversations = _setup(tmp_path)
    session = session_for(rollout, reserve=LONGEST)
    keys = list(range(len(conversations)))
    first = session.generate(keys, conversations, _greedy(ROUND), prefixes=[[] for _ in keys])
    carried = [i for i in keys if first.finish_reasons[i] == "length"]
    prefixes = [first.response_ids[i, :ROUND].tolist() for i in carried]
    asked = [conversations[i] for i in carried]
    held = session.cache
    assert all(cache is not held for cache in rollout.caches.values())
    # Same rows and cache length as the session's cache: the pool would hand that one out.
    rollout.generate(conversations, _greedy(ROUND))
    kept = session.generate(carried, asked, _greedy(ROUND), prefixes=prefixes)
    reprefilled = rollout.continue_from(asked, prefixes, _greedy(ROUND))
    assert kept.response_ids.tolist() == reprefilled.response_ids.tolist()
    torch.testing.assert_close(kept.logprobs, reprefilled.logprobs, atol=1e-5, rtol=0)
