"""Text families and Gemma 3 against real checkpoint configs, plus their chat formats.

The zoo test covers the tiny models; this checks what it cannot: that real config.json
files (tests/data/real_configs, written by older transformers versions, some
sparse) find the right family and normalize to the real rope settings, and that a tiny
model shrunk from a real config keeps them.
Run: pytest tests/test_text_and_gemma.py
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from mmrl import build_model
from mmrl.registry import get_adapter

REAL_CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"

LLAMA3_FREQS = (("high_freq_factor", 4.0), ("low_freq_factor", 1.0))
GEMMA3_GLOBAL = dict(theta=1e6, scaling="linear", factor=8.0)
GEMMA3_LOCAL = dict(theta=1e4, scaling="default", factor=None)

# checkpoint -> (family, expected rope fields, expected per-layer-type fields)
REAL = {
    "meta-llama__Llama-3.1-8B-Instruct": ("llama", dict(
        theta=5e5, scaling="llama3", factor=8.0, original_max_position_embeddings=8192,
        extra=LLAMA3_FREQS, head_dim=128), {}),
    "meta-llama__Llama-3.2-1B-Instruct": ("llama", dict(
        theta=5e5, scaling="llama3", factor=32.0, original_max_position_embeddings=8192,
        extra=LLAMA3_FREQS, head_dim=64), {}),
    "mistralai__Mistral-7B-Instruct-v0.3": ("mistral", dict(theta=1e6, scaling="default", head_dim=128), {}),
    "Qwen__Qwen3-8B": ("qwen3", dict(theta=1e6, scaling="default", head_dim=128), {}),
    # The file omits head_dim, rope_theta and rope_local_base_freq: Gemma3TextConfig's
    # defaults (256, 1e6 global, 1e4 local) must fill them in.
    "google__gemma-3-4b-it": ("gemma3", dict(**GEMMA3_GLOBAL, head_dim=256),
                              {"full_attention": GEMMA3_GLOBAL, "sliding_attention": GEMMA3_LOCAL}),
}

# Sizes of a tiny model; everything else (rope above all) stays as the real config says.
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=256)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=56, patch_size=14)


def checkpoint_dir(name: str, tmp_path: Path) -> Path:
    """The real config's folder, or a copy with the file named config.json where the
    saved file is a differently named dump (Mistral)."""
    folder = REAL_CONFIGS / name
    if (folder / "config.json").is_file():
        return folder
    (saved,) = folder.glob("config*.json")
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(saved, tmp_path / "config.json")
    return tmp_path


def without_head_dim(spec):
    return spec.with_(head_dim=None, per_layer_type=tuple(
        (name, sub.with_(head_dim=None)) for name, sub in spec.per_layer_type))


def shrink(raw: dict) -> dict:
    """A real config.json dict with tiny sizes and its rope settings untouched."""
    if "text_config" not in raw:
        return {**raw, **TINY_TEXT}
    side = TINY_VISION["image_size"] // TINY_VISION["patch_size"]
    return {**raw, "text_config": {**raw["text_config"], **TINY_TEXT},
            "vision_config": {**raw["vision_config"], **TINY_VISION}, "mm_tokens_per_image": (side // 2) ** 2}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_family_and_rope(name, tmp_path):
    family, expected, per_layer = REAL[name]
    folder = checkpoint_dir(name, tmp_path)
    adapter = get_adapter(folder)
    assert adapter.family == family

    raw = json.loads((folder / "config.json").read_text())
    from_raw = adapter.rope(raw)
    from_loaded = adapter.rope(AutoConfig.from_pretrained(folder))
    assert from_raw == from_loaded
    assert from_raw.problems() == []
    for field, value in expected.items():
        assert getattr(from_raw, field) == value, field
    assert {n for n, _ in from_raw.per_layer_type} == set(per_layer)
    for layer_type, fields in per_layer.items():
        sub = from_raw.for_layer_type(layer_type)
        assert {f: getattr(sub, f) for f in fields} == fields, layer_type


def test_gemma3_text_config_alone_matches_the_vlm():
    """The text_config of the Gemma 3 VLM read as a text-only (gemma3_text) config."""
    raw = json.loads((REAL_CONFIGS / "google__gemma-3-4b-it" / "config.json").read_text())
    text = get_adapter("gemma3_text")
    assert text.rope(raw["text_config"]) == get_adapter("gemma3").rope(raw)
    # Older Gemma 3 files name the local theta rope_local_base_freq.
    spec = text.rope({**raw["text_config"], "rope_local_base_freq": 20000.0})
    assert spec.for_layer_type("sliding_attention").theta == 20000.0


@pytest.mark.parametrize("name", sorted(REAL))
def test_tiny_model_shrunk_from_real_config_keeps_rope(name, tmp_path):
    family, _, _ = REAL[name]
    adapter = get_adapter(family)
    raw = json.loads((checkpoint_dir(name, tmp_path) / "config.json").read_text())
    config = adapter.config_from_dict(shrink(raw))
    tiny_spec = adapter.rope(config)
    assert tiny_spec.problems() == []
    assert tiny_spec.head_dim == 32
    assert without_head_dim(tiny_spec) == without_head_dim(adapter.rope(raw))

    built = build_model(family, random_init=True, config=config)
    assert adapter.rope(built.model.config) == tiny_spec
    ids = torch.randint(4, 200, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(built.model(input_ids=ids).logits).all()


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Sum 2+2"},
]
RENDERED = {
    "llama": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nSum 2+2<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] Hi[/INST] Hello.</s>[INST] Be brief.\n\nSum 2+2[/INST]",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
            "<|user|>\nSum 2+2<|end|>\n<|assistant|>\n",
    "gemma3_text": "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                   "<start_of_turn>user\nSum 2+2<end_of_turn>\n<start_of_turn>model\n",
}


@pytest.mark.parametrize("family", sorted(RENDERED))
def test_chat_format(family):
    built = build_model(family, random_init=True)
    assert built.processing.render(CONVERSATION) == RENDERED[family]


def test_gemma3_stops_at_turn_end_and_expands_images():
    built = build_model("gemma3", random_init=True)
    tokenizer = built.tokenizer
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in built.processing.stop_token_ids
    conversation = [{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (30, 40))}, {"type": "text", "text": "What?"}]}]
    batch = built.processing([conversation])
    soft = batch["input_ids"] == tokenizer.image_token_id
    assert soft.sum() == built.model.config.mm_tokens_per_image
    assert torch.equal(batch["token_type_ids"].bool(), soft)
    assert {tokenizer.boi_token_id, tokenizer.image_token_id} <= set(built.processing.blocked_token_ids)
