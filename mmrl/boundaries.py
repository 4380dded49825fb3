"""Which packed models keep their samples apart: layers that carry a state along the sequence.

A convolution's window, a linear-attention or a recurrent (state-space) state runs on from one
packed sample into the next unless the layer is told where each sample starts; attention
is kept apart by the position ids alone. Where it can, the engine runs such layers one
packed sequence a row (`mmrl.engine.stateful_layers`). A family's `padding_free` claim is verified on
its tiny model (the padding-free probe's boundary case, `mmrl.checks.packed_boundary_gap`),
so it covers the stateful layer kinds that model has. A checkpoint of the same type can
have others (a type whose default config is all attention, while its real checkpoints
interleave short convolutions): packing it was never verified, and the engine refuses it.

    unverified_layer_kinds(adapter, model.config)   # {"conv"}: packing this model is unverified
    unpackable(adapter)                             # why model.pack: true is refused for a family

Ulysses sequence parallelism splits a stateful layer's sequence over the ranks as well, so
the same rule refuses it for such a checkpoint (`unverified_ulysses`); gathered mixers run
every mixing layer on the whole sequence and are not refused.

`mmrl.settle.packs_model` resolves `model.pack` for a built model with these rules.
"""

from __future__ import annotations

# transformers' names for the kinds of layer that hold a state along the sequence
# (among `configuration_utils.ALLOWED_ATTN_LAYER_TYPES`, in 5.17 as in 5.19).
STATEFUL_LAYER_KINDS = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})


def current_layer_kinds(layer_types) -> list[str]:
    """Each entry of a `layer_types` list by transformers' current name: a kind transformers
    allows (`ALLOWED_ATTN_LAYER_TYPES`) is its own name, a legacy one is read as transformers
    reads it (`remap_legacy_layer_types`: a state-space layer's "mamba" is "linear_attention").
    Only legacy names go through the remap table: transformers 5.17's also maps "conv" to
    "linear_attention" (its entry reads "only in LFMv2"), while its Lfm2 config writes and
    keeps "conv", an allowed kind its model keys masks and caches by; 5.19 dropped that entry."""
    from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES, remap_legacy_layer_types

    return [kind if kind in ALLOWED_ATTN_LAYER_TYPES else remap_legacy_layer_types([kind])[0]
            for kind in layer_types]


def stateful_layer_kinds(config) -> set[str]:
    """The stateful kinds among a config's `layer_types` (of its text config), if it lists
    any, by transformers' current names (`current_layer_kinds`)."""
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    kinds = set()
    for each in configs:
        layer_types = list(getattr(each, "layer_types", None) or ())
        kinds.update(k for k in current_layer_kinds(layer_types) if k in STATEFUL_LAYER_KINDS)
    return kinds


def unverified_layer_kinds(adapter, config) -> set[str]:
    """Stateful layer kinds of `config` that the family's tiny model, on which its
    padding_free claim was verified, does not have."""
    kinds = stateful_layer_kinds(config)
    if not kinds:
        return set()
    tiny = adapter.tiny().config
    if isinstance(tiny, dict):
        tiny = adapter.config_from_dict(tiny)
    return kinds - stateful_layer_kinds(tiny)


def unverified_packing(adapter, kinds: set[str]) -> str:
    """Why `model.pack: true` is refused for a model with stateful layers its family's probe never saw."""
    return (f"model.pack: true, but this {adapter.family} model has {', '.join(sorted(kinds))} layers (layer_types) "
            f"that the family's tiny model lacks, so its padding_free claim does not cover them (their state "
            f"would cross packed sequence boundaries); set model.pack to auto or false")


def unverified_ulysses(adapter, kinds: set[str]) -> str:
    """Why Ulysses sequence parallelism is refused for a model with stateful layers its
    family's probe never saw: each rank would run them on its own slice of the sequence."""
    return (f"parallel.sequence_parallel: this {adapter.family} model has {', '.join(sorted(kinds))} layers "
            f"(layer_types) that the family's tiny model lacks, so its Ulysses claim does not cover them (each rank "
            f"would run them on its own slice of the sequence, their state starting over); set "
            f"parallel.sequence_parallel: 1, or verify SequenceParallel(gather_mixers=True) for the family")


def unpackable(adapter) -> str:
    """Why `model.pack: true` is refused for a family that does not declare padding_free."""
    return (f"model.pack: true, but {adapter.family} does not declare padding_free (its padding-free probe did not "
            f"verify packed batches, e.g. a convolution or recurrent state crossing a packed sequence boundary); "
            f"set model.pack to auto or false")
