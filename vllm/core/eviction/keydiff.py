"""KeyDiffPolicy: keep the keys least similar to the mean key (Park et al., 2025); no attention."""
from vllm.core.eviction.key_score import KeyScorePolicy


class KeyDiffPolicy(KeyScorePolicy):
    """A key close to the average key adds little the others do not already say, so over budget
    the live tokens whose keys are most similar to the anchor go first. The anchor is the mean
    of the view's unit keys; a token's score is the cosine of its key with the anchor, per layer
    and KV head, averaged. It changes as the context changes, hence read per evicting step."""
    key_statistic = "similarity"
