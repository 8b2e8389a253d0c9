"""Linear layers over float weights, each choosing its kernel per row count from the plan book (layers/plan_book.py), or
holding its weight quantized (layers/quantized_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.kernels import quant_ops
from kvreuse.kernels.quant import QuantizedTensor
from kvreuse.layers import quantized_linear
from kvreuse.layers.plan_book import LinearKernel, PlanBook, invariant_plan
from kvreuse.layers.quantized_linear import QuantizedLinearKernel


def _empty_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` lists the fused parts (e.g. q, k, v) in row order.

    The weight is a float parameter, or held quantized (``set_quantized``: GGUF blocks repacked, or int8
    quantized at load), in which case ``weight`` is None and ``quantized`` holds the parts."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        output_size = sum(output_sizes)
        self.dtype = dtype
        self.weight = _empty_parameter((output_size, input_size), dtype, device)
        self.bias = _empty_parameter((output_size,), dtype, device) if bias else None
        # The weight's parts (stacked by output rows) where it is held quantized (set_quantized).
        self.quantized: list[QuantizedTensor | torch.Tensor] | None = None

        # The CPU kernel chosen for this weight's shape (see choose_cpu_kernel); None: plain F.linear.
        self.kernel: LinearKernel | QuantizedLinearKernel | None = None
        # Where LoRA adapters attach (set by the model): the decoder layer and PEFT's module name per part.
        self.lora_layer: int | None = None
        self.lora_modules: tuple[str, ...] = ()
        # Kept as a plain float weight: not quantized by quantize_int8, no second layout (a MoE router: rounding
        # would move tokens between experts, and the native MoE layer reads it as it is).
        self.keep_float = False

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        if lora is not None:
            lora.apply(self, x, out)
        return out

    def choose_cpu_kernel(self, book: PlanBook, max_layouts: int = 2, batch_invariant: bool = False) -> bool:
        """Run this layer on the kernel(s) measured fastest for its shape, per row count (plan_book.py);
        ``batch_invariant``: on the one kernel whose rows do not depend on the row count, at every count.

        The plain weight is released unless the plan still uses it, so memory grows only where a
        second layout buys speed. Returns False where plain F.linear is the verdict (or not on CPU).
        """
        if self.quantized is not None:
            if batch_invariant:  # the parts qpacked runs packed for it (held once: self.quantized is them)
                self.kernel.parts = self.quantized = quantized_linear.invariant_parts(self.kernel.parts)
            # Each quantized part on the kernel measured fastest for its format and shape, per row count.
            self.kernel.plans = [quantized_linear.invariant_plan(part, self.dtype) if batch_invariant else
                                 quantized_linear.plan_for(book, part, self.dtype) if isinstance(part, QuantizedTensor)
                                 else quantized_linear.DEFAULT_PLAN for part in self.kernel.parts]
            return True
        # A float-kept layer (an MoE router, a shared expert's gate) stays on F.linear, except in batch-invariant
        # mode, where F.linear's sums may follow the step's row count.
        if self.weight is None or self.weight.device.type != "cpu" or (self.keep_float and not batch_invariant):
            return False
        plan = (invariant_plan(self.weight.dtype) if batch_invariant
                else book.plan_for(self.weight.dtype, tuple(self.weight.shape), max_layouts))
        if plan.is_plain:
            return False
        self.kernel = LinearKernel(self.weight.detach(), self._bias_tensor(), plan)
        if "plain" not in plan.layouts:  # the row-dot kernels read the plain layout too
            self.weight = None  # type: ignore[assignment]
        return True

    def _bias_tensor(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach()

    def set_quantized(self, parts: list[QuantizedTensor | torch.Tensor]) -> None:
        """Hold the weight as ``parts`` stacked by output rows (each a QuantizedTensor, or a float tensor
        for a part a file keeps unquantized), run by the quantized kernels (quantized_linear.DEFAULT_PLAN until
        ``choose_cpu_kernel`` measures). Where those cannot run (no compiler built them, or not on CPU)
        the parts are dequantized into the float weight instead: the same values, float memory."""
        rows = sum(part.shape[0] for part in parts)
        if rows != sum(self.output_sizes) or any(part.shape[1] != self.input_size for part in parts):
            shapes = ", ".join(f"{part.shape[0]}x{part.shape[1]}" for part in parts)
            raise ValueError(f"quantized parts {shapes} do not make a {sum(self.output_sizes)}x{self.input_size} weight")
        device = self.bias.device if self.bias is not None else (
            self.weight.device if self.weight is not None else torch.device("cpu"))
        if device.type == "cpu" and quant_ops.available():
            self.weight = None  # type: ignore[assignment]
            self.kernel = QuantizedLinearKernel(parts, self._bias_tensor())
            # The parts as views of the kernel's weights: a fused projection whose parts share a format is
            # stacked into one copy (merge_parts), and keeping the file's parts as well held every such
            # weight twice (qwen2.5-0.5b Q4_K_M: 150 MB more than the log's "weights held").
            self.quantized = self.kernel.views_of(parts)
            return
        dense = torch.cat([quantized_linear.dequantize_any(part) for part in parts]).to(self.dtype)
        self.weight = nn.Parameter(dense.to(device), requires_grad=False)
        self.quantized = None
        self.kernel = None

    @property
    def weight_bytes(self) -> int:
        """Memory of the weight as held (quantized, or float in any kernel layout)."""
        if self.kernel is not None:
            return self.kernel.layout_bytes
        return self.weight.numel() * self.weight.element_size()

    def part_rows(self, part: int) -> slice:
        """Rows of the fused weight that belong to part ``part`` (e.g. 1 = k of a qkv projection)."""
        start = sum(self.output_sizes[:part])
        return slice(start, start + self.output_sizes[part])
