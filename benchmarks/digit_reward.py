"""A toy reward an untrained model can learn: the share of digit characters in the response (also
its `acc`, which validation reports)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    share = sum(c.isdigit() for c in solution_str) / len(solution_str) if solution_str else 0.0
    return {"score": share, "acc": share}
