"""KNormPolicy: keep the keys with the lowest L2 norm (Devoto et al., 2024); no attention needed."""
from vllm.core.eviction.key_score import KeyScorePolicy


class KNormPolicy(KeyScorePolicy):
    """Keys with a small L2 norm draw high attention, so over budget the live tokens with the
    largest key norm go first. A token's score is ||k|| averaged over layers and KV heads."""
    key_statistic = "norm"
