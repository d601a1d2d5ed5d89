"""NVFP4-cache decode for Hopper (sm_90) in CuTe DSL: the fast path of the paged decode.

Same numerics as the Triton kernel beside it (``paged/triton.py``; twin
``reference.paged.paged_attention``) for one new token per sequence with ``exact``
exponentials: Q in FP16 scaled by a power of two per head (``|q| ≤ 2^15``), the cache's
E2M1 codes times their E4M3 block scale widened exactly to FP16, ``S = Q16·K16`` and
``O += P̂16·V16`` with FP32 accumulation, ``P̂ = E4M3(2^(x − M + 8))`` for an integer
running maximum ``M``, the normaliser summing P̂ itself.

Design (``mma.sync m16n8k16``, no shared memory in the key loop): one CTA per (sequence,
KV head, key split); each of its ``WARPS`` warps takes every ``WARPS``-th 16-key tile of
the split (a tile lies inside one page) with its own online softmax, and the warps merge
through shared memory at the end, as split-K partials do. The GQA group (at most 16 heads)
fills the MMA's 16 rows. Each thread loads its own bytes of K and V straight into
registers and widens them into MMA fragments (thread ``(g, t)`` = lane ``(4g + t)``):

* K is the B operand of ``S = Q·Kᵀ`` (n = key): thread ``(g, t)`` holds key ``g``'s
  elements ``[t·d/4, (t+1)·d/4)`` (one 16-byte load at d = 128); Q's A fragments take the
  head dimension in the same permuted order (a dot product does not care about it);
* V is the A operand of ``Oᵀ = V̂ᵀ·P̂ᵀ`` (m = head column, k = key; P̂ᵀ, the B operand, is
  the score accumulator's layout as it is, and the queries only pad N = 8 to the group):
  thread ``(g, t)`` holds keys ``2t, 2t+1, 2t+8, 2t+9``, elements ``[g·d/8, (g+1)·d/8)``
  (8-byte loads at d = 128); m-tile ``i`` row ``r`` is head column ``(r % 8)·d/8 + 2i +
  r // 8``, put back in order when O is stored;
* an E2M1 nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 0 0 e1 e0 m 0 0`` (its value
  times 2^-6), two of which ``cvt.rn.f16x2.e4m3x2`` widens at once; times the block scale
  ·2^6 in FP16 (exact: at most 7 significant bits within [2^-10, 2688]).

NVFP4 (``STAGES`` ≥ 2, the default): each warp copies its tiles whole, as stored in their
page regions, into a ring of shared-memory stages with ``cp.async`` (``STAGES − 1`` tiles in
flight, no registers held for them) and reads its fragments from there; tiles wholly inside
the sequence run a copy of the step without masks (``SPLIT_EDGE``). FP8 (and NVFP4 with
``STAGES = 0``): loads run ``depth`` tiles ahead in a ring of registers. Block-table entries
run one tile further.
Requires ``nvidia-cutlass-dsl`` only (not ``flash-attn-4``, unlike the training kernels: a
vLLM install brings it); imported lazily by ``ops`` on sm_90 only.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flamia_serve.kernels.cute_sm90_common import (
    _asm,
    _fields,
    _load_words,
    _mlir,
    compile_kernel,
    kernel_tensors,
    load_shared_words,
    pow2,
    pow2_exponent_ceil,
)
from flamia_serve.numerics.formats import P_HAT_EXP
from flamia_serve.numerics.kv_pages import KVCacheFormat

#: key tiles a warp's loads run ahead, and the CTAs per SM the compiler must fit (0: no
#: register cap), by default: H200, ``tune_decode_cute.json``: depth 2 is within 1% of depth
#: 1 (which needs fewer registers), depth 3 and a cap of four CTAs (128 registers) are slower
DEPTH = 1
CTAS_PER_SM = 0
#: NVFP4: stages of each warp's shared-memory ring of key tiles (``cp.async``, STAGES − 1
#: tiles in flight, no registers held for them); 0: the register ring of DEPTH tiles. H200,
#: ``tune_decode_cute_ring.json``: 3 stages 4–13% faster than the register ring at B16/B64 ×
#: L8192/L32768; 4 and 8 stages slower, 6 within ±4%
STAGES = 3
#: NVFP4 ring: tiles wholly inside the sequence skip the masks of its last (a second copy of
#: the tile step)
SPLIT_EDGE = True
#: warps per CTA when the caller names none (2, 4 or 8; the paged plan passes its own:
#: ``ops.cute_decode_warps``), keys per warp step (one k-block of P̂·V), MMA rows (the GQA
#: group)
WARPS = 4
TILE = 16
ROWS = 16
NO_MAX = -1073741824.0  # running-maximum sentinel (-2^30), as the Triton kernel's
#: 2^15: the FP16 row maximum of Q for the NVFP4 cache (reference.Q_FP16_MAX)
Q16_EXP = 15
P_SCALE = float(2**P_HAT_EXP)


# ---------------------------------------------------------------- PTX helpers
def _asm1(ty, args: list, text: str, constraints: str, loc, ip):
    """One-result inline PTX over DSL scalars ``args`` (typed: Int32, Int64, Float32), its
    result as ``ty`` (Int32 or Float32)."""
    return ty(_asm(_mlir(ty), [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints))


def _mma(shape_types: str, a: list, b: list, c: list, loc, ip) -> list[Float32]:
    """``D = A·B + C`` of ``mma.sync.aligned.<shape_types>`` (A: four words, B: two, C/D:
    four f32)."""
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
    args += [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 4), args,
        f"mma.sync.aligned.{shape_types} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
    )  # fmt: skip
    return _fields(res, Float32, 4, loc, ip)


def _load_bytes(op: str, addr, addr_c: str, n: int, side_effects: bool) -> Int32:
    """``n`` (1 or 2) bytes by the load ``op`` at the address value ``addr``, zero-extended."""
    ty = "u8" if n == 1 else "u16"
    return Int32(_asm(T.i32(), [addr], f"{{ .reg .b16 t; {op}.{ty} t, [$1]; cvt.u32.u16 $0, t; }}",
                      f"=r,{addr_c}", side_effects))  # fmt: skip


@dsl_user_op
def load_words(addr: Int64, n: int, *, loc=None, ip=None) -> list[Int32]:
    """``n`` (1, 2 or 4) 32-bit words at global byte address ``addr`` (aligned to ``4n``),
    through the read-only path."""
    return _load_words("ld.global.nc", Int64(addr).ir_value(loc=loc, ip=ip), "l", n, False,
                       loc, ip)  # fmt: skip


@dsl_user_op
def load_bytes(addr: Int64, n: int, *, loc=None, ip=None) -> Int32:
    """``n`` (1, 2 or 4) bytes at global address ``addr`` (aligned to ``n``), zero-extended."""
    if n == 4:
        return load_words(addr, 1, loc=loc, ip=ip)[0]
    return _load_bytes("ld.global.nc", Int64(addr).ir_value(loc=loc, ip=ip), "l", n, False)


@dsl_user_op
def load_shared_bytes(addr: Int32, n: int, *, loc=None, ip=None) -> Int32:
    """``n`` (1, 2 or 4) bytes at shared-memory address ``addr`` (aligned to ``n``),
    zero-extended."""
    if n == 4:
        return load_shared_words(addr, 1, loc=loc, ip=ip)[0]
    return _load_bytes("ld.shared", Int32(addr).ir_value(loc=loc, ip=ip), "r", n, True)


@dsl_user_op
def copy_async_16(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """``cp.async.cg`` of 16 bytes from global ``src`` to shared ``dst`` (both 16-aligned),
    in the thread's current ``cp.async`` group."""
    _asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", side_effects=True)


@dsl_user_op
def mma_f16(a: list, b: list, c: list, *, loc=None, ip=None) -> list[Float32]:
    """``mma.sync m16n8k16`` on FP16 (A: four f16x2, B: two f16x2, C/D: four f32)."""
    return _mma("m16n8k16.row.col.f32.f16.f16.f32", a, b, c, loc, ip)


# an E2M1 nibble s e1 e0 m -> the E4M3 byte s 0 0 e1 e0 m 0 0 (value · 2^-6), four bytes at
# once: "lo" from the low (even-element) nibbles, "hi" from the high ones. With the signs
# s = w & 0x88888888 and the mask m = 0x1C1C1C1C (each byte's e1 e0 m bits), lo = (w << 2
# & m) | (s << 4 & ~m) and hi = (w >> 2 & m) | (s & ~m): one lop3 each (0xE4: a & c | b & ~c;
# the other nibble's sign lands inside m and is dropped); needs .b32 s, t0, t1, m = m
_REENCODE = (
    "and.b32 s, {w}, 0x88888888; shl.b32 t0, {w}, 2; shl.b32 t1, s, 4; "
    "lop3.b32 {lo}, t0, t1, m, 0xE4; shr.b32 t0, {w}, 2; lop3.b32 {hi}, t0, s, m, 0xE4; "
)
_REENCODE_REGS = ".reg .b32 s, t0, t1, m; mov.b32 m, 0x1C1C1C1C; "


@dsl_user_op
def e2m1_word(w: Int32, *, loc=None, ip=None) -> list[Int32]:
    """Eight E2M1 codes (one word, element ``e`` in nibble ``e``) as four f16x2 of their
    values · 2^-6: elements (0, 2), (4, 6), (1, 3), (5, 7)."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 lo, hi; .reg .b16 a, b, c, d; " + _REENCODE_REGS
        + _REENCODE.format(w="$4", lo="lo", hi="hi")
        + "mov.b32 {a, b}, lo; cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; "
        "mov.b32 {c, d}, hi; cvt.rn.f16x2.e4m3x2 $2, c; cvt.rn.f16x2.e4m3x2 $3, d; }",
        "=r,=r,=r,=r,r",
    )  # fmt: skip
    return _fields(res, Int32, 4, loc, ip)


@dsl_user_op
def e2m1_word_pair(wa: Int32, wb: Int32, *, loc=None, ip=None) -> list[Int32]:
    """The same element of two keys' words as one f16x2 (key ``a`` low): eight registers,
    element 0..7 in order, values · 2^-6. The two words' bytes are interleaved first (``a``
    byte, ``b`` byte, ...), so that each re-encoded 16 bits already pair the keys."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 8),
        [Int32(w).ir_value(loc=loc, ip=ip) for w in (wa, wb)],
        "{ .reg .b32 x, l0, h0, l1, h1; .reg .b16 p, q; " + _REENCODE_REGS
        + "prmt.b32 x, $8, $9, 0x5140; "  # bytes a0 b0 a1 b1: elements 0-3 of both keys
        + _REENCODE.format(w="x", lo="l0", hi="h0")
        + "prmt.b32 x, $8, $9, 0x7362; "  # a2 b2 a3 b3: elements 4-7
        + _REENCODE.format(w="x", lo="l1", hi="h1")
        + "mov.b32 {p, q}, l0; cvt.rn.f16x2.e4m3x2 $0, p; cvt.rn.f16x2.e4m3x2 $2, q; "
        "mov.b32 {p, q}, h0; cvt.rn.f16x2.e4m3x2 $1, p; cvt.rn.f16x2.e4m3x2 $3, q; "
        "mov.b32 {p, q}, l1; cvt.rn.f16x2.e4m3x2 $4, p; cvt.rn.f16x2.e4m3x2 $6, q; "
        "mov.b32 {p, q}, h1; cvt.rn.f16x2.e4m3x2 $5, p; cvt.rn.f16x2.e4m3x2 $7, q; }",
        ",".join(["=r"] * 8) + ",r,r",
    )  # fmt: skip
    return _fields(res, Int32, 8, loc, ip)


@dsl_user_op
def scale_pair(sa: Int32, sb: Int32, byte: int, *, loc=None, ip=None) -> Int32:
    """f16x2 of E4M3 byte ``byte`` of ``sa`` (low) and of ``sb`` (high), each · 2^6."""
    sel = byte | ((4 + byte) << 4)
    return _asm1(
        Int32, [Int32(sa), Int32(sb)],
        f"{{ .reg .b32 x, y, k; .reg .b16 p, q; prmt.b32 x, $1, $2, {sel}; mov.b32 {{p, q}}, x; "
        "cvt.rn.f16x2.e4m3x2 y, p; mov.b32 k, 0x54005400; mul.rn.f16x2 $0, y, k; }",
        "=r,r,r", loc, ip,
    )  # fmt: skip


@dsl_user_op
def f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """f16x2 of two float32 (round to nearest even), ``lo`` in the low half."""
    return _asm1(Int32, [Float32(hi), Float32(lo)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f",
                 loc, ip)  # fmt: skip


@dsl_user_op
def hmul2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """f16x2 product (exact here: the operands' significands fit FP16's together)."""
    return _asm1(Int32, [Int32(a), Int32(b)], "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", loc, ip)


@dsl_user_op
def p_hat_pair(p0: Float32, p1: Float32, *, loc=None, ip=None) -> Int32:
    """f16x2 of ``E4M3(p0)``, ``E4M3(p1)`` (RNE, saturating), ``p0`` low."""
    return _asm1(
        Int32, [Float32(p0), Float32(p1)],
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.rn.f16x2.e4m3x2 $0, t; }",
        "=r,f,f", loc, ip,
    )  # fmt: skip


@dsl_user_op
def f16_pair_sum(x: Int32, *, loc=None, ip=None) -> Float32:
    """float32 sum of an f16x2's two values."""
    return _asm1(
        Float32, [Int32(x)],
        "{ .reg .b16 a, b; .reg .f32 u, v; mov.b32 {a, b}, $1; cvt.f32.f16 u, a; "
        "cvt.f32.f16 v, b; add.f32 $0, u, v; }", "=f,r", loc, ip,
    )  # fmt: skip


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    return _asm1(Float32, [Float32(x)], "cvt.rpi.f32.f32 $0, $1;", "=f,f", loc, ip)


@dsl_user_op
def mma_fp8(a: list, b: list, c: list, *, loc=None, ip=None) -> list[Float32]:
    """``mma.sync m16n8k32`` on E4M3 (A: four words of four codes, B: two, C/D: four f32)."""
    return _mma("m16n8k32.row.col.f32.e4m3.e4m3.f32", a, b, c, loc, ip)


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four E4M3 codes (RNE, saturating) in one word, ``a`` in the low byte."""
    return _asm1(
        Int32, [Float32(x) for x in (a, b, c, d)],
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f", loc, ip,
    )  # fmt: skip


@dsl_user_op
def p_hat_x4(p: list, *, loc=None, ip=None) -> tuple[Int32, list[Float32]]:
    """``E4M3(p[i])`` (RNE, saturating) for four values: the word of codes (``p[0]`` low) and
    the codes' float32 values."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] + [T.f32()] * 4),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in p],
        "{ .reg .b16 lo, hi, a, b, c, d; .reg .b32 h0, h1; "
        "cvt.rn.satfinite.e4m3x2.f32 lo, $6, $5; cvt.rn.satfinite.e4m3x2.f32 hi, $8, $7; "
        "mov.b32 $0, {lo, hi}; cvt.rn.f16x2.e4m3x2 h0, lo; cvt.rn.f16x2.e4m3x2 h1, hi; "
        "mov.b32 {a, b}, h0; mov.b32 {c, d}, h1; cvt.f32.f16 $1, a; cvt.f32.f16 $2, b; "
        "cvt.f32.f16 $3, c; cvt.f32.f16 $4, d; }",
        "=r,=f,=f,=f,=f,f,f,f,f",
    )  # fmt: skip
    word = Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip))
    return word, [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))
                  for i in range(1, 5)]  # fmt: skip


# ---------------------------------------------------------------- kernels
class _PagedDecodeSm90:
    """What the NVFP4 and FP8 decodes share: the CTA's key range, Q's rows, the ring of
    loaded tiles, the online softmax, the merge of the warps and the store. A subclass gives
    ``tile`` (keys per warp step), ``q_fmax`` (Q's format maximum as ``pow2_exponent_ceil``
    takes it), ``n_raw`` (loaded words per thread and tile), ``q_words``, ``load_tile``,
    ``attend`` and ``o_column``.

    Compiled once per (format, head dim, KV heads, GQA group, page size, partial output,
    prefetch depth, CTAs per SM, stages, dtypes). ``depth``: key tiles each warp's loads run
    ahead into registers; ``ctas_per_sm`` > 0 caps registers so that many CTAs fit an SM;
    ``stages`` ≥ 2 (subclasses with ``copy_tile``/``read_tile``): each warp copies its tiles
    whole into a ring of that many shared-memory stages with ``cp.async`` instead (``stages
    − 1`` tiles in flight, ``depth`` unused), then reads its fragments from there;
    ``split_edge`` (with the ring): tiles wholly inside the sequence run a copy of the tile
    step without masks; ``warps`` per CTA take every ``warps``-th key tile of the split."""

    def __init__(self, head_dim: int, heads_kv: int, group: int, page_size: int,
                 partial: bool, depth: int = DEPTH, ctas_per_sm: int = CTAS_PER_SM,
                 stages: int = 0, split_edge: bool = SPLIT_EDGE,
                 warps: int = WARPS) -> None:  # fmt: skip
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the CuTe decode supports 64, 128 and 256")
        if not 1 <= group <= ROWS:
            raise ValueError(f"GQA group {group}: the CuTe decode supports 1 to {ROWS}")
        if page_size % TILE:
            raise ValueError(f"page_size {page_size}: the CuTe decode needs a multiple of {TILE}")
        self.d = head_dim
        self.heads_kv = heads_kv
        self.group = group
        self.page = page_size
        self.partial = partial
        if warps not in (2, 4, 8):
            raise ValueError(f"warps {warps}: the CuTe decode runs 2, 4 or 8 warps per CTA")
        self.warps = warps
        if stages == 1 or stages < 0:
            raise ValueError(f"stages {stages}: 0 (register ring) or at least 2")
        self.depth = stages - 1 if stages else depth
        self.stages = stages
        self.split_edge = split_edge and stages > 0
        self.ctas_per_sm = ctas_per_sm
        self.q_tiles = 2 if group > 8 else 1  # n-tiles of 8 queries in O's products

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, Hq, d) bf16/fp16
        mCache: cute.Tensor,  # (blocks, 2, Hkv, region) uint8
        mBT: cute.Tensor,  # (B, pages) int32
        mSeqLens: cute.Tensor,  # (B,) int32
        mQsl: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (T, Hq, d) bf16/fp16
        mPartO: cute.Tensor,  # (rows·Hq·d,) f32
        mPartML: cute.Tensor,  # (rows·Hq·2,) f32
        qk_scale: Float32,
        out_scale: Float32,
        num_splits: Int32,
        part_tokens: Int32,
        num_decodes: Int32,
        stream: cuda.CUstream,
    ):
        # the warps' rings (if any) and, after the key loop, their outputs share one region
        warps = self.warps
        ring_words = warps * self.stages * self.stage_bytes // 4 if self.stages else 0

        @cute.struct
        class Storage:
            sO: cute.struct.Align[
                cute.struct.MemRange[Float32, max(warps * self.group * self.d, ring_words)], 128
            ]
            sM: cute.struct.MemRange[Float32, warps * self.group]
            sL: cute.struct.MemRange[Float32, warps * self.group]

        self.kernel(
            mQ, mCache, mBT, mSeqLens, mQsl, mOut, mPartO, mPartML, qk_scale, out_scale,
            num_splits, part_tokens, Storage,
        ).launch(
            grid=[num_decodes, self.heads_kv, num_splits], block=[32 * warps, 1, 1],
            stream=stream, min_blocks_per_mp=self.ctas_per_sm,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mCache: cute.Tensor,
        mBT: cute.Tensor,
        mSeqLens: cute.Tensor,
        mQsl: cute.Tensor,
        mOut: cute.Tensor,
        mPartO: cute.Tensor,
        mPartML: cute.Tensor,
        qk_scale: Float32,
        out_scale: Float32,
        num_splits: Int32,
        part_tokens: Int32,
        Storage: cutlass.Constexpr,
    ):
        d, group, tile_keys, warps = self.d, self.group, self.tile, self.warps
        seq, kvh, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        t = lane % 4
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        sO = storage.sO.get_tensor(cute.make_layout((warps, group, d), stride=(group * d, d, 1)))
        smem_ring = const_expr(self.stages > 0)
        ring = Int32(0)
        if const_expr(smem_ring):
            ring = storage.sO.data_ptr().toint() + warp * (self.stages * self.stage_bytes)
        sM = storage.sM.get_tensor(cute.make_layout((warps, group), stride=(group, 1)))
        sL = storage.sL.get_tensor(cute.make_layout((warps, group), stride=(group, 1)))

        q_start = mQsl[seq]
        q_len = mQsl[seq + 1] - q_start
        if q_len > 0:
            kv_hi = mSeqLens[seq] - q_len + 1
            n_tiles = (kv_hi + tile_keys - 1) // tile_keys
            per_split = (n_tiles + num_splits - 1) // num_splits
            t_begin = split * per_split
            t_end = cutlass.min(t_begin + per_split, n_tiles)
            first = t_begin + warp
            n_it = Int32(0)
            if first < t_end:
                n_it = (t_end - first + warps - 1) // warps
            # Q: rows g and g + 8 (heads of the group), this thread's head columns
            # [t·d/4, (t+1)·d/4) as float32 with their row maximum
            two_halves = const_expr(group > 8)
            q_vals = []
            q_amax = []
            for rh in cutlass.range_constexpr(2 if two_halves else 1):
                row = g + 8 * rh
                vals = cute.make_rmem_tensor(d // 4, Float32)
                amax = Float32(0.0)
                for e in cutlass.range_constexpr(d // 4):
                    vals[e] = Float32(0.0)
                    if row < group:
                        vals[e] = mQ[q_start, kvh * group + row, t * (d // 4) + e].to(Float32)
                    amax = cute.arch.fmax(amax, abs(vals[e]))
                for k in cutlass.range_constexpr(2):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
                q_vals.append(vals)
                q_amax.append(amax)
            row_scale = cute.make_rmem_tensor(2, Float32)
            qa = self.q_fragments(q_vals, q_amax, qk_scale, row_scale)

            acc = cute.make_rmem_tensor((self.q_tiles, d // 16, 4), Float32)  # Oᵀ
            acc.fill(0.0)
            m_run = cute.make_rmem_tensor(2, Float32)
            m_run.fill(NO_MAX)
            l_run = cute.make_rmem_tensor(2, Float32)
            l_run.fill(0.0)
            depth, n_raw = self.depth, self.n_raw
            raw = cute.make_rmem_tensor((depth, n_raw), Int32)  # ring of loaded tiles
            halves = tile_keys // TILE  # page-table entries per tile (16 keys each)
            blk_ahead = cute.make_rmem_tensor(halves, Int32)
            base = mCache.iterator.toint()
            last_page = (kv_hi - 1) // self.page
            for k in cutlass.range_constexpr(depth):
                if k < n_it:
                    tile = first + k * warps
                    for h in cutlass.range_constexpr(halves):
                        blk_ahead[h] = self.page_entry(mBT, seq, tile, h, last_page)
                    if const_expr(smem_ring):
                        self.copy_tile(ring + k * self.stage_bytes, base, tile, blk_ahead, kvh,
                                       lane)  # fmt: skip
                    else:
                        self.load_tile(raw, k, base, tile, blk_ahead, kvh, g, t)
                if const_expr(smem_ring):
                    cute.arch.cp_async_commit_group()  # empty groups keep the count per tile
            if depth < n_it:
                for h in cutlass.range_constexpr(halves):
                    blk_ahead[h] = self.page_entry(mBT, seq, first + depth * warps, h, last_page)
            if const_expr(smem_ring):
                stages, stage_bytes = self.stages, self.stage_bytes
                for it in cutlass.range(0, n_it, 1, unroll=1):
                    tile = first + it * warps
                    # tile it's group is complete once at most stages − 2 newer are pending;
                    # the warp barrier also orders last step's reads of the stage refilled now
                    cute.arch.cp_async_wait_group(stages - 2)
                    cute.arch.sync_warp()
                    cur = self.read_tile(ring + it % stages * stage_bytes, g, t)
                    if it + depth < n_it:
                        self.copy_tile(ring + (it + depth) % stages * stage_bytes, base,
                                       tile + depth * warps, blk_ahead, kvh, lane)  # fmt: skip
                    cute.arch.cp_async_commit_group()
                    if it + depth + 1 < n_it:
                        ahead = tile + (depth + 1) * warps
                        for h in cutlass.range_constexpr(halves):
                            blk_ahead[h] = self.page_entry(mBT, seq, ahead, h, last_page)
                    if const_expr(self.split_edge):
                        if (tile + 1) * tile_keys <= kv_hi:  # all keys exist: no masks
                            self.attend(cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t,
                                        two_halves, edge=False)  # fmt: skip
                        else:
                            self.attend(cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t,
                                        two_halves)  # fmt: skip
                    else:
                        self.attend(cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t,
                                    two_halves)  # fmt: skip
                # the outputs below overwrite the rings: every warp must be done with its own
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
            else:
                for it0 in cutlass.range(0, n_it, depth, unroll=1):
                    for k in cutlass.range_constexpr(depth):
                        it = it0 + k
                        if it < n_it:
                            tile = first + it * warps
                            cur = []
                            for i in cutlass.range_constexpr(n_raw):
                                cur.append(raw[k, i])
                            if it + depth < n_it:
                                self.load_tile(raw, k, base, tile + depth * warps, blk_ahead, kvh,
                                               g, t)  # fmt: skip
                            if it + depth + 1 < n_it:
                                ahead = tile + (depth + 1) * warps
                                for h in cutlass.range_constexpr(halves):
                                    blk_ahead[h] = self.page_entry(mBT, seq, ahead, h, last_page)
                            self.attend(cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t,
                                        two_halves)  # fmt: skip

            # merge the warps' partials through shared memory
            for rh in cutlass.range_constexpr(2 if two_halves else 1):
                for k in cutlass.range_constexpr(2):
                    l_run[rh] = l_run[rh] + cute.arch.shuffle_sync_bfly(l_run[rh], offset=1 << k)
                row = g + 8 * rh
                if row < group and t == 0:
                    sM[warp, row] = m_run[rh]
                    sL[warp, row] = l_run[rh]
            # Oᵀ accumulator value (query n-tile qi, m-tile i, u): query 8qi + 2t + u % 2,
            # m-tile row g + 8 (u // 2)
            for qi in cutlass.range_constexpr(self.q_tiles):
                for u in cutlass.range_constexpr(4):
                    q = 8 * qi + 2 * t + u % 2
                    if q < group:
                        for i in cutlass.range_constexpr(d // 16):
                            sO[warp, q, self.o_column(i, u // 2, g)] = acc[qi, i, u]
            cute.arch.barrier()
            tid = warp * 32 + lane
            for k in cutlass.range_constexpr((group * d + 32 * warps - 1) // (32 * warps)):
                idx = tid + k * 32 * warps
                if idx < group * d:
                    self.store_value(sO, sM, sL, idx, q_start, kvh, split, part_tokens,
                                     out_scale, mOut, mPartO, mPartML)  # fmt: skip

    @cute.jit
    def q_fragments(self, q_vals, q_amax, qk_scale, row_scale) -> list:
        """Q's A fragments, one (a0, a1, a2, a3) per k-chunk: each row (head) scaled by
        ``2^-eq`` with ``eq = pow2_exponent_ceil(amax, *self.q_fmax)`` (``row_scale`` gets
        ``qk_scale·2^eq``) and packed by ``q_words``; rows g + 8 are zero for groups ≤ 8."""
        rows = []
        for rh in cutlass.range_constexpr(len(q_vals)):
            eq = pow2_exponent_ceil(q_amax[rh], *self.q_fmax)
            row_scale[rh] = qk_scale * pow2(eq)
            rows.append(self.q_words(q_vals[rh], pow2(0 - eq)))
        zero = Int32(0)
        qa = []
        for c in cutlass.range_constexpr(len(rows[0])):
            hi = rows[1][c] if const_expr(len(rows) > 1) else (zero, zero)
            qa.append((rows[0][c][0], hi[0], rows[0][c][1], hi[1]))
        return qa

    @cute.jit
    def page_entry(self, mBT, seq, tile, half: int, last_page):
        """Cache block of the 16 keys ``16·half ..`` of ``tile`` (a page past the sequence's
        last is replaced by its last: those keys are masked, their loads stay inside it)."""
        page = cutlass.min((tile * self.tile + TILE * half) // self.page, last_page)
        return mBT[seq, page]

    @cute.jit
    def region(self, base: Int64, blk, half: int, kvh) -> Int64:
        """Global address of the (block, K|V, head) region."""
        return base + ((Int64(blk) * 2 + half) * self.heads_kv + kvh) * self.region_bytes

    @cute.jit
    def online_update(self, x, n_vals: int, rows: int, m_run, l_run, acc, t):
        """Running maximum and rescale for the tile's logits ``x[rh, 0 .. n_vals)`` (rows g,
        g + 8): ``M = max(M, ceil(max x))``, the accumulators of a row whose maximum grew
        multiplied by the exact power of two (the warp skips it when no row grew)."""
        m_new = cute.make_rmem_tensor(2, Float32)
        grow = Float32(0.0)  # the largest rise of a running maximum
        for rh in cutlass.range_constexpr(rows):
            tmax = Float32(-Float32.inf)
            for k in cutlass.range_constexpr(n_vals):
                tmax = cute.arch.fmax(tmax, x[rh, k])
            for k in cutlass.range_constexpr(2):
                tmax = cute.arch.fmax(tmax, cute.arch.shuffle_sync_bfly(tmax, offset=1 << k))
            m_new[rh] = cute.arch.fmax(m_run[rh], ceil_f32(tmax))
            grow = cute.arch.fmax(grow, m_new[rh] - m_run[rh])
        if cute.arch.vote_any_sync(grow > Float32(0.0)):
            alpha = cute.make_rmem_tensor(2, Float32)
            for rh in cutlass.range_constexpr(rows):
                alpha[rh] = pow2(Int32(cute.arch.fmax(m_run[rh] - m_new[rh], Float32(-127.0))))
                l_run[rh] = l_run[rh] * alpha[rh]
                m_run[rh] = m_new[rh]
            # Oᵀ's columns are queries: query 8qi + 2t + u's factor lives in lanes 4(2t + u)..
            for qi in cutlass.range_constexpr(self.q_tiles):
                for u in cutlass.range_constexpr(2):
                    a = cute.arch.shuffle_sync(alpha[qi], 4 * (2 * t + u))
                    for i in cutlass.range_constexpr(self.d // 16):
                        acc[qi, i, u] = acc[qi, i, u] * a
                        acc[qi, i, u + 2] = acc[qi, i, u + 2] * a

    @cute.jit
    def store_value(self, sO, sM, sL, idx, q_start, kvh, split, part_tokens, out_scale, mOut,
                    mPartO, mPartML):  # fmt: skip
        """Merge the warps' (M, l, O) of element ``idx`` (row-major over group rows x head
        columns) and store it: the output, or the split's partial (O/l, M, l) rows."""
        d = self.d
        row = idx // d
        col = idx - row * d
        m_max = sM[0, row]
        for w in cutlass.range_constexpr(1, self.warps):
            m_max = cute.arch.fmax(m_max, sM[w, row])
        l_sum = Float32(0.0)
        o_sum = Float32(0.0)
        for w in cutlass.range_constexpr(self.warps):
            wt = pow2(Int32(cute.arch.fmax(sM[w, row] - m_max, Float32(-127.0))))
            l_sum = l_sum + sL[w, row] * wt
            o_sum = o_sum + sO[w, row, col] * wt
        o = o_sum * out_scale / (l_sum if l_sum > Float32(0.0) else Float32(1.0))
        head = kvh * self.group + row
        if const_expr(self.partial):
            at = (split * part_tokens + q_start) * (self.heads_kv * self.group) + head
            mPartO[at * d + col] = o
            if col == 0:
                mPartML[at * 2] = m_max
                mPartML[at * 2 + 1] = l_sum * (1.0 / P_SCALE)
        else:
            mOut[q_start, head, col] = o.to(mOut.element_type)


class NvFP4DecodeSm90(_PagedDecodeSm90):
    """NVFP4 cache: 16-key tiles, FP16 ``mma.sync m16n8k16`` on codes widened in registers."""

    tile = TILE
    q_fmax = (Q16_EXP, 0)  # Q's row maximum 2^15 in FP16 (reference.Q_FP16_MAX)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        d = self.d
        self.k_words = d // 32  # K words per thread and key
        self.v_words = max(1, d // 64)  # V words per thread and key
        self.k_scale_bytes = d // 64
        self.v_scale_bytes = max(1, d // 128)
        self.code_bytes = d // 2
        self.scale_bytes = d // 16
        self.region_bytes = self.page * (self.code_bytes + self.scale_bytes)
        self.scale_base = self.page * self.code_bytes
        self.n_raw = 2 * self.k_words + 2 + 4 * self.v_words + 4
        # a stage of the shared-memory ring: the tile's K codes, K scales, V codes, V scales,
        # each the bytes of its page region's 16 keys as they are stored
        self.stage_half = TILE * (self.code_bytes + self.scale_bytes)
        self.stage_bytes = 2 * self.stage_half

    def o_column(self, i: int, half: int, g):
        """Head column of m-tile ``i`` row ``g + 8·half``."""
        return g * (self.d // 8) + 2 * i + half

    @cute.jit
    def q_words(self, vals, inv) -> list:
        """One row of Q in FP16 (``vals·inv``, ``|q| ≤ 2^15``): per 16-column chunk the
        (low-k, high-k) f16x2 pair, in the K fragments' column order."""
        pairs = []
        for c in cutlass.range_constexpr(self.d // 16):
            e0 = 8 * (c // 2) + 4 * (c % 2)
            pairs.append((
                f16x2(vals[e0] * inv, vals[e0 + 2] * inv),
                f16x2(vals[e0 + 1] * inv, vals[e0 + 3] * inv),
            ))  # fmt: skip
        return pairs

    @cute.jit
    def load_tile(self, raw, slot: int, base: Int64, tile, blks, kvh, g, t):
        """This thread's words of ``tile`` (in page ``blks[0]``) from global memory into ring
        ``slot`` (``gather``'s order)."""
        off0 = tile * TILE % self.page
        words = self.gather(
            self.region(base, blks[0], 0, kvh), self.region(base, blks[0], 1, kvh),
            off0 * self.code_bytes, self.scale_base + off0 * self.scale_bytes, g, t,
            load_words, load_bytes,
        )  # fmt: skip
        for i in cutlass.range_constexpr(self.n_raw):
            raw[slot, i] = words[i]

    @cute.jit
    def read_tile(self, stage: Int32, g, t) -> list:
        """This thread's words of the tile in the shared-memory ``stage`` (``gather``'s
        order)."""
        return self.gather(stage, stage + self.stage_half, 0, TILE * self.code_bytes, g, t,
                           load_shared_words, load_shared_bytes)  # fmt: skip

    @cute.jit
    def copy_tile(self, stage: Int32, base: Int64, tile, blks, kvh, lane):
        """Issue the warp's ``cp.async`` copies of ``tile`` (in page ``blks[0]``) into the
        shared-memory ``stage``: per half (K, V) its 16 keys' codes, then their scales."""
        off0 = tile * TILE % self.page
        for half in cutlass.range_constexpr(2):
            region = self.region(base, blks[0], half, kvh)
            dst = stage + half * self.stage_half
            for src, at, n_bytes in (
                (region + off0 * self.code_bytes, 0, TILE * self.code_bytes),
                (region + self.scale_base + off0 * self.scale_bytes, TILE * self.code_bytes,
                 TILE * self.scale_bytes),
            ):  # fmt: skip
                chunks = n_bytes // 16
                for c in cutlass.range_constexpr((chunks + 31) // 32):
                    idx = lane + 32 * c
                    if const_expr(chunks % 32 == 0):
                        copy_async_16(dst + at + 16 * idx, src + 16 * idx)
                    elif idx < chunks:
                        copy_async_16(dst + at + 16 * idx, src + 16 * idx)

    @cute.jit
    def gather(self, k_at, v_at, codes, scales, g, t, read_words, read_bytes) -> list:
        """This thread's code words and scale bytes of a 16-key tile whose K and V regions
        start at ``k_at`` / ``v_at`` (global or shared addresses, read with ``read_words`` /
        ``read_bytes``; key ``k``'s codes at ``codes + k·d/2``, its scales at ``scales +
        k·d/16`` within a region): K (keys g, g + 8), K scales, V (keys 2t, 2t+1, 2t+8,
        2t+9), V scales."""
        d = self.d
        kw, vw = self.k_words, self.v_words
        k_codes = [Int32(0)] * (2 * kw)
        k_scales = [Int32(0)] * 2
        for j in cutlass.range_constexpr(2):
            key = 8 * j + g
            at = k_at + codes + key * self.code_bytes + t * (d // 8)
            for p in cutlass.range_constexpr((kw + 3) // 4):
                words = read_words(at + 16 * p, min(4, kw))
                for i in cutlass.range_constexpr(min(4, kw)):
                    k_codes[j * kw + 4 * p + i] = words[i]
            k_scales[j] = read_bytes(
                k_at + scales + key * self.scale_bytes + t * self.k_scale_bytes,
                self.k_scale_bytes,
            )
        v_codes = [Int32(0)] * (4 * vw)
        v_scales = [Int32(0)] * 4
        for k in cutlass.range_constexpr(4):
            key = 2 * t + k % 2 + 8 * (k // 2)
            words = read_words(v_at + codes + key * self.code_bytes + g * (d // 16), vw)
            for i in cutlass.range_constexpr(vw):
                v_codes[k * vw + i] = words[i]
            v_scales[k] = read_bytes(
                v_at + scales + key * self.scale_bytes + g * d // 128, self.v_scale_bytes
            )
        return k_codes + k_scales + v_codes + v_scales

    @cute.jit
    def attend(self, cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t, two_halves,
               edge: cutlass.Constexpr = True):  # fmt: skip
        """One 16-key tile of the warp's online softmax from its loaded ``cur`` words
        (``edge``: keys past ``kv_hi`` may be in it and are masked)."""
        kw, vw = self.k_words, self.v_words
        key0 = tile * TILE
        # S = Q·Kᵀ: n-tile j holds keys 8j .. 8j+7 of the tile
        s = []
        for j in cutlass.range_constexpr(2):
            c_frag = [Float32(0.0)] * 4
            k_scales = cur[2 * kw + j]
            for i in cutlass.range_constexpr(kw):
                sc = scale_pair(k_scales, k_scales, i // 2)
                r = e2m1_word(cur[j * kw + i])
                for h in cutlass.range_constexpr(2):
                    b = (hmul2(r[h], sc), hmul2(r[2 + h], sc))
                    c_frag = mma_f16(qa[2 * i + h], b, c_frag)
            s.append(c_frag)
        # this thread's logits: (n-tile j, column 2t + u) = key 8j + 2t + u
        rows = 2 if const_expr(two_halves) else 1
        x = cute.make_rmem_tensor((2, 4), Float32)
        for rh in cutlass.range_constexpr(rows):
            for j in cutlass.range_constexpr(2):
                for u in cutlass.range_constexpr(2):
                    v = s[j][2 * rh + u] * row_scale[rh]
                    if const_expr(edge):
                        v = v if key0 + 8 * j + 2 * t + u < kv_hi else -Float32.inf
                    x[rh, 2 * j + u] = v
        self.online_update(x, 4, rows, m_run, l_run, acc, t)
        # P̂ᵀ as the B operand: (keys 2t, 2t+1) from score n-tile 0, (2t+8, 2t+9) from 1
        p_b = []
        for rh in cutlass.range_constexpr(rows):
            pair = []
            for j in cutlass.range_constexpr(2):
                p0 = cute.math.exp2(x[rh, 2 * j] - m_run[rh], fastmath=True) * P_SCALE
                p1 = cute.math.exp2(x[rh, 2 * j + 1] - m_run[rh], fastmath=True) * P_SCALE
                pair.append(p_hat_pair(p0, p1))
                l_run[rh] = l_run[rh] + f16_pair_sum(pair[j])
            p_b.append(pair)
        # Oᵀ += V̂ᵀ·P̂ᵀ: A registers pair keys (2t, 2t+1) and (2t+8, 2t+9); keys past the
        # sequence read zero codes and scales (their slots may hold anything)
        v0 = 2 * kw + 2
        vs0 = v0 + 4 * vw
        w = cute.make_rmem_tensor((4, vw), Int32)
        sv = cute.make_rmem_tensor(4, Int32)
        for k in cutlass.range_constexpr(4):
            sv[k] = cur[vs0 + k]
            for i in cutlass.range_constexpr(vw):
                w[k, i] = cur[v0 + k * vw + i]
            if const_expr(edge):
                ok = key0 + 2 * t + k % 2 + 8 * (k // 2) < kv_hi
                sv[k] = sv[k] if ok else Int32(0)
                for i in cutlass.range_constexpr(vw):
                    w[k, i] = w[k, i] if ok else Int32(0)
        for i in cutlass.range_constexpr(vw):
            sc01 = scale_pair(sv[0], sv[1], i // 2)
            sc23 = scale_pair(sv[2], sv[3], i // 2)
            r01 = e2m1_word_pair(w[0, i], w[1, i])
            r23 = e2m1_word_pair(w[2, i], w[3, i])
            for mm in cutlass.range_constexpr(4):  # m-tile 4i + mm: elements 8i + 2mm, +1
                a = (hmul2(r01[2 * mm], sc01), hmul2(r01[2 * mm + 1], sc01),
                     hmul2(r23[2 * mm], sc23), hmul2(r23[2 * mm + 1], sc23))  # fmt: skip
                for qi in cutlass.range_constexpr(self.q_tiles):
                    mt = 4 * i + mm
                    c_in = [acc[qi, mt, 0], acc[qi, mt, 1], acc[qi, mt, 2], acc[qi, mt, 3]]
                    out = mma_f16(a, p_b[qi], c_in)
                    for u in cutlass.range_constexpr(4):
                        acc[qi, mt, u] = out[u]


class Fp8DecodeSm90(_PagedDecodeSm90):
    """FP8 caches (``fp8``: one int32 exponent per key-head for K and for V; ``static``:
    ``fp8_static``, none): 32-key tiles, E4M3 ``mma.sync m16n8k32`` on the codes as stored,
    Q quantized per head to E4M3 (as the Triton kernel).

    Thread ``(g, t)``'s keys: in ``S = Q̂·K̂ᵀ``, n-tile ``j`` column ``2t + u`` is key
    ``8t + 2j + u`` of the tile, so the thread's scores of one row are keys ``8t .. 8t+7``:
    the B fragment of ``Oᵀ = V̂ᵀ·P̂ᵀ`` with its k index ``4t + i`` / ``16 + 4t + i`` standing
    for key ``8t + i`` / ``8t + 4 + i``; the A fragment is then two 4-byte halves of one
    8-byte load of a V̂ᵀ page row (head column ``16i + r`` for m-tile ``i`` row ``r``). K̂'s
    B fragments: key ``8(g//2) + 2j + g%2`` for n-tile ``j``, bytes ``[t·d/4, (t+1)·d/4)``
    (Q̂'s A fragments in the same order)."""

    tile = 2 * TILE
    q_fmax = (8, 0x600000)  # Q in E4M3: 448 = 1.75·2^8

    def __init__(self, *args, static: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        d = self.d
        if d > 128:
            raise ValueError(f"head_dim {d}: the CuTe FP8 decode supports 64 and 128")
        if self.stages:
            raise ValueError("stages: the shared-memory ring is built for the NVFP4 decode only")
        self.static = static
        self.k_words = d // 16  # K words per thread and key
        self.region_bytes = self.page * (d + (0 if static else 4))
        self.scale_base = self.page * d
        self.n_raw = 4 * self.k_words + 4 * (d // 16) + (0 if static else 16)

    def o_column(self, i: int, half: int, g):
        return 16 * i + 8 * half + g

    @cute.jit
    def q_words(self, vals, inv) -> list:
        """One row of Q in E4M3 (``vals·inv``): per 32-column chunk the (low-k, high-k) pair
        of four-code words."""
        pairs = []
        for c in cutlass.range_constexpr(self.d // 32):
            e0 = 8 * c
            pairs.append((
                e4m3x4(vals[e0] * inv, vals[e0 + 1] * inv, vals[e0 + 2] * inv, vals[e0 + 3] * inv),
                e4m3x4(vals[e0 + 4] * inv, vals[e0 + 5] * inv, vals[e0 + 6] * inv,
                       vals[e0 + 7] * inv),
            ))  # fmt: skip
        return pairs

    @cute.jit
    def load_tile(self, raw, slot: int, base: Int64, tile, blks, kvh, g, t):
        """This thread's words of ``tile`` (keys 16h .. in page ``blks[h]``) into ring
        ``slot``: K̂ (four keys), V̂ᵀ (rows g, g + 8 of each m-tile, keys 8t .. 8t+7), and
        the exponents ek, ev of keys 8t .. 8t+7."""
        d, page = self.d, self.page
        kw = self.k_words
        key0 = tile * self.tile
        # K̂: key 8(g//2) + 2j + g%2 lies in half g // 4
        kh = g // 4
        k_region = self.region(base, blks[0] if kh == 0 else blks[1], 0, kvh)
        for j in cutlass.range_constexpr(4):
            off = (key0 + 8 * (g // 2) + 2 * j + g % 2) % page
            at = k_region + off * d + t * (d // 4)
            for p in cutlass.range_constexpr(kw // 4):
                words = load_words(at + 16 * p, 4)
                for i in cutlass.range_constexpr(4):
                    raw[slot, j * kw + 4 * p + i] = words[i]
        # V̂ᵀ and the exponents: keys 8t .. 8t+7 lie in half t // 2
        vh = t // 2
        blk = blks[0] if vh == 0 else blks[1]
        v_region = self.region(base, blk, 1, kvh)
        off = (key0 + 8 * t) % page
        v0 = 4 * kw
        for i in cutlass.range_constexpr(d // 16):
            for half in cutlass.range_constexpr(2):
                words = load_words(v_region + (16 * i + 8 * half + g) * page + off, 2)
                raw[slot, v0 + 4 * i + 2 * half] = words[0]
                raw[slot, v0 + 4 * i + 2 * half + 1] = words[1]
        if const_expr(not self.static):  # ek from the K region, then ev from the V region
            e0 = v0 + 4 * (d // 16)
            for r in cutlass.range_constexpr(2):
                at = self.region(base, blk, r, kvh) + self.scale_base + off * 4
                for p in cutlass.range_constexpr(2):
                    words = load_words(at + 16 * p, 4)
                    for i in cutlass.range_constexpr(4):
                        raw[slot, e0 + 8 * r + 4 * p + i] = words[i]

    @cute.jit
    def attend(self, cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t, two_halves):
        """One 32-key tile of the warp's online softmax from its loaded ``cur`` words."""
        d = self.d
        kw = self.k_words
        key0 = tile * self.tile
        v0 = 4 * kw
        e0 = v0 + 4 * (d // 16)
        s = []
        for j in cutlass.range_constexpr(4):
            c_frag = [Float32(0.0)] * 4
            for c in cutlass.range_constexpr(d // 32):
                b = (cur[j * kw + 2 * c], cur[j * kw + 2 * c + 1])
                c_frag = mma_fp8(qa[c], b, c_frag)
            s.append(c_frag)
        # this thread's logits: key 8t + k, k = 2j + u; x = s·row_scale·2^ek + ev (the V
        # exponent folded into P̂, as the Triton kernel)
        rows = 2 if const_expr(two_halves) else 1
        valid = kv_hi - (key0 + 8 * t)  # keys of the thread's eight that exist
        x = cute.make_rmem_tensor((2, 8), Float32)
        ev_inv = cute.make_rmem_tensor(8, Float32)
        for k in cutlass.range_constexpr(8):
            ok = k < valid
            if const_expr(self.static):
                ev_inv[k] = Float32(1.0)
            else:
                ev = cur[e0 + 8 + k] if ok else Int32(0)
                ev_inv[k] = pow2(0 - ev)
            for rh in cutlass.range_constexpr(rows):
                v = s[k // 2][2 * rh + k % 2] * row_scale[rh]
                if const_expr(not self.static):
                    v = v * pow2(cur[e0 + k]) + Float32(ev)
                x[rh, k] = v if ok else -Float32.inf
        self.online_update(x, 8, rows, m_run, l_run, acc, t)
        p_b = []
        for rh in cutlass.range_constexpr(rows):
            words = []
            for h in cutlass.range_constexpr(2):
                p = []
                for i in cutlass.range_constexpr(4):
                    p.append(cute.math.exp2(x[rh, 4 * h + i] - m_run[rh], fastmath=True)
                             * P_SCALE)  # fmt: skip
                word, vals = p_hat_x4(p)
                words.append(word)
                for i in cutlass.range_constexpr(4):
                    l_run[rh] = l_run[rh] + vals[i] * ev_inv[4 * h + i]
            p_b.append(words)
        # V̂ᵀ bytes of keys past the sequence are zeroed (their slots may hold anything)
        masks = []  # keys 8t .. 8t+3, then 8t+4 .. 8t+7: n of the four exist
        for h in cutlass.range_constexpr(2):
            n = cutlass.max(cutlass.min(valid - 4 * h, 4), 0)
            part = (Int32(1) << (8 * cutlass.min(n, 3))) - 1
            masks.append(Int32(-1) if n == 4 else part)
        lo_mask, hi_mask = masks
        for i in cutlass.range_constexpr(d // 16):
            a = (cur[v0 + 4 * i] & lo_mask, cur[v0 + 4 * i + 2] & lo_mask,
                 cur[v0 + 4 * i + 1] & hi_mask, cur[v0 + 4 * i + 3] & hi_mask)  # fmt: skip
            for qi in cutlass.range_constexpr(self.q_tiles):
                c_in = [acc[qi, i, 0], acc[qi, i, 1], acc[qi, i, 2], acc[qi, i, 3]]
                out = mma_fp8(a, p_b[qi], c_in)
                for u in cutlass.range_constexpr(4):
                    acc[qi, i, u] = out[u]


_COMPILED: dict[tuple, object] = {}


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def paged_decode_sm90(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    part_o: torch.Tensor,
    part_ml: torch.Tensor,
    *,
    fmt: KVCacheFormat,
    num_decodes: int,
    num_splits: int,
    part_tokens: int,
    page_size: int,
    qk_scale: float,
    v_scale: float = 1.0,
    depth: int | None = None,
    ctas_per_sm: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
) -> None:
    """Decode the first ``num_decodes`` sequences (one new token each) over an NVFP4, FP8 or
    static-FP8 cache (``ops.run_paged_attention``'s contract; ``v_scale`` multiplies O):
    into ``out`` when ``num_splits`` is 1, else into the split-K partials ``part_o`` /
    ``part_ml`` (``part_tokens`` rows per split) for ``combine_splits_kernel``. ``depth`` /
    ``ctas_per_sm`` / ``stages`` / ``warps``: see :class:`_PagedDecodeSm90` (default: the
    module's ``DEPTH`` / ``CTAS_PER_SM`` / ``STAGES`` / ``WARPS``; the ring is NVFP4's only:
    FP8 defaults to 0 and refuses others)."""
    heads_q, d = q.shape[1], q.shape[2]
    heads_kv = cache.shape[2]
    group = heads_q // heads_kv
    partial = num_splits > 1
    if not partial:  # the partials are not written: any float32 tensors do
        part_o = part_ml = _placeholder(q.device)
    aligned = (
        (q, 2), (cache, 16), (block_table, 4), (seq_lens, 4), (query_start_loc, 4), (out, 2),
        (part_o, 4), (part_ml, 4),
    )  # fmt: skip
    depth = DEPTH if depth is None else depth
    ctas = CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    if stages is None:
        stages = STAGES if fmt is KVCacheFormat.NVFP4 else 0
    warps = WARPS if warps is None else warps
    key = (fmt, d, heads_kv, group, page_size, partial, depth, ctas, stages, SPLIT_EDGE, warps,
           q.dtype, out.dtype)  # fmt: skip
    if key not in _COMPILED:
        args = (d, heads_kv, group, page_size, partial, depth, ctas)
        if fmt is KVCacheFormat.NVFP4:
            kernel = NvFP4DecodeSm90(*args, stages=stages, split_edge=SPLIT_EDGE, warps=warps)
        else:
            kernel = Fp8DecodeSm90(*args, static=fmt is KVCacheFormat.FP8_STATIC, stages=stages,
                                   warps=warps)  # fmt: skip
        _COMPILED[key] = compile_kernel(kernel, aligned, Float32(qk_scale), Float32(v_scale),
                                        Int32(1), Int32(1), Int32(1))  # fmt: skip
    _COMPILED[key](*kernel_tensors(aligned), qk_scale, v_scale, num_splits, part_tokens,
                   num_decodes)  # fmt: skip
