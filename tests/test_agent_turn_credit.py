"""Per-turn credit assignment (`algo.credit_assignment: turn`): each environment reward is
credited to the policy turns up to the one it followed, the reward function's score to
every turn; grouped estimators normalize the score and each turn's rewards within the
prompt's group apart (docs/agents.md). Hand-built batches with known per-turn rewards
give the per-token advantages the formula says; the default per-trajectory path is
unchanged; the agent loop's trajectories carry their rewards to the right tokens."""

from pathlib import Path

import pytest
import torch

from mmrl.algos.advantages import get_advantage_estimator, scalar_to_token_rewards

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# Two prompts x two samples. Columns: 0-1 turn 1, 2 environment tokens, 3-4 turn 2, 5 padding.
TURN = torch.tensor([[1, 1, 0, 2, 2, 0],   # two turns: reward 0.5 after turn 1, 0.25 after turn 2
                     [1, 1, 1, 0, 0, 0],   # one turn, no environment reward
                     [1, 0, 2, 2, 2, 0],   # two turns, 0 then 1.0
                     [1, 1, 0, 2, 0, 0]])  # two turns, 0.5 then 0
ENV = {0: [0.5, 0.25], 1: [0.0], 2: [0.0, 1.0], 3: [0.5, 0.0]}
OUTCOME = torch.tensor([1.0, 0.0, 0.0, 1.0])


def _token_rewards():
    """Each environment reward on the last token of the turn it followed."""
    rewards = torch.zeros(TURN.shape)
    for row, per_turn in ENV.items():
        for k, r in enumerate(per_turn, start=1):
            rewards[row, (TURN[row] == k).nonzero().max()] = r
    return rewards


def _expected(normalize):
    """A[i, k] = normalize(outcome)[i] + sum_{j >= k} normalize(R[:, j])[i], written out
    sample by sample (R[i, j] = 0 where sample i had no turn j)."""
    turns = int(TURN.max())
    streams = [OUTCOME.tolist()] + [[ENV[i][j] if j < len(ENV[i]) else 0.0 for i in range(4)] for j in range(turns)]
    normalized = [normalize(s[:2]) + normalize(s[2:]) for s in streams]  # groups of 2
    out = torch.zeros(TURN.shape)
    for i in range(4):
        for col in range(TURN.shape[1]):
            k = int(TURN[i, col])
            if k:
                out[i, col] = normalized[0][i] + sum(normalized[j][i] for j in range(k, turns + 1))
    return out


def _grpo(group):
    mean = sum(group) / len(group)
    std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
    return [(x - mean) / (std + 1e-6) for x in group]


def _dr_grpo(group):
    return [x - sum(group) / len(group) for x in group]


def _rloo(group):
    return [x - (sum(group) - x) / (len(group) - 1) for x in group]


@pytest.mark.parametrize("name,normalize", [("grpo", _grpo), ("dr_grpo", _dr_grpo), ("rloo", _rloo)])
def test_grouped_estimators_credit_the_rewards_from_each_turn_on(name, normalize):
    estimator = get_advantage_estimator(name)
    advantages, returns = estimator.compute_by_turn(OUTCOME, _token_rewards(), TURN, group_size=2)
    assert returns is None
    torch.testing.assert_close(advantages, _expected(normalize), rtol=0, atol=1e-5)
    if name == "grpo":
        # Written out for GRPO, groups of 2 (each column normalizes to +-1/sqrt(2), or 0 when equal):
        # sample 0, turn 1: outcome +a, turn-1 rewards (0.5 vs 0) +a, turn-2 rewards (0.25 vs 0) +a -> 3a;
        # turn 2: outcome and turn 2 only -> 2a. Sample 1 (one turn): -3a.
        a = 2 ** -0.5
        torch.testing.assert_close(advantages[0], torch.tensor([3 * a, 3 * a, 0, 2 * a, 2 * a, 0]), atol=1e-5,
                                   rtol=0)
        torch.testing.assert_close(advantages[1, :3], torch.full((3,), -3 * a), atol=1e-5, rtol=0)
        # Prompt 2: outcomes 0 vs 1 -> -a; turn-1 rewards 0 vs 0.5 -> -a; turn-2 rewards 1.0 vs 0 -> +a.
        # Sample 2, turn 1: -a - a + a = -a; turn 2: -a + a = 0.
        torch.testing.assert_close(advantages[2], torch.tensor([-a, 0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    # Turns differ exactly by the normalized rewards of the turns before.
    assert not torch.equal(advantages[0, 0], advantages[0, 3])


def test_turn_credit_without_environment_rewards_equals_the_trajectory_path():
    mask = TURN > 0
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        estimator = get_advantage_estimator(name)
        by_turn, _ = estimator.compute_by_turn(OUTCOME, torch.zeros(TURN.shape), TURN, group_size=2)
        whole, _ = estimator.compute(scalar_to_token_rewards(OUTCOME, mask), mask, group_size=2)
        torch.testing.assert_close(by_turn, whole, rtol=0, atol=0)


def test_rloo_and_dr_grpo_first_turn_equals_the_summed_reward():
    """Both are linear in the rewards: the first turn's advantage is the per-trajectory one."""
    mask = TURN > 0
    total = OUTCOME + torch.tensor([sum(ENV[i]) for i in range(4)])
    for name in ("rloo", "dr_grpo"):
        estimator = get_advantage_estimator(name)
        by_turn, _ = estimator.compute_by_turn(OUTCOME, _token_rewards(), TURN, group_size=2)
        whole, _ = estimator.compute(scalar_to_token_rewards(total, mask), mask, group_size=2)
        first = TURN == 1
        torch.testing.assert_close(by_turn[first], whole[first], rtol=0, atol=1e-6)


def test_per_token_estimators_take_each_reward_at_its_turn():
    """REINFORCE++ (gamma 1): before whitening, a token's return is the rewards from its
    turn on, so turn 2's tokens lose what was paid after turn 1."""
    from mmrl.algos.advantages import masked_whiten

    returns = torch.zeros(TURN.shape)
    for i in range(4):
        for col in range(TURN.shape[1]):
            k = int(TURN[i, col])
            if k:
                returns[i, col] = OUTCOME[i] + sum(ENV[i][k - 1:])
    estimator = get_advantage_estimator("reinforce_pp")
    by_turn, _ = estimator.compute_by_turn(OUTCOME, _token_rewards(), TURN)
    torch.testing.assert_close(by_turn, masked_whiten(returns, TURN > 0), rtol=0, atol=1e-6)
    gae = get_advantage_estimator("gae")
    values = torch.zeros(TURN.shape)
    advantages, value_targets = gae.compute_by_turn(OUTCOME, _token_rewards(), TURN, values=values, gamma=1.0,
                                                    lam=1.0)
    torch.testing.assert_close(value_targets, returns, rtol=0, atol=1e-6)


def test_groups_whose_turn_rewards_are_all_equal_add_nothing():
    """GRPO stays finite: an equal column is 0 after centering, never divided by eps alone."""
    turn = torch.tensor([[1, 2], [1, 2]])
    rewards = torch.tensor([[0.3, 0.0], [0.3, 0.0]])  # both paid 0.3 after turn 1
    advantages, _ = get_advantage_estimator("grpo").compute_by_turn(torch.tensor([1.0, 1.0]), rewards, turn,
                                                                     group_size=2)
    assert torch.equal(advantages, torch.zeros(2, 2))


def test_turn_shapes_must_agree():
    with pytest.raises(ValueError, match="turn .* and token_rewards .* differ"):
        get_advantage_estimator("grpo").compute_by_turn(OUTCOME, torch.zeros(4, 3), TURN, group_size=2)


class PaysPerTurn:
    """Replies each turn and pays 0.1 x the turn's number; done after three turns."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def step(self, messages):
        self.turns += 1
        return [{"role": "user", "content": "go on"}], self.turns == 3, 0.1 * self.turns


def test_agent_trajectories_put_each_reward_on_its_turn():
    """The agent loop on a tiny text model: each trajectory's per-turn rewards reach the
    training batch on the last token of the turn they followed, and `compute_by_turn` on
    that batch gives the formula's advantages turn by turn."""
    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.rollout import SamplingParams, make_rollout
    from mmrl.rollout.agent import AgentRollout
    from mmrl.rollout_batch import trajectory_sequences

    torch.manual_seed(0)
    built = build_model("qwen2", random_init=True, seed=0)
    engine = Engine(built, init_distributed(), mixed_precision=False)
    agent = AgentRollout(make_rollout("hf", engine, built.processing), built.processing, PaysPerTurn,
                         max_turns=3, max_tokens=256)
    result = agent.generate([{"question": "a?"}, {"question": "b?"}], SamplingParams(n=2, max_new_tokens=3))
    trajectories = result.trajectories
    assert [t.turn_rewards for t in trajectories if t.finish == "done"] and all(
        t.turn_rewards == pytest.approx([0.1 * k for k in range(1, t.turns + 1)]) for t in trajectories)
    assert result.stats["agent/turn_reward"] == pytest.approx(
        sum(map(sum, (t.turn_rewards for t in trajectories))) / sum(t.turns for t in trajectories))
    seqs = trajectory_sequences(trajectories, built.processing, built.adapter, engine.model,
                                built.processing.tokenizer.pad_token_id)
    turn, rewards = seqs.extras["turn"], seqs.extras["turn_rewards"]
    assert torch.equal(turn > 0, seqs.response_mask.bool())
    for row, t in enumerate(trajectories):
        assert [int((turn[row] == k).sum()) for k in range(1, t.turns + 1)] == [b - a for a, b in t.spans]
        last = [int((turn[row] == k).nonzero().max()) for k in range(1, t.turns + 1)]
        assert rewards[row, last].tolist() == pytest.approx(t.turn_rewards)
        assert float(rewards[row].sum()) == pytest.approx(t.env_reward)
    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages, _ = get_advantage_estimator("dr_grpo").compute_by_turn(outcome, rewards, turn, group_size=2)
    for row, t in enumerate(trajectories):
        mate = row ^ 1  # the other sample of its prompt
        mine, other = (r + [0.0] * (3 - len(r)) for r in (t.turn_rewards, trajectories[mate].turn_rewards))
        for k in range(1, t.turns + 1):
            # Dr. GRPO in groups of 2: each column's advantage is half the difference (0: no such turn).
            expected = (outcome[row] - outcome[mate]) / 2 + sum((mine[j] - other[j]) / 2 for j in range(k - 1, 3))
            assert torch.allclose(advantages[row][turn[row] == k], torch.tensor(float(expected)), atol=1e-6)


def _demo(tmp_path, *extra):
    from mmrl.config import load_recipe

    return load_recipe(RECIPES / "agent_zoom_count.yaml", [
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "trainer.progress=false",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.eval_every=0",
        "data.eval=synthetic:count_shapes?n=8&seed=1&image_size=56", "trainer.export=false", *extra])


def _capture_advantages(trainer):
    """Wrap the trainer's `update.plan` to keep each plan's batches, and the rewards and
    outcomes of its kept rows."""
    calls = []
    original = trainer.update.plan

    def capture(conversations, result, rows, rewards, group_size, temperature, outcomes=None):
        plan = original(conversations, result, rows, rewards, group_size, temperature, outcomes)
        calls.append((plan.batches, rewards[rows], outcomes[rows]))
        return plan

    trainer.update.plan = capture
    return calls


@pytest.mark.slow
def test_demo_recipe_trains_with_turn_credit(tmp_path):
    """Two steps of the zoom demo with `algo.credit_assignment=turn`: it runs, updates the
    model, logs the per-turn reward, and the advantages the update used are
    `compute_by_turn`'s on the batch's per-turn rewards and the reward function's scores."""
    import json

    from mmrl.trainer import Trainer

    trainer = Trainer(_demo(tmp_path, "algo.credit_assignment=turn"))
    calls = _capture_advantages(trainer)
    before = {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}
    summary = trainer.fit()
    assert summary["steps"] == 2
    assert any(not (v == trainer.actor.model.state_dict()[k]).all() for k, v in before.items())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("agent/turn_reward" in r for r in records[:2])
    estimator = get_advantage_estimator("grpo")
    for batches, rewards, outcomes in calls:
        assert len(batches) == 1  # the demo's 16 rows fit one micro-batch
        seqs = batches[0]
        turn, paid = seqs.extras["turn"].cpu(), seqs.extras["turn_rewards"].cpu()
        assert torch.equal(turn > 0, seqs.response_mask.cpu().bool())
        torch.testing.assert_close(outcomes + paid.sum(-1), rewards)  # the total is what the metrics log
        expected, _ = estimator.compute_by_turn(outcomes, paid, turn, group_size=4)
        torch.testing.assert_close(seqs.extras["advantages"].cpu(), expected, rtol=0, atol=0)


@pytest.mark.slow
def test_default_credit_is_the_per_trajectory_advantage(tmp_path):
    """Without the option, every policy token of a sample gets the estimator's advantage of
    its summed reward (the function's score plus the environment's), bit for bit."""
    from mmrl.trainer import Trainer

    trainer = Trainer(_demo(tmp_path, "trainer.steps=1"))
    assert trainer.recipe.algo.credit_assignment == "trajectory"
    calls = _capture_advantages(trainer)
    trainer.fit()
    (batches, rewards, _), = calls
    seqs = batches[0]
    mask = seqs.response_mask.cpu()
    expected, _ = get_advantage_estimator("grpo").compute(scalar_to_token_rewards(rewards, mask), mask, group_size=4)
    assert torch.equal(seqs.extras["advantages"].cpu(), expected)


def test_turn_credit_needs_an_environment():
    from mmrl.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="credit_assignment 'turn' needs a multi-turn rollout"):
        load_recipe(RECIPES / "tiny_vlm_count.yaml", ["algo.credit_assignment=turn"])
    with pytest.raises(RecipeError, match="algo.credit_assignment: Input should be 'trajectory' or 'turn'"):
        load_recipe(RECIPES / "agent_zoom_count.yaml", ["algo.credit_assignment=step"])
