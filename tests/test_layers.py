"""The package's import layers (README "Layout"): import-linter checks pyproject's contracts.

Each module imports only the layers below it, the core imports none of the extras, and the transformers
integrations none of vLLM. A failing contract prints the offending import chain.
"""

from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_imports_follow_the_layers():
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True) == 0
