"""Chat prompts: a message list rendered by the tokenizer's chat template (or ``data.chat_template``).

``render`` fills ``prompt.text`` for every prompt that has ``messages``, with
``apply_chat_template(messages, add_generation_prompt=True)``: the text ends where the assistant's
reply begins, as TRL and verl render it. Plain-string prompts are left as they are.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.tasks.base import DataError, Prompt

# The roles chat templates know (OpenAI's and Hugging Face's message format; "developer" is OpenAI's newer
# "system"). Anything else is a typo or a foreign schema, and most templates would render it silently.
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(p: Prompt) -> None:
    """DataError naming the prompt, the message and the rule when a message is not ``{"role": <one of
    ROLES>, "content": ...}``."""
    for i, m in enumerate(p.messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            got = f"role {role!r}" if isinstance(m, dict) else f"a {type(m).__name__}, not a mapping"
            raise DataError(f"prompt {p.id}: message {i} has {got}; a chat message is {{role, content}} with role "
                            f"one of {', '.join(ROLES)}: fix the dataset's messages (or map another column with "
                            f"data.fields)")


def template_of(override: str | None, tokenizer) -> str | None:
    """The Jinja template to use: ``override`` (inline, or a file holding it), else the tokenizer's."""
    if override:
        path = Path(override)
        if "{" not in override and path.suffix in (".jinja", ".j2", ".txt", ".jinja2"):
            if not path.is_file():
                raise DataError(f"data.chat_template={override!r}: no such file; give the template text or an "
                                f"existing .jinja file")
            return path.read_text()
        return override
    return getattr(tokenizer, "chat_template", None)


def render(prompts: list[Prompt], tokenizer, override: str | None = None) -> None:
    """Set ``text`` of each chat prompt in ``prompts`` (in place); DataError naming the prompt otherwise."""
    chats = [p for p in prompts if p.messages is not None]
    if not chats:
        return
    for p in chats:
        check_messages(p)
    template = template_of(override, tokenizer)
    if not template:
        raise DataError(f"prompt {chats[0].id} is a message list but the tokenizer has no chat template; set "
                        f"data.chat_template to a Jinja template (or a .jinja file), or store plain-string prompts")
    for p in chats:
        try:
            p.text = tokenizer.apply_chat_template(p.messages, chat_template=template, tokenize=False,
                                                   add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template error is the user's input, reported with the prompt
            raise DataError(f"prompt {p.id}: the chat template failed on its messages ({type(e).__name__}: {e}); "
                            f"fix data.chat_template or the messages") from None
