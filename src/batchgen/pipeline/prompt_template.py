"""`input.prompt_template`: each row's prompt rendered from its columns by a sandboxed Jinja template.

    input: {stage: gen, prompt_template: "Rate this answer to {{ messages[-1].content }}:\n{{ completion }}"}

The template's variables are the row's columns (as distilabel's TextGeneration `template` reads its
`columns`): text as str, chat messages as a list of {role, content}, numbers as numbers. The rendered text
is the row's user message (or, with input.apply_chat_template false, its raw prompt). Rendering runs in
Jinja's sandbox with undefined names as errors: a row whose columns cannot fill it becomes an error row.
"""

from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def template_columns(text: str) -> list[str]:
    """The columns a template reads (its free variables); ValueError naming the problem when it does not parse."""
    try:
        return sorted(meta.find_undeclared_variables(_ENV.parse(text)))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"is not a valid Jinja template: {exc.message} (line {exc.lineno})") from None


@lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template:
    return _ENV.from_string(text)


def render_prompt(text: str, values: dict) -> str:
    """The template rendered with a row's column values; ValueError saying why it cannot be."""
    try:
        return _compiled(text).render(**values)
    except jinja2.UndefinedError as exc:
        raise ValueError(f"input.prompt_template: {exc.message}") from None
    except jinja2.exceptions.SecurityError as exc:
        raise ValueError(f"input.prompt_template: refused by the sandbox: {exc}") from None
    except Exception as exc:  # a filter or test failing on this row's values: the row's error, not the job's
        raise ValueError(f"input.prompt_template: cannot render this row: {type(exc).__name__}: {exc}") from None
