"""A griffe extension for the API reference: makes jaxddp's docstrings read well as Markdown.

* A Google-style ``Example:`` section is read as griffe reads ``Examples:``, so that its
  ``>>>`` lines are rendered as code (griffe knows only the plural title; the singular one
  would become an admonition whose doctest output is parsed as Markdown).
* Sphinx roles such as ``:meth:`mask``` are shown as code, ``mask``, instead of verbatim.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:meth|func|class|attr|mod|data|exc|obj|const):`~?([^`]+)`")


def _markdown(text: str) -> str:
    return _ROLE.sub(r"`\1`", _SINGULAR.sub(r"\1Examples:", text))


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)
