"""Probes of the training stack: the critic's value head, the FSDP2 multi-process step
and vLLM rollout with weight sync (Ulysses sequence parallelism: probes/sequence_parallel.py).

The FSDP2 probe launches `mmrl.probes.fsdp_step` under torchrun (2 processes) once for
all the subjects it is given, through `mmrl.probes.launcher`.
"""

from __future__ import annotations

import importlib.util
import os
import re

import torch

from mmrl.adapter import ModelAdapter
from mmrl.parallel.mesh import backend
from mmrl.probes.base import CheckFailed, NotRunHere, Subject, Verified, one_line, require
from mmrl.probes.launcher import PROCESSES, exact_numerics, require_processes, single_process, torchrun_many


def _sequences(built, engine, responses_per_prompt: int = 4):
    from mmrl.checks import sample_conversations
    from mmrl.engine import join

    conversations = sample_conversations(built.adapter)
    vocab = built.model.config.get_text_config().vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (len(conversations), responses_per_prompt)
    responses = torch.randint(min(20, vocab - 1), vocab, shape, generator=generator, device="cpu")
    mask = torch.ones_like(responses)
    mask[0, -1] = 0
    prompts = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in built.processing(conversations).items()}
    seqs = join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id)
    return seqs.to(engine.dist.device)


# -- critic ----------------------------------------------------------------------------
def check_critic(subject: Subject) -> Verified:
    """A value-head engine gives one value per response token, and a value-loss step
    moves the values toward their returns."""
    from mmrl.algos.losses import value_loss
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine

    built = subject.build()
    engine = Engine(built, single_process(subject.device), optim=OptimConfig(lr=1e-2, critic_lr=1e-2),
                    lr=1e-2, total_steps=1, value_head=True)
    seqs = _sequences(built, engine)
    with torch.no_grad():
        before = engine.values(seqs)
    require(tuple(before.shape) == tuple(seqs.response_ids.shape),
            f"values have shape {tuple(before.shape)}, responses {tuple(seqs.response_ids.shape)}")
    require(bool(torch.isfinite(before).all()), "values are not finite")
    returns = torch.ones_like(before)
    loss, _ = value_loss(engine.values(seqs), before, returns, seqs.response_mask, clip=None)
    loss.backward()
    head_grad = engine.value_head.weight.grad
    require(head_grad is not None and bool(head_grad.abs().sum() > 0), "no gradient reached the value head")
    engine.step()
    with torch.no_grad():
        after = engine.values(seqs)
    mask = seqs.response_mask.bool()
    error_before = (before - returns)[mask].abs().mean().item()
    error_after = (after - returns)[mask].abs().mean().item()
    require(error_after < error_before,
            f"a value-loss step did not reduce the value error ({error_before:.3f} -> {error_after:.3f})")
    return Verified("value head: one finite value per response token; a value-loss step moves values toward returns",
                    {"value_error_before": error_before, "value_error_after": error_after})


# -- shared media encoding ---------------------------------------------------------------
MEDIA_SHARING_LOGP_ATOL = 1e-5


def media_sharing_inapplicable(adapter: ModelAdapter) -> str | None:
    return None if adapter.is_multimodal else "text-only family (no media to encode)"


def check_media_sharing(subject: Subject) -> Verified:
    """Batches whose rows repeat prompts (images, two in one prompt where the family takes
    several; a video batch too where it takes video): encoding each prompt's media once
    gives the log-probs, gradients and AdamW step of the plain forward, with less input
    through the vision tower."""
    from contextlib import ExitStack

    from mmrl.checks import sample_conversations, video_conversations
    from mmrl.engine import join
    from mmrl.engine.media import SharedMedia
    from mmrl.parts import part_modules
    from mmrl.processing import batch_differences
    from mmrl.probes.fsdp_step import compare_updates, probe_engine, step_and_collect

    adapter = subject.adapter
    # (conversations, owners) per micro-batch: prompts with one image (two sizes) and,
    # where the family takes several, one with two; a video batch apart.
    images = sample_conversations(adapter)
    if adapter.capabilities.multi_image:
        images.append(sample_conversations(adapter, images_per_prompt=2)[1])
    batches = [(images, [0, 1, 0, 0, 1, 1] + [2, 2] * (len(images) > 2))]
    if "video" in adapter.modalities:
        batches.append((video_conversations(), [0, 0, 0]))
    rows = sum(len(owners) for _, owners in batches)
    prompts = sum(len(conversations) for conversations, _ in batches)

    def update(share: bool):
        built, engine = probe_engine(subject, single_process(subject.device))
        engine.shares_media = share  # the probe verifies the claim, so it does not read it
        vocab = built.model.config.get_text_config().vocab_size
        generator = torch.Generator(device="cpu").manual_seed(0)
        seen, logps = [], []
        with ExitStack() as hooks:
            for module in part_modules(engine.model, "vision", built.adapter):
                handle = module.register_forward_pre_hook(
                    lambda _, args, kwargs: seen.append(_input_size(args, kwargs)), with_kwargs=True)
                hooks.callback(handle.remove)
            for conversations, owners in batches:
                # The batch is made on CPU whatever the default device (processors convert
                # to numpy; the random draws use a CPU generator), then follows the model.
                with torch.device("cpu"):
                    expanded = [conversations[o] for o in owners]
                    responses = torch.randint(min(20, vocab - 1), vocab, (len(owners), 5), generator=generator)
                    mask = torch.ones_like(responses)
                    mask[1, 3:] = 0
                    advantages = torch.randn(len(owners), 1, generator=generator)
                    prompts = dict(built.processing(expanded))
                    shared = SharedMedia.of(built.processing, expanded, owners) if share else None
                    if shared is not None:
                        # The rows' batch collated from each prompt's own (what the trainer
                        # uses) equals processing the rows.
                        require(shared.collatable, "the prompts' own batches hold different keys")
                        collated = built.processing.collate([shared.singles[o] for o in shared.owners])
                        differ = batch_differences(collated, prompts)
                        require(not differ,
                                f"rows collated from each prompt's batch differ from processing them: {differ}")
                        prompts = collated
                    seqs = join(prompts, responses, mask, built.adapter, engine.model,
                                built.tokenizer.pad_token_id, shared=shared)
                seqs = seqs.to(engine.dist.device)
                logp, _ = engine.log_probs(seqs)
                (-(logp * advantages.to(logp.device) * seqs.response_mask).sum() / rows).backward()
                logps.append(logp.detach().float().cpu().flatten())
        return torch.cat(logps), (sum(seen), len(seen)), step_and_collect(engine)

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    exact_numerics()
    try:
        plain_logp, plain_work, plain_update = update(False)
        shared_logp, shared_work, shared_update = update(True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = allow_tf32
    logp_gap = (plain_logp - shared_logp).abs().max().item()
    require(logp_gap <= MEDIA_SHARING_LOGP_ATOL,
            f"log-probs with shared media encoding differ from the plain forward by {logp_gap:.2e} "
            f"(bound {MEDIA_SHARING_LOGP_ATOL:.0e})")
    failure, evidence = compare_updates(plain_update, shared_update)
    require(failure is None, f"with shared media encoding, {failure}")
    (plain_work, plain_calls), (shared_work, shared_calls) = plain_work, shared_work
    require(0 < shared_work < plain_work,
            f"the vision tower saw {shared_work} input values with sharing and {plain_work} without")
    return Verified(f"{rows} rows repeating {prompts} prompts: log-probs within {logp_gap:.1e}, same gradients "
                    f"and AdamW step; {plain_work / shared_work:.1f}x less vision input in {shared_calls} calls "
                    f"({plain_calls} plain)",
                    {"max_logp_diff": logp_gap, "vision_input_ratio": plain_work / shared_work,
                     "vision_calls": shared_calls, "vision_calls_plain": plain_calls, **evidence})


def _input_size(args: tuple, kwargs: dict) -> int:
    """Elements of the first tensor a module is called with."""
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            return value.numel()
    return 0


# -- FSDP2 -----------------------------------------------------------------------------
def check_fsdp2_many(subjects: list[Subject]) -> list[tuple[Verified | BaseException, float]]:
    require_processes(subjects[0].device)
    return torchrun_many("mmrl.probes.fsdp_step", subjects,
                         f"{PROCESSES}-process FSDP2 step ({backend(subjects[0].device)}, fp32) equals the "
                         "one-process step: gradients and AdamW-updated weights")


def check_fsdp2(subject: Subject) -> Verified:
    outcome, _ = check_fsdp2_many([subject])[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


# -- vLLM rollout and weight sync --------------------------------------------------------
# fp32 on both sides: the vLLM backend's own test bound (tests/test_vllm.py).
VLLM_LOGPROB_TOLERANCE = 1e-4


def vllm_inapplicable(adapter: ModelAdapter) -> str | None:
    return None if adapter.rollout.vllm_architecture else "the adapter names no vLLM architecture"


def check_vllm(subject: Subject) -> Verified:
    """Greedy vLLM rollout: its log-probs of the sampled tokens against the trainer's,
    then again after an optimizer step and a weight sync."""
    if importlib.util.find_spec("vllm") is None:
        raise NotRunHere("vllm not installed")
    if importlib.util.find_spec("mmrl.rollout.vllm") is None:
        raise NotRunHere("not implemented: mmrl has no vLLM rollout backend (mmrl/rollout/vllm.py) yet",
                         unimplemented=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM logs to stdout by default, which would mix with `mmrl doctor --json`.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from mmrl.checks import sample_conversations
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine, join
    from mmrl.rollout import SamplingParams, make_rollout
    from mmrl.rollout.vllm import UnsupportedByVLLM, platform_limit

    built = subject.build()
    engine = Engine(built, single_process(subject.device), optim=OptimConfig(lr=1e-2), total_steps=2)
    conversations = sample_conversations(built.adapter)
    params = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
    longest = int(built.processing(conversations)["attention_mask"].sum(-1).max())
    fit_context(engine.model.config, longest + params.max_new_tokens)
    try:
        rollout = make_rollout("vllm", engine, built.processing)
    except UnsupportedByVLLM as exc:  # a limit of vLLM on this platform, not a wrong result
        raise NotRunHere(str(exc).split(": use ")[0]) from exc
    except Exception as exc:  # noqa: BLE001 - say which stage failed, in one line
        raise CheckFailed(_vllm_start_failure(exc)) from exc

    def gap_to_trainer() -> float:
        try:
            result = rollout.generate(conversations, params)
        except Exception as exc:  # noqa: BLE001 - say which stage failed, in one line
            if platform_limit(exc):  # a kernel this build of vLLM lacks, first called here
                raise NotRunHere(f"vLLM cannot run this model here ({one_line(exc)})") from exc
            raise CheckFailed(f"vLLM generation failed: {one_line(exc)}") from exc
        require(result.logprobs is not None, "the vLLM backend returned no sampler log-probs")
        prompts = dict(built.processing(conversations))
        seqs = join(prompts, result.response_ids, result.response_mask, built.adapter, engine.model,
                    built.tokenizer.pad_token_id).to(engine.dist.device)
        with torch.no_grad():
            trainer, _ = engine.log_probs(seqs)
        mask = result.response_mask.bool()
        return (trainer.cpu()[mask] - result.logprobs[mask]).abs().max().item()

    try:
        before = gap_to_trainer()
        if before >= VLLM_LOGPROB_TOLERANCE and (dropout := _active_dropout(engine.model)):
            # vLLM never applies dropout; say whether it is the whole difference.
            engine.model.eval()
            without = gap_to_trainer()
            engine.model.train()
            verdict = (f"without it they agree ({without:.1e})" if without < VLLM_LOGPROB_TOLERANCE
                       else f"without it they still differ by {without:.2e}")
            raise CheckFailed(f"vLLM and trainer log-probs differ by {before:.2e}: the trainer's model applies "
                              f"dropout in training ({dropout}), {verdict}; set its dropout probabilities to 0")
        require(before < VLLM_LOGPROB_TOLERANCE, f"vLLM and trainer log-probs differ by {before:.2e}")
        seqs = _sequences(built, engine)  # move the weights, sync them into vLLM, compare again
        logp, _ = engine.log_probs(seqs)
        (-(logp * seqs.response_mask).sum()).backward()
        engine.step()
        try:
            rollout.sync(engine)
        except Exception as exc:  # noqa: BLE001 - say which stage failed, in one line
            raise CheckFailed(f"vLLM weight sync failed: {one_line(exc)}") from exc
        after = gap_to_trainer()
        require(after < VLLM_LOGPROB_TOLERANCE,
                f"after a weight sync, vLLM and trainer log-probs differ by {after:.2e}")
    finally:
        close = getattr(rollout, "close", None)
        if close is not None:
            close()
    return Verified(f"vLLM greedy rollout log-probs match the trainer's before and after a weight sync "
                    f"(tolerance {VLLM_LOGPROB_TOLERANCE:.0e})",
                    {"max_logprob_diff_before": before, "max_logprob_diff_after_sync": after})


def fit_context(config, needed: int) -> None:
    """Widen a rotary-position config's context (`max_position_embeddings`, which vLLM
    takes as its engine length) to `needed` tokens where the probe's prompt is longer
    (an image that expands to thousands of tokens in a tiny config of 1024 positions).
    Rotary positions have no table to outgrow, so the trainer's model is unchanged; a
    model with a learned position table keeps its context, and vLLM says the prompt is
    too long."""
    text = config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    rotary = getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None)
    if isinstance(context, int) and context < needed and rotary:
        text.max_position_embeddings = needed


def _vllm_start_failure(exc: BaseException) -> str:
    """One line on why vLLM did not start from the checkpoint the rollout wrote."""
    # vLLM reads the config.json the rollout wrote; its model classes are written for
    # published checkpoints, whose config.json may carry fields the transformers config
    # class does not define (so a config built in code lacks them).
    missing = re.fullmatch(r"'(\w+Config)' object has no attribute '(\w+)'", str(exc))
    if isinstance(exc, AttributeError) and missing is not None:
        config_class, field = missing.groups()
        return (f"vLLM's model reads config.{field}, which this {config_class} lacks (transformers does not define "
                f"it; published checkpoints' config.json carry it): set it in the adapter's tiny() config")
    frame = _failed_frame(exc)
    if isinstance(exc, KeyError) and exc.args and frame is not None and "vocab[" in (frame.line or ""):
        # A model's processor in vLLM that finds special tokens by looking text up in the
        # vocabulary of the checkpoint's tokenizer.
        return (f"vLLM's processor for this model looks up {exc.args[0]!r} in the tokenizer's vocabulary, which the "
                "tiny tokenizer lacks: give tiny()'s tokenizer that token")
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors) and errors():
        # vLLM's config validation (pydantic): its first error's message, without the list
        # of every architecture vLLM supports that an unsupported one's message ends with.
        message = str(errors()[0].get("msg", "")).split(" Supported architectures:")[0]
        return f"vLLM did not load the model: {message[:300]}"
    where = ""
    if not str(exc).strip() and frame is not None:  # a bare assert: name the line that failed
        where = f" at {frame.filename.split('site-packages/')[-1]}:{frame.lineno} ({(frame.line or '').strip()})"
    return f"vLLM did not load the model: {one_line(exc)}{where}"


def _failed_frame(exc: BaseException):
    """The traceback frame where `exc` was raised (None where it has none)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def _active_dropout(model) -> str:
    """The dropout the model applies in training mode ('' when none): the config's nonzero
    dropout probabilities, e.g. 'resid_pdrop=0.1, attn_pdrop=0.1'. Training draws its
    log-probs through it, so no rollout engine can match them."""
    if not model.training:
        return ""
    text = model.config.get_text_config()
    found = {}
    for config in (model.config,) if text is model.config else (model.config, text):
        for name, value in config.to_dict().items():
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                found.setdefault(name, value)
    modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    if not found and not modules:
        return ""
    return ", ".join(f"{k}={v}" for k, v in found.items()) or "nn.Dropout modules with p > 0"
