// Quantized KV pool on CPU: the write (quantize into slots) and the gather (dequantize from slots) of one layer's
// K and V in one call each, instead of a dozen PyTorch ops per tensor (kvreuse/cache/kv_quant.py is the
// reference this must equal, value for value: the same scale, rounded up to bfloat16, the same
// round-half-to-even codes, c10's own float8 conversions, and the same bfloat16 rounding of a product).
//
// scheme: 0 int8 (codes int8, max 127), 1 fp8_e4m3 (codes as uint8 bytes, max 448), 2 fp8_e5m2 (max 57344).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float kMaxCode[3] = {127.0f, 448.0f, 57344.0f};
constexpr double kRoundUp = 1.0 + 1.0 / 256.0;

template <typename In>
void write_rows(const In* x, int64_t rows, int64_t dim, int64_t scheme, uint8_t* codes, c10::BFloat16* scales,
                const int64_t* slots, int64_t heads) {
  const float factor = static_cast<float>(kRoundUp / kMaxCode[scheme]);
  const float max_code = kMaxCode[scheme];
  const float tiny = std::numeric_limits<float>::min();  // bfloat16's smallest normal: float's
  for (int64_t row = 0; row < rows; ++row) {  // row = token * heads + head
    const In* values = x + row * dim;
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(static_cast<float>(values[i])));
    float scale = amax * factor;
    if (scale < tiny) scale = tiny;
    const c10::BFloat16 stored(scale);
    scale = static_cast<float>(stored);
    const int64_t slot_row = slots[row / heads] * heads + row % heads;
    scales[slot_row] = stored;
    uint8_t* out = codes + slot_row * dim;
    for (int64_t i = 0; i < dim; ++i) {
      float q = static_cast<float>(values[i]) / scale;
      q = std::min(std::max(q, -max_code), max_code);
      if (scheme == 0) {
        const int8_t code = static_cast<int8_t>(std::nearbyint(q));
        std::memcpy(out + i, &code, 1);
      } else if (scheme == 1) {
        out[i] = c10::Float8_e4m3fn(q).x;
      } else {
        out[i] = c10::Float8_e5m2(q).x;
      }
    }
  }
}

template <typename Out>
void gather_rows(const uint8_t* codes, const c10::BFloat16* scales, const int64_t* slots, int64_t begin,
                 int64_t end, int64_t heads, int64_t dim, int64_t scheme, Out* out) {
  float table[256];  // what each byte means: 256 entries, so no conversion in the inner loop
  for (int code = 0; code < 256; ++code) {
    const uint8_t byte = static_cast<uint8_t>(code);
    if (scheme == 0) {
      int8_t value;
      std::memcpy(&value, &byte, 1);
      table[code] = static_cast<float>(value);
    } else if (scheme == 1) {
      table[code] = static_cast<float>(c10::Float8_e4m3fn(byte, c10::Float8_e4m3fn::from_bits()));
    } else {
      table[code] = static_cast<float>(c10::Float8_e5m2(byte, c10::Float8_e5m2::from_bits()));
    }
  }
  for (int64_t token = begin; token < end; ++token) {
    const int64_t slot = slots[token];
    for (int64_t head = 0; head < heads; ++head) {
      const uint8_t* row = codes + (slot * heads + head) * dim;
      Out* target = out + (token * heads + head) * dim;
      const float scale = static_cast<float>(scales[slot * heads + head]);
      float values[512];  // dim <= 512 (checked): the codes' values, converted in a loop that vectorizes
      if (scheme == 0) {
        const int8_t* signed_row = reinterpret_cast<const int8_t*>(row);
        for (int64_t i = 0; i < dim; ++i) values[i] = static_cast<float>(signed_row[i]);
      } else {
        for (int64_t i = 0; i < dim; ++i) values[i] = table[row[i]];
      }
      if constexpr (std::is_same_v<Out, float>) {
        for (int64_t i = 0; i < dim; ++i) target[i] = values[i] * scale;
      } else {
        // The reference multiplies in bfloat16: both factors are bfloat16 already (every int8 and float8 value
        // is one), the float product is rounded once, to nearest even. Codes are finite (quantize clamps),
        // so the rounding needs no NaN case and the loop vectorizes.
        uint16_t* bits_out = reinterpret_cast<uint16_t*>(target);
        for (int64_t i = 0; i < dim; ++i) {
          const float product = values[i] * scale;
          uint32_t bits;
          std::memcpy(&bits, &product, 4);
          bits += 0x7FFFu + ((bits >> 16) & 1u);
          bits_out[i] = static_cast<uint16_t>(bits >> 16);
        }
      }
    }
  }
}

void check_layer(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.element_size() == 1, "codes: [slots, heads, dim] bytes");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kBFloat16,
              "scales: [slots, heads] bfloat16");
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1), "scales do not match codes");
}

const int64_t* checked_slots(const at::Tensor& slots, int64_t num_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots: contiguous int64 [tokens]");
  const int64_t* data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(data[t] >= 0 && data[t] < num_slots, "slot ", data[t], " is outside the pool");
  }
  return data;
}

void kv_quant_write(at::Tensor codes_k, at::Tensor codes_v, at::Tensor scales_k, at::Tensor scales_v,
                    const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v, int64_t scheme) {
  TORCH_CHECK(scheme >= 0 && scheme <= 2, "scheme must be 0 (int8), 1 (fp8_e4m3) or 2 (fp8_e5m2)");
  check_layer(codes_k, scales_k);
  check_layer(codes_v, scales_v);
  const auto slot_index = slots.contiguous();
  const int64_t* slot_data = checked_slots(slot_index, codes_k.size(0));
  const int64_t heads = codes_k.size(1), dim = codes_k.size(2), tokens = slot_index.size(0);
  for (auto pair : {std::make_tuple(&k, &codes_k, &scales_k), std::make_tuple(&v, &codes_v, &scales_v)}) {
    const at::Tensor values = std::get<0>(pair)->contiguous();
    TORCH_CHECK(values.dim() == 3 && values.size(0) == tokens && values.size(1) == heads && values.size(2) == dim,
                "k / v: [tokens, heads, dim] matching the pool");
    auto* codes = static_cast<uint8_t*>(std::get<1>(pair)->data_ptr());
    auto* scale_data = std::get<2>(pair)->data_ptr<c10::BFloat16>();
    if (values.scalar_type() == at::kFloat) {
      write_rows(values.data_ptr<float>(), tokens * heads, dim, scheme, codes, scale_data, slot_data, heads);
    } else {
      TORCH_CHECK(values.scalar_type() == at::kBFloat16, "k / v must be float32 or bfloat16");
      write_rows(values.data_ptr<c10::BFloat16>(), tokens * heads, dim, scheme, codes, scale_data, slot_data, heads);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> kv_quant_gather(const at::Tensor& codes_k, const at::Tensor& codes_v,
                                                   const at::Tensor& scales_k, const at::Tensor& scales_v,
                                                   const at::Tensor& slots, int64_t scheme, at::ScalarType dtype) {
  TORCH_CHECK(scheme >= 0 && scheme <= 2, "scheme must be 0 (int8), 1 (fp8_e4m3) or 2 (fp8_e5m2)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  check_layer(codes_k, scales_k);
  check_layer(codes_v, scales_v);
  const auto slot_index = slots.contiguous();
  const int64_t* slot_data = checked_slots(slot_index, codes_k.size(0));
  const int64_t heads = codes_k.size(1), dim = codes_k.size(2), tokens = slot_index.size(0);
  auto out_k = at::empty({tokens, heads, dim}, codes_k.options().dtype(dtype));
  auto out_v = at::empty({tokens, heads, dim}, codes_k.options().dtype(dtype));
  TORCH_CHECK(dim <= 512, "head_dim must be at most 512");
  // Threads pay off only for long gathers (a prefill chunk over a long context), not a decode step's.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (auto pair : {std::make_tuple(&codes_k, &scales_k, &out_k), std::make_tuple(&codes_v, &scales_v, &out_v)}) {
      const auto* codes = static_cast<const uint8_t*>(std::get<0>(pair)->data_ptr());
      const auto* scale_data = std::get<1>(pair)->data_ptr<c10::BFloat16>();
      at::Tensor& out = *std::get<2>(pair);
      if (dtype == at::kFloat) {
        gather_rows(codes, scale_data, slot_data, begin, end, heads, dim, scheme, out.data_ptr<float>());
      } else {
        gather_rows(codes, scale_data, slot_data, begin, end, heads, dim, scheme, out.data_ptr<c10::BFloat16>());
      }
    }
  });
  return {out_k, out_v};
}

}  // namespace

TORCH_LIBRARY(kvreuse_kv, m) {
  m.def("kv_quant_write(Tensor(a!) codes_k, Tensor(b!) codes_v, Tensor(c!) scales_k, Tensor(d!) scales_v, "
        "Tensor slots, Tensor k, Tensor v, int scheme) -> ()");
  m.def("kv_quant_gather(Tensor codes_k, Tensor codes_v, Tensor scales_k, Tensor scales_v, Tensor slots, "
        "int scheme, ScalarType dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvreuse_kv, CPU, m) {
  m.impl("kv_quant_write", &kv_quant_write);
  m.impl("kv_quant_gather", &kv_quant_gather);
}
