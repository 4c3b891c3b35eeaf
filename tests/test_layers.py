"""The package's import layers (README "Layout"): import-linter checks pyproject's contracts.

Each module imports only the layers below it, the core imports none of the extras, and the transformers
integrations none of vLLM. A failing contract prints the offending import chain. The contracts see the modules'
own imports, not what importing a module runs (the package's ``__init__`` files): a fresh interpreter with the
extras blocked imports them, which covers those. Both run in a subprocess: import-linter configures logging
(``dictConfig``), which disables the loggers that exist in its process, this package's among them.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("transformers", "vllm", "gguf", "accelerate", "matplotlib", "tqdm")
CORE = ("kvarn_compile", "kvarn_compile.backend", "kvarn_compile.latent_ops", "kvarn_compile.methods")
TRANSFORMERS_SIDE = tuple(f"kvarn_compile.integrations.{m}" for m in ("hf", "hf_latent", "static_cache"))


def run_python(*lines: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "\n".join(lines)], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_imports_follow_the_layers():
    run = run_python(
        "import sys",
        "from importlinter.cli import lint_imports",
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize(("blocked", "modules"), [(EXTRAS, CORE), (("vllm",), TRANSFORMERS_SIDE)],
                         ids=["core-without-extras", "transformers-side-without-vllm"])  # fmt: skip
def test_modules_import_with_packages_blocked(blocked, modules):
    """A module that imports a blocked package (``sys.modules[name] = None``) fails with ImportError."""
    run = run_python(
        "import importlib, sys",
        *(f"sys.modules[{name!r}] = None" for name in blocked),
        *(f"importlib.import_module({m!r})" for m in modules),
    )
    assert run.returncode == 0, run.stderr[-3000:]
