// OIQ dequantize: bit unpacking + group scaling [+ inverse Walsh-Hadamard + sign flip].
//
// Grid (32, N, 1), threadgroup (32, ROWS, 1): one simdgroup per row, lane l
// owning values [l*E, (l+1)*E).  Template: OutT, D.  params: bits, group
// size, unrotate (uniform over the launch).
// Inputs: codes (N, D*bits/32) uint32, scales (N, D/group) float16,
// signs (D,) float32, rot_scale (float, 1/sqrt(D)), params.  Output: out (N, D) OutT.
// codes and scales may be bound `constant` (fewer than 8 elements): they are
// only indexed, or passed to the pointer-type template oiq_unpack.
constexpr int E = D / 32;

int bits = params[0];
int group = params[1];
bool unrotate = params[2] != 0;
int W = D * bits / 32;
float half_levels = float((1 << bits) - 1) / 2.0f;

uint lane = thread_position_in_threadgroup.x;
uint row = thread_position_in_grid.y;

uint c[E];
oiq_unpack<E>(codes + size_t(row) * W, uint(bits), lane, c);
float scale = float(scales[size_t(row) * (D / group) + lane * E / group]);
float y[E];
for (int e = 0; e < E; e++) {
  y[e] = (float(c[e]) - half_levels) * scale;
}
if (unrotate) {
  oiq_wht<E>(y, lane, rot_scale);
  for (int e = 0; e < E; e++) {
    y[e] *= signs[lane * E + e];
  }
}
device OutT* o = out + size_t(row) * D + lane * E;
for (int e = 0; e < E; e++) {
  o[e] = OutT(y[e]);
}
