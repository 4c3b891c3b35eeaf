"""Rotate up to three tensors of head vectors into the Hadamard domain in one launch (an attention step's q, k
and v, or an append's k and v), and the rotation itself for other kernels (``hadamard_blocks``).

Each tensor x [T, H, D] (fp16/bf16, last dim contiguous, any token/head strides) becomes x @ blockdiag(H_R, ...)
(R = ``reference.rotation_block(D)``) in its own output dtype, as ``rotated_to`` computes it: fp32 butterflies
(sums and differences of x's values), scaled by R^-0.5 and rounded once. Programs take ROWS head vectors each;
program ids run over the tensors in turn.

NOTE why (H200, benchmarks/results/h200-decode-s15/table/results.md): a decode step's op took 0.032 ms at batch
1 / 2K against 0.0097 ms of attention kernels, most of the rest in the small kernels around them: each
rotation was a GEMM, a scaling and a cast (8 launches for q, k and v). With one launch, a dot of the rows with the
+-1 Sylvester block (benchmarks/results/h200-rotation-fused/ab.txt, side by side): the op at 2K 0.0321 -> 0.0218
ms (batch 1), 0.0366 -> 0.0253 (8), 0.0660 -> 0.0524 (32), 0.1577 -> 0.1415 (128). Then butterflies instead of that
dot, which loaded the [128, 128] block (32 KB) in every program (benchmarks/results/h200-s29/call1/ab.txt, op ms, the
package with and without): B1/2K 0.0092 -> 0.0086, B8/2K 0.0144 -> 0.0130, B8/32K 0.0801 -> 0.0795; an append's
rotation of k and v 4.0 -> 3.4 us at batch 1.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ..reference import rotate, rotation_block

ROWS = 16  # head vectors per program


@triton.jit
def hadamard_blocks(x, BLOCK: tl.constexpr):
    """x [R, D] fp32 @ blockdiag(H, ..., H), H the normalised [BLOCK, BLOCK] Sylvester-Hadamard matrix
    (H[i, j] = (-1)^popcount(i & j) / sqrt(BLOCK)): the rotation, and its own inverse (H is symmetric), so it rotates
    in and back alike. log2(BLOCK) butterfly stages in registers: each pairs the columns that differ in their lowest
    bit, (a + b, a - b), and puts that bit on top of the column's index in its block, so after log2(BLOCK) stages the
    columns are back in order."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    x = tl.reshape(x, [R * D // BLOCK, BLOCK])
    for _ in tl.static_range(BLOCK.bit_length() - 1):
        a, b = tl.split(tl.reshape(x, [R * D // BLOCK, BLOCK // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [R * D // BLOCK, BLOCK])
    return tl.reshape(x, [R, D]) * (BLOCK**-0.5)


@triton.jit
def _rotate_rows(x_ptr, out_ptr, first, num_rows, heads, stride_t, stride_h, D: tl.constexpr, R: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """Rows first..first+ROWS-1 of one tensor (row = (token, head) = (row // heads, row % heads))."""
    rows = first + tl.arange(0, ROWS)
    live = rows < num_rows
    src = (rows // heads).to(tl.int64) * stride_t + (rows % heads).to(tl.int64) * stride_h
    dst = rows.to(tl.int64) * D
    offs = tl.arange(0, R)
    for block in tl.static_range(D // R):  # the blocks of R channels, each rotated by the same H_R
        x = tl.load(x_ptr + src[:, None] + block * R + offs[None, :], mask=live[:, None], other=0.0)
        out = hadamard_blocks(x.to(tl.float32), R)
        tl.store(out_ptr + dst[:, None] + block * R + offs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])  # fmt: skip


@triton.jit(do_not_specialize=["rows0", "rows1", "rows2", "programs0", "programs01"])
def _rotate_kernel(
    x0, o0, rows0, heads0, st0, sh0, x1, o1, rows1, heads1, st1, sh1, x2, o2, rows2, heads2, st2, sh2,
    programs0, programs01, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
):  # fmt: skip
    if EARLY_DEPENDENTS:  # the next launch, a programmatic dependent, may start now (it waits for these rows)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < programs0:
        _rotate_rows(x0, o0, pid * ROWS, rows0, heads0, st0, sh0, D, R, ROWS)
    elif pid < programs01:
        _rotate_rows(x1, o1, (pid - programs0) * ROWS, rows1, heads1, st1, sh1, D, R, ROWS)
    else:
        _rotate_rows(x2, o2, (pid - programs01) * ROWS, rows2, heads2, st2, sh2, D, R, ROWS)


def rotate_rows(tensors: list[torch.Tensor], dtypes: list[torch.dtype], early_dependents: bool = False
                ) -> list[torch.Tensor]:  # fmt: skip
    """[x_i [T_i, H_i, D_i]] (fp16/bf16) -> their rotations, contiguous, in dtypes[i]: one launch for each
    distinct (D, input dtype), at most three tensors per launch. Validation is the caller's (the ops check
    dtypes and head dims). ``early_dependents`` (Hopper and later): the launch after these is a programmatic
    dependent of them, let start at once (it waits with griddepcontrol.wait before reading their output)."""
    outs = [torch.empty(x.shape, dtype=dt, device=x.device) for x, dt in zip(tensors, dtypes, strict=True)]
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(tensors):
        groups.setdefault((x.shape[-1], x.dtype), []).append(i)
    for (d, _), members in groups.items():
        assert len(members) <= 3, "one launch rotates at most three tensors"
        args, programs = [], [0]
        for i in members:
            x = tensors[i] if tensors[i].stride(-1) == 1 else tensors[i].contiguous()
            args += [x, outs[i], x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)]
            programs.append(programs[-1] + triton.cdiv(x.shape[0] * x.shape[1], ROWS))
        while len(programs) < 4:  # unused slots: no rows, never reached
            args += [args[0], args[1], 0, 1, 0, 0]
            programs.append(programs[-1])
        if programs[3] > 0:
            _rotate_kernel[(programs[3],)](*args, programs[1], programs[2], D=d, R=rotation_block(d), ROWS=ROWS,
                                           EARLY_DEPENDENTS=early_dependents)  # fmt: skip
    return outs


def rotated_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rotated with fp32 sums and rounded once to ``dtype`` (``rotated_many`` for one tensor)."""
    return rotated_many([x], [dtype])[0]


def rotated_many(tensors: list[torch.Tensor], dtypes: list[torch.dtype], early_dependents: bool = False
                 ) -> list[torch.Tensor]:  # fmt: skip
    """Each x [..., D] rotated with fp32 sums and rounded once to its dtype (for k/v: what the reference
    stores, up to the order of the fp32 sums).

    fp16/bf16 inputs on CUDA go through one launch of ``rotate_rows`` for up to three tensors of one head
    dim: fp32 butterflies, scaled and rounded in the kernel. NOTE (H200): the GEMM form before it (mm with fp32
    output, scale, cast) took 4.5-5 us per tensor in three launches (benchmarks/results/h200-rotation); one launch
    for q, k and v made a decode step's op 10 us faster at 2K context (benchmarks/results/h200-rotation-fused).
    ``early_dependents``: as ``rotate_rows``.
    Anything else, and CPU tensors, also under the Triton interpreter: the reference's fp32 rotation (so the
    interpreter's kernel tests store exactly what the reference stores; the kernel is tested on its own).
    """
    if all(x.dtype in (torch.float16, torch.bfloat16) and x.is_cuda for x in tensors):
        shaped = [x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1]) for x in tensors]
        rotated = rotate_rows(shaped, dtypes, early_dependents)
        return [y.view(x.shape) for x, y in zip(tensors, rotated, strict=True)]
    return [rotate(x.float()).to(dt) for x, dt in zip(tensors, dtypes, strict=True)]
