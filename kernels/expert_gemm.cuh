// FC1 (gate and up) and FC2 (down) over work tiles of one expert, weights decoded on the fly.
//
// A work tile is up to R*16 routes of one expert (route_pack.cuh). Each warp owns one 16-column n tile
// of one projection and walks the k dimension in 128-wide chunks: it decodes each 16x16 weight tile once
// into registers and applies it to every live block of routes of the work tile (chunk_mma), so at large
// M a decoded weight is reused R times. The route rows (rotated input for FC1, activated intermediate for
// FC2) are staged per chunk in shared memory as fp16.
//
// FC1 splits the hidden dimension into ranges, each CTA one range of one item (fc1_split.cuh), and writes
// fp32 partial sums per range; the activation phase adds them in a fixed order, so the result never
// depends on scheduling.
//
// The parts, each building on those before it: gemm_tile.cuh (work tiles, loads), copy_pipeline.cuh
// (the cp.async ring), chunk_mma.cuh (decode and MMA of a chunk), fc1.cuh, input_rotation.cuh, fc2.cuh.
#pragma once
#include "fc1.cuh"
#include "fc2.cuh"
#include "input_rotation.cuh"
