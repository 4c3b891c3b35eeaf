"""Every kernel specialization the launchers ask for compiles for Hopper (sm_90), without a GPU.

The Triton interpreter runs the kernels' Python, not the compiler: globals that are not constexpr,
loop-carried values that change shape, or shared memory past the SM's 228 KB only fail at compile time.
Here each launcher runs on CPU tensors with its kernel swapped for a recorder, and the recorded launch is
compiled to a cubin for sm_90. The compiler needs real @triton.jit functions, so the test runs this file
as a script in a subprocess without TRITON_INTERPRET. ``--sass`` also prints the attention and append kernels'
registers, shared memory and the SASS instruction mix of its tile loop (no GPU needed; see ``sass_report``).
"""

import argparse
import collections
import itertools
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from kvarn_compile import KVarNCache, deferred_flush, get_preset
from kvarn_compile.kernels import (
    combine_splits,
    decode_attention,
    latent_attention,
    paged_attention,
    quantize_store,
    rotate,
)
from kvarn_compile.paged_latent import LatentCache

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 228 * 1024


class Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def compile_launch(kernel, args, kwargs):
    """Compile a recorded launch for sm_90 as kernel[grid](*args, **kwargs) would on a GPU: the same
    signature, constexprs and specialization (which pointers are 16-byte aligned, which integers are
    multiples of 16), so that loads are vectorized as they are there."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, spec, options)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)


def record(monkeypatch, module, name, launcher, *args, **kwargs):
    recorder = Recorder(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    result = launcher(*args, **kwargs)
    assert recorder.launches, "the launcher launched nothing"
    return recorder, result


CONFIGS = [  # preset, Hq, Hkv, Dk, Dv, dtype, keep_first_tile
    ("kvarn_k4v2_g128", 32, 8, 128, 128, torch.float16, False),
    ("kvarn_k4v2_g128", 32, 8, 128, 128, torch.bfloat16, True),
    ("kvarn_k4v2_g64", 64, 4, 256, 256, torch.bfloat16, False),  # GQA 16: the decode kernel's widest group
    ("kvarn_k4v4_g128", 9, 3, 64, 64, torch.float16, True),
    ("kvarn_k4v2_g128", 16, 16, 192, 128, torch.bfloat16, False),
    ("kvarn_k8v8_g32", 8, 1, 512, 512, torch.float16, False),
    ("kvarn_k2v2_g32", 8, 2, 64, 64, torch.float16, True),  # 8-token sub-blocks: no tl.dot
]


def check_config(monkeypatch, config, query_len):
    name, hq, hkv, dk, dv, dtype, sink = config
    preset = get_preset(name)
    cache = KVarNCache.allocate(2, 4096, hkv, dk, dv, preset, dtype, keep_first_tile=sink)
    tokens = 2 * query_len
    q = torch.zeros(tokens, hq, dk)
    k, v = torch.zeros(tokens, hkv, dk, dtype=dtype), torch.zeros(tokens, hkv, dv, dtype=dtype)
    slots = torch.arange(2, dtype=torch.int32)
    start = torch.tensor([100, 3000], dtype=torch.int32)
    qsl = torch.tensor([0, query_len, tokens], dtype=torch.int32)
    pages, exact_k, exact_v, table, lens = cache.tensors()

    launches = []
    # the op's rotations of the fresh q, k, v (one launch per head dim)
    q_in = torch.zeros(tokens, hq, dk, dtype=dtype)
    # (a decode step's rotation may let the attention kernel start early: starts_during_rotation)
    rec, _ = record(monkeypatch, rotate, "_rotate_kernel", rotate.rotate_rows, [q_in, k, v],
                    [torch.float32, dtype, dtype], query_len == 1)  # fmt: skip
    launches += [(rec.kernel, *launch) for launch in rec.launches]
    # the append; a decode step's also as the two parts of a deferred flush, FLUSH for as many calls as a deferral's
    for part in (quantize_store.WHOLE, quantize_store.STAGE)[: 2 if query_len == 1 else 1]:
        with monkeypatch.context() as patch:
            rec, _ = record(patch, quantize_store, "_quantize_store_kernel", quantize_store.quantize_store, k, v,
                            pages, exact_k, exact_v, table, lens, slots, start, qsl, preset, query_len, part,
                            None if part is quantize_store.WHOLE else quantize_store.snapshot_for(slots))  # fmt: skip
        launches += [(rec.kernel, *launch) for launch in rec.launches]
    if query_len == 1:
        call = quantize_store.Flush(pages, exact_k, exact_v, table, quantize_store.snapshot_for(slots), preset)
        with monkeypatch.context() as patch:
            rec, _ = record(patch, quantize_store, "_quantize_store_kernel", quantize_store.flush_tiles, [call, call],
                            deferred_flush.GROUP)  # fmt: skip
        launches += [(rec.kernel, *launch) for launch in rec.launches]
    decode = Recorder(decode_attention._decode_attention_kernel)  # the Gluon kernel of GPU decode steps
    monkeypatch.setattr(decode_attention, "_decode_attention_kernel", decode)
    call = (q, k, v, pages, exact_k, exact_v, table, slots, start, qsl, preset, dk**-0.5, True, 0, query_len)
    rec, partials = record(monkeypatch, paged_attention, "_paged_attention_kernel", paged_attention.paged_partials,
                           *call, num_splits=4)  # fmt: skip
    if decode.launches:  # the Gluon kernel's other form: a programmatic dependent of the rotation
        decode_attention.decode_attention(q, pages, table, slots, start, qsl, *partials, preset, dk**-0.5, 0, 4, hkv,
                                          2, sink, pdl=True)  # fmt: skip
    out = torch.zeros(tokens, hq, dv)
    if query_len == 1:  # the GPU's decode step where the exact part merges (a programmatic dependent of Gluon's; its
        # programs count themselves done with an atomic: test_kernels runs it under the interpreter, this compiles it)
        monkeypatch.setattr(paged_attention, "merge_in_exact_split", lambda *args: True)
        paged_attention.paged_partials(*call, num_splits=4, out=torch.zeros(tokens, hq, dv, dtype=dtype))
        # q, k and v as they came: the merging exact part rotates q itself (ROTATE_IN); and with more partials than
        # a merge step holds, it merges in steps
        paged_attention.paged_partials(q_in, *call[1:], num_splits=40, out=torch.zeros(tokens, hq, dv, dtype=dtype),
                                       rotated=False)  # fmt: skip
    launches += [(kernel.kernel, *launch) for kernel in (rec, decode) for launch in kernel.launches]
    for rows in (1, combine_splits.ROWS):  # both launch forms: while the SMs are not all busy, and after
        with monkeypatch.context() as patch:
            rec, _ = record(patch, combine_splits, "_combine_splits_kernel", combine_splits.combine_splits,
                            *partials, out, True, rows)  # fmt: skip
        launches += [(rec.kernel, *launch) for launch in rec.launches]

    compiled_kernels = []
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs)
        assert "cubin" in compiled.asm
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, f"{kernel.__name__}: {compiled.metadata.shared} B"
        compiled_kernels.append((kernel.__name__, compiled))
    return compiled_kernels


LATENT_CONFIGS = [  # preset, latent dim, rope dim, heads, dtype (MLA: DeepSeek-V2-Lite 16 heads, V3 128)
    ("kvarn_k4v2_g128", 512, 64, 16, torch.bfloat16),
    ("kvarn_k4v2_g64", 512, 64, 128, torch.float16),
    ("kvarn_k8v4_g32", 256, 32, 8, torch.bfloat16),
    ("kvarn_k2v2_g128", 128, 64, 16, torch.float16),
]


def check_latent_config(monkeypatch, config, query_len):
    name, latent, rope, heads, dtype = config
    preset = get_preset(name)
    cache = LatentCache.allocate(2, 4096, latent, rope, preset, dtype)
    tokens = 2 * query_len
    c, r = torch.zeros(tokens, latent, dtype=dtype), torch.zeros(tokens, rope, dtype=dtype)
    slots = torch.arange(2, dtype=torch.int32)
    start = torch.tensor([100, 3000], dtype=torch.int32)
    qsl = torch.tensor([0, query_len, tokens], dtype=torch.int32)
    launches = []
    rec, _ = record(monkeypatch, quantize_store, "_quantize_store_kernel", quantize_store.latent_store, c, r,
                    *cache.tensors(), slots, start, qsl, preset, query_len)  # fmt: skip
    launches += [(rec.kernel, *launch) for launch in rec.launches]
    q_c, q_r = torch.zeros(tokens, heads, latent), torch.zeros(tokens, heads, rope, dtype=dtype)
    combine = Recorder(combine_splits._combine_splits_kernel)  # the launcher merges the splits right after
    monkeypatch.setattr(combine_splits, "_combine_splits_kernel", combine)
    rec, _ = record(monkeypatch, latent_attention, "_latent_attention_kernel", latent_attention.latent_attention,
                    q_c, q_r, *cache.tensors(), slots, start, qsl, preset.latent_layout(latent, rope), 0.1, query_len)  # fmt: skip
    launches += [(kernel.kernel, *launch) for kernel in (rec, combine) for launch in kernel.launches]
    compiled_kernels = []
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs)
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, f"{kernel.__name__}: {compiled.metadata.shared} B"
        compiled_kernels.append((kernel.__name__, compiled))
    return compiled_kernels


def decode_configurations() -> list:
    """(preset, D, programs per tile) of every Gluon decode kernel the launchers ask for: every preset and head dim
    that ``decode_attention.supports`` gives it, with whole tiles per program and, where half a tile fills a block,
    halves (``decode_attention.tile_parts``)."""
    configurations = []
    for kb, vb, g, d, parts in itertools.product((2, 4), (2, 4), (32, 64, 128, 256), (64, 128, 256), (1, 2)):
        preset = get_preset(f"kvarn_k{kb}v{vb}_g{g}")
        if decode_attention.supports(preset, 4, d, d) and (parts == 1 or decode_attention.halves_fill_a_block(preset)):
            configurations.append((preset, d, parts))
    return configurations


def check_decode_configuration(monkeypatch, preset, d: int, parts: int):
    """The Gluon decode kernel of one of ``decode_configurations`` compiles: its staging buffers and shared-memory
    slices are shaped by the preset, D and the programs per tile (a slice must start at a multiple of its length,
    which some G and D break). Whole tiles in the combine's form (the launch ``paged_partials`` makes of these CPU
    tensors: q rotated, every partial stored) and in a merging step's that fills the GPU (a programmatic dependent of
    the rotation, the partials rotated back, the exact split let start once q is read), and both whole tiles and
    halves in the form of the small steps whose programs leave half the GPU free (``paged_attention.paged_partials``
    launches these only for CUDA tensors): q as it came, rotated by each program, the partials rotated back, the
    exact split let start at once. Returns the first compiled kernel."""
    pages, exact_k, exact_v, table, _ = KVarNCache.allocate(2, 4096, 2, d, d, preset, torch.float16).tensors()
    q, k = torch.zeros(2, 8, d), torch.zeros(2, 2, d, dtype=torch.float16)
    batch = (torch.arange(2, dtype=torch.int32), torch.tensor([100, 3000], dtype=torch.int32),
             torch.tensor([0, 1, 2], dtype=torch.int32))  # fmt: skip
    decode = Recorder(decode_attention._decode_attention_kernel)
    monkeypatch.setattr(decode_attention, "_decode_attention_kernel", decode)
    if parts == 1:
        record(monkeypatch, paged_attention, "_paged_attention_kernel", paged_attention.paged_partials, q, k, k,
               pages, exact_k, exact_v, table, *batch, preset, d**-0.5, True, 0, 1, num_splits=4)  # fmt: skip
    # the small steps' form; the merging steps that fill the GPU (whole tiles); and for the default preset's halves
    # from rotated q too (``attend_and_append``'s)
    partials = torch.zeros(2, 8, 4 * parts + 1, d), torch.zeros(2, 8, 4 * parts + 1, 2)
    forms = [(q.half(), "start", True, False)]
    if parts == 1:
        forms.append((q, "q", False, True))
    if (preset.name, d, parts) == ("kvarn_k4v2_g128", 128, 2):
        forms.append((q, "q", False, False))
    for q_in, early, rotate_q, pdl in forms:
        decode_attention.decode_attention(q_in, pages, table, *batch, *partials, preset, d**-0.5, 0, 4, 2,
                                          2, False, parts=parts, pdl=pdl, early_dependents=early,
                                          rotate_q=rotate_q, rotate_back=True)  # fmt: skip
    kernels = [compile_launch(decode.kernel, args, kwargs) for args, kwargs in decode.launches]
    for kernel in kernels:
        assert kernel.metadata.shared <= SHARED_MEMORY_LIMIT, f"{preset.name} D {d}: {kernel.metadata.shared} B"
    return kernels[0]


def specialization(kernel, args, kwargs) -> list:
    """What Triton keys a kernel's compiled variants by on Hopper: argument types, which integers are 1 or
    multiples of 16, which pointers are 16-byte aligned, the constexprs."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(HOPPER))
    return binder(*args, **kwargs)[1]


def same_kernels_at_any_row(monkeypatch, launch_step) -> None:
    """A mixed serving step's prefill rows start at any row d of the per-sequence metadata (slots, start
    positions, ...), 16-byte aligned or not: both must launch the same compiled kernels, not compile others
    (seconds each in the middle of serving). ``launch_step(patch, at_row)`` records a step's launches as
    (kernel, args, kwargs), its per-sequence metadata passed through ``at_row`` (the values, in a view starting
    at row 0, then 1)."""
    keys = []
    for row in (0, 1):
        with monkeypatch.context() as patch:
            launches = launch_step(patch, lambda t, row=row: torch.cat([t.new_zeros(row), t])[row:])
        keys.append([specialization(*launch) for launch in launches])
    assert keys[0] == keys[1], keys


def step_batch(query_len: int) -> tuple[torch.Tensor, ...]:
    """Two sequences of query_len tokens each: slots, start positions, query_start_loc."""
    return (torch.arange(2, dtype=torch.int32), torch.tensor([100, 3000], dtype=torch.int32),
            torch.tensor([0, query_len, 2 * query_len], dtype=torch.int32))  # fmt: skip


def launches_of(*recorders: Recorder) -> list:
    """The recorders' launches as (kernel, args, kwargs), what ``specialization`` takes."""
    return [(rec.kernel, *launch) for rec in recorders for launch in rec.launches]


def check_metadata_alignment(monkeypatch, query_len: int) -> None:
    """``same_kernels_at_any_row`` for the append and the attention (chunk and decode kernels)."""
    preset = get_preset("kvarn_k4v2_g128")
    cache = KVarNCache.allocate(2, 4096, 8, 128, preset=preset, dtype=torch.float16)
    pages, exact_k, exact_v, table, lens = cache.tensors()
    q, k = torch.zeros(2 * query_len, 32, 128), torch.zeros(2 * query_len, 8, 128, dtype=torch.float16)

    def launch_step(patch, at_row):
        slots, start, qsl = map(at_row, step_batch(query_len))
        store, _ = record(patch, quantize_store, "_quantize_store_kernel", quantize_store.quantize_store, k, k,
                          pages, exact_k, exact_v, table, at_row(lens), slots, start, qsl, preset, query_len)  # fmt: skip
        decode = Recorder(decode_attention._decode_attention_kernel)
        patch.setattr(decode_attention, "_decode_attention_kernel", decode)
        chunk, _ = record(patch, paged_attention, "_paged_attention_kernel", paged_attention.paged_partials, q, k, k,
                          pages, exact_k, exact_v, table, slots, start, qsl, preset, 0.1, True, 0, query_len,
                          num_splits=4)  # fmt: skip
        return launches_of(store, chunk, decode)

    same_kernels_at_any_row(monkeypatch, launch_step)


def check_latent_metadata_alignment(monkeypatch, query_len: int) -> None:
    """``same_kernels_at_any_row`` for the MLA kernels, the append and the latent attention. (The latent
    attention's seq_lens are the cache's own, per slot, never a slice of a step's: they stay at row 0.)"""
    preset = get_preset("kvarn_k4v2_g128")
    cache = LatentCache.allocate(2, 4096, 512, 64, preset, torch.bfloat16)
    pages, exact_c, exact_r, table, lens = cache.tensors()
    c, r = torch.zeros(2 * query_len, 512, dtype=torch.bfloat16), torch.zeros(2 * query_len, 64, dtype=torch.bfloat16)
    q_c, q_r = torch.zeros(2 * query_len, 16, 512), torch.zeros(2 * query_len, 16, 64, dtype=torch.bfloat16)

    def launch_step(patch, at_row):
        slots, start, qsl = map(at_row, step_batch(query_len))
        store, _ = record(patch, quantize_store, "_quantize_store_kernel", quantize_store.latent_store, c, r, pages,
                          exact_c, exact_r, table, at_row(lens), slots, start, qsl, preset, query_len)  # fmt: skip
        # (the combine reads no per-sequence metadata: recorded only so that it does not launch)
        patch.setattr(combine_splits, "_combine_splits_kernel", Recorder(combine_splits._combine_splits_kernel))
        attend, _ = record(patch, latent_attention, "_latent_attention_kernel", latent_attention.latent_attention,
                           q_c, q_r, pages, exact_c, exact_r, table, lens, slots, start, qsl,
                           preset.latent_layout(512, 64), 0.1, query_len)  # fmt: skip
        return launches_of(store, attend)

    same_kernels_at_any_row(monkeypatch, launch_step)


def sass_report(name: str, cubin: bytes, shared: int, loop_op: str = "HMMA") -> str:
    """Registers per thread, shared memory per program and the SASS instruction mix of the loop with the
    most ``loop_op`` instructions (HMMA: the quantized-tile loop of an attention kernel; MUFU: the append
    kernel's normalisation loop, with its exp/log/sqrt), per warp and iteration: a GPU-free proxy to read
    before timing a kernel change on the GPU (registers and shared memory bound the programs per SM: 64K
    registers, 228 KB)."""
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tools / "nvdisasm", "-c", f.name], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    registers = re.search(r"REG:(\d+)", usage).group(1)
    instruction = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
    best: list[str] = []
    for start, line in enumerate(sass):  # a loop: a label, then a branch back to it
        label = re.match(r"^(\.L_x_\d+):", line)
        end = next((i for i in range(start + 1, len(sass)) if label and f"BRA `({label.group(1)})" in sass[i]), None)
        if end is not None:
            ops = [m.group(1) for m in map(instruction.match, sass[start : end + 1]) if m]
            if ops.count(loop_op) > best.count(loop_op):
                best = ops
    mix = ", ".join(f"{op} {n}" for op, n in collections.Counter(best).most_common(24))
    return f"{name}: {registers} registers, {shared:,} B shared; loop of {len(best)} instructions: {mix}"


def print_sass_reports(config, compiled) -> None:
    """``sass_report`` of each attention kernel (its tile loop) and append kernel (its normalisation loop)."""
    for name, kernel in compiled:
        loop_op = "HMMA" if "attention" in name else "MUFU" if "quantize_store" in name else None
        if loop_op:
            print(*config, sass_report(name, kernel.asm["cubin"], kernel.metadata.shared, loop_op))


def jobs(sass: bool) -> list:
    """The compile checks, each a function of no arguments that patches the kernels it records in a context of its
    own: the dense configurations (decode and chunk steps; the first also checks its launches' specialization),
    every decode kernel configuration, the latent configurations (the first also checks its launches'
    specialization). ``sass``: each also prints its attention and append kernels' SASS summaries (``sass_report``)."""

    def dense(config, query_len):
        def run():
            with pytest.MonkeyPatch.context() as patch:
                compiled = check_config(patch, config, query_len)
            if config == CONFIGS[0]:
                with pytest.MonkeyPatch.context() as patch:
                    check_metadata_alignment(patch, query_len)
            if sass and query_len == 1:
                print_sass_reports(config[:5], compiled)

        return run

    def decode(preset, d, parts):
        def run():
            with pytest.MonkeyPatch.context() as patch:
                kernel = check_decode_configuration(patch, preset, d, parts)
            if sass and (preset.name, d) == ("kvarn_k4v2_g128", 128):  # whole tiles and halves per program
                print(f"{preset.name} D {d}, {parts} program(s) per tile:",
                      sass_report("_decode_attention_kernel", kernel.asm["cubin"], kernel.metadata.shared))  # fmt: skip

        return run

    def latent(config, query_len):
        def run():
            with pytest.MonkeyPatch.context() as patch:
                compiled = check_latent_config(patch, config, query_len)
            if config == LATENT_CONFIGS[0]:
                with pytest.MonkeyPatch.context() as patch:
                    check_latent_metadata_alignment(patch, query_len)
            if sass and query_len == 1:
                print_sass_reports(config[:4], compiled)

        return run

    return ([dense(config, query_len) for config in CONFIGS for query_len in (1, 200)]
            + [decode(*configuration) for configuration in decode_configurations()]
            + [latent(config, query_len) for config in LATENT_CONFIGS for query_len in (1, 200)])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sass", action="store_true", help="print the attention and append kernels' SASS summaries")
    parser.add_argument("--part", default="0/1", help="I/N: only every N-th check from the I-th (default: all)")
    args = parser.parse_args()
    part, parts = map(int, args.part.split("/"))
    for job in jobs(args.sass)[part::parts]:
        job()


PARTS = 4  # subprocesses, which pytest-xdist's workers share out (cold caches, 2-core CPU, -n 2: 2.6-5.7 min each)


def test_decode_configurations_are_many():  # the filter lets through what the launchers ask for, not nothing
    assert len(decode_configurations()) > 40


@pytest.mark.long
@pytest.mark.parametrize("part", range(PARTS))
def test_kernels_compile_for_hopper(part):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, __file__, "--part", f"{part}/{PARTS}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


if __name__ == "__main__":
    main()
