"""The README's usage example runs as written (on the CPU here)."""

import pathlib
import re


def test_readme_example_runs():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})  # noqa: S102 - the example is ours
