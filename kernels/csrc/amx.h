// The AMX-INT8 form of the block matmuls (amx.cpp), for qgemm.cpp's dispatcher. Kept apart from
// qgemm.cpp so it compiles without torch's headers (a second of the cold build, not fifteen).
#pragma once

#include <cstdint>

namespace specserve::amx {

// The weight layouts of qgemm.cpp that the tile form reads (see its header for each layout).
enum class Layout : int { kQ8 = 0, kQ4_1 = 1, kQ8F = 2 };

// One block_linear call's operands: the weights in qgemm.cpp's interleaved layout, the
// activations already quantized per block of 32 (codes xq [M, K], scales dx and float sums sx
// [M, KB]), y [M, N] float32.
struct Operands {
  Layout layout;
  const void* qs;      // kQ8, kQ8F: int8 [G, KB, 256]; kQ4_1: uint8 [G, KB, 128]
  const void* d;       // kQ8, kQ4_1: float16 [G, KB, 8]; kQ8F: float32 [G, KB, 2, 8]
  const void* m;       // kQ4_1: float16 [G, KB, 8]; kQ8F: float32 [G, KB, 8] or null; kQ8: null
  const float* bias;   // [N] or null
  const int8_t* xq;
  const float* dx;
  const float* sx;
  float* y;
  int64_t M, K, KB, N;
};

// True when this CPU has AMX-INT8 and AVX-512 and the OS lets this process use the tile
// registers (Linux grants them on request; asked once).
bool supported();

// Groups (2p, 2p + 1) for p in [p0, p1), every row (16 rows a pass, the rest in one pass);
// each pair must be whole (the caller runs an odd last group in another form, same bits).
void run_pairs(const Operands& op, int64_t p0, int64_t p1);

}  // namespace specserve::amx
