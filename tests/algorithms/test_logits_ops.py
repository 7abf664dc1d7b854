import math

import pytest
import torch

from rlactors.algorithms import chunked_entropy_from_logits, entropy_from_logits, logprobs_from_logits


def _entropy_loop(row):
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    total = sum(exps)
    return -sum(e / total * math.log(e / total) for e in exps)


def _logprob_loop(row, label):
    top = max(row)
    return row[label] - top - math.log(sum(math.exp(v - top) for v in row))


def test_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
    # uniform over 4 -> ln 4; probabilities [1/4, 3/4] -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert torch.allclose(entropy_from_logits(logits), torch.tensor(expected), atol=1e-6)


def test_entropy_and_logprobs_match_loops_for_every_chunk_size():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    entropy_expected = torch.tensor([[_entropy_loop(logits[b, t].tolist()) for t in range(5)] for b in range(2)], dtype=torch.float64)
    logprob_expected = torch.tensor(
        [[_logprob_loop(logits[b, t].tolist(), labels[b, t].item()) for t in range(5)] for b in range(2)], dtype=torch.float64
    )
    assert torch.allclose(entropy_from_logits(logits), entropy_expected)
    assert torch.allclose(logprobs_from_logits(logits, labels), logprob_expected)
    for chunk_size in (1, 3, 7, 10, 1000):
        assert torch.allclose(chunked_entropy_from_logits(logits, chunk_size), entropy_expected)
        assert torch.allclose(logprobs_from_logits(logits, labels, chunk_size=chunk_size), logprob_expected)


def test_chunked_gradients_equal_unchunked_gradients():
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, 9, generator=generator)
    labels = torch.randint(0, 9, (3, 4), generator=generator)
    weights = torch.randn(3, 4, generator=generator)

    def grads(chunk_size):
        logits = base.clone().requires_grad_(True)
        if chunk_size is None:
            entropy, logp = entropy_from_logits(logits), logprobs_from_logits(logits, labels)
        else:
            entropy = chunked_entropy_from_logits(logits, chunk_size)
            logp = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
        ((entropy - logp) * weights).sum().backward()
        return logits.grad

    reference = grads(None)
    assert reference.abs().sum() > 0
    for chunk_size in (1, 5, 100):
        assert torch.allclose(grads(chunk_size), reference, atol=1e-6)
    # And by hand: d log p_label / d logits = onehot(label) - softmax(logits).
    probs = torch.softmax(base, dim=-1)
    entropy_free = base.clone().requires_grad_(True)
    (logprobs_from_logits(entropy_free, labels, chunk_size=2) * weights).sum().backward()
    label = labels[0, 0].item()
    expected = weights[0, 0] * ((torch.arange(9) == label).float() - probs[0, 0])
    assert torch.allclose(entropy_free.grad[0, 0], expected, atol=1e-6)


def test_low_precision_logits_keep_dtype_and_use_float32_inside():
    logits = (torch.randn(4, 33) * 5).to(torch.bfloat16)
    labels = torch.randint(0, 33, (4,))
    exact = logprobs_from_logits(logits.float(), labels)
    out = logprobs_from_logits(logits, labels, chunk_size=3)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact.to(torch.bfloat16))
    assert chunked_entropy_from_logits(logits, 2).dtype == entropy_from_logits(logits).dtype == torch.bfloat16


def test_edge_cases():
    empty = torch.zeros(0, 7)
    assert chunked_entropy_from_logits(empty, 4).shape == (0,)
    assert logprobs_from_logits(empty, torch.zeros(0, dtype=torch.long), chunk_size=4).shape == (0,)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_entropy_from_logits(torch.zeros(2, 5), 0)
