// OIQ quantize: [key scaling + sign flip + Walsh-Hadamard] + group abs-max
// [+ MSE clip search] + rounding + bit packing, one pass per row.
//
// Grid (32, N, 1), threadgroup (32, ROWS, 1): one simdgroup per row (token x
// head) of D values, lane l owning values [l*E, (l+1)*E).  Template: T (input
// dtype), D, ROWS.  params: bits, group size, rotate, clip, rows per lam row
// (0: no key scales), rows per signs row, round (cast the rotated row back to
// T before quantizing, as rotation.rotate does for T input), joined, align of
// the rows before a split row, align of the rows from it, the split row (align:
// 0 keeps the scale chosen, 2 stores sum(y*y) / sum(y*u) for the codes chosen, 1
// the mean of the two, codec.quantize(align=0, 1, 0.5); the split row is where
// a launch over keys and values stacked passes from keys to values).  All but
// align are uniform over the launch, so their branches and loop bounds are
// too; align is uniform over a row, so over its simdgroup.
// Inputs (the kernel is built without ensure_row_contiguous: every input is
// read through its strides, none is copied before the launch):
//   x (..., D): N = prod(leading axes) rows, any strides (a slice of the
//   cache's stacked window buffer along the token axis, a transposed view):
//   row r is located over the leading axes from x_shape / x_strides (the
//   last leading axis varying fastest), its values x_strides[ndim - 1] apart;
//   lam (N / rows_per_lam, D) float32 key scales (or a placeholder) and signs
//   (N / rows_per_signs, D) float32, read through their two strides;
//   rot_scale (float, 1/sqrt(D)); clip_ratios (11,) float32
//   (codec.CLIP_RATIOS); params.
// The row as quantized: y = H(x / lam * signs) / sqrt(D) (dispatch.quantize_rows).
// Outputs (contiguous, row r at r * width), G = D / group scales per row:
//   joined = 0: codes (N, W = D*bits/32) uint32, scales (N, G) float16.
//   joined = 1: codes (N, W + S) uint32, codec.join_rows(codes, scales): the W
//   code words, then S = ceil(G / 2) words of float16 scale bits, scale 2j in
//   the low half of word W + j and 2j + 1 in the high half (an odd G leaves a
//   zero high half in the last word); written by the first lane of each even
//   group, which takes the next group's scale by simd_shuffle.  scales is then
//   a (1,) placeholder, never written.
constexpr int E = D / 32;
constexpr int N_CLIP = 11;

threadgroup uchar tg_codes[ROWS * D];

int bits = params[0];
int group = params[1];
bool rotate = params[2] != 0;
bool clip = params[3] != 0;
int rows_per_lam = params[4];
int rows_per_signs = params[5];
bool round_to_input = params[6] != 0;
bool joined = params[7] != 0;
int W = D * bits / 32;
int G = D / group;
int row_words = joined ? W + (G + 1) / 2 : W;
int lanes_per_group = group / E;
float half_levels = float((1 << bits) - 1) / 2.0f;

uint lane = thread_position_in_threadgroup.x;
uint r = thread_position_in_threadgroup.y;
uint row = thread_position_in_grid.y;
int align_mode = int(row) < params[10] ? params[8] : params[9];
bool align = align_mode != 0;

// The row's first value: row -> index over the leading axes, last one fastest.
int64_t loc = 0;
uint rest = row;
for (int k = x_ndim - 2; k >= 0; k--) {
  loc += int64_t(rest % uint(x_shape[k])) * x_strides[k];
  rest /= uint(x_shape[k]);
}
int64_t step = x_strides[x_ndim - 1];
const device T* xr = x + loc + int64_t(lane * E) * step;
float y[E];
if (step == 1) {
  for (int e = 0; e < E; e++) {
    y[e] = float(xr[e]);
  }
} else {
  for (int e = 0; e < E; e++) {
    y[e] = float(xr[e * step]);
  }
}
if (rows_per_lam > 0) {
  int64_t base = int64_t(row / rows_per_lam) * lam_strides[0];
  for (int e = 0; e < E; e++) {
    y[e] = y[e] / lam[base + int64_t(lane * E + e) * lam_strides[1]];
  }
}
if (rotate) {
  int64_t base = int64_t(row / rows_per_signs) * signs_strides[0];
  for (int e = 0; e < E; e++) {
    y[e] *= signs[base + int64_t(lane * E + e) * signs_strides[1]];
  }
  oiq_wht<E>(y, lane, rot_scale);
  if (round_to_input) {
    for (int e = 0; e < E; e++) {
      y[e] = float(T(y[e]));
    }
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
// (uniform over the simdgroup: the shuffles below need every lane, so a group
// holding non-finite values runs the search too and ignores its result)
if (clip) {
  // codec.quantize(clip=True): the candidate (amax * ratio / half, as stored) of least
  // squared error, the first on ties; errors summed neighbours first (codec.pairwise_sum):
  // in registers over the lane's E values, then across the group's lanes.
  float best_err = INFINITY;
  for (int c = 0; c < N_CLIP; c++) {
    half cand_h = half(min(amax * clip_ratios[c] / half_levels, 65504.0f));
    float cand = float(cand_h);
    float err[E];
    for (int e = 0; e < E; e++) {
      float code = cand > 0.0f ? clamp(rint(y[e] / cand + half_levels), 0.0f, 2.0f * half_levels) : 0.0f;
      float d = (code - half_levels) * cand - y[e];
      err[e] = d * d;
    }
    for (int h = 1; h < E; h <<= 1) {
      for (int e = 0; e < E; e += 2 * h) {
        err[e] = err[e] + err[e + h];
      }
    }
    float total = err[0];
    for (ushort m = 1; m < lanes_per_group; m <<= 1) {
      total = total + simd_shuffle_xor(total, m);
    }
    if (!bad && total < best_err) {
      best_err = total;
      scale_h = cand_h;
    }
  }
}
float scale = float(scale_h);
float yy[E];
float yu[E];
for (int e = 0; e < E; e++) {
  float c = scale > 0.0f ? clamp(rint(y[e] / scale + half_levels), 0.0f, 2.0f * half_levels) : 0.0f;
  tg_codes[r * D + lane * E + e] = uchar(c);
  if (align) {
    yy[e] = y[e] * y[e];
    yu[e] = y[e] * (c - half_levels);
  }
}
if (align) {
  // codec.quantize(align=True): the scale sum(y*y) / sum(y*u) for these codes, both sums
  // neighbours first as the clip search's errors; a zero group keeps its scale (0), and so
  // does one whose sums overflow
  for (int h = 1; h < E; h <<= 1) {
    for (int e = 0; e < E; e += 2 * h) {
      yy[e] = yy[e] + yy[e + h];
      yu[e] = yu[e] + yu[e + h];
    }
  }
  float syy = yy[0];
  float syu = yu[0];
  for (ushort m = 1; m < lanes_per_group; m <<= 1) {
    syy = syy + simd_shuffle_xor(syy, m);
    syu = syu + simd_shuffle_xor(syu, m);
  }
  float ratio = syy / syu;
  float target = align_mode == 2 ? ratio : 0.5f * (scale + ratio);
  if (!bad && syu > 0.0f && isfinite(ratio)) {
    scale_h = half(min(target, 65504.0f));
  }
}
// Every lane of a group holds the group's scale (the reductions above are
// butterflies over the group's lanes).
half stored = bad ? numeric_limits<half>::quiet_NaN() : scale_h;
if (joined) {
  // the scale of the group after this lane's, from the first lane of that group
  // (wrapping around at the last group, whose pair is then the zero padding)
  uint bits_here = uint(as_type<ushort>(stored));
  uint bits_next = simd_shuffle(bits_here, ushort((lane + uint(lanes_per_group)) & 31u));
  int g = int(lane) * E / group;
  if ((int(lane) * E) % (2 * group) == 0) {
    codes[size_t(row) * row_words + W + g / 2] = bits_here | ((g + 1 < G ? bits_next : 0u) << 16);
  }
} else if ((lane * E) % group == 0) {
  scales[size_t(row) * G + lane * E / group] = stored;
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
  codes[size_t(row) * row_words + w] = word;
}
