"""A model's chat template: the Jinja template it ships (a GGUF file's `tokenizer.chat_template`,
or `chat_template` in a checkpoint's tokenizer_config.json / chat_template.jinja) that turns a
list of `{"role", "content"}` messages into the prompt text the model was tuned on. It renders
in a sandboxed, immutable Jinja environment with the conventions Hugging Face templates rely on
(blocks trimmed, `loop` controls, `raise_exception`, a `tojson` that keeps non-ASCII text,
`strftime_now`, and the `bos_token` / `eos_token` strings). A template that does not compile,
or raises while rendering (e.g. "roles must alternate"), is a `ChatTemplateError`. No torch.
"""

from __future__ import annotations

import datetime
import json


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or refuses the messages it was given."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template. source: the Jinja text; bos_token / eos_token: the special tokens'
    text, which templates may write themselves."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn header when
        add_generation_prompt; ChatTemplateError when the template refuses them."""
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from None
