"""Stage 5, verify: import the rendered adapter under a scratch module name, run the
zoo's quick checks on its tiny model and keep the capabilities that passed."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

from mmrl import errors
from mmrl.adapter import Capabilities
from mmrl.imports import load_module
from mmrl.scaffold.base import CHECKED, TOLERANCE, Discovery, Gap, Layout, Resolved
from mmrl.scaffold.depth import to_write
from mmrl.scaffold.render import base_capabilities, render_adapter, render_processing


_POSITIONS = "position_ids: "


def verify(d: Discovery, layout: Layout, notes: list[str], gaps: list[Gap] | None = None) -> Capabilities | None:
    """Import the rendered adapter (under a scratch module name), run the zoo's quick
    checks on its tiny model and return the capabilities that passed (None when the
    tiny model does not run at all; `d.fill_in` then says why). When a padded batch
    differs from each prompt alone with counted positions, or the tiny model does not run
    with them at all, the checks run again with the
    model placing its own, then (where it has a rope index) with that index computed one
    row at a time, then (text families) with right-padded batches
    (`left_padding = False`: a forward that ignores the mask for pads in front); the
    adapter keeps the first that matched. Each capability left undeclared is added to
    `gaps` (its column, why, what to write by hand)."""
    gaps = [] if gaps is None else gaps
    fill_in = list(d.fill_in)
    verified = _verify_once(d, layout, notes, gaps)
    if verified is None and not d.own_positions:
        # Counted positions can stop the tiny model outright (passed on through **kwargs to
        # a part that reads another length of positions, a Q-Former's): again with the
        # model placing its own, kept where the tiny model then runs.
        d.own_positions, stopped = True, list(d.fill_in)
        d.fill_in[:] = fill_in
        again_notes: list[str] = []
        again_gaps: list[Gap] = []
        verified = _verify_once(d, layout, again_notes, again_gaps)
        if verified is None:  # both causes are for the user to fix
            own = [f"with the model's own positions, {item}" for item in d.fill_in[len(fill_in):]]
            d.own_positions, d.fill_in[:] = False, stopped + own
        else:
            notes[:], gaps[:] = again_notes, again_gaps
    if verified is not None and _tower_unreached(gaps) and not d.redraw_zeros:
        verified = _with_zeros_drawn(d, layout, notes, gaps, verified)
    if d.own_positions or not _position_gap(d):
        return _with_rope_index_positions(d, layout, notes, gaps, verified)
    attempts = [{"own_positions": True}]
    if _has_rope_index(d.resolved):
        attempts.append({"rope_index_per_row": True})
    if not d.resolved.is_vision_language:  # right-padded rollout takes token ids only
        attempts.append({"left_padding": False})
    kept = list(d.fill_in)
    for attempt in attempts:
        for name, value in attempt.items():
            setattr(d, name, value)
        d.fill_in[:] = [item for item in kept if not item.startswith(_POSITIONS)]
        again_notes: list[str] = []
        again_gaps: list[Gap] = []
        again = _verify_once(d, layout, again_notes, again_gaps)
        if again is not None and not _position_gap(d):
            notes[:] = again_notes
            gaps[:] = again_gaps
            return again
        for name in attempt:
            setattr(d, name, type(d).__dataclass_fields__[name].default)
    d.fill_in[:] = kept
    return verified


# The single_image gap where the images reach no trainable weight of the tower.
TOWER_UNREACHED = "no gradient reaches the vision tower: the images do not change the loss"


def zero_weights(model) -> tuple[str, ...]:
    """Name patterns (layer indices as `*`) of the parameters a random init left all zero,
    biases and norms aside: gates and projections that a checkpoint fills in."""
    import re

    found = [re.sub(r"\.\d+\.", ".*.", name) for name, p in model.named_parameters()
             if p.numel() and not name.endswith("bias") and "norm" not in name.lower() and not bool(p.any())]
    return tuple(dict.fromkeys(found))


def _tower_unreached(gaps: list[Gap]) -> bool:
    return any(g.column == "single_image" and g.cause.startswith(TOWER_UNREACHED) for g in gaps)


# Columns a model that computes its own rope positions cannot have while they are left to
# it: packed rows (it counts positions across sequences) and shared media (it computes them
# from the batch's media, which holds each prompt's once).
_WRITTEN_POSITIONS_COLUMNS = ("padding_free", "media_sharing")


def _with_rope_index_positions(d: Discovery, layout: Layout, notes: list[str], gaps: list[Gap],
                               verified: Capabilities | None) -> Capabilities | None:
    """Where the model computes its own rope positions (`get_rope_index`) and packing or
    shared media did not verify, the checks again with the adapter writing those positions
    out (`rope_index_positions`); kept where the adapter then declares all it did and more."""
    if (verified is None or d.own_positions or d.rope_index_per_row or not _has_rope_index(d.resolved)
            or not any(g.column in _WRITTEN_POSITIONS_COLUMNS for g in gaps)):
        return verified
    d.rope_index_positions = True
    fill_in = list(d.fill_in)
    again_notes: list[str] = []
    again_gaps: list[Gap] = []
    again = _verify_once(d, layout, again_notes, again_gaps)
    before, after = set(verified.declared()), set(again.declared()) if again is not None else set()
    if again is not None and after > before and not _position_gap(d) and _rope_index_is_the_models(d, layout):
        notes[:] = again_notes
        gaps[:] = again_gaps
        return again
    d.rope_index_positions, d.fill_in[:] = False, fill_in
    return verified


def _rope_index_is_the_models(d: Discovery, layout: Layout) -> bool:
    """Whether the written-out positions give the logits the model's own give, on a batch
    of images and on one with a video (which the quick checks do not hold, and for which a
    rope index may need more than the batch's names give it): a batch the model itself
    cannot take (a processing without video) is left out."""
    import torch

    from mmrl import build_model
    from mmrl.checks import logits_of, sample_conversations, video_conversations

    with _rendered(d, layout):
        built = build_model(d.family, random_init=True)
        for conversations in (sample_conversations(built.adapter), video_conversations()):
            try:
                batch = {k: v for k, v in built.processing(conversations).items() if k != "position_ids"}
                own = logits_of(built.model, batch)
            except Exception:  # noqa: BLE001 - not a batch this family takes
                continue
            try:
                positions = built.adapter.position_ids(built.model, batch)
                written = logits_of(built.model, {**batch, "position_ids": positions})
            except Exception:  # noqa: BLE001 - a batch the model takes and its written positions do not
                return False
            mask = batch["attention_mask"].bool()
            if not torch.allclose(own[mask], written[mask], atol=TOLERANCE, rtol=0):
                return False
    return True


def _has_rope_index(resolved: Resolved) -> bool:
    """Whether a class of the model's module computes its rope index itself
    (transformers' `get_rope_index`, on the inner model the class wraps)."""
    import transformers

    module = sys.modules[getattr(transformers, resolved.model_class).__module__]
    return any(isinstance(v, type) and hasattr(v, "get_rope_index") for v in vars(module).values())


def _position_gap(d: Discovery) -> bool:
    return any(item.startswith(_POSITIONS) for item in d.fill_in)


def _with_zeros_drawn(d: Discovery, layout: Layout, notes: list[str], gaps: list[Gap],
                      verified: Capabilities) -> Capabilities:
    """The tiny model's images reach no weight of its tower: where the class initializes
    weights to zero (a gate in front of cross-attention, an image projection), the checks
    again with the adapter's prepare_model drawing them (`redraw_zeros`); kept where the
    tower then learns."""
    from mmrl import build_model

    with _rendered(d, layout):
        d.redraw_zeros = zero_weights(build_model(d.family, random_init=True).model)
    if not d.redraw_zeros:
        return verified
    again_notes: list[str] = []
    again_gaps: list[Gap] = []
    fill_in = list(d.fill_in)
    again = _verify_once(d, layout, again_notes, again_gaps)
    if again is not None and not _tower_unreached(again_gaps):
        notes[:] = again_notes
        gaps[:] = again_gaps
        return again
    d.redraw_zeros, d.fill_in[:] = (), fill_in
    return verified


@contextlib.contextmanager
def _rendered(d: Discovery, layout: Layout):
    """The adapter (and processing) as rendered now, registered under scratch module names."""
    from mmrl.registry import unregister

    scratch = Path(tempfile.mkdtemp(prefix="mmrl-add-model-"))
    names = []
    try:
        processing_ref = None
        if layout.processing is not None:
            (scratch / "processing.py").write_text(render_processing(d))
            name = f"_mmrl_scaffold_processing_{d.family}"
            load_module(name, scratch / "processing.py")
            names.append(name)
            processing_ref = f"{name}:{d.class_name}Processing"
        (scratch / "adapter.py").write_text(render_adapter(d, layout, base_capabilities(d), processing_ref))
        name = f"_mmrl_scaffold_adapter_{d.family}"
        load_module(name, scratch / "adapter.py")
        names.append(name)
        try:
            yield
        finally:
            unregister(d.family)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        shutil.rmtree(scratch, ignore_errors=True)


def _verify_once(d: Discovery, layout: Layout, notes: list[str], gaps: list[Gap]) -> Capabilities | None:
    import torch

    from mmrl import build_model
    from mmrl.checks import (
        generate, lora_merge_difference, loss_and_backward, packed_vs_padded, padded_vs_single,
        sample_conversations,
    )

    with _rendered(d, layout):
        return _run_checks(d, notes, gaps, torch, build_model, generate, lora_merge_difference,
                           loss_and_backward, packed_vs_padded, padded_vs_single, sample_conversations)


def _run_checks(d, notes, gaps, torch, build_model, generate, lora_merge_difference, loss_and_backward,
                packed_vs_padded, padded_vs_single, sample_conversations) -> Capabilities | None:
    verified: dict[str, bool] = {}

    def check(capability: str, run) -> None:
        try:
            ok, detail = run()
        except Exception as exc:  # a failing check is a finding, not a crash
            ok, detail = False, errors.one_line(exc, typed=True)
        verified[capability] = ok
        if not ok:
            notes.append(f"{capability} not declared: {detail}")
            cause = errors.one_line(detail, 240, whole=True)
            gaps.append(Gap(capability, cause, to_write(capability, cause, d.tiny.config if d.tiny else None)))

    def fresh():
        return build_model(d.family, random_init=True)

    try:
        built = fresh()
        conversations = sample_conversations(built.adapter)
        gap = padded_vs_single(built, conversations)
    except Exception as exc:  # the tiny model itself does not run: nothing can be verified
        hint = ("the processor's arguments (image size, tokens per image, special tokens) must agree with the "
                "config" if d.resolved.is_vision_language else "the shrunk config values must fit the model code")
        d.fill_in.append(f"tiny(): the scaffolded tiny model does not run ({errors.whole_cause(exc, 320)}); "
                         f"{hint}; then run the family's tests")
        return None
    if gap >= TOLERANCE:
        d.fill_in.append(f"{_POSITIONS}a padded batch differs from each prompt alone by {gap:.2g}")
    vlm = d.resolved.is_vision_language

    def learns():
        from mmrl.checks import tower_learns

        loss = loss_and_backward(built, conversations)
        grads = [p.grad for p in built.model.parameters() if p.grad is not None]
        ok = bool(torch.isfinite(loss)) and any(g.abs().sum() > 0 for g in grads)
        if ok and vlm and not tower_learns(built):
            return False, TOWER_UNREACHED
        return ok, f"loss {loss.item():.3g}"

    def generates():
        tokens = generate(built, conversations, max_new_tokens=4)
        return tokens.shape == (len(conversations), 4), f"generated shape {tuple(tokens.shape)}"

    def packs():
        from mmrl.checks import packed_boundary_gap

        boundary = packed_boundary_gap(built)
        if not boundary.exact:
            return False, f"state crosses a packed sequence boundary (a short sample behind a long neighbour " \
                          f"differs from itself alone by {boundary})"
        gap = packed_vs_padded(built, conversations)
        return gap < TOLERANCE, f"packed and padded logits differ by {gap:.2g}"

    def checkpoints():
        model = fresh()
        plain = loss_and_backward(model, conversations)
        grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
        model.model.zero_grad(set_to_none=True)
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        again = loss_and_backward(model, conversations)
        same = all(torch.allclose(g, p.grad, atol=1e-5) for n, p in model.model.named_parameters()
                   if (g := grads.get(n)) is not None and p.grad is not None)
        return bool(torch.allclose(plain, again, atol=1e-6)) and same, "checkpointed gradients differ"

    def lora(scope):
        def run():
            gap, effect = lora_merge_difference(fresh(), conversations, scope)
            return effect > 1e-3 and gap < TOLERANCE, f"LoRA ({scope}) merge gap {gap:.2g}, effect {effect:.2g}"
        return run

    def two_images():
        model = fresh()
        loss = loss_and_backward(model, sample_conversations(model.adapter, images_per_prompt=2))
        return bool(torch.isfinite(loss)), f"loss {loss.item()}"

    check("single_image" if vlm else "generation", learns)
    check("generation", generates)
    check("padding_free", packs)
    check("gradient_checkpointing", checkpoints)
    check("lora_language", lora("language"))
    def shares_media():
        from mmrl.probes import Subject, probe
        from mmrl.registry import get_adapter

        result = probe("media_sharing").run(Subject(get_adapter(d.family), source=d.family))
        return result.status == "verified", result.reason

    if vlm:
        check("lora_vision", lora("vision") if d.vision_leaves else (lambda: (False, "no vision leaves")))
        check("multi_image", two_images)
        check("media_sharing", shares_media)
    return Capabilities(**{name: verified.get(name, False) for name in CHECKED})


