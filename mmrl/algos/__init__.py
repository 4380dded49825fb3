"""The RL math of the trainer: advantage estimators, policy/value losses and KL terms.

Pure tensor functions, no model code; see each module for shapes and conventions.

    from mmrl.algos import get_advantage_estimator, policy_loss, kl_loss, importance_weights
"""

from mmrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    scalar_to_token_rewards,
    uniform_groups,
)
from mmrl.algos.kl import KL_ESTIMATORS, kl_estimate, kl_in_reward, kl_loss
from mmrl.algos.off_policy import OFF_POLICY_MODES, importance_weights
from mmrl.algos.losses import (
    AGGREGATIONS,
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    policy_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "AdvantageEstimator",
    "KL_ESTIMATORS",
    "OFF_POLICY_MODES",
    "aggregate",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "get_advantage_estimator",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "kl_in_reward",
    "kl_loss",
    "masked_mean",
    "masked_whiten",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "scalar_to_token_rewards",
    "uniform_groups",
    "value_loss",
]
