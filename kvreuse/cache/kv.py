"""KVCache: the paged K and V tensors of every layer, addressed by slot.

The cache core (``blocks.py``, ``prefix.py``) decides which block ids a request owns without ever
touching a tensor; this module owns the tensors those ids point into. All layers live in one
allocation shaped ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`` so that a
slot index ``block_id * block_size + offset`` addresses one token in every layer, a write is one
``index_copy_`` per layer, and a block copy (token-granular reuse of a partially matched block) is a
single indexing operation over all layers at once.

With a quantized ``kv_cache_dtype`` (kvreuse.cache.kv_quant) the tensor holds one-byte codes and a second
one, ``scales`` ``[num_layers, 2, num_slots, num_kv_heads]`` bfloat16, holds their scales: `write`
quantizes, `gather` dequantizes what attention reads, and a block's bytes (tiers) are its codes, then
its scales, then its features, then its planes.

A hybrid model's short convolutions (LFM2: models/lfm2.py) keep one ``planes`` row per slot and conv layer, the
convolution's input at that token: a layer's state at any position is the rows of the K - 1 tokens before it, so
a prefix hit resumes at any token with nothing recomputed, and the planes travel with their block as K/V does
(copies, tiers). One extra row per layer, always zero, stands for positions before 0.
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch

from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.kv_quant import (
    SCALE_DTYPE,
    KVQuantScheme,
    dequantize,
    kv_bytes_per_token,
    kv_float_dtype,
    quantize,
    resolve_kv_cache_dtype,
)
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.kernels.kv_codec import cpu_kv_codec


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory costs only what is written to it, on CPU: an anonymous mapping, whose pages
    the kernel provides as zeros when first touched (POSIX guarantees the zeros), so a pool sized for
    16,384 tokens is resident as its blocks fill rather than at start-up (``torch.zeros`` writes every page
    at once). Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: a forked child's writes stay its own. The tensor keeps the mapping alive (frombuffer holds a
    # reference to the buffer it views).
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


class KVShape(Protocol):
    """What the cache needs to know of a model (``kvreuse.models.config.ModelConfig`` is one): the cache
    sits below the model package and never imports it."""

    num_kv_layers: int  # the layers that keep K/V (a hybrid's recurrent layers keep none)
    num_key_value_heads: int
    head_dim: int
    num_plane_layers: int  # a hybrid's short-convolution layers, each a plane row per token (0: none)
    plane_size: int  # the values of one plane row (a conv layer's width)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int: ...


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        feature_size: int = 0,
        kv_cache_dtype: str = "auto",
        native_codec: bool = True,
        plane_layers: int = 0,
        plane_size: int = 0,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model's: what attention computes in and what `gather` returns
        self.device = torch.device(device)
        self.kv_cache_dtype = kv_cache_dtype
        self.scheme: KVQuantScheme | None = resolve_kv_cache_dtype(kv_cache_dtype)
        # What the pool's tensor holds: floats (the model's dtype, or bfloat16), or one-byte codes.
        storage = kv_float_dtype(kv_cache_dtype, dtype) if self.scheme is None else self.scheme.storage_dtype
        # Zeros rather than empty: padded attention reads unused slots (masked out), and NaN
        # garbage times a zero weight would still be NaN. On CPU the zeros are pages not yet touched.
        self.kv = zeroed((num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim), storage, self.device)
        self.scales: torch.Tensor | None = None
        # A quantized pool on CPU writes and gathers through the C++ codec where it builds (equal value for value
        # to kv_quant's PyTorch reference, which runs elsewhere and where native_codec is False: the tests' reference).
        self.codec = (cpu_kv_codec() if native_codec and self.scheme is not None and self.device.type == "cpu"
                      else None)
        if self.scheme is not None:
            self.scales = zeroed((num_layers, 2, num_blocks * block_size, num_kv_heads), SCALE_DTYPE, self.device)
        # Per-layer (K, V) views of codes and scales, made once: write and gather run for every layer of
        # every step.
        self._codes = [(self.kv[layer, 0], self.kv[layer, 1]) for layer in range(num_layers)]
        self._scales = ([(self.scales[layer, 0], self.scales[layer, 1]) for layer in range(num_layers)]
                        if self.scales is not None else [])
        # Speculative decoding: one feature vector per slot (what an EAGLE draft reads for the position
        # before its token), so a prefix hit brings the draft's input along with the K/V. One extra row,
        # always zero, stands for "position -1" (the first token has no predecessor).
        self.feature_size = feature_size
        self.features: torch.Tensor | None = None
        if feature_size > 0:
            self.features = zeroed((num_blocks * block_size + 1, feature_size), dtype, self.device)
        # A hybrid's conv layers: a row per slot in the model's dtype (never quantized: the convolution reads the
        # bits it wrote), the last row of each layer zero.
        self.plane_layers, self.plane_size = plane_layers, plane_size
        self.planes: torch.Tensor | None = None
        if plane_layers > 0:
            self.planes = zeroed((plane_layers, num_blocks * block_size + 1, plane_size), dtype, self.device)
        # A hybrid's Gated DeltaNet layers: one state per sequence, not per token (cache/recurrent_state.py; set by
        # the engine's builder beside the pool).
        self.states: RecurrentStatePool | None = None

    @classmethod
    def for_model(
        cls, model_config: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device | str, kv_cache_dtype: str = "auto",
    ) -> KVCache:
        """A cache shaped for ``model_config``."""
        return cls(
            model_config.num_kv_layers, num_blocks, block_size, model_config.num_key_value_heads,
            model_config.head_dim, dtype, device, kv_cache_dtype=kv_cache_dtype,
            plane_layers=model_config.num_plane_layers, plane_size=model_config.plane_size,
        )

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the pool's tensor holds (the model's, bfloat16, or a quantized scheme's codes)."""
        return self.kv.dtype

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def zero_feature_slot(self) -> int:
        """The features row that is always zero (the feature "before" position 0)."""
        return self.num_slots

    @property
    def zero_plane_slot(self) -> int:
        """The planes row that is always zero (the convolution's input before position 0)."""
        return self.num_slots

    @property
    def memory_bytes(self) -> int:
        features = self.features.numel() * self.features.element_size() if self.features is not None else 0
        scales = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        planes = self.planes.numel() * self.planes.element_size() if self.planes is not None else 0
        states = self.states.memory_bytes if self.states is not None else 0
        return self.kv.numel() * self.kv.element_size() + scales + features + planes + states

    def write_features(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        """Store one feature row [num_tokens, feature_size] per slot."""
        assert self.features is not None, "this KVCache was made without feature_size"
        self.features.index_copy_(0, slot_mapping, features.to(self.dtype))

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [num_tokens, kv_heads, head_dim] of ``layer`` at ``slot_mapping`` [num_tokens]."""
        codes = self._codes[layer]
        if self.scheme is None:
            codes[0].index_copy_(0, slot_mapping, k.to(self.kv.dtype))
            codes[1].index_copy_(0, slot_mapping, v.to(self.kv.dtype))
            return
        scales = self._scales[layer]
        if self.codec is not None and self.codec.handles(k.dtype) and k.dtype == v.dtype:
            self.codec.write(codes, scales, slot_mapping, k, v, self.scheme.name)
            return
        for which, values in ((0, k), (1, v)):
            quantized, value_scales = quantize(values, self.scheme)
            codes[which].index_copy_(0, slot_mapping, quantized)
            scales[which].index_copy_(0, slot_mapping, value_scales)

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots`` [n] -> two [n, kv_heads, head_dim] in ``dtype`` (default: the
        model's), dequantized when the pool is quantized."""
        dtype = dtype or self.dtype
        codes = self._codes[layer]
        if self.scheme is None:
            return codes[0].index_select(0, slots).to(dtype), codes[1].index_select(0, slots).to(dtype)
        scales = self._scales[layer]
        if self.codec is not None and self.codec.handles(dtype):
            return self.codec.gather(codes, scales, slots, self.scheme.name, dtype)
        keys, values = (dequantize(codes[which].index_select(0, slots), scales[which].index_select(0, slots),
                                   self.scheme, dtype) for which in (0, 1))
        return keys, values

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``layer``'s K and V as stored, [num_slots, kv_heads, head_dim] each (floats in ``storage_dtype``, or
        one-byte codes), and their scales [num_slots, kv_heads] where the pool is quantized (else None): what a kernel
        that reads the pool in place (attention/cpu_paged.py) is handed."""
        codes = self._codes[layer]
        if self.scheme is None:
            return codes[0], codes[1], None, None
        scales = self._scales[layer]
        return codes[0], codes[1], scales[0], scales[1]

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy the first ``num_tokens`` slots of each source block into its destination, all layers."""
        if not copies:
            return
        src_slots: list[int] = []
        dst_slots: list[int] = []
        for copy in copies:
            for block_id, role in ((copy.src_block, "src_block"), (copy.dst_block, "dst_block")):
                if not 0 <= block_id < self.num_blocks:
                    raise ValueError(f"{role} {block_id} is outside 0..{self.num_blocks - 1}")
            if not 0 <= copy.num_tokens <= self.block_size:
                raise ValueError(f"num_tokens {copy.num_tokens} must be between 0 and block_size {self.block_size}")
            if copy.src_block == copy.dst_block:
                continue
            src_start = copy.src_block * self.block_size
            dst_start = copy.dst_block * self.block_size
            src_slots.extend(range(src_start, src_start + copy.num_tokens))
            dst_slots.extend(range(dst_start, dst_start + copy.num_tokens))
        if not src_slots:
            return
        src = torch.tensor(src_slots, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.int64, device=self.device)
        # Gather first (a copy), then scatter: correct even if a destination is another copy's source.
        self.kv[:, :, dst] = self.kv[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]
        if self.features is not None:
            self.features[dst] = self.features[src]
        if self.planes is not None:
            self.planes[:, dst] = self.planes[:, src]

    @property
    def tokens_per_gib(self) -> int:
        """Tokens one GiB of this pool holds (its K/V in ``kv_cache_dtype``, scales, features and planes included)."""
        return 2**30 * self.block_size // self.block_bytes

    # --- one block as bytes (KV tiers) ------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block's K/V: [layers, 2, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        features = self.block_size * self.feature_size * element
        planes = self.block_size * self.plane_layers * self.plane_size * element
        return self.block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                                    self.storage_dtype, self.scheme) + features + planes

    def _block_parts(self, block_id: int) -> list[torch.Tensor]:
        """Views of one block's K/V codes, their scales (quantized pools), its features and its planes, in record
        order."""
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        parts = [self.kv[:, :, rows]]
        if self.scales is not None:
            parts.append(self.scales[:, :, rows])
        if self.features is not None:
            parts.append(self.features[rows])
        if self.planes is not None:
            parts.append(self.planes[:, rows])
        return parts

    def read_block(self, block_id: int) -> bytes:
        """One block's K/V of every layer (then its scales, its features and its planes, if any) as bytes."""
        return b"".join(part.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
                        for part in self._block_parts(block_id))

    def write_block(self, block_id: int, payload: bytes | memoryview) -> None:
        """Fill one block from ``read_block``'s bytes."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block payload has {self.block_bytes} bytes, got {len(payload)}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for part in self._block_parts(block_id):
            size = part.numel() * part.element_size()
            part.copy_(raw[offset:offset + size].view(part.dtype).view(part.shape).to(self.device))
            offset += size

    @staticmethod
    def bytes_per_token(model_config: KVShape, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one token's K and V across the model's layers, in ``kv_cache_dtype``, and of its planes (a
        hybrid's conv layers, in ``dtype``)."""
        planes = model_config.num_plane_layers * model_config.plane_size * torch.empty((), dtype=dtype).element_size()
        return kv_bytes_per_token(model_config.num_kv_layers, model_config.num_key_value_heads,
                                  model_config.head_dim, kv_float_dtype(kv_cache_dtype, dtype),
                                  resolve_kv_cache_dtype(kv_cache_dtype)) + planes

    @staticmethod
    def num_blocks_for_memory(
        memory_bytes: int, block_size: int, model_config: KVShape, dtype: torch.dtype,
        extra_bytes_per_token: int = 0, kv_cache_dtype: str = "auto",
    ) -> int:
        """How many blocks of ``block_size`` tokens fit in ``memory_bytes``; at least one or ValueError.
        ``extra_bytes_per_token``: what a token needs beyond the model's K/V (a draft's K/V and feature)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        bytes_per_block = block_size * (KVCache.bytes_per_token(model_config, dtype, kv_cache_dtype)
                                        + extra_bytes_per_token)
        num_blocks = memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {memory_bytes} bytes holds no KV block: one block of {block_size} "
                f"tokens needs {bytes_per_block} bytes for this model in {dtype} (kv_cache_dtype {kv_cache_dtype})"
            )
        return int(num_blocks)
