"""Evaluation text: ``stdlib`` (docstrings of Python's standard library, offline, fixed order) or a file.

The stdlib corpus reads the modules' source with ``ast`` (nothing is imported, so nothing runs) and keeps
every docstring of modules, classes and functions in source order, modules in the order of ``MODULES``.
The text depends on the Python version (3.11 and 3.12 docstrings differ slightly): the evaluation's
JSON names the version it used.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import sys

# Pure-Python modules with plenty of prose in their docstrings (frozen or C modules have no source).
MODULES = (
    "argparse", "ast", "calendar", "collections", "configparser", "contextlib", "csv", "dataclasses", "difflib",
    "email.message", "fractions", "functools", "heapq", "inspect", "ipaddress", "json", "logging", "mailbox",
    "numbers", "pathlib", "pickle", "pprint", "random", "shutil", "statistics", "string", "subprocess", "tarfile",
    "textwrap", "threading", "typing", "urllib.parse", "uuid", "zipfile", "_pydecimal", "_pydatetime", "enum",
    "gettext", "glob", "gzip", "http.client", "imaplib", "locale", "optparse", "queue", "sched", "selectors",
    "smtplib", "socket", "tempfile", "timeit", "tokenize", "trace", "traceback", "unittest.case", "weakref",
)  # fmt: skip


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, kinds)), key=lambda n: getattr(n, "lineno", 0))
    return [doc for n in nodes if (doc := ast.get_docstring(n))]


@functools.cache
def stdlib_text() -> str:
    """The docstrings of ``MODULES`` (those with Python source on this interpreter), blank-line separated."""
    parts = []
    for name in MODULES:
        spec = importlib.util.find_spec(name) if name.split(".")[0] in sys.stdlib_module_names else None
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        parts.extend(_docstrings(pathlib.Path(spec.origin).read_text(encoding="utf-8")))
    return "\n\n".join(parts)


def load_corpus(corpus: str) -> str:
    """``"stdlib"`` or the path of a UTF-8 text file."""
    if corpus == "stdlib":
        return stdlib_text()
    path = pathlib.Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"--corpus: expected 'stdlib' or a UTF-8 text file, got {corpus!r}")
    return path.read_text(encoding="utf-8")
