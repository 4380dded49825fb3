"""Multi-turn rollouts on the compiled path's kept cache (mmrl/rollout/sessions.py), on tiny
random-init models in fp32, greedy: an agent run of three turns, with an image arriving in
each environment reply for the VLMs, gives plain `generate`'s tokens and log-probs turn by
turn for a text family (qwen2), an mrope family (qwen2_5_vl) and a non-Qwen VLM
(idefics3), while the turns after the first prefill only their new tokens and images into
each sample's cache row. Finished samples free their rows, new or diverging samples
prefill whole beside continuing ones, rows survive the moves inside and between turns,
media whose part cannot be found is prefilled whole, and the path can be turned off.
On CPU the decode loop runs eagerly (`compile=False`); the last test runs it compiled on
CUDA (`-m gpu`)."""

import functools

import pytest
import torch
from PIL import Image
from test_agent_rollout import ImageReplies, _rows

from mmrl import build_model
from mmrl.engine import Engine
from mmrl.parallel import init_distributed
from mmrl.rollout import SamplingParams, compiled, make_rollout, sessions
from mmrl.rollout.agent import AgentRollout
from mmrl.rollout_batch import trajectory_sequences

FAMILIES = ["qwen2", "qwen2_5_vl", "idefics3"]
GREEDY = SamplingParams(n=2, max_new_tokens=6, temperature=0, logprobs=True)


class TextReplies:
    """A text environment: a reply of its own length each turn."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["text"]}]

    def step(self, messages):
        self.turns += 1
        return [{"role": "user", "content": "so " * self.turns + "and then?"}], False, 0.0


class DoneAfter:
    """`ImageReplies` (or `TextReplies`) that says done after `turns` policy turns."""

    def __init__(self, inner, turns):
        self.inner, self.turns, self.seen = inner, turns, 0

    def reset(self, row):
        return self.inner.reset(row)

    def step(self, messages):
        self.seen += 1
        new, _, reward = self.inner.step(messages)
        return new, self.seen >= self.turns, reward


def _setup(family, device="cpu"):
    """A tiny model whose greedy continuations differ from token to token (widened random
    weights, as tests/test_rollout_fast.py): a wrong position or feature would show."""
    options = {"min_pixels": 784, "max_pixels": 56 * 56} if family != "qwen2" else {}
    with torch.device(device):
        built = build_model(family, random_init=True, seed=0, processing_options=options)
    generator = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for parameter in built.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, device=device) * 0.3)
    engine = Engine(built, init_distributed(device), mixed_precision=False, share_media=False)
    return built, engine


def _environment_role(built):
    return "tool" if built.adapter.family.startswith("qwen") else "user"  # the other templates have no tool role


def _environment(built):
    if not built.adapter.is_multimodal:
        return TextReplies
    role = _environment_role(built)
    return lambda: ImageReplies(role)


def _staggered(built):
    """An environment factory whose samples say done after 1, 2 and 3 turns, in turn."""
    made = []

    def make():
        made.append(1)
        return DoneAfter(_environment(built)(), turns=1 + (len(made) - 1) % 3)

    return make


def _agent(built, engine, backend, env=None, max_turns=3, **options):
    rollout = make_rollout(backend, engine, built.processing, **options)
    return AgentRollout(rollout, built.processing, env or _environment(built), max_turns=max_turns,
                        max_tokens=4096)


def _assert_same(fast, plain):
    assert [t.turns for t in fast.trajectories] == [t.turns for t in plain.trajectories]
    for ours, theirs in zip(fast.trajectories, plain.trajectories):
        assert ours.ids == theirs.ids and ours.spans == theirs.spans and ours.finish == theirs.finish
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert fast.texts == plain.texts


def _suffix_tokens(trajectories, shared_openings=True):
    """What prefilling only the new tokens feeds: each first prompt whole (once per dataset
    row where its samples share the opening's prefill: `DecodeSession`'s first call), then
    each later prompt from the last token sampled before it (the one token a decode loop
    never feeds)."""
    total, opened = 0, set()
    for t in trajectories:
        if not shared_openings or t.prompt not in opened:
            total += t.spans[0][0]
            opened.add(t.prompt)
        total += sum(start - (end - 1) for (_, end), (start, _) in zip(t.spans, t.spans[1:]))
    return total


@pytest.mark.parametrize("family, decode", [*((f, "compiled") for f in FAMILIES), ("qwen2_5_vl", "graphs")])
def test_kept_cache_turns_equal_plain_generate(family, decode):
    """`decode`: the step `rollout.decode` picks, here its eager CPU twin ("graphs" builds
    the masks from the session's mask and the slot the step writes, as its CUDA graphs do)."""
    built, engine = _setup(family)
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=False, decode=decode)
    fast = agent.generate(_rows(), GREEDY)
    assert agent.backend.fallback_reason is None
    assert decode == "compiled" or agent.backend._step.fallback is None  # the graphs step itself ran
    stats = agent.session.stats
    assert stats["turn_by_turn"] is None and stats["reprefill_reason"] is None and stats["reprefilled_samples"] == 0
    assert [t.turns for t in fast.trajectories] == [3] * 4 and stats["turns"] == 3
    if built.adapter.is_multimodal:  # images arrived in the later turns
        assert all(sum(part.get("type") == "image" for m in t.messages if isinstance(m["content"], list)
                       for part in m["content"]) == 3 for t in fast.trajectories)
    # The continuations are not one token repeated.
    assert len(set(fast.trajectories[0].last_ids)) > 2
    _assert_same(fast, plain)
    # Only the new tokens went in: the turns' whole conversations hold far more; each
    # row's two samples share their opening's prefill (GREEDY: n=2).
    assert stats["prefill_tokens"] == _suffix_tokens(fast.trajectories) and stats["shared_openings"] == 2
    assert stats["prefill_tokens"] < 0.6 * stats["whole_tokens"]
    assert fast.stats["agent/prefill_tokens"] == stats["prefill_tokens"] / 4
    # Turn 2 checked that the new images' pixels alone (joined, as Qwen2.5-VL lays them
    # out) are the whole batch's part, and that its ids put together from the rows' last
    # prompts and the new text are the whole rows'; turn 3 then processed no row whole (its
    # batch holds no pixels). Idefics3's one-row-per-sample layout pads to every row's
    # images: never left out.
    assert stats["text_turns"] == stats["alone_positions"] == (1 if family == "qwen2_5_vl" else 0)
    assert stats["light_turns"] == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_repeated_openings_prefill_once_and_change_nothing(family):
    """The first turn prefills each row's opening once for its two samples (mrope and plain
    positions alike): the same tokens and log-probs over every turn as prefilling every
    sample's opening (`prefill_once=False`), with one opening's tokens fewer per row."""
    built, engine = _setup(family)
    unshared = _agent(built, engine, "hf_compiled", compile=False, prefill_once=False)
    reference = unshared.generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    fast = agent.generate(_rows(), GREEDY)
    assert agent.backend.fallback_reason is None and unshared.backend.fallback_reason is None
    _assert_same(fast, reference)
    assert len(set(fast.trajectories[0].last_ids)) > 2
    ours, theirs = agent.session.stats, unshared.session.stats
    assert theirs["shared_openings"] == 0 and ours["shared_openings"] == 2
    repeats = sum(t.spans[0][0] for t in fast.trajectories[1::2])  # each row's second sample's opening
    assert repeats > 0 and ours["prefill_tokens"] == theirs["prefill_tokens"] - repeats
    assert ours["whole_tokens"] == theirs["whole_tokens"]


def test_openings_repeat_by_their_text_and_the_identity_of_their_media():
    image = Image.new("RGB", (56, 56), (200, 30, 30))

    def opening(picture, text="What is it?"):
        return [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": text}]}]

    key = sessions._opening_key
    assert key(opening(image)) == key(opening(image))
    assert key(opening(image)) != key(opening(image.copy()))  # equal pixels are not looked at
    assert key(opening(image)) != key(opening(image, "And this?"))
    assert key([{"role": "user", "content": "hi"}]) != key([{"role": "system", "content": "hi"}])


def test_equal_images_in_distinct_objects_are_processed_once(monkeypatch):
    """Each sample's environment makes its own image object, the same pixels for every
    sample at a turn (as a tool's crop of the prompt's image): the session processes each
    content alone once (the two openings' images, then one reply image per turn: 4 calls,
    not one per sample and turn: 10), and still gives plain generate's tokens."""
    built, engine = _setup("qwen2_5_vl")
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    alone = []
    process = type(built.processing).__call__

    def counting(self, conversations, *args, **kwargs):
        if len(conversations) == 1 and all(part.get("type") == "image" for m in conversations[0]
                                           for part in m["content"]):
            alone.append(conversations[0])
        return process(self, conversations, *args, **kwargs)

    monkeypatch.setattr(type(built.processing), "__call__", counting)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    fast = agent.generate(_rows(), GREEDY)
    assert agent.session.stats["reprefill_reason"] is None and agent.session.stats["reprefilled_samples"] == 0
    _assert_same(fast, plain)
    assert len(alone) == 4


@pytest.mark.parametrize("axes", [None, 3])
def test_suffixes_gathered_at_once_are_the_row_by_row_ones(axes):
    """`_suffixes` (one gather) gives what the former loop over rows gave: each row's real
    tokens from its start on, left-padded, with their per-token entries and positions;
    real tokens anywhere in a row (left padding, holes), a row prefilled whole (start 0)."""
    generator = torch.Generator().manual_seed(0)
    rows, length, width, pad = 5, 12, 9, 7
    mask = (torch.rand(rows, length, generator=generator) > 0.3).long()
    mask[0, :5] = 0
    mask[:, -1] = 1
    real_counts = mask.sum(1).tolist()
    starts = [0 if r == 1 else max(real - width, 0) + r % 3 for r, real in enumerate(real_counts)]
    starts = [min(s, real - 1) for s, real in zip(starts, real_counts)]
    width = max(real - start for real, start in zip(real_counts, starts))
    inputs = {"input_ids": torch.randint(10, 100, (rows, length), generator=generator), "attention_mask": mask,
              "mm_token_type_ids": torch.randint(0, 3, (rows, length), generator=generator)}
    shape = (rows, length) if axes is None else (axes, rows, length)
    positions = torch.randint(0, 50, shape, generator=generator)
    suffix, places, suffix_mask = sessions._suffixes(inputs, positions, starts, width, pad)

    expected = {"input_ids": torch.full((rows, width), pad), "mm_token_type_ids": torch.zeros(rows, width).long()}
    expected_places = positions.new_zeros((*positions.shape[:-2], rows, width))
    expected_mask = torch.zeros(rows, width, dtype=torch.bool)
    for row, start in enumerate(starts):
        take = mask[row].bool().nonzero().squeeze(-1)[start:]
        count = len(take)
        for key in expected:
            expected[key][row, width - count:] = inputs[key][row, take]
        expected_places[..., row, width - count:] = positions[..., row, take]
        expected_mask[row, width - count:] = True
    assert suffix.keys() == expected.keys() and all(torch.equal(suffix[k], expected[k]) for k in expected)
    assert torch.equal(places, expected_places) and torch.equal(suffix_mask, expected_mask)
    assert int(suffix_mask[1].sum()) == real_counts[1]  # the whole row


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_later_turns_process_each_image_content_once(family):
    """A later turn's conversations, each row processed alone with each image content's
    processing done once and then collated, are the batch processing them together gives;
    the image processor ran once per distinct list of images, not once per row."""
    from mmrl.processing import batch_differences

    built, engine = _setup(family)
    session = sessions.DecodeSession(make_rollout("hf_compiled", engine, built.processing, compile=False))
    conversations = []
    for row in _rows():
        for sample in range(3):
            env = ImageReplies(_environment_role(built))
            opening = env.reset(row)
            reply, _, _ = env.step([*opening, {"role": "assistant", "content": f"it is {sample}"}])
            conversations.append([*opening, {"role": "assistant", "content": f"it is {sample}"}, *reply])
    assert len({id(c[-1]["content"][0]["image"]) for c in conversations}) == 6  # an object per sample
    ours = session._process(conversations, per_row=True)
    assert batch_differences(ours, dict(built.processing(conversations))) == []
    assert session._image_memo.calls == 2  # a row's images: its opening's and the reply (equal in every row)
    assert batch_differences(session._process(conversations, per_row=False),
                             dict(built.processing(conversations))) == []
    # A processor that will not work through the wrapper: every row processed together,
    # the processor's own image processor back in place.
    class Raising(sessions._ImageMemo):
        def __call__(self, *args, **kwargs):
            raise TypeError("not this one")

    images = built.processing.processor.image_processor
    failing = sessions.DecodeSession(session.rollout)
    failing._image_memo = Raising(images, failing._content)
    assert batch_differences(failing._process(conversations, per_row=True),
                             dict(built.processing(conversations))) == []
    assert failing._per_row_failed and built.processing.processor.image_processor is images


def test_an_images_content_key_is_its_pixels_exactly():
    """Equal pixels in distinct objects share a key; pixels that agree at every sampled byte
    but one elsewhere, another size or mode do not (each compared whole, no digest)."""
    import numpy
    from PIL import Image

    built, engine = _setup("qwen2_5_vl")
    session = sessions.DecodeSession(make_rollout("hf_compiled", engine, built.processing, compile=False))
    pixels = numpy.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=numpy.uint8)
    near = pixels.copy()
    near.reshape(-1)[1] ^= 1  # not a sampled byte: the same bucket, other pixels
    assert 1 % sessions._SAMPLED != 0
    first, again, other = (Image.fromarray(p.copy()) for p in (pixels, pixels, near))
    assert session._content(first) == session._content(again) == session._content(first)
    assert session._content(other)[:3] == session._content(first)[:3]  # the sampled bytes agree
    assert session._content(other) != session._content(first)
    assert session._content(Image.fromarray(pixels[:, :29].copy())) != session._content(first)
    assert session._content(first.convert("RGBA")) != session._content(first)
    assert session._content("a text") == "a text"
    session.close()
    assert session._contents == {} and session._digests == {}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_repeated_reply_images_are_encoded_once(family, monkeypatch):
    """With media sharing on, a later turn's new images that repeat across rows (every
    sample's reply image is the same at a turn) go through the vision encoder once per
    content, and every turn still gives plain generate's tokens and log-probs."""
    built, engine = _setup(family)
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=True)
    assert engine.shares_media
    encoded = []
    owner = next(m for m in engine.model.modules() if callable(getattr(m, "get_image_features", None))
                 and not any(c is not m and callable(getattr(c, "get_image_features", None))
                             for c in m.modules()))
    original = type(owner).get_image_features

    def counting(self, pixel_values, *args, **kwargs):
        encoded.append(pixel_values.shape[:2])
        return original(self, pixel_values, *args, **kwargs)

    monkeypatch.setattr(type(owner), "get_image_features", counting)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    fast = agent.generate(_rows(), GREEDY)
    stats = agent.session.stats
    assert agent.backend.fallback_reason is None and stats["reprefill_reason"] is None
    _assert_same(fast, plain)
    # Turns 2 and 3: four rows, one reply image each, the same in every row: the encoder
    # took one reply image's pixels each time (ImageReplies' images of turns 2 and 3).
    assert stats["shared_media_rows"] == 6
    replies = [Image.new("RGB", (56, 56), (40, 215, 90)), Image.new("RGB", (28, 56), (80, 175, 90))]
    alone = [built.processing([[{"role": "user", "content": [{"type": "image", "image": image}]}]])["pixel_values"]
             for image in replies]
    assert [tuple(shape) for shape in encoded[-2:]] == [tuple(pixels.shape[:2]) for pixels in alone]
    if family == "qwen2_5_vl":  # the next run's trusted turns (ids put together: `text_turns`) share too
        encoded.clear()
        again = agent.generate(_rows(), GREEDY)
        assert agent.session.stats["text_turns"] == 2 and agent.session.stats["shared_media_rows"] == 6
        _assert_same(again, plain)
        assert [tuple(shape) for shape in encoded[-2:]] == [tuple(pixels.shape[:2]) for pixels in alone]


def test_timed_turns_say_where_their_seconds_went():
    built, engine = _setup("qwen2_5_vl")
    agent = _agent(built, engine, "hf_compiled", compile=False)
    agent.generate(_rows(), GREEDY)
    assert agent.timings == [] and agent.session.stats["phases"] == []  # off by default
    agent.timed = True
    agent.generate(_rows(), GREEDY)
    assert [t["turn"] for t in agent.timings] == [1, 2, 3] and all(t["rows"] == 4 for t in agent.timings)
    phases = [t["session"] for t in agent.timings]
    assert [p["prefill_rows"] for p in phases] == [2, 4, 4]  # the openings once per row, then every row
    for turn, p in zip(agent.timings, phases):
        assert all(p[k] >= 0 for k in ("process_s", "inputs_s", "suffix_s", "prefill_s", "decode_s", "record_s"))
        assert p["rest_s"] == pytest.approx(p["total_s"] - sum(p[k] for k in (
            "process_s", "inputs_s", "suffix_s", "prefill_s", "decode_s", "record_s")))
        assert p["total_s"] <= turn["generate_s"] and turn["environment_s"] >= 0 and turn["agent_s"] >= 0
    assert phases[0]["suffix_s"] == 0 and phases[1]["suffix_s"] > 0  # the first turn prefills whole
    # The later turns' new media found, a part of their inputs' seconds.
    assert all(0 < p["inputs_media_s"] <= p["inputs_s"] for p in phases[1:])


def test_the_later_turns_read_the_kept_cache(monkeypatch):
    """Emptying the kept cache before a later turn's prefill changes that turn's log-probs:
    the suffix is decoded against what the earlier turns left in the rows."""
    built, engine = _setup("qwen2_5_vl")
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    prefill = sessions.DecodeSession._prefill_suffix

    def emptied(self, *args, **kwargs):
        for layer in self.cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
        return prefill(self, *args, **kwargs)

    monkeypatch.setattr(sessions.DecodeSession, "_prefill_suffix", emptied)
    fast = _agent(built, engine, "hf_compiled", compile=False).generate(_rows(), GREEDY)
    first = plain.trajectories[0].spans[0][1] - plain.trajectories[0].spans[0][0]
    ours, theirs = (torch.tensor(r.trajectories[0].logprobs[first:first + 1]) for r in (fast, plain))
    assert (ours - theirs).abs().max() > 1e-2


def _counted_prefills(monkeypatch, engine) -> list[tuple[bool, int, int, int]]:
    """Per prefill forward of the compiled backend from now on: (layers asked, its rows,
    compiled layer calls in it, dynamo graphs made in it). Dynamo's `aot_eager` backend: the
    graphs dynamo makes, at eager arithmetic."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    seen = []
    prefill = compiled.CompiledHFRollout.prefill

    def counted(self, run, cache, inputs, positions, layers=False):
        calls, graphs = engine.compiled_layers.compiled_calls, counters["stats"]["unique_graphs"]
        out = prefill(self, run, cache, inputs, positions, layers=layers)
        seen.append((layers, len(inputs["input_ids"]), engine.compiled_layers.compiled_calls - calls,
                     counters["stats"]["unique_graphs"] - graphs))
        return out

    monkeypatch.setattr(compiled.CompiledHFRollout, "prefill", counted)
    return seen


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_later_turns_prefill_through_the_compiled_layers(family, monkeypatch):
    """Where the engine compiles its decoder layers, a later turn's prefill into the kept
    cache runs through them (`prefill_layers`), each layer writing its own view of the
    cache in its graph: plain generate's tokens and log-probs, and one prefill graph (its
    rows and widths dynamic) for both later turns' prefills. The first turn's prefill (a
    fresh cache) stays eager, as does every prefill with `prefill_layers` off."""
    from torch._dynamo.utils import counters

    built, _ = _setup(family)
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False, compile_layers=True)
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    seen = _counted_prefills(monkeypatch, engine)
    for on in (True, False):
        torch._dynamo.reset()
        counters.clear()
        seen.clear()
        agent = _agent(built, engine, "hf_compiled", compile=True, decode="graphs", prefill_layers=on)
        fast = agent.generate(_rows(), GREEDY)
        assert agent.backend.fallback_reason is None and engine.compiled_layers.failed is None
        assert agent.session.stats["turn_by_turn"] is None and agent.session.stats["reprefilled_samples"] == 0
        _assert_same(fast, plain)
        layers = len(engine.compiled_layers.layers)
        assert [asked for asked, *_ in seen] == [False, True, True]
        assert seen[0][2] == 0  # the first turn: eager
        if on:
            assert [calls for *_, calls, _ in seen[1:]] == [layers, layers]
            assert seen[1][3] == 1 and seen[2][3] == 0  # one graph for both later turns
        else:
            assert [calls for *_, calls, _ in seen[1:]] == [0, 0]
    assert not counters["graph_break"]


@pytest.mark.slow
def test_later_turns_prefill_through_inductors_layers():
    """The same with inductor's own kernels (C++ on the CPU; the GPU test runs triton's):
    the later turns' prefills through the compiled layers lower and give plain generate's
    tokens and log-probs, twice (the second rollout on the graphs of the first)."""
    built, _ = _setup("qwen2_5_vl")
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False, compile_layers=True)
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=True, decode="graphs")
    for _ in range(2):
        _assert_same(agent.generate(_rows(), GREEDY), plain)
    assert engine.compiled_layers.failed is None and agent.backend.prefill_layers is True
    assert agent.session.stats["turn_by_turn"] is None and agent.backend.fallback_reason is None


def test_the_prefill_graph_serves_a_cache_that_narrows(monkeypatch):
    """Samples that finish leave the kept cache (6, then 4, then 2 rows, each cache new):
    the later turns' prefills through the compiled layers still meet the one graph, with
    plain generate's tokens and log-probs."""
    monkeypatch.setattr(compiled, "CACHE_LENGTH_STEP", 8)
    built, _ = _setup("qwen2")
    engine = Engine(built, init_distributed("cpu"), mixed_precision=False, share_media=False, compile_layers=True)
    params = SamplingParams(n=3, max_new_tokens=5, temperature=0, logprobs=True)

    plain = _agent(built, engine, "hf", env=_staggered(built)).generate(_rows(), params)
    seen = _counted_prefills(monkeypatch, engine)
    agent = _agent(built, engine, "hf_compiled", env=_staggered(built), compile=True, decode="graphs")
    fast = agent.generate(_rows(), params)
    assert agent.session.stats["cache_rows"] == [6, 4, 2]
    layers = len(engine.compiled_layers.layers)
    assert [(asked, rows, calls) for asked, rows, calls, _ in seen] == [(False, 2, 0), (True, 4, layers),
                                                                         (True, 2, layers)]
    assert [graphs for *_, graphs in seen[1:]] == [1, 0]
    _assert_same(fast, plain)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_finished_samples_free_their_rows(family, monkeypatch):
    """Samples that finish (the environment says done) leave the cache: each turn's cache
    holds only the samples still running (and makes room for them: a short cache-length
    step), and they keep plain generate's tokens and log-probs."""
    monkeypatch.setattr(compiled, "CACHE_LENGTH_STEP", 8)
    built, engine = _setup(family)
    params = SamplingParams(n=3, max_new_tokens=5, temperature=0, logprobs=True)

    plain = _agent(built, engine, "hf", env=_staggered(built)).generate(_rows(), params)
    agent = _agent(built, engine, "hf_compiled", env=_staggered(built), compile=False)
    fast = agent.generate(_rows(), params)
    assert [t.turns for t in fast.trajectories] == [1, 2, 3, 1, 2, 3]
    assert agent.backend.fallback_reason is None and agent.session.stats["cache_rows"] == [6, 4, 2]
    assert agent.backend.caches and {rows for rows, *_ in agent.backend.caches} <= {2, 4, 6}
    assert agent.session.cache is None  # let go when the rollout ended
    _assert_same(fast, plain)


def test_light_turns_prefill_new_and_restarted_samples_with_their_pixels():
    """Through the session directly (Qwen2.5-VL): once turn 2 checked that the new images'
    pixels alone are the whole batch's part, turn 3's batch (and the rollout's next
    session's later turns) leave the conversations' pixel tensors out; a sample new in
    that turn (its whole conversation's images) beside a continuing one, and a turn where
    no sample continues (every row prefilled whole: its pixels processed after all), each
    still equal plain generate."""
    built, engine = _setup("qwen2_5_vl")
    plain = make_rollout("hf", engine, built.processing)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    session = sessions.session_for(rollout, reserve=512)
    params = SamplingParams(n=1, max_new_tokens=5, temperature=0, logprobs=True)
    env, agent = ImageReplies(_environment_role(built)), _agent(built, engine, "hf")

    def grown(conversations, result):
        out = []
        for row, conversation in enumerate(conversations):
            sampled = result.response_ids[row, :int(result.response_mask[row].sum())].tolist()
            reply, _, _ = env.step(conversation)
            out.append([*conversation, {"role": "assistant", "content": agent._content(conversation, sampled)},
                        *reply])
        return out

    def same_as_plain(result, conversations):
        reference = plain.generate(conversations, params)
        assert torch.equal(result.response_ids, reference.response_ids)
        torch.testing.assert_close(result.logprobs, reference.logprobs, atol=1e-4, rtol=0)

    openings = [ImageReplies().reset(row) for row in _rows()]
    first = session.generate(["a", "b"], openings, params)
    second_turn = grown(openings, first)
    second = session.generate(["a", "b"], second_turn, params)
    assert session._light and session._pixel_keys == ("pixel_values",) and session.stats["light_turns"] == 0
    # The suffixes' positions from the suffixes alone (mrope's, shifted by each row's last
    # position) were checked against the whole rows'; later turns skip the whole rows'.
    assert sessions._POSITIONS.get(rollout) is True and session.stats["alone_positions"] == 0
    same_as_plain(second, second_turn)
    third_turn = [grown(second_turn, second)[0], openings[1]]  # "a" continues, "c" is new
    third = session.generate(["a", "c"], third_turn, params)
    assert session.stats["light_turns"] == 1 and "pixel_values" not in third.prompt_inputs
    assert session.stats["alone_positions"] == 1
    assert session.stats["reprefilled_samples"] == 1 and rollout.fallback_reason is None
    same_as_plain(third, third_turn)
    fourth = session.generate(["d", "e"], openings, params)  # no row continues: prefilled whole
    assert session.stats["light_turns"] == 2 and rollout.fallback_reason is None
    assert session.stats["reprefill_reason"] == "no sample's conversation continues the tokens its cache row holds"
    same_as_plain(fourth, openings)
    # The check holds for the rollout: a next session (the agent's next rollout) trusts it
    # from its first later turn on.
    again = sessions.session_for(rollout, reserve=512)
    again_turn = grown(openings, again.generate(["a", "b"], openings, params))
    same_as_plain(again.generate(["a", "b"], again_turn, params), again_turn)
    # (Its ids put together from the rows' last prompts: `test_trusted_later_turns_skip_...`.)
    assert again.stats["text_turns"] == 1 and again.stats["reprefill_reason"] is None
    assert again.stats["alone_positions"] == 1


def _counting_processing(monkeypatch):
    """The `per_row` flags of the session's `_process` calls (each a processing of whole rows)."""
    calls = []
    original = sessions.DecodeSession._process

    def counted(self, conversations, per_row, light=False):
        calls.append(per_row)
        return original(self, conversations, per_row, light)

    monkeypatch.setattr(sessions.DecodeSession, "_process", counted)
    return calls


def test_trusted_later_turns_skip_processing_rows_whole(monkeypatch):
    """Qwen2.5-VL: once a rollout checked (turn 2 of its first agent run) that each row's
    ids put together from its last prompt and the new text alone (`mmrl.rollout.text_suffix`)
    are the whole rows' processed ids, its later turns (turn 3, then the next run's turns 2
    and 3) process no row whole (only the new text and each reply image once per content)
    and still give plain `generate`'s tokens and log-probs."""
    built, engine = _setup("qwen2_5_vl")
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    first = agent.generate(_rows(), GREEDY)
    assert sessions._TEXT.get(agent.backend) is True and agent.session.stats["text_turns"] == 1
    _assert_same(first, plain)
    calls = _counting_processing(monkeypatch)
    second = agent.generate(_rows(), GREEDY)
    stats = agent.session.stats
    assert stats["text_turns"] == 2 and stats["reprefill_reason"] is None and stats["reprefilled_samples"] == 0
    assert True not in calls  # no later turn processed its rows whole
    _assert_same(second, plain)
    assert stats["prefill_tokens"] == _suffix_tokens(second.trajectories)


def test_a_text_path_that_differs_from_processing_whole_is_never_trusted(monkeypatch):
    """A text path whose ids are not the whole rows' (here one token dropped from every
    row's reply) fails its one check: later turns keep processing rows whole and equal
    plain `generate`."""
    from mmrl.rollout import text_suffix

    built, engine = _setup("qwen2_5_vl")
    original = text_suffix.continued

    def dropping(*args):
        rows = original(*args)
        return None if rows is None else [{k: v[:-2] + v[-1:] if k == "input_ids" else torch.cat([v[:-2], v[-1:]])
                                           for k, v in row.items()} for row in rows]

    monkeypatch.setattr(sessions, "continued", dropping)
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    agent.generate(_rows(), GREEDY)
    assert sessions._TEXT.get(agent.backend) is False
    calls = _counting_processing(monkeypatch)
    _assert_same(agent.generate(_rows(), GREEDY), plain)
    assert agent.session.stats["text_turns"] == 0 and calls.count(True) == 2


def test_new_and_diverging_samples_prefill_whole_beside_continuing_ones():
    """Through the session directly: a sample whose conversation no longer begins with
    its row's tokens, and a sample new in the second turn, prefill their whole
    conversations (old slots masked) in the same batch as a continuing sample; each
    response equals plain generate's on its conversation."""
    built, engine = _setup("qwen2_5_vl")
    plain = make_rollout("hf", engine, built.processing)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    session = sessions.session_for(rollout, reserve=256)
    params = SamplingParams(n=1, max_new_tokens=5, temperature=0, logprobs=True)
    env = _environment(built)
    openings = [env().reset(row) for row in _rows()]
    first = session.generate(["a", "b"], openings, params)
    grown, agent = [], _agent(built, engine, "hf")
    for row, opening in enumerate(openings):
        sampled = first.response_ids[row, :int(first.response_mask[row].sum())].tolist()
        reply, _, _ = env().step(opening)
        grown.append([*opening, {"role": "assistant", "content": agent._content(opening, sampled)}, *reply])
    drifted = [{**grown[1][0], "content": [grown[1][0]["content"][0], {"type": "text", "text": "Something else?"}]},
               *grown[1][1:]]
    conversations = [grown[0], drifted, openings[0]]
    second = session.generate(["a", "b", "c"], conversations, params)
    assert rollout.fallback_reason is None
    assert session.stats["reprefilled_samples"] == 2 and session.stats["cache_rows"] == [2, 3]
    reference = plain.generate(conversations, params)
    assert torch.equal(second.response_ids, reference.response_ids)
    torch.testing.assert_close(second.logprobs, reference.logprobs, atol=1e-4, rtol=0)
    session.close()


def test_a_diverging_sample_sends_a_trusted_turn_back_to_processing_rows_whole():
    """Once the rollout trusts the text path (an agent run on it), a turn where one sample's
    conversation no longer begins with what its row holds is processed whole (that sample
    prefilled whole beside the continuing one) and equals plain generate."""
    built, engine = _setup("qwen2_5_vl")
    plain = make_rollout("hf", engine, built.processing)
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    AgentRollout(rollout, built.processing, _environment(built), max_turns=3, max_tokens=4096).generate(_rows(), GREEDY)
    assert sessions._TEXT.get(rollout) is True
    session = sessions.session_for(rollout, reserve=256)
    params = SamplingParams(n=1, max_new_tokens=5, temperature=0, logprobs=True)
    env, agent = _environment(built), _agent(built, engine, "hf")
    openings = [env().reset(row) for row in _rows()]
    first = session.generate(["a", "b"], openings, params)
    grown = []
    for row, opening in enumerate(openings):
        sampled = first.response_ids[row, :int(first.response_mask[row].sum())].tolist()
        reply, _, _ = env().step(opening)
        grown.append([*opening, {"role": "assistant", "content": agent._content(opening, sampled)}, *reply])
    drifted = [{**grown[1][0], "content": [grown[1][0]["content"][0], {"type": "text", "text": "Something else?"}]},
               *grown[1][1:]]
    second = session.generate(["a", "b"], [grown[0], drifted], params)
    assert session.stats["text_turns"] == 0 and session.stats["reprefilled_samples"] == 1
    assert rollout.fallback_reason is None
    reference = plain.generate([grown[0], drifted], params)
    assert torch.equal(second.response_ids, reference.response_ids)
    torch.testing.assert_close(second.logprobs, reference.logprobs, atol=1e-4, rtol=0)
    session.close()


def test_rows_survive_the_moves_inside_and_between_turns(monkeypatch):
    """Rows that stop early leave the decode batch mid-turn (their slots written back to
    the kept cache) and go on in the next turn, and when a turn would overflow the cache
    every row's real slots move to its front (a short cache-length step and no reserve
    force both): the tokens and log-probs stay plain generate's."""
    built, engine = _setup("qwen2_vl")
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0, logprobs=True)
    plain = _agent(built, engine, "hf").generate(_rows(), params)
    # The end of turn takes the logits of a token some rows sample: they stop there, the
    # template writes the same end of turn, and the sample goes on.
    end_of_turn = built.processing.stop_token_ids[0]
    counts = torch.bincount(torch.tensor([tok for t in plain.trajectories for tok in t.last_ids]))
    often = int(counts.argmax())
    with torch.no_grad():
        head = engine.model.get_output_embeddings().weight
        head[end_of_turn] = head[often] * 1.05
    plain = _agent(built, engine, "hf").generate(_rows(), params)
    lengths = [end - start for t in plain.trajectories for start, end in t.spans]
    assert min(lengths) <= 4 and max(lengths) == 8 and all(t.turns == 3 for t in plain.trajectories)
    monkeypatch.setattr(compiled, "CACHE_LENGTH_STEP", 8)
    made_room = []
    make_room = sessions.DecodeSession._make_room
    monkeypatch.setattr(sessions.DecodeSession, "_make_room",
                        lambda self, *a: made_room.append(self.fill) or make_room(self, *a))
    monkeypatch.setattr("mmrl.rollout.agent.session_for",
                        lambda backend, reserve=0: sessions.DecodeSession(backend, reserve=0))
    agent = _agent(built, engine, "hf_compiled", compile=False, min_compact_rows=2, check_every=2)
    moved = []
    moved_rows = agent.backend.moved
    monkeypatch.setattr(agent.backend, "moved", lambda cache, keep, length: moved.append(len(keep))
                        or moved_rows(cache, keep, length))
    fast = agent.generate(_rows(), params)
    assert made_room and moved
    assert agent.backend.fallback_reason is None and agent.session.stats["reprefill_reason"] is None
    _assert_same(fast, plain)


def test_making_room_moves_each_rows_real_slots_to_the_front_in_order():
    """`_make_room` on a cache whose slots hold their own row and slot numbers: each row's
    real slots (the mask's), in order, end at the longest row's count; the mask follows;
    a longer cache is made only when the room is still short."""
    from types import SimpleNamespace

    built, engine = _setup("qwen2")
    rollout = make_rollout("hf_compiled", engine, built.processing, compile=False)
    session = sessions.DecodeSession(rollout)
    cache = rollout.static_cache(3, 16)
    numbered = (torch.arange(16.).view(1, 1, 16, 1) + 100 * torch.arange(3.).view(3, 1, 1, 1)).expand(3, 2, 16, 4)
    for layer in cache.layers:
        layer.lazy_initialization(numbered, numbered)
        layer.keys.copy_(numbered)
        layer.values.copy_(numbered)
        layer.cumulative_length.fill_(12)
    real = [[0, 1, 2, 3, 4, 5, 8, 9, 11], [3, 4, 5, 6, 7, 9, 10], [1, 4, 7, 10]]
    mask = torch.zeros(3, 16, dtype=torch.long)
    for row, slots in enumerate(real):
        mask[row, slots] = 1
    session.cache, session.mask, session.length, session.fill, session.rows = cache, mask, 16, 12, ["a", "b", "c"]
    run = SimpleNamespace(dtype=None, device=torch.device("cpu"))
    for needed, length in ((7, 16), (20, compiled.CACHE_LENGTH_STEP)):
        session._make_room(run, needed)
        assert session.fill == 9 and session.length == length
        assert session.cache is cache if length == 16 else session.cache is not cache
        for layer in session.cache.layers:
            assert int(layer.cumulative_length) == 9
            for row, slots in enumerate(real):
                kept = session.mask[row].nonzero().squeeze(-1).tolist()
                assert kept == list(range(9 - len(slots), 9))
                for tensor in (layer.keys, layer.values):
                    assert tensor[row, 0, kept, 0].tolist() == [100.0 * row + slot for slot in slots]


def test_media_whose_part_is_not_found_prefill_whole(monkeypatch):
    """Where the new images' tensors cannot be cut out of the whole conversation's, the
    turn prefills every conversation whole, says why, and still gives plain generate's."""
    built, engine = _setup("idefics3")
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    monkeypatch.setattr(sessions, "_same", lambda alone, part: False)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    fast = agent.generate(_rows(), GREEDY)
    stats = agent.session.stats
    assert agent.backend.fallback_reason is None
    # Every turn prefilled whole but the first, whose repeated openings were prefilled once.
    repeated = _suffix_tokens(fast.trajectories, shared_openings=False) - _suffix_tokens(fast.trajectories)
    assert "pixel_values" in stats["reprefill_reason"] and stats["prefill_tokens"] == stats["whole_tokens"] - repeated
    _assert_same(fast, plain)


def test_keep_cache_off_and_other_backends_go_turn_by_turn():
    built, engine = _setup("qwen2")
    kept = _agent(built, engine, "hf_compiled", compile=False).generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    agent.keep_cache = False
    off = agent.generate(_rows(), GREEDY)
    assert agent.session is None and "agent/prefill_tokens" not in off.stats
    assert agent.backend.fallback_reason is None
    _assert_same(off, kept)
    plain = _agent(built, engine, "hf")
    plain.generate(_rows(), GREEDY)
    assert plain.session is None


def test_sampled_turns_keep_their_log_probs():
    """Sampling (temperature 1) on the kept cache: each policy turn's log-probs equal the
    training pass's over the final trajectory (the context, images and positions of the
    whole conversation)."""
    built, engine = _setup("qwen2_5_vl")
    torch.manual_seed(0)
    agent = _agent(built, engine, "hf_compiled", compile=False)
    result = agent.generate(_rows(), SamplingParams(n=2, max_new_tokens=4, logprobs=True))
    assert agent.backend.fallback_reason is None and agent.session.stats["reprefilled_samples"] == 0
    seqs = trajectory_sequences(result.trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = engine.log_probs(seqs, temperature=1.0, with_entropy=False)
    sampler = torch.cat([torch.tensor(t.logprobs) for t in result.trajectories])
    torch.testing.assert_close(logp[seqs.response_mask.bool()], sampler, atol=2e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_cache_turns_on_cuda_compiled_equal_plain_generate(family):
    """The same agent run with the decode step compiled (inductor, CUDA graphs) on CUDA,
    fp32: plain generate's tokens and log-probs, the later turns prefilling only what is
    new; a second run (Qwen2.5-VL: its later turns' ids put together from the rows' last
    prompts, `text_turns`) too."""
    built, engine = _setup(family, device="cuda")
    plain = _agent(built, engine, "hf").generate(_rows(), GREEDY)
    agent = _agent(built, engine, "hf_compiled")
    for run in range(2):
        fast = agent.generate(_rows(), GREEDY)
        assert agent.backend.fallback_reason is None
        stats = agent.session.stats
        assert stats["turn_by_turn"] is None and stats["reprefilled_samples"] == 0
        assert stats["prefill_tokens"] == _suffix_tokens(fast.trajectories) < stats["whole_tokens"]
        assert stats["text_turns"] == (1 + run if family == "qwen2_5_vl" else 0)
        assert [t.turns for t in fast.trajectories] == [t.turns for t in plain.trajectories]
        for ours, theirs in zip(fast.trajectories, plain.trajectories):
            assert ours.ids == theirs.ids and ours.spans == theirs.spans
            torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-3, rtol=0)
