"""`kvarn-compile eval` with extra method names knob{I}-{F}_k4v2_g128: kvarn_k4v2_g128 with I normalisation
iterations and F value flip rounds (the package: 8 and 16), the append kernel's two costs (session 21,
benchmarks/results/h200-s21/parts/flush/). Arguments: those of `kvarn-compile eval`."""

import dataclasses
import functools
import sys

from kvarn_compile import methods
from kvarn_compile.cli import capacity, evaluate
from kvarn_compile.cli.main import main
from kvarn_compile.integrations import hf

package_method = methods.get_method


@functools.cache
def get_method(name: str) -> methods.Method:
    if not name.startswith("knob"):
        return package_method(name)
    knob, rest = name.split("_", 1)
    iterations, flips = map(int, knob.removeprefix("knob").split("-"))
    preset = dataclasses.replace(package_method("kvarn_" + rest).preset, iterations=iterations, value_flips=flips)
    return methods.Method(name, preset.tile_size, methods._preset_roundtrip(preset, True), preset.bytes_per_token,
                          preset)  # fmt: skip


evaluate.get_method = capacity.get_method = hf.get_method = get_method
sys.argv = ["kvarn-compile", "eval", *sys.argv[1:]]
main()
