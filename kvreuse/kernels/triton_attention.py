"""Triton paged-attention kernels that read K/V in place through block tables (no gathered copy).

The pool of one layer is ``[num_slots, num_kv_heads, head_dim]`` for K and for V (``KVCache.layer_pools``), a
token's slot being ``block_id * block_size + offset``. Every kernel here walks a sequence's positions tile by
tile, turns each position into a slot through the sequence's row of the block table (one table entry per
position: a key tile may span several blocks, or part of one, so any block size works and tiles need not line up
with blocks), and loads the K/V rows of those slots directly. Nothing is gathered into a padded copy first, which
on a GPU is the cost the PyTorch reference pays per layer.

Decode (``paged_decode_attention``) is one query per sequence. A program per (sequence, KV head) alone would leave
most of the GPU idle for small batches while each program walked thousands of keys, so the keys are split
(flash-decoding, "split-K"): the grid is (sequence, KV head, split) and each split walks a contiguous run of the
row's blocks. The runs are computed *in the kernel* from the row's runtime context length (and window), so one
launch configuration serves every mix of lengths: a captured CUDA graph replays it with new lengths. Each split
keeps an online softmax (running max, running sum, unnormalised accumulator, all float32) and writes the three
to a workspace; a second small kernel merges the splits (rescaling each by exp(m_split - m_global)). With one
split the first kernel normalises and writes the output itself. The query heads of one KV head (GQA) are one
program's rows, so each K/V tile is loaded once for the whole group; the group is padded to 16 rows so QK^T and
PV are ``tl.dot`` (tensor cores on a GPU; decode is bound by reading K/V, so the padded rows' arithmetic is free,
and a [group, keys, head_dim] elementwise product would need far more registers than an MMA fragment).

Prefill (``paged_prefill_attention``) takes all of a step's sequences in one launch: fresh prompts, chunks that
continue cached context (the causal mask shifted by ``context_len - query_len``) and single-token rows. The grid
is (query tile, sequence, KV head); a tile's rows are BLOCK_Q queries times the group's heads (the group folded
into the rows, as in vLLM's unified Triton attention), so GQA again loads each K/V tile once per group. A tile
only walks the keys some of its rows can see: up to its last query's position, and from its first query's
window start on.

Quantized pools hold one-byte codes with a bfloat16 scale per (token, KV head): value = code * scale. The scale
is constant along head_dim, so it is taken out of the dot products: scores are ``(q . codes) * k_scale`` per
key column and the probabilities are multiplied by ``v_scale`` per key before ``p @ v_codes``, one multiply per key
rather than per value. The codes convert to the dot's dtype exactly (int8, and every float8 value, fit bfloat16
and float16), so the only rounding is the usual one of the dot itself (under a float16 model the PV dot is taken
in bfloat16: p * v_scale could fall among float16's subnormals). float8 bytes (stored as uint8) are decoded with
a few integer ops, exact for every non-NaN byte on every GPU architecture and in the interpreter: an e5m2 byte is
the high byte of a float16; an e4m3fn byte, sign-extended and shifted into a float16's exponent/mantissa field,
reads as its value times 2^-8 (the biases differ by 8; e4m3 subnormals become float16 subnormals), and the 2^8
goes into the per-token scale. Triton's native float8e4nv needs sm_89+, and the interpreter decodes e5m2's
infinities wrongly, hence the integer route.

Sliding windows (a query at position p sees keys p - W + 1 .. p) bound the walk: blocks wholly before a query
tile's window are never loaded, and a decode row's splits partition only its window. Learned sinks (gpt-oss) are
one extra logit per head that joins the softmax's denominator only: at the end, m = max(m_keys, sink) and
out = acc * exp(m_keys - m) / (l * exp(m_keys - m) + exp(sink - m)).

Scores are kept in base 2 (``scale * log2(e)`` folded into the scores, ``exp2``), the usual flash-attention
economy. Fully masked rows (padding rows, a decode row of context 0, a tile before a row's window) keep their
max at -inf; exponentials use a max of 0 in its place, so they give 0 rather than NaN, and a row that saw
nothing outputs zeros.

Launchers never read a device value (no ``.item()``, no host copies): grids, tile sizes and the split count come
from tensor shapes and Python ints only, so they can run inside CUDA graph capture. Under ``TRITON_INTERPRET=1``
(set before this module is imported) the kernels run with NumPy on CPU tensors, which is how the tests run them
without a GPU; the interpreter's ``tl.dot`` multiplies bfloat16's raw bits, so on CPU bfloat16 operands are
widened to float32 for the dots (exact products; only the accumulation order differs from a GPU's).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# kv_code -> what the kernels read the pool as (a constexpr, so each kind compiles its own specialised kernel).
KV_CODES = {"float": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
_LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# --- device helpers ----------------------------------------------------------------------------------------------


@triton.jit
def _codes_to_dot(x, KV_CODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Pool values as loaded (floats, int8 codes, or float8 bytes in uint8) -> DOT_DTYPE, exactly, in few integer
    ops (decode is bound by reading K/V; every op per element counts). e4m3 codes come out as value * 2^-8:
    ``_load_scales`` puts the 2^8 back into the per-token scale, one multiply per key instead of one per value."""
    if KV_CODE == 2:
        # e4m3fn: s eeee mmm, bias 7. Sign-extended to 16 bits and shifted by 7, eeee lands in the low 4 bits of
        # float16's exponent, mmm at the top of its mantissa, the sign in bit 15, and a copy of the sign in bit 14
        # (float16's top exponent bit), which is cleared. float16 then reads 2^(e - 15) (1 + m/8), or for e = 0 the
        # float16 subnormal m/8 * 2^-14: e4m3's value (2^(e - 7) (1 + m/8), or m * 2^-9) times 2^-8, exactly.
        bits = (x.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16385
        y = bits.to(tl.int16).to(tl.float16, bitcast=True).to(DOT_DTYPE)
    elif KV_CODE == 3:
        # e5m2 is float16 with the low mantissa byte cut off.
        y = (x.to(tl.uint16) << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(DOT_DTYPE)
    else:
        y = x.to(DOT_DTYPE)
    return y


@triton.jit
def _load_scales(ptr, slots, kv_head, stride_s, stride_h, valid, KV_CODE: tl.constexpr):
    """The per-token scales of a tile's keys, float32, times 2^8 for e4m3 (see ``_codes_to_dot``)."""
    scales = tl.load(ptr + slots * stride_s + kv_head * stride_h, mask=valid, other=0.0).to(tl.float32)
    if KV_CODE == 2:
        scales = scales * 256.0
    return scales


@triton.jit
def _dot(a, b):
    """a @ b accumulated in float32; float32 operands in full precision (TF32 would cost ~1e-3 relative)."""
    if a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, table_row, positions, valid, seen,
                 kv_head, stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
                 offs_d, mask_d, scale_log2, BLOCK_SIZE: tl.constexpr, KV_CODE: tl.constexpr,
                 QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr):
    """One tile of keys (``positions``, found through the block table) folded into the online softmax of the rows
    of ``q``: (m, l, acc) updated. ``valid``: the tile's positions that exist; ``seen``: which of them each row may
    attend to (broadcasting to [rows, keys]). Both kernels' inner step."""
    blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    # K as [head_dim, keys] straight from the pool (no transpose), V as [keys, head_dim].
    k = tl.load(k_ptr + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                mask=valid[None, :] & mask_d[:, None], other=0)
    scores = _dot(q, _codes_to_dot(k, KV_CODE, QK_DTYPE)) * scale_log2
    if KV_CODE != 0:
        scores = scores * _load_scales(k_scales_ptr, slots, kv_head, stride_kss, stride_ksh, valid, KV_CODE)[None, :]
    scores = tl.where(seen, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                mask=valid[:, None] & mask_d[None, :], other=0)
    if KV_CODE != 0:
        p = p * _load_scales(v_scales_ptr, slots, kv_head, stride_vss, stride_vsh, valid, KV_CODE)[None, :]
    acc = acc * alpha[:, None] + _dot(p.to(PV_DTYPE), _codes_to_dot(v, KV_CODE, PV_DTYPE))
    return m_new, l_i, acc


@triton.jit
def _normalised(acc, m_i, l_i, sinks_ptr, heads, mask, HAS_SINKS: tl.constexpr):
    """The rows' outputs from their online softmax state: acc / l, with each head's sink (a logit that joins the
    denominator only) where the layer has sinks. A row that saw nothing (context 0) gets 0, never NaN."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        denom = l_i * keep + tl.exp2(sink - top)
        acc = acc * keep[:, None]
    else:
        denom = l_i
    denom = tl.where(denom == 0.0, 1.0, denom)
    return acc / denom[:, None]


# --- store ---------------------------------------------------------------------------------------------------------


@triton.jit
def _store_rows_kernel(pool_ptr, rows_ptr, slots_ptr, stride_pool, stride_rows, width, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # a padding row of a CUDA graph's batch: store nothing
        return
    mask = offs < width
    values = tl.load(rows_ptr + row.to(tl.int64) * stride_rows + offs, mask=mask)
    tl.store(pool_ptr + slot * stride_pool + offs, values, mask=mask)


def _as_words(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` [rows, ...] (trailing dims contiguous) as [rows, width] of the widest integer word that divides a
    row's bytes: the copy is dtype-agnostic (bfloat16, int8, float8 bytes alike) and moves 4 bytes per element
    where it can."""
    flat = tensor.reshape(rows, -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    row_bytes = flat.shape[1] * flat.element_size()
    for word in (torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0 and (flat.storage_offset() * flat.element_size()) % word.itemsize == 0 \
                and (flat.stride(0) * flat.element_size()) % word.itemsize == 0:
            return flat.view(word)
    return flat.view(torch.uint8)


def store_kv_rows(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``pool[slots[t]] = rows[t]`` for every t with ``slots[t] >= 0``; rows with a negative slot are skipped.

    pool [num_slots, ...] (trailing dims contiguous), rows [T, ...] of the same trailing shape and dtype, slots [T]
    int32/int64. Any dtype: rows are copied as machine words.
    """
    if rows.dtype != pool.dtype:
        raise ValueError(f"rows are {rows.dtype} but the pool holds {pool.dtype}")
    if tuple(rows.shape[1:]) != tuple(pool.shape[1:]):
        raise ValueError(f"rows {tuple(rows.shape)} do not match the pool's rows {tuple(pool.shape[1:])}")
    num_rows = rows.shape[0]
    if slots.shape != (num_rows,):
        raise ValueError(f"slots must be [{num_rows}], got {tuple(slots.shape)}")
    if num_rows == 0:
        return
    pool_words = _as_words(pool, pool.shape[0])
    if pool_words.data_ptr() != pool.data_ptr():
        raise ValueError("the pool's trailing dims must be contiguous (it is written in place)")
    row_words = _as_words(rows, num_rows)
    if row_words.dtype != pool_words.dtype:  # a row view's offset did not allow the pool's word: copy it aligned
        row_words = rows.contiguous().reshape(num_rows, -1).view(pool_words.dtype)
    width = pool_words.shape[1]
    block = min(1024, triton.next_power_of_2(width))
    _store_rows_kernel[(num_rows, triton.cdiv(width, block))](
        pool_words, row_words, slots, pool_words.stride(0), row_words.stride(0), width, BLOCK_W=block)


# --- decode ----------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, lens_ptr, sinks_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_tb, stride_ob, stride_oh,
    scale_log2, window,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_CODE: tl.constexpr,
    QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(QK_DTYPE)

    # This split's positions, from the row's runtime length: the blocks the row's keys (its window's, if any)
    # lie in are cut into NUM_SPLITS contiguous runs. A context of 0 (graph padding) or a split past the end
    # gets an empty run.
    context_len = tl.load(lens_ptr + seq)
    first = context_len * 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)  # blocks wholly before the window are never touched
    first_block = first // BLOCK_SIZE
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE) - first_block
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    split_block = first_block + split * per_split
    start = tl.maximum(split_block * BLOCK_SIZE, first)
    end = tl.minimum((split_block + per_split) * BLOCK_SIZE, context_len)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    for tile in range(start, end, BLOCK_N):
        positions = tile + offs_n
        valid = positions < end
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, table_row, positions, valid, valid[None, :],
            kv_head, stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
            offs_d, mask_d, scale_log2, BLOCK_SIZE, KV_CODE, QK_DTYPE, PV_DTYPE)

    if NUM_SPLITS == 1:
        # The whole row was this program's: normalise here, no merge kernel.
        out = _normalised(acc, m_i, l_i, sinks_ptr, heads, mask_g, HAS_SINKS)
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        # Workspace [B, H, S] for m and l, [B, H, S, HEAD_DIM] for acc; every split writes (an empty one -inf, 0, 0).
        row = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=mask_g)
        tl.store(part_l_ptr + row, l_i, mask=mask_g)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    rows = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    m_s = tl.load(part_m_ptr + rows, mask=mask_s, other=float("-inf"))
    l_s = tl.load(part_l_ptr + rows, mask=mask_s, other=0.0)
    acc_s = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    top = tl.max(m_s, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key and no sink: all weights 0
    weights = tl.exp2(m_s - top)  # an empty split (m = -inf) weighs 0
    denom = tl.sum(weights * l_s, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - top)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = tl.sum(acc_s * weights[:, None], 0) / denom
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (a host-side property, no synchronisation); 8 for the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       device: torch.device) -> int:
    """Splits per row from shapes only: enough programs to fill the GPU about twice over, but no split shorter
    than ~256 keys of the longest context the table can hold (the merge costs a workspace round trip); a power of
    two, at most 64, so few kernel variants compile."""
    wanted = triton.cdiv(2 * _multiprocessors(device), max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max_blocks * block_size, 256)
    splits = max(1, min(wanted, by_length, 64))
    return 1 << (splits.bit_length() - 1)


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, kv_code: str, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None, head_dim: int) -> int:
    if kv_code not in KV_CODES:
        raise ValueError(f"kv_code must be one of {sorted(KV_CODES)}, got {kv_code!r}")
    code = KV_CODES[kv_code]
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 3 or pool.shape[2] != head_dim or pool.stride(2) != 1:
            raise ValueError(f"{name} must be [num_slots, num_kv_heads, {head_dim}] with contiguous rows, "
                             f"got {tuple(pool.shape)} strides {pool.stride()}")
        expected = {0: (torch.float32, torch.bfloat16, torch.float16), 1: (torch.int8,),
                    2: (torch.uint8,), 3: (torch.uint8,)}[code]
        if pool.dtype not in expected:
            raise ValueError(f"kv_code {kv_code!r} reads {name} as {expected}, got {pool.dtype}")
    if code != 0 and (k_scales is None or v_scales is None):
        raise ValueError(f"kv_code {kv_code!r} needs k_scales and v_scales")
    return code


def _dot_dtypes(q: torch.Tensor, k_pool: torch.Tensor, code: int) -> tuple[object, object]:
    """The dtypes the kernels' QK^T and PV dots take (float32 ones run in full IEEE precision).

    The query's dtype where the pool's values are exact in it (the same float dtype, or one-byte codes: int8 and
    every float8 value fit bfloat16 and float16); float32 where they differ (a bfloat16 pool under a float32 or
    float16 model). PV under a float16 model with a quantized pool is bfloat16: its operand is p * v_scale per key,
    which for small probabilities and scales would fall among float16's subnormals. The interpreter's ``tl.dot``
    multiplies bfloat16's raw bits, so off CUDA bfloat16 dots are taken in float32 (exact products there)."""
    qk = q.dtype if code != 0 or k_pool.dtype == q.dtype else torch.float32
    pv = torch.bfloat16 if code != 0 and qk == torch.float16 else qk
    if q.device.type != "cuda":
        qk, pv = (torch.float32 if dtype == torch.bfloat16 else dtype for dtype in (qk, pv))
    return _TL_DTYPES[qk], _TL_DTYPES[pv]


def _decode_tiles(block_d: int, quantized: bool) -> tuple[int, int, int]:
    """(keys per tile, warps, pipeline stages) of the decode kernel. Measured on an H200 (32 rows x 4096 keys, 8 KV
    heads of 128, 2 splits): a bfloat16 pool reads at 3.7 TB/s with 64-key tiles; one-byte codes do best with
    32-key tiles (~15% faster there than 64: the decode of the codes, not the bytes, bounds them)."""
    return (32 if quantized or block_d > 128 else 64), 4, 3


def _prefill_tiles(max_query_len: int, group: int, block_d: int) -> tuple[int, int, int]:
    """(rows per tile, keys per tile, warps) of the prefill kernel. Rows are queries x the group's heads: 16 when
    the step's sequences are short (decode-like rows waste less), 64 otherwise; never fewer than the group."""
    block_m = 16 if max_query_len * group <= 16 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, (64 if block_d <= 128 else 32), (4 if block_m <= 64 else 8)


def _dummy(tensor: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return tensor if tensor is not None else fallback


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    kv_code: str = "float",
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context -> [B, num_heads, head_dim] in q's dtype.

    q [B, num_heads, head_dim], the query of position ``context_lens[b] - 1`` (its K/V already in the pool);
    block_tables [B, max_blocks] int32 (padded with any valid block id); context_lens [B] int32 (0: a padding row,
    whose output is zeros). ``num_splits``: key splits per row (default from shapes, ``default_num_splits``).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    code = _check_pools(k_pool, v_pool, kv_code, k_scales, v_scales, head_dim)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if out.stride(2) != 1:
        raise ValueError("out's last dim must be contiguous")
    max_blocks = block_tables.shape[1]
    splits = num_splits if num_splits is not None else default_num_splits(batch, num_kv_heads, max_blocks,
                                                                          block_size, q.device)
    if splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {splits}")
    qk_dtype, pv_dtype = _dot_dtypes(q, k_pool, code)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages = _decode_tiles(block_d, code != 0)
    if splits > 1:
        part_m = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused (the kernel writes the output itself)
    k_scales = _dummy(k_scales, k_pool)
    v_scales = _dummy(v_scales, v_pool)
    scale_strides = ((k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1))
                     if code != 0 else (0, 0, 0, 0))
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_pool, v_pool, k_scales, v_scales, block_tables, context_lens, _dummy(sinks, q),
        out, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        *scale_strides, block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale) * _LOG2E, int(sliding_window or 0),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=splits, KV_CODE=code, QK_DTYPE=qk_dtype,
        PV_DTYPE=pv_dtype, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, _dummy(sinks, q), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits),
            HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


# --- prefill (and any mixed step) ------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, starts_ptr, lens_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_tb, stride_ot, stride_oh,
    scale_log2, window,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_CODE: tl.constexpr,
    QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(starts_ptr + seq)
    query_len = tl.load(starts_ptr + seq + 1) - query_start
    first_query = q_tile * BLOCK_Q
    if first_query >= query_len:  # the grid is sized for the longest sequence of the step
        return
    context_len = tl.load(lens_ptr + seq)
    offset = context_len - query_len  # position of the sequence's first query

    # Row r of the tile: query first_query + r // GROUP, head kv_head * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    queries = first_query + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (queries < query_len)
    mask_d = offs_d < HEAD_DIM
    q_positions = offset + queries
    tokens = (query_start + queries).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & mask_d[None, :], other=0.0).to(QK_DTYPE)

    # Keys the tile's rows can see: up to its last query's position, from its first query's window start on.
    last_query = tl.minimum(query_len, first_query + BLOCK_Q) - 1
    end = offset + last_query + 1
    start = end * 0
    if HAS_WINDOW:
        start = tl.maximum(offset + first_query - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    for tile in range(start, end, BLOCK_N):
        positions = tile + offs_n
        valid = positions < end
        seen = valid[None, :] & (positions[None, :] <= q_positions[:, None])
        if HAS_WINDOW:
            seen = seen & (positions[None, :] > q_positions[:, None] - window)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, table_row, positions, valid, seen,
            kv_head, stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
            offs_d, mask_d, scale_log2, BLOCK_SIZE, KV_CODE, QK_DTYPE, PV_DTYPE)

    out = _normalised(acc, m_i, l_i, sinks_ptr, heads, row_valid, HAS_SINKS)
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    max_query_len: int,
    block_size: int,
    scale: float,
    kv_code: str = "float",
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's queries of N sequences, each over its paged context with an offset causal mask -> [T, H, D].

    q [T, num_heads, head_dim]: sequence i owns rows ``query_start_loc[i] .. query_start_loc[i + 1]`` (int32
    [N + 1]); ``context_lens[i]`` (int32 [N]) counts its tokens after this step, the new ones (already in the pool)
    included, so its query j sits at position ``context_lens[i] - query_len_i + j``. ``max_query_len``: the
    longest query_len (a Python int: it sizes the grid). Fresh prompts, chunks over cached context and single-token
    rows mix freely in one launch.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    code = _check_pools(k_pool, v_pool, kv_code, k_scales, v_scales, head_dim)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len < 1:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if out.stride(2) != 1:
        raise ValueError("out's last dim must be contiguous")
    qk_dtype, pv_dtype = _dot_dtypes(q, k_pool, code)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = _prefill_tiles(max_query_len, group, block_d)
    block_q = block_m // group  # whole queries per tile (a group of 3 leaves rows unused)
    k_scales = _dummy(k_scales, k_pool)
    v_scales = _dummy(v_scales, v_pool)
    scale_strides = ((k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1))
                     if code != 0 else (0, 0, 0, 0))
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_pool, v_pool, k_scales, v_scales, block_tables, query_start_loc, context_lens, _dummy(sinks, q), out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        *scale_strides, block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale) * _LOG2E, int(sliding_window or 0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, KV_CODE=code, QK_DTYPE=qk_dtype, PV_DTYPE=pv_dtype,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, num_warps=num_warps,
    )
    return out


# --- float8 decoding, as the kernels do it (tests) -------------------------------------------------------------------


@triton.jit
def _decode_codes_kernel(codes_ptr, out_ptr, n, KV_CODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    values = _codes_to_dot(tl.load(codes_ptr + offs, mask=mask, other=0), KV_CODE, tl.float32)
    if KV_CODE == 2:
        values = values * 256.0  # what _load_scales puts into the scales
    tl.store(out_ptr + offs, values, mask=mask)


def codes_to_float(codes: torch.Tensor, kv_code: str) -> torch.Tensor:
    """A 1-D tensor of pool codes -> float32 values, decoded exactly as the attention kernels decode them."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    n = codes.numel()
    if n:
        _decode_codes_kernel[(triton.cdiv(n, 256),)](codes.contiguous(), out, n, KV_CODE=KV_CODES[kv_code], BLOCK=256)
    return out
