"""Observations rendered through a chat template: the tiny tokenizer's (Qwen's im_start/im_end)."""

from rlactors.environments.render import chat_observation_text
from rlactors.models import build_char_tokenizer


def test_an_observation_closes_the_turn_opens_a_tool_message_and_the_next_assistant_turn():
    tokenizer = build_char_tokenizer()
    expected_tail = "<|im_start|>tool\n=42\n<|im_end|>\n<|im_start|>assistant\n"
    # The model ended its turn with <|im_end|>: only the newline after it is added.
    assert chat_observation_text(tokenizer, "=42\n", "[calc 6*7]<|im_end|>") == "\n" + expected_tail
    # Cut at a stop string: the whole end of turn is added, as observation.
    assert chat_observation_text(tokenizer, "=42\n", "[calc 6*7]") == "<|im_end|>\n" + expected_tail
    # What the model reads is exactly the template's rendering of the conversation.
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "[calc 6*7]"},
                    {"role": "tool", "content": "=42\n"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    prefix = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert prefix + "[calc 6*7]" + chat_observation_text(tokenizer, "=42\n", "[calc 6*7]") == rendered
