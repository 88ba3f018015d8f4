// Shared helpers of the OIQ kernels.
//
// Layout used by every kernel: one simdgroup holds one head vector of D
// values, lane l owning the E = D / 32 consecutive values [l*E, (l+1)*E) in
// registers.  The Walsh-Hadamard butterflies on the low log2(E) index bits
// run in registers, the remaining five bits across lanes with
// simd_shuffle_xor.

// Normalized Walsh-Hadamard transform of the D-vector spread over the
// simdgroup.  Butterflies go low index bit first and the last stage's outputs
// are multiplied by `scale`, the exact order of operations of
// mx.hadamard_transform (CPU and Metal), so fp32 results are bit-identical.
template <int E>
METAL_FUNC void oiq_wht(thread float* x, uint lane, float scale) {
  for (int h = 1; h < E; h <<= 1) {
    for (int i = 0; i < E / 2; i++) {
      int k = i & (h - 1);
      int j = ((i - k) << 1) + k;
      float a = x[j];
      float b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
  }
  for (ushort m = 1; m < 32; m <<= 1) {
    bool upper = (lane & m) != 0;
    for (int e = 0; e < E; e++) {
      float other = simd_shuffle_xor(x[e], m);
      x[e] = upper ? other - x[e] : x[e] + other;
    }
  }
  for (int e = 0; e < E; e++) {
    x[e] *= scale;
  }
}

// Codes of values [lane*E, (lane+1)*E) of one packed vector of `bits`-bit
// codes: value i sits in bits [i*bits, (i+1)*bits) of the LSB-first stream
// `words` (mx.quantize's layout; 3/5/6-bit values straddle words).  The lane's
// bits span at most NW words (at 8 bits); only words inside the vector's
// W = E*bits words are read.  P is the pointer type: MLX binds an input of
// fewer than 8 elements (one packed vector at low bits, a placeholder) as
// `const constant uint32_t*`, larger ones as `const device uint32_t*`.
template <int E, typename P>
METAL_FUNC void oiq_unpack(P words, uint bits, uint lane, thread uint* c) {
  constexpr int NW = (E * 8 + 31) / 32 + 1;
  uint W = uint(E) * bits;
  uint mask = (1u << bits) - 1u;
  uint bit0 = lane * W;
  uint w0 = bit0 >> 5;
  uint sh0 = bit0 & 31u;
  uint local[NW];
  for (int k = 0; k < NW; k++) {
    local[k] = (w0 + uint(k) < W) ? words[w0 + k] : 0u;
  }
  for (int e = 0; e < E; e++) {
    uint bit = sh0 + uint(e) * bits;
    uint w = bit >> 5;
    uint sh = bit & 31u;
    uint v = local[w] >> sh;
    if (sh + bits > 32u) {
      v |= local[w + 1] << (32u - sh);
    }
    c[e] = v & mask;
  }
}
