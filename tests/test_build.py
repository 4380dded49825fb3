"""`mmrl.build_model`: what a build tells its caller about the model it built."""

import pytest


def test_a_model_built_with_frozen_parameters_is_named_in_one_warning(monkeypatch):
    """A model whose own code freezes parameters (IDEFICS's config: `freeze_vision_layers`)
    warns once at build: mmrl never unfreezes, so training would leave them frozen. The
    zoo's families come with none frozen."""
    import warnings

    from mmrl import build_model
    from mmrl.registry import get_adapter

    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        build_model("qwen2", random_init=True)
    assert not [w for w in plain if "frozen parameters" in str(w.message)]  # a family that freezes nothing

    def frozen_embedding(model):
        model.get_input_embeddings().requires_grad_(False)
        return model

    monkeypatch.setattr(type(get_adapter("qwen2")), "prepare_model", lambda self, model: frozen_embedding(model))
    with pytest.warns(UserWarning, match=r"comes with 1 frozen parameters.*embed_tokens.*never unfreezes") as caught:
        build_model("qwen2", random_init=True)
    assert len([w for w in caught if "frozen parameters" in str(w.message)]) == 1


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    from mmrl import build_model

    folder = tmp_path_factory.mktemp("vlm")
    build_model("qwen2_vl", random_init=True).save(folder)
    return folder


@pytest.mark.parametrize("random_init", [False, True])
def test_a_recipes_config_read_without_its_processor_is_the_one_built_with(vlm_checkpoint, random_init):
    """`recipe_config(model, processor=False)` (the compile helper's read: no tokenizer
    loaded) gives the config the full read gives, overrides applied on a random init."""
    from mmrl.build import recipe_config
    from mmrl.config import ModelConfig

    overrides = {"text_config": {"num_hidden_layers": 1}} if random_init else {}
    model = ModelConfig(path=str(vlm_checkpoint), random_init=random_init, config_overrides=overrides)
    processor, config = recipe_config(model)
    none, alone = recipe_config(model, processor=False)
    assert processor is not None and none is None
    assert alone.to_dict() == config.to_dict()
    assert (alone.get_text_config().num_hidden_layers == 1) == random_init


def test_the_length_checks_tokenizer_is_the_builds(vlm_checkpoint):
    """The tokenizer the checks before the build read (`recipe_config`'s processor, which
    the trainer's build then takes) splits text as the built model's processing does, and
    the built processor keeps the saved class."""
    from mmrl import load_model
    from mmrl.build import recipe_config
    from mmrl.config import ModelConfig

    processor, config = recipe_config(ModelConfig(path=str(vlm_checkpoint)))
    tokenizer, text_config = processor.tokenizer, config.get_text_config()
    built = load_model(vlm_checkpoint)
    text = "How many red squares are there? Count them: one, two, three."
    assert tokenizer(text)["input_ids"] == built.processing.tokenizer(text)["input_ids"]
    assert type(tokenizer) is type(built.processing.tokenizer)
    assert text_config.to_dict() == built.model.config.get_text_config().to_dict()


def _tokenizer_loads(monkeypatch) -> list[str]:
    """The class of every tokenizer `from_pretrained` from here on, in order."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    loads, plain = [], PreTrainedTokenizerBase.from_pretrained.__func__
    monkeypatch.setattr(PreTrainedTokenizerBase, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(cls.__name__) or plain(cls, *a, **k)))
    return loads


def _processed(processor):
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[Image.new("RGB", (90, 60), (200, 30, 30))], return_tensors="pt")


def test_a_generic_tokenizer_class_is_loaded_once_and_the_processor_takes_it(vlm_checkpoint, monkeypatch):
    """A VLM checkpoint whose tokenizer class is generic (the zoo's tiny ones, Llama 3-based
    VLMs): mmrl loads the tokenizer once as that class and the processor takes it, where
    transformers' processor would load its own beside one handed to it (bench/processor_load.py);
    ids and pixels are those of the handed path, and transformers' hook is its own again after."""
    import torch
    from transformers import AutoProcessor, ProcessorMixin

    from mmrl.build import _load_tokenizer, _own_tokenizer_class, load_processor
    from mmrl.registry import get_adapter

    assert _own_tokenizer_class(vlm_checkpoint)
    hook = ProcessorMixin.__dict__["_load_tokenizer_from_pretrained"]
    loads = _tokenizer_loads(monkeypatch)
    processor = load_processor(vlm_checkpoint, get_adapter("qwen2_vl"), trust_remote_code=False)
    assert loads == ["TokenizersBackend"] and type(processor.tokenizer).__name__ == "TokenizersBackend"
    assert ProcessorMixin.__dict__["_load_tokenizer_from_pretrained"] is hook
    handed = AutoProcessor.from_pretrained(vlm_checkpoint, tokenizer=_load_tokenizer(vlm_checkpoint, False))
    assert len(loads) == 3  # the handed path: mmrl's load and the processor's own
    mine, theirs = _processed(processor), _processed(handed)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_a_processor_that_does_not_take_the_tokenizer_is_handed_it(vlm_checkpoint, monkeypatch):
    """Where the processor loaded its own tokenizer after all (a transformers without the hook,
    or a processor class that loads it another way), `load_processor` loads it again with the
    tokenizer handed over, as before: the saved class, not AutoTokenizer's swap."""
    import contextlib

    from mmrl import build
    from mmrl.registry import get_adapter

    monkeypatch.setattr(build, "_processor_takes", lambda tokenizer: contextlib.nullcontext())
    processor = build.load_processor(vlm_checkpoint, get_adapter("qwen2_vl"), trust_remote_code=False)
    assert type(processor.tokenizer).__name__ == "TokenizersBackend"
    assert _processed(processor)["input_ids"].shape[0] == 1
