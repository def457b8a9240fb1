"""A finished request's whole sequence -- what a follow-up turn resends -- as canonical text,
which the emulator's prefix cache hashes in blocks: its prompt text (rendered by
`policies.prefix`, as the proxy renders it for its prefix index) followed by its answer
rendered the same way (an assistant message after a chat prompt, token ids after an ids
prompt, plain text otherwise).
"""

from __future__ import annotations

from policies.prefix import ids_text, message_text
from simulator.emulator import synthetic


def sequence_text(chat: bool, prompt_text: str, ids_prompt: bool, generated: int) -> str:
    """The prompt followed by the first `generated` output tokens, as a follow-up resends them."""
    if ids_prompt:
        return prompt_text + ids_text(synthetic.token_ids(0, generated))
    answer = synthetic.text(0, generated)
    if chat:
        return prompt_text + message_text("assistant", answer)
    return prompt_text + answer
