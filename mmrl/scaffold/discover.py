"""Stage 4, model: build the tiny model on CPU and read the family's layout off its
modules: embeddings and lm_head, the decoder stack, the vision tower and projector
(wherever they sit), block classes to shard, linear leaves for LoRA, rope, and whether
vLLM serves the architecture."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from mmrl.adapter import Parts
from mmrl.scaffold.base import Discovery, Resolved, ScaffoldError
from mmrl.scaffold.media_plan import build_config, build_processor, images_see_each_other, prepends_positions
from mmrl.scaffold.resolve import class_name
from mmrl.scaffold.shrink import TinyInputs, build_tiny
from mmrl.scaffold.vllm_registry import vllm_architecture


def _path_of(model, module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ScaffoldError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _block_lists(model, prefix: str, mixed: bool = False) -> list[tuple[str, Any]]:
    """ModuleLists under `prefix` whose items are all one class (any classes with
    `mixed`: a hybrid's stack), most parameters first."""
    import torch

    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and _under(name, prefix):
            if (mixed or len({type(m) for m in module}) == 1) and any(True for _ in module.parameters()):
                found.append((name, module))
    return sorted(found, key=lambda item: -sum(p.numel() for p in item[1].parameters()))


def _linear_leaves(block) -> tuple[str, ...]:
    import torch

    leaves: list[str] = []
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf not in leaves and _gives_a_tensor(module):
            leaves.append(leaf)
    return tuple(leaves)


def _gives_a_tensor(linear) -> bool:
    """False for a Linear subclass whose own forward returns something else (Llama 4's and
    PhiMoE's routers give scores and logits): a LoRA layer adds its product to what the
    wrapped layer returns. A forward that cannot be tried on one row is given the benefit."""
    import torch

    if type(linear).forward is torch.nn.Linear.forward:
        return True
    try:
        with torch.no_grad():
            out = linear(torch.zeros(1, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device))
    except Exception:
        return True
    return isinstance(out, torch.Tensor)


def inspect_family(resolved: Resolved, family: str, tiny: TinyInputs) -> Discovery:
    """Build the tiny model on CPU and read the family's layout off its modules."""
    from mmrl.rope import RopeSpec

    config = tiny.config
    model = build_tiny(resolved.model_class, config)
    head, nested_head = _output_embeddings(model)
    if head is None:
        raise ScaffoldError(f"{resolved.model_class} has no output embeddings (lm_head) to read", category="model-init")
    embed = _path_of(model, model.get_input_embeddings())
    lm_head = _path_of(model, head)
    text_config = config.get_text_config(decoder=True)
    language, decoder = _decoder_stack(model, embed, getattr(text_config, "num_hidden_layers", None))
    for depth in _other_layer_counts(text_config) if decoder is None else ():
        language, decoder = _decoder_stack(model, embed, depth)
        if decoder is not None:
            break
    if decoder is None:
        raise ScaffoldError(f"{resolved.model_class}: no stack of {text_config.num_hidden_layers} decoder layers "
                            f"around {embed!r}; name parts.language and shard_layers by hand", category="parts")
    fill_in: list[str] = []
    vision = projector = ()
    vision_block = None
    vision_leaves: tuple[str, ...] = ()
    if resolved.is_vision_language:
        width = getattr(text_config, "hidden_size", None)
        vision, projector, vision_block, vision_leaves = _vision_parts(
            model, language, width, getattr(config, resolved.vision_config_key, None), fill_in)
    parts = Parts(language=language, embed=embed, lm_head=lm_head, vision=vision or None,
                  projector=projector or None)
    # A head whose output embedding sits inside a larger head module (a bias, a
    # transform before it) is that whole module.
    head = lm_head.rpartition(".")[0]
    while head and not _under(language, head) and any(_under(n, head) for n in _uncovered_parameters(model, parts)):
        parts = replace(parts, lm_head=(head,))
        head = head.rpartition(".")[0]
    if not resolved.is_vision_language:  # a text model's modules beside its stack belong to its head
        outside = sorted({n.split(".")[0] for n in _uncovered_parameters(model, parts)})
        if outside and "." not in language:
            parts = replace(parts, lm_head=tuple(dict.fromkeys((*parts.lm_head, *outside))))
        elif outside:
            parts = replace(parts, vision=_image_input_beside(model, language, parts))
    uncovered = _uncovered_parameters(model, parts)
    if uncovered:
        fill_in.append(f"parts: parameters in no part: {', '.join(uncovered[:5])}")
    rope = RopeSpec.from_config(config)
    architecture, note = vllm_architecture(resolved.model_class)
    # Two behaviours found by running the tiny model on processed images.
    processor = _tiny_processor(resolved, tiny)
    media_text = (tiny.media.image_placeholder, tiny.media.text_kwargs) if processor is not None else ()
    return Discovery(
        resolved=resolved, family=family, class_name=class_name(resolved, family), parts=parts,
        decoder_layers=tuple(dict.fromkeys(type(m).__name__ for m in decoder)), vision_block=vision_block,
        language_leaves=tuple(dict.fromkeys(leaf for m in decoder for leaf in _linear_leaves(m))), vision_leaves=vision_leaves, rope=rope,
        vllm_architecture=architecture, vllm_note=note, fill_in=fill_in, tiny=tiny,
        prepends_positions=processor is not None and prepends_positions(model, processor, *media_text),
        nested_head=nested_head,
        encode_images_alone=processor is not None and images_see_each_other(model, processor, *media_text),
    )


def _output_embeddings(model) -> tuple[Any, str]:
    """(output embeddings, "") of the model (`lm_head`); where the class declares none of
    its own because it nests a whole causal LM (`self.language_model =
    AutoModelForCausalLM.from_config(...)`, whose forward gives the logits), (that nested
    model's, its path): the outermost model inside with output embeddings, where there is
    one. (None, "") where neither is."""
    from transformers import PreTrainedModel

    head = model.get_output_embeddings()
    if head is not None:
        return head, ""
    nested = [(name, m) for name, m in model.named_modules() if name and isinstance(m, PreTrainedModel)
              and m.get_output_embeddings() is not None]
    outermost = [(name, m) for name, m in nested if not any(other != name and _under(name, other)
                                                            for other, _ in nested)]
    if len(outermost) != 1:
        return None, ""
    name, inner = outermost[0]
    return inner.get_output_embeddings(), name


def _tiny_processor(resolved: Resolved, tiny: TinyInputs):
    """The tiny vision-language model's processor; None for a text type or one not built."""
    if tiny.media is None or not resolved.is_vision_language:
        return None
    try:
        tokenizer, _ = build_config(resolved, tiny.media)
        return build_processor(tiny.media, tokenizer, tiny.config)
    except ScaffoldError:
        return None


def _decoder_stack(model, embed: str, depth: int | None):
    """(language path, layer list): the closest module around the input embeddings that
    holds a list of `depth` layers, of one class or (a hybrid) several."""
    path = embed
    while path:
        path = path.rpartition(".")[0]
        for mixed in (False, True):
            stacks = [m for _, m in _block_lists(model, path, mixed) if depth is None or len(m) == depth]
            if stacks:
                return path, stacks[0]
    return embed.rpartition(".")[0], None


def _other_layer_counts(text_config) -> list[int]:
    """Layer counts the text config holds beside `num_hidden_layers`, in its order: where
    the layers are reused (two stacks looped over cycles), `num_hidden_layers` counts the
    layer passes the cache holds and a field like `num_layers_per_stack` the layers of a
    list. Read only where no list holds `num_hidden_layers` layers."""
    own = text_config.to_dict()
    depth = own.get("num_hidden_layers")
    return list(dict.fromkeys(value for key, value in own.items()
                              if "layers" in key and type(value) is int and 0 < value != depth))


def _uncovered_parameters(model, parts: Parts) -> list[str]:
    names = []
    paths = [p for _, group in parts.items() for p in group]
    for name, _ in model.named_parameters(remove_duplicate=False):
        if not any(_under(name, p) for p in paths):
            names.append(name)
    return names


def _vision_parts(model, language: str, text_width: int | None, vision_config, fill_in: list[str]):
    """(vision paths, projector paths, vision block class, vision linear leaves): the
    vision tower is the sibling of the language model (or of a module around it: a
    whole causal LM nested in the VLM) that holds a stack of blocks, the one built from
    the vision sub-config where several do; every other sibling with parameters (and
    loose parameters beside them) projects. Where no sibling is left, the projector sits
    inside the tower: its children after the block stack that reach the language
    model's width. A model with no stacked sibling at any level reads images through
    patch embedders beside the language model (no tower: patches projected straight
    into the decoder's width): the language model's nearest siblings are then its
    vision part, with no blocks to shard. Two towers built from the vision sub-config
    (images and video frames apart) are both the vision part."""
    inner_path = language.rpartition(".")[0]
    nearest = None
    while True:
        inner = model.get_submodule(inner_path) if inner_path else model
        prefix = f"{inner_path}." if inner_path else ""
        siblings = [(prefix + name, child) for name, child in inner.named_children()
                    if not _under(language, prefix + name) and any(True for _ in child.parameters())]
        if nearest is None and inner_path:
            nearest = siblings
        stacked = any(_block_lists(model, path) for path, _ in siblings)
        if not inner_path or stacked:
            break
        inner_path = inner_path.rpartition(".")[0]
    inside = _tower_inside(model, language, vision_config) if not stacked else None
    if inside is not None:
        return inside
    if nearest and not stacked:
        leaves = tuple(dict.fromkeys(leaf or path.rpartition(".")[2] for path, child in nearest
                                     for leaf in _linear_leaves(child)))
        return tuple(path for path, _ in nearest), (), None, leaves
    towers, projector = [], []
    for path, child in siblings:
        blocks = _block_lists(model, path)
        built_from_vision = type(getattr(child, "config", None)) is type(vision_config)
        rank = (built_from_vision, sum(p.numel() for p in child.parameters()))
        (towers if blocks else projector).append((rank, path, blocks))
    projector_paths = [path for _, path, _ in projector]
    projector_paths += [prefix + name for name, _ in inner.named_parameters(recurse=False)]
    if not towers:
        fill_in.append("parts.vision / shard_layers: no vision tower with a stack of blocks was found")
        return (), tuple(projector_paths), None, ()
    towers.sort(key=lambda t: t[0], reverse=True)
    (from_vision, _), vision_path, blocks = towers[0]
    # Another tower built from the vision sub-config is vision too (one for images, one for
    # video frames); a second stacked sibling of another kind (a Q-Former) projects.
    twins = [path for (built, _), path, _ in towers[1:] if from_vision and built]
    projector_paths += [path for _, path, _ in towers[1:] if path not in twins]
    if not projector_paths:
        projector_paths = _inner_projector(model, vision_path, blocks[0][0], text_width)
    if not projector_paths:
        fill_in.append("parts.projector: the projector sits inside the vision tower; name its path")
    block = blocks[0][1][0]
    return (vision_path, *twins), tuple(projector_paths), type(block).__name__, _linear_leaves(block)


def _tower_inside(model, language: str, vision_config):
    """(vision paths, projector paths, vision block class, vision linear leaves) for a
    model whose one module holds both its text stack and its vision tower (no sibling of
    the language model is a tower): the module under the language path built from the
    vision sub-config is the tower, and its siblings that a text-only forward does not run
    are the projector (none where the model cannot run without an image). None where no
    module under the language path was built from the vision sub-config."""
    if vision_config is None:
        return None
    tower = next((name for name, module in model.named_modules()
                  if name != language and _under(name, language) and _block_lists(model, name)
                  and type(getattr(module, "config", None)) is type(vision_config)), None)
    if tower is None:
        return None
    parent = tower.rpartition(".")[0]
    beside = [f"{parent}.{name}" if parent else name for name, child in model.get_submodule(parent).named_children()
              if any(True for _ in child.parameters())]
    ran = _run_on_text(model, [path for path in beside if path != tower])
    projector = tuple(path for path in beside if path != tower and ran is not None and path not in ran)
    blocks = _block_lists(model, tower)
    block = blocks[0][1][0]
    return (tower,), projector, type(block).__name__, _linear_leaves(block)


def _image_input_beside(model, language: str, parts: Parts) -> tuple[str, ...]:
    """Modules beside a nested language model, in no part, that a text-only forward does
    not run: a multimodal model scaffolded as a text family (its causal-LM class is the
    same as its image-text one) reads images through them (a patch embedding), so they
    are its vision part; the text family declares no image capability."""
    parent = language.rpartition(".")[0]
    uncovered = _uncovered_parameters(model, parts)
    beside = [f"{parent}.{name}" for name, _ in model.get_submodule(parent).named_children()
              if any(_under(n, f"{parent}.{name}") for n in uncovered)]
    ran = _run_on_text(model, beside)
    return () if ran is None else tuple(path for path in beside if path not in ran)


def _run_on_text(model, paths: list[str]) -> set[str] | None:
    """Which of the modules at `paths` one forward pass on a few text tokens runs; None
    where the model does not run without an image."""
    import torch

    ran: set[str] = set()
    handles = [model.get_submodule(path).register_forward_pre_hook(lambda module, args, path=path: ran.add(path))
               for path in paths]
    vocab = model.get_input_embeddings().num_embeddings
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 11).reshape(1, 8) % vocab)
    except Exception:  # a model that needs an image in every pass
        return None
    finally:
        for handle in handles:
            handle.remove()
    return ran


def _inner_projector(model, tower: str, stack: str, text_width: int | None) -> list[str]:
    """Children of the vision tower registered after its block stack that own a
    weight of the language model's width (the tiny vision width differs from it):
    a merger or downsampling projection, not the tower's final norm."""
    if not text_width:
        return []
    found, after = [], False
    for name, child in model.get_submodule(tower).named_children():
        path = f"{tower}.{name}"
        if _under(stack, path):
            after = True
            continue
        if after and any(text_width in p.shape for p in child.parameters()):
            found.append(path)
    return found
