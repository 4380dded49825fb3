"""Ulysses sequence parallelism (mmrl.parallel.ulysses): the attention and mask functions
in one process, then 2 processes under torchrun (gloo) against one process for log-probs,
gradients and AdamW-updated weights, the probe over every registered family, and the
recipe's `parallel.sequence_parallel` checks.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmrl.parallel import ulysses
from cpu_processes import REPO, run, torchrun



@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of one process: the all-to-alls and gathers run, as identities."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Attention(torch.nn.Module):
    is_causal = True

    def __init__(self, heads, kv_heads):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.config = None


def _qkv(batch=2, heads=4, kv_heads=2, length=7, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator)
    k = torch.randn(batch, kv_heads, length, dim, generator=generator)
    v = torch.randn(batch, kv_heads, length, dim, generator=generator)
    return q, k, v


def _padding_mask(batch=2, length=7):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    return mask


def test_mask_covers_the_padded_sequence():
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    padding = _padding_mask()
    with ulysses.active(None, rank=0, size=2):
        mask = ulysses.ulysses_mask(2, q_length=4, kv_length=7, mask_function=causal_mask_function,
                                    attention_mask=padding)
        sliding = ulysses.ulysses_mask(2, q_length=4, kv_length=7,
                                       mask_function=sliding_window_causal_mask_function(3), attention_mask=padding)
    plain = sdpa_mask(batch_size=2, q_length=7, kv_length=7, attention_mask=padding, allow_is_causal_skip=False)
    assert mask.shape == (2, 1, 8, 8)
    assert torch.equal(mask[:, :, :7, :7], plain.expand(2, 1, 7, 7))
    assert not mask[:, :, :7, 7].any(), "real positions must not see the padding"
    assert mask[:, :, 7, 7].all() and not mask[:, :, 7, :7].any(), "a padding row attends to itself only"
    assert mask[0, 0, 6, 3] and not sliding[0, 0, 6, 3], "a window of 3 keys"
    assert sliding[0, 0, 6, 4] and sliding[0, 0, 6, 6] and not sliding[:, :, :7, 7].any()
    # No context: the base implementation's mask (sdpa may skip it entirely).
    assert ulysses.ulysses_mask(2, q_length=7, kv_length=7, mask_function=causal_mask_function,
                                attention_mask=torch.ones(2, 7, dtype=torch.bool)) is None


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_equals_sdpa(one_process_group, kv_heads):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q, k, v = _qkv(kv_heads=kv_heads)
    module = _Attention(4, kv_heads)
    padding = _padding_mask()
    mask4d = sdpa_mask(batch_size=2, q_length=7, kv_length=7, attention_mask=padding, allow_is_causal_skip=False)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask4d, scaling=0.3)
    # No context: plain delegation to sdpa.
    out, _ = ulysses.ulysses_attention(module, q, k, v, mask4d, scaling=0.3)
    assert torch.equal(out, expected)
    # P = 1: the all-to-alls and the full-sequence mask of the Ulysses path.
    with ulysses.active(one_process_group):
        mask = ulysses.ulysses_mask(2, q_length=7, kv_length=7, mask_function=causal_mask_function,
                                    attention_mask=padding)
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = ulysses.ulysses_attention(module, q1, k1, v1, mask, scaling=0.3)
    real = padding[:, None, :, None].transpose(1, 2)  # fully masked rows (left padding) aside
    torch.testing.assert_close(out * real, expected * real, atol=1e-6, rtol=0)
    out.sum().backward()
    assert q1.grad is not None and k1.grad.shape == k.shape


def test_gather_columns_backward_keeps_own_columns(one_process_group):
    local = torch.randn(2, 3, requires_grad=True)
    gathered = ulysses.gather_columns(local, [3], 0, one_process_group)
    assert torch.equal(gathered, local)
    (gathered * torch.arange(3.0)).sum().backward()
    assert torch.equal(local.grad, torch.arange(3.0).expand(2, 3))


def test_local_columns_split_the_response():
    # 11 positions over 2 ranks: 6 each (the last one padding); columns 5..9 predict
    # the response.
    keep0, widths = ulysses.local_columns(11, 5, 10, rank=0, size=2)
    keep1, _ = ulysses.local_columns(11, 5, 10, rank=1, size=2)
    assert widths == [1, 4] and keep0.tolist() == [5] and keep1.tolist() == [0, 1, 2, 3]
    empty, widths = ulysses.local_columns(11, 8, 10, rank=0, size=2)
    assert widths == [0, 2] and empty.numel() == 0


def test_installed_model_still_generates_and_equals_itself(one_process_group):
    """install() changes nothing outside `active`; inside it with P = 1 the logits equal."""
    from mmrl import build_model
    from mmrl.checks import generate, sample_conversations

    built = build_model("qwen2", random_init=True, seed=0)
    conversations = sample_conversations(built.adapter)
    batch = dict(built.processing(conversations))
    batch["position_ids"] = built.adapter.position_ids(built.model, batch)
    with torch.no_grad():
        before = built.model(**batch, use_cache=False).logits
        tokens = generate(built, conversations)
        ulysses.install(built.model, built.adapter)
        assert built.model.config.get_text_config()._attn_implementation == ulysses.NAME
        after = built.model(**batch, use_cache=False).logits
        assert torch.equal(generate(built, conversations), tokens)
        with ulysses.active(one_process_group):
            split = built.model(**batch, use_cache=False).logits
    real = batch["attention_mask"].bool()
    assert torch.equal(before, after)
    torch.testing.assert_close(split[real], before[real], atol=1e-5, rtol=0)


def _scaffold_like_adapter(layer: str, language: str):
    from types import SimpleNamespace

    from mmrl.adapter import Parts, SequenceParallel

    return SimpleNamespace(family="x", sequence_parallel=SequenceParallel(), shard_layers=(layer,),
                           parts=Parts(language=language))


def test_an_attention_free_decoder_is_told_that_ulysses_needs_attention_heads():
    """A pure state-space decoder (built eager, as its class lacks SDPA) is not told to
    set sdpa, which could not help: the error names its layer kinds and that Ulysses
    splits attention heads."""
    import transformers

    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as error:
        ulysses.install(model, _scaffold_like_adapter("MambaBlock", "backbone"))
    message = str(error.value)
    assert "no attention heads to split" in message and "(MambaBlock: MambaMixer)" in message
    assert "keep sequence_parallel = None" in message and "SequenceParallel(gather_mixers=True)" in message
    assert "sdpa" not in message


def test_a_decoder_on_another_attention_is_told_to_set_sdpa():
    """Ulysses wraps sdpa or eager (tests/test_ulysses_eager.py); any other is refused."""
    from mmrl import build_model

    built = build_model("qwen2", random_init=True, seed=0)
    built.model.config.get_text_config()._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"not 'flash_attention_2' \(set model.attn_implementation: sdpa\)"):
        ulysses.install(built.model, built.adapter)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_probe_runs_every_family_in_one_launch():
    """Every family that declares Ulysses, over 2 processes in one launch of
    mmrl.probes.sp_step against one process: qwen2 (text) and qwen2_vl (image, 3-D mrope
    positions) among them, whose log-probs, gradients and AdamW-updated weights are held
    to the bounds below (sp_step makes every sequence of odd length, so it is padded to
    split over the 2 ranks)."""
    from mmrl.probes.base import CheckFailed, Subject, Verified
    from mmrl.probes.sequence_parallel import check_sequence_parallel_many
    from mmrl.probes.sp_step import LOGPROB_ATOL
    from mmrl.registry import families

    adapters = [a for a in families() if a.sequence_parallel is not None]
    subjects = [Subject(adapter, source=adapter.family) for adapter in adapters]
    outcomes = check_sequence_parallel_many(subjects)
    assert len(outcomes) == len(subjects)
    by_family = {s.source: outcome for s, (outcome, _) in zip(subjects, outcomes)}
    for family in ("qwen2", "qwen2_vl", "llama"):
        assert isinstance(by_family[family], Verified), by_family[family]
    for family in ("qwen2", "qwen2_vl"):
        evidence = by_family[family].evidence
        assert evidence["max_logprob_diff"] <= LOGPROB_ATOL and evidence["gradient_tensors"] > 0, evidence
        assert evidence["max_weight_diff"] < 5e-4 and evidence["mean_weight_diff"] < 1e-6, evidence
    for family, outcome in by_family.items():
        assert isinstance(outcome, (Verified, CheckFailed)), (family, outcome)
        if isinstance(outcome, CheckFailed):
            assert "\n" not in str(outcome) and "torchrun failed" not in str(outcome), (family, outcome)


CHECKPOINTED_CRITIC = '''
import json, sys, torch
from mmrl.config import OptimConfig
from mmrl.engine import Engine, join
from mmrl.parallel import Dist, init_distributed
from mmrl.probes.base import Subject
from mmrl.probes.fsdp_step import compare_updates
from mmrl.probes.sp_step import batch
from mmrl.registry import get_adapter

torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
dist = init_distributed("cpu", sequence_parallel=2)
alone = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
subject = Subject(get_adapter(sys.argv[2]), source=sys.argv[2])

def run(d):
    built = subject.build(seed=0)
    engine = Engine(built, d, optim=OptimConfig(lr=1e-2, grad_clip=1e9), gradient_checkpointing=True,
                    value_head=True)
    engine.model.train()
    prompts, responses, mask, advantages = batch(built)
    seqs = join(prompts, responses, mask, built.adapter, engine.model, built.tokenizer.pad_token_id)
    logp, entropy = engine.log_probs(seqs)
    values = engine.values(seqs)
    loss = -(logp * advantages[:, None]).mean() + entropy.mean() + (values - 1).pow(2).mean()
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in [*engine.model.named_parameters(), *(("value_head." + n, p) for n, p in
                                                              engine.value_head.named_parameters())]
             if p.grad is not None}
    engine.step()
    return [t.detach() for t in (logp, entropy, values)], grads, engine.full_state_dict()

reference = run(alone) if dist.is_main else None
parallel = run(dist)
if dist.is_main:
    gaps = [(a - b).abs().max().item() for a, b in zip(reference[0], parallel[0])]
    reason, evidence = compare_updates(reference[1:], parallel[1:])
    open(sys.argv[1], "w").write(json.dumps({"gaps": gaps, "reason": reason, "evidence": evidence}))
torch.distributed.destroy_process_group()
from mmrl.parallel.mesh import exit_cleanly  # no interpreter teardown: gloo's threads can abort it
exit_cleanly()
'''


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpointed_critic_and_entropy_under_ulysses(tmp_path):
    """Activation checkpointing (layers recomputed outside the forward's context), the
    entropy and a value head, SP=2 against one process."""
    script, out = tmp_path / "critic.py", tmp_path / "critic.json"
    script.write_text(CHECKPOINTED_CRITIC)
    run(torchrun(2, script, out, "qwen2_vl"), timeout=300)
    record = json.loads(out.read_text())
    assert max(record["gaps"]) <= 1e-5, record
    assert record["reason"] is None, record


def test_bad_sequence_parallel_is_a_one_line_error(tmp_path, monkeypatch):
    from mmrl import build_model
    from mmrl.config import RecipeError, load_recipe
    from mmrl.parallel import Dist
    from mmrl.trainer import Trainer

    heads = build_model("qwen2", random_init=True).model.config.num_attention_heads
    size = heads + 1  # never divides the query heads
    recipe = load_recipe(overrides=["model.path=qwen2", "model.random_init=true",
                                    "data.train=synthetic:count_shapes?n=16", "reward.name=counting",
                                    f"trainer.output_dir={tmp_path}", f"parallel.sequence_parallel={size}"])
    # A stand-in for `size` processes: the check runs before anything is sharded, and
    # before the model is built (from the config alone).
    dist = Dist(rank=0, world_size=size, local_rank=0, device=torch.device("cpu"), mesh=None,
                sequence_parallel=size)

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the bad sequence_parallel was found")

    monkeypatch.setattr("mmrl.build.build_model", no_build)
    with pytest.raises(RecipeError) as info:
        Trainer(recipe, dist=dist)
    message = str(info.value)
    assert message.startswith("parallel.sequence_parallel:") and "num_attention_heads" in message
    assert "\n" not in message
    # One process cannot host a group of `size`.
    with pytest.raises(RecipeError, match=r"^parallel\.sequence_parallel: .*world size 1"):
        Trainer(recipe)
    with pytest.raises(RecipeError, match="parallel.sequence_parallel"):
        load_recipe(overrides=["model.path=qwen2", "data.train=x.jsonl", "parallel.sequence_parallel=0"])


def test_heads_rule():
    from types import SimpleNamespace

    attrs = ("num_attention_heads", "num_key_value_heads")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)
    assert ulysses.heads_problem(config, attrs, 2) is None  # one KV head: repeated
    assert ulysses.heads_problem(config, attrs, 4) is None
    assert "num_attention_heads = 4" in ulysses.heads_problem(config, attrs, 3)
    assert "num_key_value_heads = 3" in ulysses.heads_problem(
        SimpleNamespace(num_attention_heads=8, num_key_value_heads=3), attrs, 2)


def test_sdpa_reference_for_the_mask():
    """The Ulysses mask fed to plain sdpa equals HF's sdpa path on the unpadded sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q, k, v = _qkv(kv_heads=4)
    padding = _padding_mask()
    with ulysses.active(None, rank=0, size=2):
        mask = ulysses.ulysses_mask(2, q_length=4, kv_length=7, mask_function=causal_mask_function,
                                    attention_mask=padding)
    pad = lambda t: F.pad(t, (0, 0, 0, 1))  # noqa: E731
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)[:, :, :7]
    plain = sdpa_mask(batch_size=2, q_length=7, kv_length=7, attention_mask=padding, allow_is_causal_skip=False)
    expected, _ = sdpa_attention_forward(_Attention(4, 4), q, k, v, plain)
    real = padding[:, None, :, None]
    torch.testing.assert_close(out * real, expected.transpose(1, 2) * real, atol=1e-6, rtol=0)


def _train(tmp_path: Path, processes: int, sequence_parallel: int) -> list[dict]:
    out = tmp_path / f"run{processes}x{sequence_parallel}"
    launcher = torchrun(processes) if processes > 1 else [sys.executable]
    command = [*launcher, "-m", "mmrl.cli", "train", str(REPO / "recipes" / "tiny_vlm_count.yaml"),
               "trainer.steps=2", f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_every=0",
               "data.eval=synthetic:count_shapes?n=4&seed=1", "data.prompts_per_step=4",
               "rollout.samples_per_prompt=2", "trainer.threads=1", "trainer.export=false",
               f"parallel.sequence_parallel={sequence_parallel}"]
    run(command, timeout=400)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][:-1]


def _same_run(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"] and x["response/length"] == y["response/length"]
        for key in ("entropy", "grad_norm", "loss/policy"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_with_sequence_parallel_equals_one_process(tmp_path):
    """Two training steps of the tiny VLM recipe: one Ulysses group of 2 processes
    samples what one process samples (same seed, same prompts) and takes the same steps."""
    _same_run(_train(tmp_path, 1, 1), _train(tmp_path, 2, 2))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_data_and_sequence_parallel_equals_data_parallel(tmp_path):
    """4 processes as 2 data x 2 sequence shards equal plain FSDP2 over 2 processes:
    FSDP sums each group's partial gradients and averages over the data shards only."""
    _same_run(_train(tmp_path, 2, 1), _train(tmp_path, 4, 2))


@pytest.mark.parametrize("rank", [0, 1])
def test_masked_inputs_keep_the_rows_of_each_ranks_positions(rank):
    """A (B, S) mask with one row of another input per True position (DeepStack-style):
    the mask is cut like the sequence, the rows follow their positions."""
    from mmrl.adapter import SequenceParallel

    spec = SequenceParallel(masked_inputs=(("visual_pos_masks", ("deepstack_visual_embeds",)),))
    hook = ulysses._splitter(spec)
    chosen = torch.tensor([[False, True, True, False, True], [True, False, False, True, True]])
    rows = torch.arange(6.0)[:, None].expand(6, 3)  # row i: the i-th True position, row-major
    kwargs = {"inputs_embeds": torch.randn(2, 5, 3), "attention_mask": torch.ones(2, 5, dtype=torch.long),
              "position_ids": torch.arange(5).expand(2, 5), "visual_pos_masks": chosen,
              "deepstack_visual_embeds": [rows, rows * 10]}
    with ulysses.active(group=None, rank=rank, size=2):
        _, cut = hook(torch.nn.Identity(), (), kwargs)
    # Rank 0 owns positions 0-2, rank 1 positions 3-4 and one of padding.
    expected_rows = [0.0, 1.0, 3.0] if rank == 0 else [2.0, 4.0, 5.0]
    assert cut["deepstack_visual_embeds"][0][:, 0].tolist() == expected_rows
    assert cut["deepstack_visual_embeds"][1][:, 0].tolist() == [10 * r for r in expected_rows]
    padded = F.pad(chosen, (0, 1))
    assert torch.equal(cut["visual_pos_masks"], padded[:, 3 * rank:3 * rank + 3])
    assert cut["inputs_embeds"].shape == (2, 3, 3)
    assert int(cut["visual_pos_masks"].sum()) == len(expected_rows)


def test_a_decoder_called_positionally_is_split_by_its_signatures_names():
    """Families such as GPT-2 call their decoder stack as `self.transformer(input_ids, ...)`:
    the splitter binds those arguments to their names and cuts them as keywords; a forward
    whose arguments have no names is one line."""
    from mmrl.adapter import SequenceParallel
    from mmrl.parallel.ulysses import _splitter, active

    class Stack(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **extra):
            self.seen = {"input_ids": input_ids, "position_ids": position_ids, **extra}
            return input_ids

    class Unnamed(torch.nn.Module):
        def forward(self, *inputs):
            return inputs[0]

    stack, unnamed = Stack(), Unnamed()
    for module in (stack, unnamed):
        module.register_forward_pre_hook(_splitter(SequenceParallel()), with_kwargs=True)
    ids = torch.arange(8).unsqueeze(0)
    with active(None, rank=1, size=2):
        stack(ids, labels=ids)
        with pytest.raises(ValueError, match="needs keyword arguments for Unnamed"):
            unnamed(ids)
    assert stack.seen["input_ids"].tolist() == [[4, 5, 6, 7]]  # rank 1's half
    assert stack.seen["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert stack.seen["labels"].tolist() == [[4, 5, 6, 7]]
