"""Encoding one image per call (`mmrl.encoder_calls.encode_each_image_alone`): for a tower
that lets a batch's images attend to each other, each image gets the features it gets
alone, the outputs join as one call gives them, and a call it cannot cut runs as it is."""

import copy

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from mmrl import build_model
from mmrl.checks import sample_conversations
from mmrl.encoder_calls import encode_each_image_alone
from mmrl.engine.media import SharedMedia, sharing


class Mixing(torch.nn.Module):
    """A tower over every image's patches as one sequence: each patch adds the mean of
    all of them, so an image's features change with the other images of the call."""

    def __init__(self, per_image: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)
        self.per_image = per_image
        self.calls = 0

    def get_image_features(self, pixel_values, image_grid_thw, **kwargs):
        self.calls += 1
        hidden = self.proj(pixel_values)
        hidden = hidden + hidden.mean(0, keepdim=True)
        rows = image_grid_thw.prod(-1).tolist()
        pooled = torch.split(hidden, rows) if self.per_image else hidden
        return BaseModelOutputWithPooling(last_hidden_state=hidden[None], pooler_output=pooled)


def _images():
    grid = torch.tensor([[1, 2, 2], [1, 2, 3]])
    return torch.randn(10, 4, generator=torch.Generator().manual_seed(1)), grid


@pytest.mark.parametrize("per_image", [True, False])
def test_each_image_gets_its_features_alone_and_the_outputs_join(per_image):
    tower = Mixing(per_image)
    pixels, grid = _images()
    first = tower.get_image_features(pixels[:4], grid[:1]).pooler_output
    first = first[0] if per_image else first
    joint = tower.get_image_features(pixels, grid).pooler_output
    assert not torch.allclose((joint[0] if per_image else joint[:4]), first)  # the tower mixes them

    encode_each_image_alone(tower)
    tower.calls = 0
    out = tower.get_image_features(pixels, grid)
    assert tower.calls == 2
    alone = [type(tower).get_image_features(tower, pixels[:4], grid[:1]).pooler_output,
             type(tower).get_image_features(tower, pixels[4:], grid[1:]).pooler_output]
    if per_image:
        assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == 2
        for got, want in zip(out.pooler_output, alone):
            torch.testing.assert_close(got, want[0], rtol=0, atol=0)
    else:
        torch.testing.assert_close(out.pooler_output, torch.cat(alone), rtol=0, atol=0)
    assert out.last_hidden_state is None  # no forward reads it


def test_a_call_it_cannot_cut_runs_as_it_is():
    tower = encode_each_image_alone(Mixing())
    pixels, grid = _images()
    tower.calls = 0
    tower.get_image_features(pixels, grid, pixel_attention_mask=torch.ones(10))  # a third tensor
    tower.get_image_features(pixels[:4], grid[:1])  # one image
    assert tower.calls == 2
    flat = encode_each_image_alone(Mixing(per_image=False))
    flat.get_image_features(pixels[:9], grid)  # rows that add up neither way
    assert flat.calls == 1


def test_a_deep_copy_encodes_with_its_own_weights_and_the_signature_shows():
    import inspect

    tower = encode_each_image_alone(Mixing())
    twin = copy.deepcopy(tower)
    with torch.no_grad():
        twin.proj.weight.add_(1.0)
    pixels, grid = _images()
    mine, theirs = tower.get_image_features(pixels, grid), twin.get_image_features(pixels, grid)
    assert twin.calls == tower.calls and not torch.allclose(mine.pooler_output[0], theirs.pooler_output[0])
    # transformers' generate picks the encoder's arguments by its parameters' names
    assert {"pixel_values", "image_grid_thw"} <= set(inspect.signature(tower.get_image_features).parameters)


@pytest.fixture(scope="module")
def qwen2_vl():
    built = build_model("qwen2_vl", random_init=True)
    built.model.float().eval()
    return built


def test_a_real_tower_runs_once_per_image_and_gives_the_plain_log_probs(qwen2_vl):
    """Qwen2-VL's tower keeps images apart already (one attention span per image): per
    image it gives the plain path's logits, one tower call per image, in a forward and
    inside media sharing, which leaves the per-image method in place afterwards."""
    model = copy.deepcopy(qwen2_vl.model)
    conversations = sample_conversations(qwen2_vl.adapter)[:2]
    batch = qwen2_vl.inputs(conversations)
    images = int(batch["image_grid_thw"].shape[0])
    assert images >= 2
    with torch.no_grad():
        plain = model(**batch).logits
    encode_each_image_alone(model)
    calls = []
    model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        per_image = model(**batch).logits
    assert len(calls) == images
    torch.testing.assert_close(per_image, plain, rtol=1e-5, atol=1e-5)

    rows = conversations + conversations
    shared = SharedMedia.of(qwen2_vl.processing, rows, owners=[0, 1, 0, 1])
    batch = qwen2_vl.inputs(rows)
    with torch.no_grad(), sharing(model, batch, shared):
        joint = model(**batch).logits
    torch.testing.assert_close(joint[:2], joint[2:], rtol=1e-5, atol=1e-5)
    assert "get_image_features" in vars(model.model)  # back after the sharing


def test_the_scaffold_finds_a_tower_that_mixes_images(qwen2_vl):
    """`images_see_each_other` is True for a tower whose images see each other (Qwen2-VL's
    with every patch given the mean of the call's patches) where one image per call
    parts them, and False for the tower as transformers writes it."""
    from mmrl.scaffold.media_plan import images_see_each_other

    model = copy.deepcopy(qwen2_vl.model)
    placeholder = qwen2_vl.processor.image_token
    assert not images_see_each_other(model, qwen2_vl.processor, placeholder)

    def mix(module, args, output):
        output.pooler_output = output.pooler_output + output.pooler_output.mean(0, keepdim=True)
        return output

    model.model.visual.register_forward_hook(mix)
    assert images_see_each_other(model, qwen2_vl.processor, placeholder)
    assert "get_image_features" not in vars(model.model)  # the probe leaves the model as it was
