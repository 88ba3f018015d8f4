// OIQ quantize: [sign flip + Walsh-Hadamard] + group abs-max + rounding + bit packing.
//
// Grid (32, N, 1), threadgroup (32, ROWS, 1): one simdgroup per row (token x
// head) of D values, lane l owning values [l*E, (l+1)*E).  Template: T (input
// dtype), D, ROWS.  params: bits, group size, rotate (apply the rotation
// first); they are uniform over the launch, so their branches and loop bounds
// are too.
// Inputs: x (N, D), signs (D,) float32, rot_scale (float, 1/sqrt(D)), params.
// Outputs: codes (N, D*bits/32) uint32, scales (N, D/group) float16.
constexpr int E = D / 32;

threadgroup uchar tg_codes[ROWS * D];

int bits = params[0];
int group = params[1];
bool rotate = params[2] != 0;
int W = D * bits / 32;
int lanes_per_group = group / E;
float half_levels = float((1 << bits) - 1) / 2.0f;

uint lane = thread_position_in_threadgroup.x;
uint r = thread_position_in_threadgroup.y;
uint row = thread_position_in_grid.y;

const device T* xr = x + size_t(row) * D + lane * E;
float y[E];
for (int e = 0; e < E; e++) {
  y[e] = float(xr[e]);
}
if (rotate) {
  for (int e = 0; e < E; e++) {
    y[e] *= signs[lane * E + e];
  }
  oiq_wht<E>(y, lane, rot_scale);
  // rotation.rotate returns its input dtype: round there before quantizing.
  for (int e = 0; e < E; e++) {
    y[e] = float(T(y[e]));
  }
}

// A group holding NaN/Inf is stored as scale NaN, codes 0 (codec.quantize).
uint bad = 0;
float amax = 0.0f;
for (int e = 0; e < E; e++) {
  bad |= isfinite(y[e]) ? 0u : 1u;
  amax = max(amax, abs(y[e]));
}
for (ushort m = 1; m < lanes_per_group; m <<= 1) {
  bad |= simd_shuffle_xor(bad, m);
  amax = max(amax, simd_shuffle_xor(amax, m));
}
if (bad) {
  amax = 0.0f;
}
// The scale is rounded to float16 (saturated) before the codes are computed.
half scale_h = half(min(amax / half_levels, 65504.0f));
float scale = float(scale_h);
for (int e = 0; e < E; e++) {
  float c = scale > 0.0f ? clamp(rint(y[e] / scale + half_levels), 0.0f, 2.0f * half_levels) : 0.0f;
  tg_codes[r * D + lane * E + e] = uchar(c);
}
if ((lane * E) % group == 0) {
  scales[size_t(row) * (D / group) + lane * E / group] =
      bad ? numeric_limits<half>::quiet_NaN() : scale_h;
}

threadgroup_barrier(mem_flags::mem_threadgroup);

// Word w holds bits [32w, 32w+32) of the row's stream: gather the values
// that touch it (the first may straddle in from the previous word).
for (int w = lane; w < W; w += 32) {
  int first = (w * 32) / bits;
  int last = min((w * 32 + 31) / bits, D - 1);
  uint word = 0;
  for (int i = first; i <= last; i++) {
    int off = i * bits - w * 32;
    uint v = tg_codes[r * D + i];
    word |= off >= 0 ? (v << uint(off)) : (v >> uint(-off));
  }
  codes[size_t(row) * W + w] = word;
}
