// OIQ dequantize: bit unpacking + group scaling [+ inverse Walsh-Hadamard + sign flip].
//
// Grid (32, N, 1), threadgroup (32, ROWS, 1): one simdgroup per row, lane l
// owning values [l*E, (l+1)*E).  Template: OutT, D, BITS, GROUP, UNROTATE.
// Inputs: codes (N, D*BITS/32) uint32, scales (N, D/GROUP) float16,
// signs (D,) float32, rot_scale (float, 1/sqrt(D)).  Output: out (N, D) OutT.
constexpr int E = D / 32;
constexpr int W = D * BITS / 32;
constexpr float HALF_LEVELS = float((1 << BITS) - 1) / 2.0f;

uint lane = thread_position_in_threadgroup.x;
uint row = thread_position_in_grid.y;

uint c[E];
oiq_unpack<BITS, E>(codes + size_t(row) * W, lane, c);
float scale = float(scales[size_t(row) * (D / GROUP) + lane * E / GROUP]);
float y[E];
for (int e = 0; e < E; e++) {
  y[e] = (float(c[e]) - HALF_LEVELS) * scale;
}
if (UNROTATE) {
  oiq_wht<E>(y, lane, rot_scale);
  for (int e = 0; e < E; e++) {
    y[e] *= signs[lane * E + e];
  }
}
device OutT* o = out + size_t(row) * D + lane * E;
for (int e = 0; e < E; e++) {
  o[e] = OutT(y[e]);
}
