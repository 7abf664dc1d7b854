"""A user reward with veRL's signature whose value varies within a group even for an untrained
model, so dynamic sampling has groups to keep and to reject."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2), "acc": len(solution_str) % 2 == 1}
