"""A user reward with veRL's signature whose value varies within a group even for an untrained
model, so dynamic sampling has groups to keep and to reject."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2), "acc": len(solution_str) % 2 == 1}


def compute_score_half_flat(data_source, solution_str, ground_truth, extra_info=None):
    """The parity reward for prompts whose answer is odd; 0 for every response to the others (about
    half the prompts): dynamic sampling drops those groups, for zero variance."""
    if int(ground_truth) % 2 == 0:
        return {"score": 0.0, "acc": False}
    return compute_score(data_source, solution_str, ground_truth, extra_info)
