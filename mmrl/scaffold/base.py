"""What the scaffold's stages hand each other: the resolved type, what inspecting the
tiny model found, where files go, and the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.adapter import Capabilities, Parts

# Shapes of a tiny vision tower: small enough for CPU; two blocks, so that a feature layer
# read from the end (-2) is a block's output, not the embeddings.
TINY_VISION_SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
# The zoo's tolerance (fp32 logits, max absolute difference).
TOLERANCE = 2e-4
# Capabilities the quick check decides; the rest stay at their defaults for the probes.
CHECKED = ("generation", "padding_free", "gradient_checkpointing", "lora_language", "lora_vision",
           "single_image", "multi_image", "media_sharing")
# Checked and written for vision-language families only (text families have no media).
VISION_ONLY = ("lora_vision", "single_image", "multi_image", "media_sharing")
# Capabilities the depth stage decides by running their probes (depth.py), in this order.
DEPTH = ("video", "sequence_parallel", "multi_turn", "vllm")
# The coverage sweep's capability columns: what the scaffold decides for a type.
COLUMNS = CHECKED + DEPTH


@dataclass(frozen=True)
class Gap:
    """A capability the scaffold did not declare: its column, why (one line) and what
    to write by hand to claim it."""

    column: str
    cause: str
    write: str


class ScaffoldError(ValueError):
    """The model type cannot be scaffolded (unknown, already registered, files exist).

    `category` names the kind of refusal for the coverage sweep; the message is one line
    that says what stopped the scaffold and what the user has to write by hand."""

    def __init__(self, message: str, category: str = "refused"):
        super().__init__(message)
        self.category = category


@dataclass(frozen=True)
class Resolved:
    """A model type as transformers' auto tables name it."""

    model_type: str
    config_class: str  # "ConfigName" in the transformers namespace
    model_class: str
    is_vision_language: bool
    # The name of the model type's vision sub-config (None for text types).
    vision_config_key: str | None = None


@dataclass
class Discovery:
    """What inspecting the tiny model found; the adapter is rendered from this."""

    resolved: Resolved
    family: str
    class_name: str
    parts: Parts
    decoder_layers: tuple[str, ...]  # one class, or a hybrid's several
    vision_block: str | None
    language_leaves: tuple[str, ...]
    vision_leaves: tuple[str, ...]
    rope: Any
    vllm_architecture: str | None
    vllm_note: str
    tiny: Any = None  # shrink.TinyInputs: the tiny config, tokenizer, processor and media plan
    fill_in: list[str] = field(default_factory=list)
    # The model's own positions match a padded batch where counted ones do not (verify).
    own_positions: bool = False
    # Nor those: the model's rope index (`get_rope_index`) counts media across the whole
    # batch, and computed one row at a time it matches (verify); the adapter's
    # position_ids does that.
    rope_index_per_row: bool = False
    # The model's own rope index over the batch, written out by the adapter's position_ids
    # (`mmrl.positions.rope_index_positions`): what the model computes when given none, but
    # kept by packed rows and shared media, so it declares more (verify).
    rope_index_positions: bool = False
    # Neither does: the forward ignores the mask for pads in front, and a right-padded
    # batch matches each prompt alone (verify); the adapter declares left_padding = False.
    left_padding: bool = True
    # What the decoder stack gets along the sequence beyond ids, embeddings and positions
    # (found by running it, depth.py): the adapter's SequenceParallel cuts these too.
    sequence_parallel: Any = None  # mmrl.adapter.SequenceParallel, or None for the default
    # Parameter name patterns (`mmrl.tiny.redraw_zeros`) of weights the class initializes to
    # zero that cut every gradient to the vision tower of the random-init tiny model (a
    # gate, a projection; verify): the adapter's prepare_model draws them.
    redraw_zeros: tuple[str, ...] = ()
    # The model's logits run longer than input_ids, its own positions in front (found by
    # running it, discover.py): the adapter declares prepends_positions = True.
    prepends_positions: bool = False
    # The module path of the causal LM the model nests whole where the class declares no
    # output embeddings of its own (discover.py): the adapter's on_load gives the model
    # that one's, which mmrl's log-prob head reads.
    nested_head: str = ""
    # The tower lets a batch's images attend to each other, and one image per encoder call
    # gives each image its features alone (found by running it, discover.py): the adapter
    # declares encode_images_alone = True.
    encode_images_alone: bool = False


@dataclass
class Layout:
    """Where the files of a scaffolded family go."""

    root: Path
    adapter: Path
    processing: Path | None
    test: Path
    extra: dict[Path, str]  # path -> content of the package/docs files
    appends: dict[Path, str]  # existing files that get a line added
    adapter_module: str
    processing_module: str | None
    in_tree: bool


@dataclass
class Result:
    family: str
    written: list[Path]
    next_command: str
    capabilities: Capabilities | None
    notes: list[str]
    dry_run: bool
    contents: dict[Path, str]
    # Capabilities left undeclared, with why and what to write (quick checks and depth).
    gaps: list[Gap] = field(default_factory=list)
    # Columns decided (verified or not); the others did not apply or did not run.
    decided: list[str] = field(default_factory=list)
    # Where sequence_parallel verified, the mode it verified in and the adapter declares:
    # "ulysses" (attention heads split) or "gathered" (SequenceParallel(gather_mixers=True)).
    sequence_parallel_mode: str = ""


