"""Client-side chat formatting for `--chat`: DeepSeek's single-turn template.

    <｜User｜>{message}<｜Assistant｜>

(fullwidth bars and the tokens DeepSeek's tokenizers define; the engine's tokenizer adds the
begin-of-sentence token itself). The server takes plain text only, so the client formats.
"""

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"


def chat_prompt(message: str, system: str | None = None) -> str:
    return f"{system or ''}{USER}{message}{ASSISTANT}"
