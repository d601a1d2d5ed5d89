"""K/V quantized inside the CuTe forward by its idle producer warps (sm_90a, CuTe DSL).

The forward's producer warpgroup runs one TMA warp; its three other warps have nothing to
do. With ``FlamiaFwdSm90(quantize_kv=True)`` they write what ``quantize_qkv`` writes for
K and V (E4M3 codes, exponents, ``kv_factors``, the column layout ``v_t``; same bits, twin
``reference.quantize_qkv``) while the consumers run, instead of a launch before the kernel:
MHA packs (P3), whose K/V are as large as Q, spend a fifth of their forward in that launch.

Protocol (no warp waits on anything but memory it reads, so no deadlock):

* tasks = (KV head, 32-token block, K or V), taken by atomic ticket (``mTaskTicket``,
  zero at launch) in the order the consumers need them: KV heads in groups of
  ``group_heads``, and inside a group the blocks in ``mTaskSlot``'s order (documents by
  their longest work item, longest first; a document's blocks last first), K and V of a
  block next to each other; the consumers take the work list group by group
  (``work_item``), so a group's K/V are written while the group before it runs;
* a task's warp loads its block's BF16/FP16 rows (each lane ``d/32`` columns of every
  token), writes codes, exponents and factors with ordinary stores, fences (``membar.gl``
  and the async proxy), then adds 1 to the flag of (KV head, block) (``mFlags``, zero at
  launch): 2 when K and V are written;
* the TMA warp, before loading a key tile, spins (``ld.relaxed.gpu``, ``nanosleep``) until
  the flags of the tile's blocks read 2, then fences (acquire, async proxy) and loads.

Numerics as ``kernels/_common.fp8_rows`` (GPU): NaN-ignoring maxima, ``e = ceil(log2(amax
/ 448))`` clamped to [-127, 127] (``e4m3_exponent``), codes ``RNE_satfinite(x·2^-e)``; K one
exponent per block, V one per token with all-zero rows at ``V_ZERO_EXPONENT``; K's rows
stored token-major, V's codes in ``v_t`` positions (``operands.v_t_position``), padded with
zero codes to the next 16 columns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa_utils

from flamia_serve.kernels.cute_sm90_common import (
    _asm,
    _fields,
    e4m3_exponent,
    load_shared_words,
    pow2,
)
from flamia_serve.numerics.scales import V_ZERO_EXPONENT

#: tokens of a quantization block (the recipes' token block; ``v_t`` permutes keys inside
#: 16-token groups)
BLOCK = 32
GROUP16 = 16
#: K's tokens loaded at once per pass (registers: 72 per producer thread), by default
K_CHUNK = 16
#: a warp prefetches its next task's rows into L2 while it runs one, by default
PREFETCH = True
#: int32 words after the flags that ``trace`` writes: Σ task ns (from waiting for its rows
#: to its flag's release), tasks, Σ ns the TMA warps spent in ``wait_tile``, its calls,
#: then u64 the first task's start and the last task's end (globaltimer; the host sets the
#: start to all ones)
TRACE_FIELDS = ("task_ns", "tasks", "tma_wait_ns", "tma_waits", "first_start", "last_end")
TRACE_WORDS = 8
#: a warp copies its next task's rows into shared memory (bulk copies, one round trip)
#: while it runs one, by default (instead of loading them into registers from L2)
STAGE = True


# ---------------------------------------------------------------- PTX helpers
@dsl_user_op
def load_words_if(addr: Int64, n: int, ok: Int32, *, loc=None, ip=None) -> list[Int32]:
    """``n`` (1 or 2) 32-bit words at global byte address ``addr`` (read-only path) where
    ``ok`` is nonzero, zeros (no load) where it is zero."""
    regs = ", ".join(f"${i}" for i in range(n))
    zero = " ".join(f"mov.b32 ${i}, 0;" for i in range(n))
    vec = f".v{n}" if n > 1 else ""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * n) if n > 1 else T.i32(),
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(ok).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .pred p; setp.ne.s32 p, ${n + 1}, 0; {zero} "
        f"@p ld.global.nc{vec}.u32 {{{regs}}}, [${n}]; }}".replace("{$0}", "$0"),
        ",".join(["=r"] * n) + ",l,r",
    )  # fmt: skip
    return _fields(res, Int32, n, loc, ip) if n > 1 else [Int32(res)]


@dsl_user_op
def store_word(addr: Int64, w: Int32, *, loc=None, ip=None) -> None:
    """One 32-bit store to global ``addr``."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(w).ir_value(loc=loc, ip=ip)],
         "st.global.b32 [$0], $1;", "l,r", side_effects=True)  # fmt: skip


@dsl_user_op
def store_half(addr: Int64, w: Int32, *, loc=None, ip=None) -> None:
    """The low 16 bits of ``w`` to global ``addr``."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(w).ir_value(loc=loc, ip=ip)],
         "{ .reg .b16 h; cvt.u16.u32 h, $1; st.global.b16 [$0], h; }", "l,r",
         side_effects=True)  # fmt: skip


@dsl_user_op
def store_words4(addr: Int64, words: list, *, loc=None, ip=None) -> None:
    """Four 32-bit ``words`` to global ``addr`` (16-byte aligned)."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip)
                                                     for w in words]  # fmt: skip
    _asm(None, args, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
         side_effects=True)  # fmt: skip


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """E4M3 codes (round to nearest even, saturating finite, NaN kept) of four floats as one
    word, ``a`` in the lowest byte."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Int32(_asm(
        T.i32(), args,
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f",
    ))  # fmt: skip


@dsl_user_op
def release_add(addr: Int64, *, loc=None, ip=None) -> None:
    """This thread's earlier global writes visible GPU-wide and to the async proxy, then
    ``+1`` at global ``addr`` (release, GPU scope)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)],
         "{ fence.proxy.async.global; red.release.gpu.global.add.s32 [$0], 1; }", "l",
         side_effects=True)  # fmt: skip


@dsl_user_op
def writes_visible(*, loc=None, ip=None) -> None:
    """``membar.gl`` and an async-proxy fence: this thread's global writes ordered before
    what it (or a warp it synchronises with) releases next."""
    _asm(None, [], "{ fence.acq_rel.gpu; fence.proxy.async.global; }", "", side_effects=True)


@dsl_user_op
def relaxed_load(addr: Int64, *, loc=None, ip=None) -> Int32:
    """``ld.relaxed.gpu`` of the int32 at global ``addr`` (no L1 invalidation, unlike
    ``ld.acquire``: follow it with :func:`acquire_fence`)."""
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
                      "ld.relaxed.gpu.global.s32 $0, [$1];", "=r,l", side_effects=True))


@dsl_user_op
def acquire_fence(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.gpu``: the relaxed loads before it acquire what they read."""
    _asm(None, [], "fence.acq_rel.gpu;", "", side_effects=True)


@dsl_user_op
def async_proxy_acquire(*, loc=None, ip=None) -> None:
    """Order what this thread acquired before its next async-proxy (TMA) reads."""
    _asm(None, [], "fence.proxy.async.global;", "", side_effects=True)


@dsl_user_op
def prefetch_l2(addr: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """Bring ``nbytes`` (a multiple of 16) at global ``addr`` (16-byte aligned) into L2."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)],
         f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};", "l", side_effects=True)


@dsl_user_op
def bulk_copy(dst: Int32, src: Int64, nbytes: int, mbar: Int32, *, loc=None, ip=None) -> None:
    """``nbytes`` (a multiple of 16) at global ``src`` to shared ``dst`` (both 16-byte
    aligned) by the bulk-copy engine, completing its bytes on the mbarrier at ``mbar``."""
    args = [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip),
            Int32(mbar).ir_value(loc=loc, ip=ip)]  # fmt: skip
    _asm(None, args, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
         f"[$0], [$1], {nbytes}, [$2];", "r,l,r", side_effects=True)  # fmt: skip


@dsl_user_op
def mbar_init(mbar: Int32, *, loc=None, ip=None) -> None:
    """Initialise the mbarrier at shared ``mbar`` for one arrival, visible to the async
    proxy."""
    _asm(None, [Int32(mbar).ir_value(loc=loc, ip=ip)],
         "{ mbarrier.init.shared::cta.b64 [$0], 1; fence.mbarrier_init.release.cluster; "
         "fence.proxy.async.shared::cta; }", "r", side_effects=True)  # fmt: skip


@dsl_user_op
def mbar_arrive(mbar: Int32, tx_bytes: Int32, *, loc=None, ip=None) -> None:
    """Arrive on the mbarrier at ``mbar``, expecting ``tx_bytes`` more bytes (0: none)."""
    _asm(None, [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(tx_bytes).ir_value(loc=loc, ip=ip)],
         "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r",
         side_effects=True)  # fmt: skip


@dsl_user_op
def mbar_try_wait(mbar: Int32, parity: Int32, *, loc=None, ip=None) -> Int32:
    """1 once the mbarrier at ``mbar`` completed the phase of ``parity``, else 0."""
    return Int32(_asm(
        T.i32(), [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
        "selp.b32 $0, 1, 0, p; }", "=r,r,r", side_effects=True,
    ))  # fmt: skip


@dsl_user_op
def smem_reads_done(*, loc=None, ip=None) -> None:
    """Order this thread's shared-memory reads before later async-proxy writes there."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", side_effects=True)


@dsl_user_op
def global_time(*, loc=None, ip=None) -> Int64:
    """``%globaltimer`` (ns)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", side_effects=True))


@dsl_user_op
def trace_add(addr: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """``red.add`` of ``value`` to the int32 at global ``addr`` (the trace's sums)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "red.relaxed.gpu.global.add.s32 [$0], $1;", "l,r", side_effects=True)  # fmt: skip


@dsl_user_op
def trace_extreme(addr: Int64, value: Int64, op: str, *, loc=None, ip=None) -> None:
    """``red.min``/``red.max`` (``op``) of the u64 ``value`` at global ``addr``."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int64(value).ir_value(loc=loc, ip=ip)],
         f"red.relaxed.gpu.global.{op}.u64 [$0], $1;", "l,l", side_effects=True)  # fmt: skip


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    _asm(None, [], f"nanosleep.u32 {ns};", "", side_effects=True)


@dsl_user_op
def bf16x2_to_f32(w: Int32, *, loc=None, ip=None) -> list[Float32]:
    """The two BF16 halves of ``w`` (low first) as floats (exact)."""
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 2), [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 a, b; shl.b32 a, $2, 16; and.b32 b, $2, 0xFFFF0000; "
        "mov.b32 $0, a; mov.b32 $1, b; }",
        "=f,=f,r",
    )  # fmt: skip
    return _fields(res, Float32, 2, loc, ip)


@dsl_user_op
def f16x2_to_f32(w: Int32, *, loc=None, ip=None) -> list[Float32]:
    """The two FP16 halves of ``w`` (low first) as floats (exact)."""
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 2), [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
        "=f,=f,r",
    )  # fmt: skip
    return _fields(res, Float32, 2, loc, ip)


def v_t_key(position: int) -> int:
    """Token of column ``position`` of a 16-token group (``operands.v_t_key``, Python)."""
    i = position & 15
    return (position - i) + ((i >> 2) << 1) + (((i >> 1) & 1) << 3) + (i & 1)


def v_t_position(t: int) -> int:
    """Column of token ``t`` of a 16-token group (``operands.v_t_position``, Python)."""
    return (((t >> 1) & 3) << 2) + ((t >> 3) << 1) + (t & 1)


def _tokens_at(q: int) -> list[int]:
    """Tokens at positions ``4q .. 4q + 3`` of a 16-token group (``v_t_key``)."""
    return [v_t_key(4 * q + i) for i in range(4)]


@cute.jit
def column_key(position: Int32) -> Int32:
    """Token of column ``position`` of a 32-token block (``operands.v_t_key``)."""
    i = position & 15
    return (position - i) + ((i >> 2) << 1) + (((i >> 1) & 1) << 3) + (i & 1)


class KVQuantizer:
    """The producer warps' K/V quantization and the TMA warp's wait (see the module
    docstring). ``d`` 64 or 128 (each lane ``d/32`` columns of a token: 4 or 2 bytes);
    ``fp16``: the inputs are FP16 (else BF16)."""

    def __init__(
        self,
        head_dim: int,
        heads_kv: int,
        group_heads: int,
        fp16: bool,
        k_chunk: int = K_CHUNK,
        prefetch: bool = PREFETCH,
        stage: bool = STAGE,
        trace: bool = False,
    ) -> None:
        if head_dim not in (64, 128):
            raise ValueError(f"quantize_kv needs head_dim 64 or 128, got {head_dim}")
        if heads_kv % group_heads:
            raise ValueError(f"group_heads {group_heads} must divide heads_kv {heads_kv}")
        self.d = head_dim
        self.heads_kv = heads_kv
        self.group_heads = group_heads
        self.fp16 = fp16
        self.words = head_dim // 64  # 32-bit words (two values each) per lane and token
        if BLOCK % k_chunk:
            raise ValueError(f"k_chunk {k_chunk} must divide {BLOCK}")
        self.k_chunk, self.prefetch_rows, self.stage = k_chunk, prefetch, stage
        # trace (a diagnostic): TRACE_WORDS int32 after the flags take the sums of
        # TRACE_FIELDS (globaltimer ns)
        self.trace = trace
        # stage: each warp's two buffers of a block's rows (BF16/FP16) in shared memory
        self.buffer_bytes = BLOCK * 2 * head_dim

    def shared_words(self) -> int:
        """32-bit words of shared memory the three warps' buffers take (``stage``)."""
        return 3 * 2 * self.buffer_bytes // 4 if self.stage else 4

    # ------------------------------------------------------------ producer warps
    @cute.jit
    def run(self, kv, warp: Int32, n_warps: Int32, buffers: Int32, mbars: Int32):
        """Take tasks until none is left (``warp``: this warp among the ``n_warps`` of the
        grid that run this; the ticket makes the order, they only start spread). A warp
        holds its next task while it runs one: with ``stage`` its rows are on their way
        into the warp's other shared-memory buffer (``buffers``: two of ``buffer_bytes``;
        ``mbars``: their two mbarriers), else prefetched into L2 (``prefetch``)."""
        n_slots = kv.n_slots
        n_tasks = self.heads_kv * 2 * n_slots
        lane = cute.arch.lane_idx()
        task = warp
        following = self.draw(kv, n_warps, lane)
        buf = Int32(0)
        phases = Int32(0)  # bit b: the parity buffer b's mbarrier completes next
        if const_expr(self.stage):
            if lane == 0:
                mbar_init(mbars)
                mbar_init(mbars + 8)
            cute.arch.sync_warp()
            if task < n_tasks:
                self.stage_rows(kv, task, lane, n_slots, buffers, mbars)
        if const_expr(self.trace):
            if lane == 0:
                trace_extreme(kv.trace_addr + 16, global_time(), "min")
        while task < n_tasks:
            t0 = Int64(0)
            if const_expr(self.trace):
                t0 = global_time()
            if const_expr(self.stage):
                if following < n_tasks:
                    other = 1 - buf
                    into = buffers + other * self.buffer_bytes
                    self.stage_rows(kv, following, lane, n_slots, into, mbars + other * 8)
                parity = (phases >> buf) & 1
                while mbar_try_wait(mbars + buf * 8, parity) == 0:
                    pass
                phases = phases ^ (1 << buf)
                self.task(kv, task, lane, n_slots, buffers + buf * self.buffer_bytes)
                smem_reads_done()  # before this buffer takes the task after next
                cute.arch.sync_warp()
                buf = 1 - buf
            else:
                if const_expr(self.prefetch_rows):
                    if following < n_tasks:
                        self.prefetch(kv, following, lane, n_slots)
                self.task(kv, task, lane, n_slots, Int32(0))
            if const_expr(self.trace):
                if lane == 0:
                    trace_add(kv.trace_addr, Int32(global_time() - t0))
                    trace_add(kv.trace_addr + 4, Int32(1))
            task = following
            following = self.draw(kv, n_warps, lane)
        if const_expr(self.trace):
            if lane == 0:
                trace_extreme(kv.trace_addr + 24, global_time(), "max")

    @cute.jit
    def stage_rows(self, kv, task: Int32, lane: Int32, n_slots: Int32, buffer: Int32,
                   mbar: Int32):  # fmt: skip
        """Task ``task``'s rows into ``buffer`` (lane ``j``: token ``j``, one bulk copy of
        ``2·d`` bytes), completing on ``mbar`` (empty slots: an arrival alone)."""
        head, which, _slot, start, length, _col0 = self.decode(kv, task, n_slots)
        src = kv.k_in_addr if which == 0 else kv.v_in_addr
        if lane == 0:
            mbar_arrive(mbar, length * (2 * self.d))
        if lane < length:
            row = src + ((Int64(start + lane) * self.heads_kv + head) * self.d) * 2
            bulk_copy(buffer + lane * (2 * self.d), row, 2 * self.d, mbar)

    @cute.jit
    def draw(self, kv, n_warps: Int32, lane: Int32) -> Int32:
        """The next task from the ticket (the first ``n_warps`` are the warps' own)."""
        ticket = Int32(0)
        if lane == 0:
            ticket = fa_utils.atomic_add_i32(1, kv.ticket.iterator)
        return n_warps + cute.arch.shuffle_sync(ticket, 0)

    @cute.jit
    def decode(self, kv, task: Int32, n_slots: Int32):
        """Task ``task``: (group, slot in ``mTaskSlot``'s order, head in the group, K or V)
        -> (head, K (0) or V (1), slot, first token, tokens, first column)."""
        per_group = self.group_heads * 2 * n_slots
        group = task // per_group
        r = task - group * per_group
        pos = r // (2 * self.group_heads)
        sub = r - pos * (2 * self.group_heads)
        slot = kv.task_slot[pos]
        return (group * self.group_heads + sub // 2, sub % 2, slot, kv.blk_start[slot],
                kv.blk_len[slot], kv.blk_col[slot])  # fmt: skip

    @cute.jit
    def prefetch(self, kv, task: Int32, lane: Int32, n_slots: Int32):
        """Task ``task``'s rows into L2: lane ``j`` its block's token ``j`` (one bulk
        prefetch of ``2·d`` bytes; no registers held)."""
        head, which, _slot, start, length, _col0 = self.decode(kv, task, n_slots)
        src = kv.k_in_addr if which == 0 else kv.v_in_addr
        if lane < length:
            row = src + ((Int64(start + lane) * self.heads_kv + head) * self.d) * 2
            prefetch_l2(row, 2 * self.d)

    @cute.jit
    def task(self, kv, task: Int32, lane: Int32, n_slots: Int32, buffer: Int32):
        """Quantize task ``task``'s block (rows in shared ``buffer`` with ``stage``), then
        release its flag."""
        head, which, slot, start, length, col0 = self.decode(kv, task, n_slots)
        if length > 0:
            if which == 0:
                src = kv.k_in_addr
                if const_expr(self.stage):
                    src = Int64(buffer)
                self.k_block(kv, head, start, length, col0, lane, src)
            else:
                src = kv.v_in_addr
                if const_expr(self.stage):
                    src = Int64(buffer)
                self.v_block(kv, head, start, length, col0, lane, src)
            writes_visible()
            cute.arch.sync_warp()
            if lane == 0:
                release_add(kv.flags_addr + (Int64(head) * kv.n_slots64 + slot) * 4)

    def row_words(self, src: Int64, head: Int32, start: Int32, length: Int32, j: int,
                  lane: Int32, word: int | None = None) -> list:  # fmt: skip
        """This lane's ``d/32`` values of the block's token ``j`` as packed 16-bit pairs
        (``word``: only that one of them), zero past ``length``: from global memory at
        ``src`` (not loaded past ``length``; the token's offset from the block's first row
        is a constant, so a block's loads share one address register), or with ``stage``
        from the shared buffer at ``src`` (row ``j`` at ``j·2d`` bytes)."""
        first = lane * (2 * self.words) + (0 if word is None else 2 * word)
        n = self.words if word is None else 1
        if self.stage:
            mask = ((length - 1 - j) >> 31) ^ -1  # all ones while j < length, else zero
            addr = Int32(src) + j * (2 * self.d) + first * 2
            return [w & mask for w in load_shared_words(addr, n)]
        row0 = src + ((Int64(start) * self.heads_kv + head) * self.d + first) * 2
        return load_words_if(row0 + j * self.heads_kv * self.d * 2, n, Int32(j < length))

    def column(self, words: list, c: int) -> Float32:
        """Column ``c`` of this lane's packed values (exact)."""
        w = words[c // 2]
        if self.fp16:
            return f16x2_to_f32(w)[c % 2]
        return (w << 16 if c % 2 == 0 else w & -65536).bitcast(Float32)

    def amax(self, words: list) -> Float32:
        """NaN-ignoring maximum of |x| over this lane's packed values."""
        m = Float32(0.0)
        for c in range(2 * self.words):
            m = fa_utils.fmax(m, cute.math.absf(self.column(words, c)))
        return m

    @cute.jit
    def k_block(self, kv, head: Int32, start: Int32, length: Int32, col0: Int32, lane: Int32,
                src: Int64):  # fmt: skip
        """K: one exponent for the block (NaN-ignoring maximum over every value), codes
        token-major; ``kv_factors`` row 0 and ``k_exp`` at the block's columns. Two passes
        over the rows (the second reads them again: registers hold ``k_chunk`` tokens at a time)."""
        amax = Float32(0.0)
        for chunk in cutlass.range(BLOCK // self.k_chunk, unroll=1):
            rows = []
            for i in cutlass.range_constexpr(self.k_chunk):
                j = chunk * self.k_chunk + i
                rows.append(self.row_words(src, head, start, length, j, lane))
            for i in cutlass.range_constexpr(self.k_chunk):
                amax = fa_utils.fmax(amax, self.amax(rows[i]))
        amax = fa_utils.warp_reduce(amax, fa_utils.fmax)
        e = e4m3_exponent(amax)
        scale = pow2(-e)
        for chunk in cutlass.range(BLOCK // self.k_chunk, unroll=1):
            rows = []
            for i in cutlass.range_constexpr(self.k_chunk):
                j = chunk * self.k_chunk + i
                rows.append(self.row_words(src, head, start, length, j, lane))
            for i in cutlass.range_constexpr(self.k_chunk):
                j = chunk * self.k_chunk + i
                at = kv.k_codes_addr + (
                    (Int64(start + j) * self.heads_kv + head) * self.d + lane * (2 * self.words)
                )
                vals = [self.column(rows[i], c) * scale for c in range(2 * self.words)]
                if j < length:
                    if const_expr(self.words == 2):
                        store_word(at, e4m3x4(*vals))
                    else:
                        zero = Float32(0.0)
                        store_half(at, e4m3x4(vals[0], vals[1], zero, zero))
        if column_key(lane) < length:
            store_half(kv.k_exp_addr + (Int64(head) * kv.t_pad64 + col0 + lane) * 2, e)
            fac = kv.factors_addr + (Int64(head) * 3 * kv.t_pad64 + col0 + lane) * 4
            store_word(fac, pow2(e).bitcast(Int32))

    @cute.jit
    def v_block(self, kv, head: Int32, start: Int32, length: Int32, col0: Int32, lane: Int32,
                src: Int64):  # fmt: skip
        """V: one exponent per token (all-zero rows: ``V_ZERO_EXPONENT``), codes into
        ``v_t`` (this lane's ``d/32`` rows, 16 columns per store, zero codes past the
        block's tokens); ``v_exp`` and ``kv_factors`` rows 1 and 2 at the block's
        columns."""
        cols = 2 * self.words
        my_e = Int32(0)  # the exponent of this lane's column (token column_key(lane))
        for half in cutlass.range_constexpr(BLOCK // GROUP16):
            if half * GROUP16 < length:
                # token half·16 + t's exponent: byte t % 4 of packed[t // 4] (registers)
                packed = [Int32(0)] * (GROUP16 // 4)
                for t in cutlass.range_constexpr(GROUP16):
                    j = half * GROUP16 + t
                    words = self.row_words(src, head, start, length, j, lane)
                    m = fa_utils.warp_reduce(self.amax(words), fa_utils.fmax)
                    e = e4m3_exponent(m)
                    packed[t // 4] = packed[t // 4] | ((e & 0xFF) << (8 * (t % 4)))
                    stored = Int32(V_ZERO_EXPONENT) if m == Float32(0.0) else e
                    my_e = stored if lane == half * GROUP16 + v_t_position(t) else my_e
                # the codes, one word of this lane's columns at a time (read again: 16
                # tokens' whole rows and their scales would not fit the registers)
                for wi in cutlass.range_constexpr(self.words):
                    words = []
                    for t in cutlass.range_constexpr(GROUP16):
                        j = half * GROUP16 + t
                        words.append(
                            self.row_words(src, head, start, length, j, lane, wi)
                        )
                    scales = []
                    for t in cutlass.range_constexpr(GROUP16):
                        e = (packed[t // 4] << (24 - 8 * (t % 4))) >> 24
                        scales.append(pow2(-e))
                    for c in cutlass.range_constexpr(2):
                        codes = []
                        for q in cutlass.range_constexpr(GROUP16 // 4):
                            codes.append(e4m3x4(*[
                                self.column(words[t], c) * scales[t] for t in _tokens_at(q)
                            ]))  # fmt: skip
                        row = Int64(head) * self.d + lane * cols + 2 * wi + c
                        at = kv.v_t_addr + row * kv.t_pad64 + col0 + half * GROUP16
                        store_words4(at, codes)
        if column_key(lane) < length:
            store_half(kv.v_exp_addr + (Int64(head) * kv.t_pad64 + col0 + lane) * 2, my_e)
            fac = kv.factors_addr + ((Int64(head) * 3 + 1) * kv.t_pad64 + col0 + lane) * 4
            store_word(fac, my_e.to(Float32).bitcast(Int32))
            store_word(fac + kv.t_pad64 * 4, pow2(-my_e).bitcast(Int32))

    # ------------------------------------------------------------ the TMA warp
    @cute.jit
    def wait_tile(self, kv, head_kv: Int32, first_slot: Int32, seqlen: Int32, n: Int32,
                  tile_n: cutlass.Constexpr):  # fmt: skip
        """Spin until the blocks of key tile ``n`` (of a document whose first block is slot
        ``first_slot`` and which has ``seqlen`` keys) are written, then order the TMA loads
        after them. The tile's flags are read together (one round trip when they are set),
        relaxed, with one acquire fence after."""
        last = (seqlen + BLOCK - 1) // BLOCK - 1
        row = kv.flags_addr + (Int64(head_kv) * kv.n_slots64 + first_slot) * 4
        t0 = Int64(0)
        if const_expr(self.trace):
            t0 = global_time()
        ready = Int32(0)
        while ready == 0:
            ready = Int32(1)
            for i in cutlass.range_constexpr(tile_n // BLOCK):
                b = cutlass.min(n * (tile_n // BLOCK) + i, last)
                ready = ready & Int32(relaxed_load(row + b * 4) >= 2)
            if ready == 0:
                nanosleep(64)
        acquire_fence()
        async_proxy_acquire()
        if const_expr(self.trace):
            if cute.arch.lane_idx() == 0:
                trace_add(kv.trace_addr + 8, Int32(global_time() - t0))
                trace_add(kv.trace_addr + 12, Int32(1))
