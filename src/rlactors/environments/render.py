"""Observation text as the model sees it: verbatim, or as a tool message of the chat template.

A chat model's next turn must read the observation as its template renders a tool reply: close
the assistant's turn, open a tool message, close it, open the assistant's next turn. The template
is the model's own, so instead of hard-coding one format the text is read off two renderings of a
stand-in conversation, with and without the tool message (veRL's agent loop does the same). Pure:
a Hugging Face tokenizer in, text out.
"""

from __future__ import annotations

_MARK = "\u2063turn\u2063"  # stand-in content no template writes itself
_STAND_IN = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _MARK}]


def chat_observation_text(tokenizer, observation: str, turn_text: str) -> str:
    """The text to append after a model turn whose text (decoded with special tokens) is
    `turn_text`, so that the chat template reads `observation` as a tool message and the
    assistant's next turn has begun. Whatever part of the template's end-of-turn the model already
    wrote (its `<|im_end|>`, say) is not repeated."""
    base = tokenizer.apply_chat_template(_STAND_IN, tokenize=False)
    full = tokenizer.apply_chat_template(_STAND_IN + [{"role": "tool", "content": observation}], tokenize=False,
                                         add_generation_prompt=True)
    if not full.startswith(base) or _MARK not in base:
        raise ValueError("the chat template renders a conversation differently once a tool message follows: "
                         "observations cannot be rendered with it (set rollout.environment.chat_template=false "
                         "to insert them verbatim)")
    end_of_turn = base[base.rindex(_MARK) + len(_MARK):]  # e.g. "<|im_end|>\n"
    written = next((n for n in range(len(end_of_turn), 0, -1) if turn_text.endswith(end_of_turn[:n])), 0)
    return end_of_turn[written:] + full[len(base):]
