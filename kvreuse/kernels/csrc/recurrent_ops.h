// What the recurrent layers' native mixers share (csrc/mamba2_scan.cpp, csrc/gated_delta.cpp): sums in lanes of a
// fixed order, and the causal depthwise convolution with SiLU whose last K - 1 inputs live in a sequence's slot.
// Every value is computed the same way whatever row it is in and whatever else the step holds, so a token's output
// is the same bits in a prefill chunk, a decode step or a resumed run (what a snapshot hit needs).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvreuse_recurrent {

// Sums in 16 lanes, each lane in index order, the lanes then added in order: a fixed order (the same bits whatever the
// batch) that the compiler vectorises (a plain running sum cannot be reordered).
constexpr int64_t kLanes = 16;

inline float sum_of_squares(const float* x, int64_t size) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * x[i + l];
  float total = 0.f;
  for (; i < size; ++i) total += x[i] * x[i];
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

inline float silu(float x) { return x * (1.f / (1.f + std::exp(-x))); }

struct Sequences {
  std::vector<int64_t> slot, start, len;
};

inline Sequences sequences(at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef lens, int64_t tokens,
                           int64_t num_slots) {
  const int64_t count = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == count && static_cast<int64_t>(lens.size()) == count,
              "recurrent mixer: slots, starts and lens of one length");
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "recurrent mixer: slot out of range");
    TORCH_CHECK(starts[i] >= 0 && lens[i] >= 0 && starts[i] + lens[i] <= tokens, "recurrent mixer: rows out of range");
  }
  return {std::vector<int64_t>(slots.begin(), slots.end()), std::vector<int64_t>(starts.begin(), starts.end()),
          std::vector<int64_t>(lens.begin(), lens.end())};
}

// The causal depthwise convolution of x [T, C] by w [C, K] (plus bias [C] where not null), then SiLU, into out
// [T, C]: per (sequence, channel), rows in order, the K - 1 inputs before a sequence's first row read from
// conv [slots, layers, K - 1, C] at its slot and layer, which ends holding its last K - 1 inputs. A channel's taps
// are summed in tap order.
inline void conv_silu(const float* x, const float* w, const float* bias, float* conv, int64_t conv_slot_stride,
                      int64_t conv_layer_offset, float* out, int64_t channels, int64_t kernel, const Sequences& seqs) {
  const int64_t keep = kernel - 1, num_seqs = static_cast<int64_t>(seqs.slot.size());
  constexpr int64_t kChannelChunk = 256;
  const int64_t chunks = (channels + kChannelChunk - 1) / kChannelChunk;
  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> window;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / chunks, first = (task % chunks) * kChannelChunk;
      const int64_t last = std::min(first + kChannelChunk, channels), rows = seqs.len[seq], width = last - first;
      float* state = conv + seqs.slot[seq] * conv_slot_stride + conv_layer_offset;  // [K - 1, C]
      window.assign((keep + rows) * width, 0.f);  // [K - 1 + rows, chunk]
      for (int64_t r = 0; r < keep; ++r)
        for (int64_t c = first; c < last; ++c) window[r * width + c - first] = state[r * channels + c];
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = first; c < last; ++c) window[(keep + r) * width + c - first] = x[(seqs.start[seq] + r) * channels + c];
      for (int64_t r = 0; r < rows; ++r) {
        float* row = out + (seqs.start[seq] + r) * channels;
        for (int64_t c = first; c < last; ++c) {
          float total = window[r * width + c - first] * w[c * kernel];
          for (int64_t tap = 1; tap < kernel; ++tap) total = total + window[(r + tap) * width + c - first] * w[c * kernel + tap];
          if (bias != nullptr) total = total + bias[c];
          row[c] = silu(total);
        }
      }
      for (int64_t r = 0; r < keep; ++r)
        for (int64_t c = first; c < last; ++c) state[r * channels + c] = window[(rows + r) * width + c - first];
    }
  });
}

}  // namespace kvreuse_recurrent
