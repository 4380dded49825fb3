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
