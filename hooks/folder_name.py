"""A Jinja extension that keeps a bad project_slug from creating folders outside the project.

Cookiecutter renders the name of the template folder, `{{cookiecutter.project_slug}}`, and creates
it *before* the pre-generation hook can refuse the answer: a slug like `a/b` would create `a/` and
`a/b/`, and cookiecutter removes only `a/b/` after the hook fails. Rendered through this extension,
a slug with a path separator becomes one folder name (`a_b`), which cookiecutter then removes.
Valid slugs never contain a separator, so they render unchanged.
"""

from jinja2 import pass_context
from jinja2.ext import Extension


@pass_context
def _finalize(context, value):
    slug = (context.get("cookiecutter") or {}).get("project_slug")
    if isinstance(value, str) and value == slug and ("/" in value or "\\" in value):
        return value.replace("/", "_").replace("\\", "_")
    return value


class SafeFolderName(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        environment.finalize = _finalize
