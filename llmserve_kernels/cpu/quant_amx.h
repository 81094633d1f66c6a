// Fast mode on the matrix engine (AMX, issue #52): quant_amx.cpp's entry, which the interleaved
// kernel (quant_interleaved.cpp) offers each call to first.

#pragma once

#include <cstdint>

#include "quant_fast.h"

namespace llmserve::quant {

// Activation rows from which a call goes to the matrix engine (a tile takes 16; a last tile
// of fewer is padded). Under it the vector kernel was as fast or faster, alone and in a whole
// decode step (bench/RESULTS.md, "Fast mode on AMX tiles").
constexpr int64_t kMatrixEngineRows = 32;

// out [n, out_features] = the fast-mode dots of interleaved weights w of `type` with the
// quantized activations a (n rows of in / 32 blocks, not biased), bit for bit those of the
// interleaved kernel; false, with nothing written, where the path does not take the call (the
// engine off or absent: amx::enabled; Q6_K; fewer than kMatrixEngineRows rows; out_features
// not a multiple of 16).
bool matrix_engine_linear(int type, const ActBlock* a, int64_t n, int64_t in, const uint8_t* w,
                          int64_t out_features, float* out);

}  // namespace llmserve::quant
