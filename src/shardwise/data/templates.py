"""Chat templates shipped with shardwise (data/templates/*.jinja), for models whose tokenizer
has none, or to replace the one it has (`--chat-template NAME|FILE`).

Each shipped template renders a prefix of a conversation as a prefix of the whole, which
encode.py needs to find the turns that carry loss. Templates run in transformers' sandboxed
Jinja environment, so a template file cannot run code.
"""

from __future__ import annotations

import os
from importlib import resources

from shardwise.errors import ShardwiseError

MAX_TEMPLATE_BYTES = 1 << 20


def names() -> list[str]:
    folder = resources.files("shardwise").joinpath("data", "templates")
    return sorted(p.name[: -len(".jinja")] for p in folder.iterdir() if p.name.endswith(".jinja"))


def template_text(value: str, where: str = "--chat-template") -> str:
    """The Jinja text of a shipped template NAME or of a template FILE."""
    if value in names():
        return resources.files("shardwise").joinpath("data", "templates", value + ".jinja").read_text("utf-8")
    if not os.path.isfile(value):
        raise ShardwiseError(f"{where}: '{value}' is neither a shipped chat template ({', '.join(names())}) "
                             "nor a Jinja file")
    try:
        with open(value, "rb") as fh:
            raw = fh.read(MAX_TEMPLATE_BYTES + 1)
        if len(raw) > MAX_TEMPLATE_BYTES:
            raise ShardwiseError(f"{where}: {value} is larger than 1 MiB; a chat template is a short Jinja file")
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardwiseError(f"{where}: {value} is not valid UTF-8; save the template as UTF-8") from None
    except OSError as e:
        raise ShardwiseError(f"{where}: cannot read {value} ({e.strerror})") from None


def use_chat_template(tokenizer, value: str, where: str = "--chat-template") -> None:
    """Give `tokenizer` the chat template `value` (a NAME or FILE); '' keeps the tokenizer's own. Either must be
    valid Jinja: a syntax error is one line naming the file (or the model's own template) and its line, here,
    rather than an error blamed on the first conversation it renders."""
    if value:
        tokenizer.chat_template = template_text(value, where)
    tokenizer.shardwise_template = value  # how error lines name it (encode.template_name)
    own = tokenizer.chat_template  # none, one template, or a dict of named ones (transformers picks one per call)
    texts = own.items() if isinstance(own, dict) else [("", own)] if isinstance(own, str) else []
    import jinja2

    for name, text in texts:
        try:
            _compile(text)
        except jinja2.TemplateSyntaxError as e:
            whose = (f"{where} {value}" if value and value not in names() else
                     "the model's own chat template" + (f" '{name}'" if name else "")
                     + " (chat_template.jinja or tokenizer_config.json's chat_template)")
            raise ShardwiseError(f"{whose}: line {e.lineno}: not valid Jinja ({e.message}); fix the template, or "
                                 "choose another with --chat-template NAME|FILE") from None


def _compile(text: str) -> None:
    """Compile `text` as transformers will render it: its own environment where this transformers has it (its
    `{% generation %}` tag and loop controls), else Jinja's with loop controls."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        import jinja2

        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)
