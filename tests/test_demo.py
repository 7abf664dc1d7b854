"""The demo's warm-up pieces on the tiny model (the full demo is `make demo`)."""

from rlactors.config import load_config
from rlactors.data import read_parquet_rows
from rlactors.data.synthetic import COUNTDOWN_START, countdown, write_task
from rlactors.demo import COUNTDOWN_WARMUP, DEMO_CONFIG, DEMO_WARMUP, greedy_accuracy, sft_batch, warm_up
from rlactors.models import load_model, load_tokenizer


def test_sft_batch_supervises_the_answer_and_end_of_sequence(tmp_path, tiny_model_dir):
    rows = read_parquet_rows(write_task("arithmetic", tmp_path, 4, 2)[0])[0]
    tokenizer = load_tokenizer(tiny_model_dir)
    batch = sft_batch(rows, tokenizer)
    for row, prompt, response in zip(rows, batch.prompt_token_ids, batch.response_token_ids, strict=True):
        assert tokenizer.decode(prompt) == row.prompt[0].content
        assert response[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(response[:-1]) == row.reward_model.ground_truth


def test_countdown_warm_up_checks_whole_answers():
    # The greedy check generates up to max_new_tokens: the longest answer and its end-of-sequence fit.
    assert COUNTDOWN_WARMUP["max_new_tokens"] >= len(countdown(COUNTDOWN_START["max"])) + 1
    assert COUNTDOWN_WARMUP.keys() == DEMO_WARMUP.keys()


def test_warm_up_trains_and_writes_a_loadable_folder(ray_session, tmp_path, tiny_model_dir):
    settings = DEMO_WARMUP | {"min_steps": 4, "max_steps": 8, "check_every_steps": 4, "num_check_rows": 16}
    config = load_config(DEMO_CONFIG, [f"pipeline.output_dir={tmp_path}", "data.num_train_rows=200"])
    path = warm_up(config, tiny_model_dir, tmp_path / "warm", settings=settings)
    assert load_model(path) is not None
    rows = read_parquet_rows(tmp_path / "data" / "test.parquet")[0][:16]
    assert 0.0 <= greedy_accuracy(path, rows) <= 1.0
    # The supervised answers became more likely: the warm-up really trained the model it saved.
    batch = sft_batch(rows, load_tokenizer(path))
    assert answer_nll(path, batch) < answer_nll(tiny_model_dir, batch) - 0.5


def answer_nll(model_path, batch) -> float:
    import torch

    model = load_model(model_path).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_token_ids, batch.response_token_ids, strict=True):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])
            total, count = total - float(logp.sum()), count + len(response)
    return total / count
