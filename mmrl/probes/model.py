"""Probes of the model itself: build, save/reload, rope, forward/backward, generation,
padded and packed batches, freezing, LoRA, activation checkpointing, images and video.

Each check uses the shared checks of `mmrl.checks` with the tolerances of
`tests/test_zoo.py`, so a probe and the zoo test decide the same way.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from mmrl.adapter import PART_NAMES, ModelAdapter
from mmrl.checks import (
    checkpointing_difference,
    generate,
    logits_of,
    lora_merge_difference,
    loss_and_backward,
    packed_boundary_gap,
    packed_vs_padded,
    padded_vs_single,
    sample_conversations,
    video_conversations,
)
from mmrl.probes.base import TOLERANCE, CheckFailed, Subject, Verified, require
from mmrl.rollout.base import trim_responses

RELOAD_TOLERANCE = 1e-5  # save_pretrained -> from_pretrained, fp32 logits
LORA_EFFECT = 1e-3  # random LoRA weights must move the logits at least this much
CHECKPOINTING_LOSS_ATOL = 1e-6  # recomputation in fp32 repeats the same kernels
CHECKPOINTING_GRAD_ATOL = 1e-5


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _has_grad(params) -> bool:
    return any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)


def _part_grads(built) -> dict[str | None, bool]:
    from mmrl.parts import parameters_by_part

    return {part: _has_grad(p for _, p in params if p.requires_grad)
            for part, params in parameters_by_part(built.model, built.adapter).items()}


# -- applicability ---------------------------------------------------------------------
def needs_images(adapter: ModelAdapter) -> str | None:
    return None if "image" in adapter.modalities else "text-only family (no image modality)"


def needs_video(adapter: ModelAdapter) -> str | None:
    return None if "video" in adapter.modalities else "the family lists no video modality"


def needs_vision_lora(adapter: ModelAdapter) -> str | None:
    if "image" not in adapter.modalities:
        return "text-only family (no vision tower)"
    return None if adapter.lora.vision else "the adapter names no vision LoRA targets (lora.vision)"


def needs_language_lora(adapter: ModelAdapter) -> str | None:
    return None if adapter.lora.language else "the adapter names no language LoRA targets (lora.language)"


# -- checks ----------------------------------------------------------------------------
def check_random_init(subject: Subject) -> Verified:
    """The model builds and the declared parts and shard layers match it."""
    from mmrl.parts import check_parts, parameters_by_part

    built = subject.build()
    model, adapter = built.model, built.adapter
    missing_paths = check_parts(model, adapter)
    require(not missing_paths, f"declared part paths name nothing in the model: {', '.join(missing_paths[:3])}")
    groups = parameters_by_part(model, adapter)
    orphans = [name for name, _ in groups.get(None, [])]
    require(not orphans, f"{len(orphans)} parameters belong to no part, e.g. {orphans[0] if orphans else ''}")
    classes = {type(m).__name__ for m in model.modules()}
    absent = sorted(set(adapter.shard_layers) - classes)
    require(not absent, f"shard_layers names classes the model lacks: {', '.join(absent)}")
    how = "random init of the tiny config" if subject.random_init else "loaded from the checkpoint"
    return Verified(
        f"{type(model).__name__} ({how}): every parameter is in a declared part; shard layers present",
        {"parameters": _params(model), "parts": sorted(p for p in groups if p), "class": type(model).__name__},
    )


def check_save_reload(subject: Subject) -> Verified:
    built = subject.build()
    conversations = sample_conversations(built.adapter)
    before = logits_of(built.model.eval(), built.inputs(conversations))
    with tempfile.TemporaryDirectory() as tmp:
        built.save(tmp)
        require((Path(tmp) / "model.safetensors").is_file(), "save_pretrained wrote no model.safetensors")
        reloaded = subject.load(tmp)
    require(reloaded.adapter is built.adapter,
            f"the saved checkpoint (model_type {built.model.config.model_type!r}) reloads as family "
            f"{reloaded.adapter.family!r}, not {built.adapter.family!r}")
    after = logits_of(reloaded.model.eval(), reloaded.inputs(conversations))
    gap = (before - after).abs().max().item()
    if not torch.allclose(before, after, atol=RELOAD_TOLERANCE):
        changed = _changed_inputs(built.inputs(conversations), reloaded.inputs(conversations))
        culprit = (f"the reloaded processor makes different inputs ({changed})" if changed
                   else "same inputs, so the weights or the model code differ")
        raise CheckFailed(f"reloaded model disagrees with the saved one: max |logit diff| {gap:.2e} "
                          f"(tolerance {RELOAD_TOLERANCE:.0e}); {culprit}")
    return Verified(f"save_pretrained + from_pretrained (safetensors) give the same logits "
                    f"(max |diff| {gap:.1e} <= {RELOAD_TOLERANCE:.0e})", {"max_abs_diff": gap})


def _changed_inputs(a: dict, b: dict) -> str:
    """Which model inputs differ between two processings of the same conversations."""
    changed = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            continue
        if x.shape != y.shape:
            changed.append(f"{key} shape {tuple(x.shape)} vs {tuple(y.shape)}")
        elif not torch.equal(x, y):
            changed.append(f"{key} max |diff| {(x.float() - y.float()).abs().max().item():.2e}")
    missing = sorted(set(a) ^ set(b))
    return ", ".join(changed + [f"{k} only on one side" for k in missing])


def check_rope(subject: Subject) -> Verified:
    from mmrl.rope import RopeSpec

    built = subject.build()
    spec = built.adapter.rope(built.model.config)
    problems = spec.problems()
    require(not problems, f"rope spec is inconsistent: {problems[0] if problems else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        built.model.config.save_pretrained(tmp)
        raw = json.loads((Path(tmp) / "config.json").read_text())
    from_raw = RopeSpec.from_config(raw)
    require(from_raw == spec, f"raw config.json and the loaded config disagree: {from_raw} != {spec}")
    summary = {"theta": spec.theta, "scaling": spec.scaling, "rotary_dim": spec.rotary_dim,
               "mrope_section": list(spec.mrope_section) if spec.mrope_section else None,
               "per_layer_type": [name for name, _ in spec.per_layer_type]}
    return Verified("RopeSpec from config.json equals the loaded config's, and is consistent", summary)


def check_forward_backward(subject: Subject) -> Verified:
    built = subject.build()
    conversations = sample_conversations(built.adapter)
    loss = loss_and_backward(built, conversations)
    require(bool(torch.isfinite(loss)), f"loss is {loss.item()}")
    reached = _part_grads(built)
    require(reached.get("language", False), "no gradient reached the language model")
    if built.adapter.is_multimodal:
        require(reached.get("vision", False), "no gradient reached the vision tower")
    what = "two prompts" + (" with images of two sizes" if built.adapter.is_multimodal else "")
    return Verified(f"finite LM loss on {what}; gradients reach "
                    + ", ".join(p for p, ok in sorted(reached.items(), key=str) if p and ok),
                    {"loss": round(loss.item(), 4),
                     "parts_with_gradient": sorted(p for p, ok in reached.items() if p and ok)})


def check_generation(subject: Subject) -> Verified:
    built = subject.build()
    conversations = sample_conversations(built.adapter)
    if not subject.random_init:
        return _checkpoint_generation(built, conversations)
    new_tokens = generate(built, conversations, max_new_tokens=8)
    require(tuple(new_tokens.shape) == (len(conversations), 8),
            f"generated shape {tuple(new_tokens.shape)}, expected ({len(conversations)}, 8)")
    blocked = torch.tensor(built.processing.blocked_token_ids, device=new_tokens.device)
    require(not torch.isin(new_tokens, blocked).any(), "a blocked special token was generated")
    texts = built.processing.decode(new_tokens)
    require(len(texts) == len(conversations) and all(isinstance(t, str) for t in texts),
            "decode did not return one string per prompt")
    return Verified("HF generate: 8 greedy tokens per prompt, no blocked special tokens, decoded",
                    {"new_tokens": new_tokens.tolist()})


def _checkpoint_generation(built, conversations) -> Verified:
    """A checkpoint is served by plain `generate` with its own `generation_config.json`:
    greedy, that must give the answers the rollout's decoding gives (blocked tokens
    suppressed, stopping at the stop ids), so an export missing those constraints fails
    here where its policy would reach a blocked token."""
    model, processing = built.model.eval(), built.processing
    batch = dict(processing(conversations))
    stops, pad = processing.stop_token_ids, built.tokenizer.pad_token_id
    blocked = processing.blocked_token_ids
    prompt = batch["input_ids"].shape[1]
    with torch.no_grad():
        plain = model.generate(**batch, do_sample=False, max_new_tokens=8)[:, prompt:]
        trained = model.generate(**batch, do_sample=False, max_new_tokens=8, eos_token_id=stops, pad_token_id=pad,
                                 suppress_tokens=blocked or None)[:, prompt:]
    plain, plain_mask, _ = trim_responses(plain, stops, pad)
    trained, trained_mask, _ = trim_responses(trained, stops, pad)
    answers = [row[mask.bool()].tolist() for row, mask in zip(plain, plain_mask)]
    expected = [row[mask.bool()].tolist() for row, mask in zip(trained, trained_mask)]
    config = model.generation_config
    suppressed = set(config.suppress_tokens or ())
    lacking = [i for i in blocked if i not in suppressed]
    reached = sorted({t for row in answers for t in row} & set(blocked))
    if reached:
        names = ", ".join(built.tokenizer.convert_ids_to_tokens(reached))
        raise CheckFailed(f"plain generate with the checkpoint's generation_config.json produces blocked special "
                          f"tokens ({names}): its suppress_tokens lack {len(lacking)} of the {len(blocked)} tokens "
                          f"the rollout blocks; export it with `mmrl export` (mmrl/export.py writes them)")
    require(answers == expected, f"plain generate with the checkpoint's generation_config.json answers {answers}, "
                                 f"the rollout's decoding {expected}")
    note = "" if not lacking else f" (its generation config suppresses {len(blocked) - len(lacking)} of the " \
                                  f"{len(blocked)} blocked tokens; greedy reached none of the others)"
    return Verified("plain generate with the checkpoint's own generation config gives the rollout's greedy "
                    "answers, no blocked special tokens" + note,
                    {"new_tokens": answers, "suppressed_missing": len(lacking)})


def check_padded_batch(subject: Subject) -> Verified:
    built = subject.build()
    gap = padded_vs_single(built, sample_conversations(built.adapter))
    layout = "left-padded batch" if built.adapter.left_padding else "batch of one sequence a row (left_padding=False)"
    require(gap < TOLERANCE, f"{layout} differs from each prompt alone: max |logit diff| {gap:.2e} "
                             f"(tolerance {TOLERANCE:.0e})")
    return Verified(f"{layout} with the adapter's position ids equals each prompt alone "
                    f"(max |diff| {gap:.1e} < {TOLERANCE:.0e})", {"max_abs_diff": gap})


def check_padding_free(subject: Subject) -> Verified:
    """The packed batch equals the padded one, and a short sample packed right behind a
    long neighbour has the log-probs it has alone (no state crosses the boundary: the
    convolution, linear-attention and recurrent layers of hybrid families)."""
    built = subject.build()
    boundary = packed_boundary_gap(built)
    require(boundary.exact, f"state crosses a packed sequence boundary: a short sample behind a long neighbour "
                            f"differs from itself alone by {boundary}")
    gap = packed_vs_padded(built, sample_conversations(built.adapter))
    require(gap < TOLERANCE,
            f"packed batch differs from padded: max |logit diff| {gap:.2e} (tolerance {TOLERANCE:.0e})")
    return Verified(f"packed (padding-free) batch equals the padded one (max |diff| {gap:.1e} < {TOLERANCE:.0e}); "
                    f"a short sample behind a long neighbour equals itself alone ({boundary})",
                    {"max_abs_diff": gap, "boundary_max_abs_logprob_diff": boundary.logprob,
                     "boundary_max_abs_hidden_diff": boundary.hidden})


def check_freeze(subject: Subject) -> Verified:
    """Freeze each declared part alone: it gets no gradient, every other part still does
    (parameters shared with the frozen part, like tied embeddings, excepted)."""
    from mmrl.parts import freeze, parameters_by_part

    built = subject.build()
    model, adapter = built.model, built.adapter
    conversations = sample_conversations(adapter)
    groups = parameters_by_part(model, adapter)
    parts = [p for p in PART_NAMES if getattr(adapter.parts, p) and groups.get(p)]
    initial = {id(p): p.requires_grad for p in model.parameters()}
    frozen_counts = {}
    for part in parts:
        for p in model.parameters():
            p.requires_grad_(initial[id(p)])
        model.zero_grad(set_to_none=True)
        frozen_counts[part] = freeze(model, parts=(part,), adapter=adapter)
        loss_and_backward(built, conversations)
        frozen = {id(p) for _, p in groups[part]}
        require(all(p.grad is None and not p.requires_grad for _, p in groups[part]),
                f"freezing {part}: its parameters still get gradients")
        for other in parts:
            own = [p for _, p in groups[other] if id(p) not in frozen and initial[id(p)]]
            if other != part and own:
                require(_has_grad(own), f"freezing {part} also stopped the gradients of {other}")
    return Verified(f"each part frozen alone ({', '.join(parts)}) gets no gradient; the others still train",
                    {"frozen_tensors": frozen_counts})


def _lora(subject: Subject, scopes: tuple[str, ...]) -> Verified:
    evidence = {}
    for scope in scopes:
        fresh = subject.build()
        gap, effect = lora_merge_difference(fresh, sample_conversations(fresh.adapter), scope)
        require(effect > LORA_EFFECT, f"LoRA ({scope}) did not change the output (max |diff| {effect:.1e})")
        require(gap < TOLERANCE, f"LoRA ({scope}) merged and unmerged differ by {gap:.2e} (tolerance {TOLERANCE:.0e})")
        evidence[scope] = {"merge_max_abs_diff": gap, "lora_effect": effect}
    return Verified(f"LoRA ({', '.join(scopes)}) changes the logits, and merged equals unmerged "
                    f"(tolerance {TOLERANCE:.0e})", evidence)


def check_lora_language(subject: Subject) -> Verified:
    return _lora(subject, ("language",))


def check_lora_vision(subject: Subject) -> Verified:
    return _lora(subject, ("vision", "all"))


def check_gradient_checkpointing(subject: Subject) -> Verified:
    built = subject.build()
    gap = checkpointing_difference(built, sample_conversations(built.adapter))
    require(gap["enabled"], "gradient checkpointing did not turn on")
    require(gap["same_parameters"], "checkpointing changed which parameters get gradients")
    require(gap["loss_diff"] <= CHECKPOINTING_LOSS_ATOL, f"loss with checkpointing differs by {gap['loss_diff']:.1e}")
    require(gap["max_grad_diff"] <= CHECKPOINTING_GRAD_ATOL,
            f"gradients differ with checkpointing by {gap['max_grad_diff']:.1e}")
    return Verified(f"activation checkpointing gives the same loss and gradients "
                    f"(max |grad diff| {gap['max_grad_diff']:.1e})",
                    {"max_abs_grad_diff": gap["max_grad_diff"], "tensors": gap["tensors"]})


def check_single_image(subject: Subject) -> Verified:
    built = subject.build()
    conversations = sample_conversations(built.adapter, images_per_prompt=1)
    loss = loss_and_backward(built, conversations)
    require(bool(torch.isfinite(loss)), f"loss is {loss.item()}")
    require(_part_grads(built).get("vision", False), "no gradient reached the vision tower")
    new_tokens = generate(built, conversations, max_new_tokens=4)
    require(tuple(new_tokens.shape) == (2, 4), f"generated shape {tuple(new_tokens.shape)}, expected (2, 4)")
    return Verified("one image per prompt (56x56 and 84x112 in one batch): finite loss, vision gradients, generation",
                    {"loss": round(loss.item(), 4)})


def check_multi_image(subject: Subject) -> Verified:
    built = subject.build()
    loss = loss_and_backward(built, sample_conversations(built.adapter, images_per_prompt=2))
    require(bool(torch.isfinite(loss)), f"loss with two images per prompt is {loss.item()}")
    return Verified("two images of different sizes per prompt: finite loss and backward",
                    {"loss": round(loss.item(), 4), "vision_gradient": _part_grads(built).get("vision", False)})


def check_video(subject: Subject) -> Verified:
    built = subject.build()
    new_tokens = generate(built, video_conversations(), max_new_tokens=4)
    require(tuple(new_tokens.shape) == (1, 4), f"generated shape {tuple(new_tokens.shape)}, expected (1, 4)")
    evidence: dict = {"new_tokens": new_tokens.tolist()}
    if "image" in subject.adapter.modalities:
        # A batch that mixes image prompts and a video prompt: each row as if alone.
        mixed = sample_conversations(subject.adapter) + video_conversations()
        evidence["mixed_batch_max_diff"] = gap = padded_vs_single(built, mixed)
        require(gap < TOLERANCE, f"in a batch mixing image and video prompts a row differs from itself alone by "
                                 f"{gap:.2e} (bound {TOLERANCE:.0e})")
    return Verified("a 4-frame 56x56 clip: processed and 4 tokens generated"
                    + ("; a batch mixing it with image prompts equals each prompt alone" if len(evidence) > 1 else ""),
                    evidence)
