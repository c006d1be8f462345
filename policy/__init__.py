"""The policy: what is served and trained — model loading and the named models, the cached decoder, the
sampler's distribution and token log-probabilities, the exploration rule (greedy, or a sample on a budget), the prompt formats, what of a completion a user is
shown, and the show-gate. Every area that serves, scores or trains stands on this floor."""
