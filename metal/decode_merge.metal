// OIQ decode attention, pass 2: log-sum-exp merge of the slices (and the
// attention-sink logit), inverse Walsh-Hadamard + sign flip of the packed
// slices' share only, + value mean.
//
// Grid (32, B*H_q*L, 1), threadgroup (32, ROWS, 1): one simdgroup per query
// row, lane l owning output values [l*E, (l+1)*E).  Template: OutT (the output
// dtype: the queries'), D (value head dimension).  params: n_kv, rep, L,
// n_parts, n_qchunks, QB (query rows per chunk of pass 1), has sinks, has
// mean, unrotate, P_S, P_Q (slices
// [P_S, P_S + P_Q) are the packed segment's, in the rotated domain; the others
// are un-rotated), sinks per head (else per query row), has key mean shift;
// uniform over the launch.
// Sinks: logits per query head (n_q) or per query row (B, H_q, L), float32;
// with the key mean shift, each query row's logit less part_shift (pass 1's
// scale * q . key mean).
// part_ml, sinks, mean, signs and part_shift may be bound `constant` (fewer
// than 8 elements); they are only indexed.  mean: the value mean, un-rotated
// (B, H_kv, D).  Output: out (B, H_q, L, D) OutT, accumulated in float32 and
// rounded once at the store (the reference's float32 result .astype(OutT)).
// The exps here stay precise: P + 1 per query row (not per key), and the part
// weights scale whole slices.
constexpr int E = D / 32;

uint lane = thread_position_in_threadgroup.x;
int g = int(thread_position_in_grid.y);
int n_kv = params[0];
int rep = params[1];
int L = params[2];
int n_parts = params[3];
int nqc = params[4];
int qb = params[5];
bool has_sinks = params[6] != 0;
bool has_mean = params[7] != 0;
bool unrotate = params[8] != 0;
int p_sink = params[9];
int p_quant = params[10];
int n_q = n_kv * rep;

int b = g / (n_q * L);
int h = (g / L) % n_q;
int l = g % L;
int kvh = h / rep;
int qq = (h % rep) * L + l;
int z = (b * n_kv + kvh) * nqc + qq / qb;
int i = qq % qb;

float mx_ = -INFINITY;
for (int p = 0; p < n_parts; p++) {
  mx_ = max(mx_, part_ml[((size_t(z) * n_parts + p) * qb + i) * 2]);
}
float sink = -INFINITY;
if (has_sinks) {
  sink = sinks[params[11] != 0 ? h : g];
  if (params[12] != 0) {
    sink -= part_shift[z * qb + i];
  }
}
mx_ = max(mx_, sink);
float lsum = 0.0f;
float acc[E];
float acc_packed[E];
for (int e = 0; e < E; e++) {
  acc[e] = 0.0f;
  acc_packed[e] = 0.0f;
}
for (int p = 0; p < n_parts; p++) {
  size_t slot = (size_t(z) * n_parts + p) * qb + i;
  float mp = part_ml[slot * 2];
  if (mp > -INFINITY) {
    float f = exp(mp - mx_);
    lsum += part_ml[slot * 2 + 1] * f;
    bool packed = p >= p_sink && p < p_sink + p_quant;
    for (int e = 0; e < E; e++) {
      float w = part_o[slot * D + lane * E + e] * f;
      if (packed) {
        acc_packed[e] += w;
      } else {
        acc[e] += w;
      }
    }
  }
}
if (has_sinks) {
  lsum += exp(sink - mx_);
}
float y[E];
for (int e = 0; e < E; e++) {
  y[e] = acc_packed[e] / lsum;
}
if (unrotate) {
  oiq_wht<E>(y, lane, rot_scale);
  for (int e = 0; e < E; e++) {
    y[e] *= signs[lane * E + e];
  }
}
for (int e = 0; e < E; e++) {
  y[e] += acc[e] / lsum;
  if (has_mean) {
    y[e] += mean[(b * n_kv + kvh) * D + lane * E + e];
  }
  out[size_t(g) * D + lane * E + e] = OutT(y[e]);
}
