"""The RL math against small examples worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from mmrl.algos import (
    ADVANTAGE_ESTIMATORS,
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    kl_estimate,
    kl_in_reward,
    kl_loss,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    scalar_to_token_rewards,
    uniform_groups,
    value_loss,
)


def close(actual, expected, atol=1e-4):
    actual, expected = torch.as_tensor(actual).float(), torch.as_tensor(expected).float()
    torch.testing.assert_close(actual.detach(), expected.detach(), atol=atol, rtol=0)


# Two right-padded responses: three tokens, then two tokens and one pad.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


# -- advantages ------------------------------------------------------------------------
def test_grpo_normalizes_within_each_group():
    # group [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071 -> +-0.5 / 0.7071
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    close(grpo_advantages(rewards, 2), [0.7071, -0.7071, -0.7071, 0.7071])
    # Dr. GRPO keeps the centered rewards unscaled.
    close(grpo_advantages(rewards, 2, scale="none"), [0.5, -0.5, -0.5, 0.5])


def test_grpo_group_of_equal_rewards_gets_zero():
    # group [2, 2, 2] has std 0; group [0, 3, 0]: mean 1, std sqrt((1 + 4 + 1) / 2) = sqrt(3)
    advantages = grpo_advantages(torch.tensor([2.0, 2.0, 2.0, 0.0, 3.0, 0.0]), 3)
    s3 = math.sqrt(3)
    close(advantages, [0.0, 0.0, 0.0, -1 / s3, 2 / s3, -1 / s3])


def test_grpo_rejects_bad_layouts():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(torch.zeros(4), 2, scale="max")


def test_rloo_uses_leave_one_out_baseline():
    # [1, 0]: 1 - 0 = 1, 0 - 1 = -1. [3, 0, 0]: 3 - 0 = 3, 0 - (3 + 0) / 2 = -1.5 (twice)
    close(rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2), [1.0, -1.0, -1.0, 1.0])
    close(rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3), [3.0, -1.5, -1.5])


def test_reinforce_pp_discounts_then_whitens_over_valid_tokens():
    # gamma 0.5. Returns: row 0 [0.25, 0.5, 1], row 1 [0.5, 1] (pad skipped, its reward 9 ignored).
    # Mean of the 5 valid returns 0.65; deviations [-0.4, -0.15, 0.35, -0.15, 0.35];
    # unbiased variance 0.45 / 4 = 0.1125, std 0.33541.
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    advantages = reinforce_pp_advantages(token_rewards, MASK, gamma=0.5)
    close(advantages, [[-1.1926, -0.4472, 1.0435], [-0.4472, 1.0435, 0.0]])


def test_gae_on_ragged_right_padded_batch():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); the value after the last valid token is 0.
    # row 0: d2 = 1 - 0.7 = 0.3;            A2 = 0.3
    #        d1 = 0.9 * 0.7 - 0.6 = 0.03;   A1 = 0.03 + 0.72 * 0.3 = 0.246
    #        d0 = 0.9 * 0.6 - 0.5 = 0.04;   A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # row 1 (pad value 9.9 must not leak): d1 = 1 - 0.6 = 0.4; A1 = 0.4
    #        d0 = 0.04;                      A0 = 0.04 + 0.72 * 0.4 = 0.328
    # returns = advantages + values, 0 on the pad.
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.9]])
    advantages, returns = gae_advantages(token_rewards, values, MASK, gamma=0.9, lam=0.8)
    close(advantages, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]])
    close(returns, [[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]])


def test_gae_with_lambda_one_and_no_discount_is_return_minus_value():
    token_rewards = torch.tensor([[0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    advantages, returns = gae_advantages(token_rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(advantages, [[1.5, 1.0, 0.5]])
    close(returns, [[2.0, 2.0, 2.0]])


def test_scalar_reward_lands_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    close(scalar_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask), [[0, 2, 0], [0, 0, 3], [0, 0, 0]])


def test_uniform_groups_marks_groups_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert uniform_groups(rewards, 2).tolist() == [True, True, False, False, True, True]
    assert uniform_groups(rewards, 3).tolist() == [False] * 6


def test_estimators_by_name():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*dr_grpo, gae, grpo"):
        get_advantage_estimator("ppo")


def test_estimator_compute_gives_per_token_advantages():
    # Sequence rewards 1 and 0 in one group of 2 -> RLOO +1 / -1 on every valid token.
    token_rewards = scalar_to_token_rewards(torch.tensor([1.0, 0.0]), MASK)
    advantages, returns = get_advantage_estimator("rloo").compute(token_rewards, MASK, group_size=2)
    close(advantages, [[1, 1, 1], [-1, -1, 0]])
    assert returns is None
    advantages, _ = get_advantage_estimator("dr_grpo").compute(token_rewards, MASK, group_size=2)
    close(advantages, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])
    with pytest.raises(ValueError, match="needs critic values"):
        get_advantage_estimator("gae").compute(token_rewards, MASK)


# -- aggregation and losses ------------------------------------------------------------
def test_aggregation_modes_on_ragged_mask():
    # valid values: row 0 [1, 2, 3], row 1 [4]; padding holds junk that must not count.
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(aggregate(values, mask, "token_mean"), 2.5)  # (1 + 2 + 3 + 4) / 4
    close(aggregate(values, mask, "seq_mean_token_mean"), 3.0)  # (6 / 3 + 4 / 1) / 2
    close(aggregate(values, mask, "seq_mean_token_sum_norm", norm_length=4), 1.25)  # (6 / 4 + 4 / 4) / 2
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(values, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(values, mask, "sum")


# Ratios pi / pi_old per token; row 0 has advantage +1, row 1 advantage -1, row 1's last token is padding.
RATIOS = torch.tensor([[0.5, 1.5, 1.1], [0.5, 1.5, 7.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def test_policy_loss_clip_higher():
    # clip range [0.8, 1.28]. Per-token loss max(-A r, -A clip(r)):
    #   row 0 (A=+1): r 0.5 -> max(-0.5, -0.8) = -0.5;  r 1.5 -> max(-1.5, -1.28) = -1.28 (clipped);
    #                 r 1.1 -> -1.1
    #   row 1 (A=-1): r 0.5 -> max(0.5, 0.8) = 0.8 (clipped); r 1.5 -> max(1.5, 1.28) = 1.5
    # token_mean = (-0.5 - 1.28 - 1.1 + 0.8 + 1.5) / 5 = -0.116; clipped 2 of 5 tokens.
    loss, metrics = policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, MASK, clip_low=0.2, clip_high=0.28)
    close(loss, -0.116)
    close(metrics["clip_fraction"], 0.4)
    close(metrics["ratio_mean"], (0.5 + 1.5 + 1.1 + 0.5 + 1.5) / 5)
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.5, 1.1, 0.5, 1.5)]
    close(metrics["approx_kl"], sum(k3) / 5)


def test_policy_loss_gradient_is_zero_where_clipped():
    # d(-A r)/d logp = -A r, divided by 5 tokens (token_mean):
    #   row 0: [-0.5 / 5, 0 (r 1.5 above 1.28 with A > 0: clipped), -1.1 / 5]
    #   row 1: [0 (r 0.5 below 0.8 with A < 0: clipped), 1.5 / 5, 0 (padding)]
    logp = RATIOS.log().requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(2, 3), ADVANTAGES, MASK, clip_high=0.28)
    loss.backward()
    close(logp.grad, [[-0.1, 0.0, -0.22], [0.0, 0.3, 0.0]])
    assert logp.grad[0, 1] == 0.0


def test_policy_loss_per_token_advantages_match_broadcast():
    per_token = ADVANTAGES[:, None].expand(2, 3).clone()
    broadcast, _ = policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, MASK)
    explicit, _ = policy_loss(RATIOS.log(), torch.zeros(2, 3), per_token, MASK)
    close(broadcast, explicit)


def test_policy_loss_dual_clip_caps_negative_advantages():
    # A = -1, r = 4: plain PPO loss max(4, 1.2) = 4; dual clip c = 3 caps it at 3.
    logp = torch.tensor([[math.log(4.0)]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    close(loss, 3.0)
    close(metrics["dual_clip_fraction"], 1.0)
    plain, _ = policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    close(plain, 4.0)


def test_value_loss_is_clipped_around_old_values():
    # clip 0.2. token 0: V 1.0, old 0.5, R 1.0: unclipped 0, clipped V 0.7 -> 0.09; max 0.09 (clipped)
    #           token 1: V 0.4, old 0.5, R 0.0: unclipped 0.16, clipped V 0.4 -> 0.16
    # loss = 0.5 * (0.09 + 0.16) / 2 = 0.0625
    values = torch.tensor([[1.0, 0.4]], requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]]), torch.ones(1, 2))
    close(loss, 0.0625)
    close(metrics["clip_fraction"], 0.5)
    loss.backward()
    close(values.grad, [[0.0, 0.2]])  # token 0 is clipped; token 1: 0.5 * 2 * (0.4 - 0) / 2 tokens


def test_entropy_of_uniform_distribution_and_bonus_sign():
    entropy = entropy_from_logits(torch.zeros(1, 2, 4))
    close(entropy, [[math.log(4), math.log(4)]])
    close(entropy_bonus(entropy, torch.ones(1, 2), coef=0.01), -0.01 * math.log(4))


# -- KL --------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([0.0, -1.0, 1.0]), torch.zeros(3)
    close(kl_estimate(logp, ref, "k1"), [0.0, -1.0, 1.0])
    close(kl_estimate(logp, ref, "k2"), [0.0, 0.5, 0.5])
    # k3 = exp(ref - logp) - (ref - logp) - 1: [0, e - 2, 1/e]
    close(kl_estimate(logp, ref, "k3"), [0.0, math.e - 2, math.exp(-1)])
    close(kl_estimate(logp, ref, "k3", clamp=0.5), [0.0, 0.5, math.exp(-1)])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_non_negative_and_zero_when_equal():
    torch.manual_seed(0)
    logp, ref = torch.randn(64) * 3, torch.randn(64) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(64))


def test_k3_gradient_stays_finite_for_extreme_log_ratios():
    logp = torch.tensor([-200.0, 0.0], requires_grad=True)
    kl_loss(logp, torch.zeros(2), torch.ones(2), coef=1.0, clamp=10.0).backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_in_reward_subtracts_detached_penalty_on_valid_tokens():
    kl = torch.tensor([[0.5, 1.0, 2.0]], requires_grad=True)
    rewards = kl_in_reward(torch.tensor([[0.0, 0.0, 1.0]]), kl, coef=0.1, mask=torch.tensor([[1, 1, 0]]))
    close(rewards, [[-0.05, -0.1, 1.0]])
    assert not rewards.requires_grad


def test_kl_loss_aggregates_k3():
    # k3 per token [0, e - 2]; token_mean 0.359, times coef 0.5
    loss = kl_loss(torch.tensor([[0.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2), coef=0.5)
    close(loss, 0.5 * (math.e - 2) / 2)


# -- off-policy correction (mmrl/algos/off_policy.py) ------------------------------------------------
def _off_policy_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 5, generator=generator) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 5, generator=generator)
    advantages = torch.randn(3, 5, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return logp, old, advantages, mask


@pytest.mark.parametrize("mode", ["tis", "mask", "none"])
@pytest.mark.parametrize("aggregation, dual_clip", [("token_mean", None), ("seq_mean_token_mean", 3.0),
                                                     ("seq_mean_token_sum_norm", None)])
def test_behaviour_equal_to_old_gives_the_uncorrected_loss_bit_for_bit(mode, aggregation, dual_clip):
    """Staleness 0: the behaviour log-probs are the old ones, every weight is exactly 1."""
    from mmrl.algos import importance_weights

    logp, old, advantages, mask = _off_policy_batch()
    options = {"clip_high": 0.28, "aggregation": aggregation, "dual_clip": dual_clip, "norm_length": 5}
    plain, plain_stats = policy_loss(logp, old, advantages, mask, **options)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    weights, spread = importance_weights(old, old.clone(), mask, mode=mode, cap=2.0)
    assert torch.equal(weights, torch.ones_like(weights))
    corrected, stats = policy_loss(logp, old, advantages, mask, importance_weights=weights, **options)
    (grad,) = torch.autograd.grad(corrected, logp)
    assert torch.equal(corrected, plain) and torch.equal(grad, plain_grad)
    assert all(torch.equal(stats[k], plain_stats[k]) for k in plain_stats)
    assert float(spread["ratio_mean"]) == float(spread["ratio_max"]) == 1.0 and float(spread["capped_fraction"]) == 0


def test_importance_weights_truncate_mask_or_ignore_the_ratio():
    from mmrl.algos import importance_weights

    # pi_old / b per token: e^1.5 = 4.48 (above cap 2), e^0.5 = 1.65, 1, e^-1 = 0.37 (below 1/2), padding
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.5, -0.5, 0.0, 1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    tis, stats = importance_weights(old, behaviour, mask, mode="tis", cap=2.0)
    close(tis, [[2.0, math.exp(0.5), 1.0, math.exp(-1.0), 1.0]])
    close(stats["capped_fraction"], 0.25)
    close(stats["ratio_max"], math.exp(1.5))
    close(stats["ratio_min"], math.exp(-1.0))
    close(stats["ratio_mean"], (math.exp(1.5) + math.exp(0.5) + 1 + math.exp(-1)) / 4)
    masked, stats = importance_weights(old, behaviour, mask, mode="mask", cap=2.0)
    close(masked, [[0.0, math.exp(0.5), 1.0, 0.0, 1.0]])
    close(stats["capped_fraction"], 0.5)
    none, stats = importance_weights(old, behaviour, mask, mode="none", cap=2.0)
    assert torch.equal(none, torch.ones_like(none)) and float(stats["capped_fraction"]) == 0.0
    huge, _ = importance_weights(old, torch.full_like(old, -1e4), mask, mode="tis", cap=2.0)
    assert torch.isfinite(huge).all()
    with pytest.raises(ValueError, match="unknown off-policy correction 'icepop'"):
        importance_weights(old, behaviour, mask, mode="icepop")
    with pytest.raises(ValueError, match="above 1"):
        importance_weights(old, behaviour, mask, cap=1.0)


def test_truncated_weights_scale_each_tokens_policy_gradient():
    """One pass (ratio 1): d loss / d logp_t = -A_t * w_t / tokens, w = min(pi_old / b, cap)."""
    from mmrl.algos import importance_weights

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach()
    behaviour = old + torch.tensor([[-2.0, 0.3, 0.0]])  # rho = e^2 (capped to 2), e^-0.3, 1
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights, _ = importance_weights(old, behaviour, mask, mode="tis", cap=2.0)
    loss, _ = policy_loss(logp, old, advantages, mask, importance_weights=weights)
    loss.backward()
    close(logp.grad, [[-1.0 * 2.0 / 3, 1.0 * math.exp(-0.3) / 3, -2.0 * 1.0 / 3]])
