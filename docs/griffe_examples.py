"""Griffe extension: render Keras-style `Example:` sections.

keras_hetero's docstrings follow Keras (STYLE.md): an `Example:` heading, a
blank line, then unindented `>>>` lines. Google-style parsers expect the
section body indented under its heading, and Markdown reads unindented
`>>>` as nested block quotes. This indents such a trailing section under
its heading, as a fenced `pycon` code block, so mkdocstrings renders it as
code; the docstrings themselves stay as they are.
"""

import re

from griffe import Extension

_KERAS_EXAMPLE = re.compile(r"^(Examples?:)\n\s*\n(>>> .*)\Z", re.M | re.S)


def indent_examples(text):
    """Returns `text` with a trailing unindented example section indented."""

    def indent(match):
        lines = ["```pycon", *match.group(2).splitlines(), "```"]
        body = "\n".join(f"    {line}" if line else "" for line in lines)
        return f"{match.group(1)}\n{body}"

    return _KERAS_EXAMPLE.sub(indent, text)


class KerasExamples(Extension):
    """Rewrites each docstring's Keras-style example section on load."""

    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = indent_examples(obj.docstring.value)
