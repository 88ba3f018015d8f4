// OIQ decode attention, pass 2: log-sum-exp merge of the slices (and the
// attention-sink logit) + value mean + inverse Walsh-Hadamard + sign flip.
//
// Grid (32, B*H_q*L, 1), threadgroup (32, ROWS, 1): one simdgroup per query
// row, lane l owning output values [l*EV, (l+1)*EV).
// params: n_kv, rep, L, n_parts, n_qchunks.  Output: out (B, H_q, L, DV) float32.
constexpr int EV = DV / 32;

uint lane = thread_position_in_threadgroup.x;
int g = int(thread_position_in_grid.y);
int n_kv = params[0];
int rep = params[1];
int L = params[2];
int n_parts = params[3];
int nqc = params[4];
int n_q = n_kv * rep;

int b = g / (n_q * L);
int h = (g / L) % n_q;
int l = g % L;
int kvh = h / rep;
int qq = (h % rep) * L + l;
int z = (b * n_kv + kvh) * nqc + qq / QB;
int i = qq % QB;

float mx_ = -INFINITY;
for (int p = 0; p < n_parts; p++) {
  mx_ = max(mx_, part_ml[((size_t(z) * n_parts + p) * QB + i) * 2]);
}
float sink = HAS_SINKS ? sinks[g] : -INFINITY;  // sinks: (B, H_q, L) logits
mx_ = max(mx_, sink);
float lsum = 0.0f;
float acc[EV];
for (int e = 0; e < EV; e++) {
  acc[e] = 0.0f;
}
for (int p = 0; p < n_parts; p++) {
  size_t slot = (size_t(z) * n_parts + p) * QB + i;
  float mp = part_ml[slot * 2];
  if (mp > -INFINITY) {
    float f = exp(mp - mx_);
    lsum += part_ml[slot * 2 + 1] * f;
    for (int e = 0; e < EV; e++) {
      acc[e] += part_o[slot * DV + lane * EV + e] * f;
    }
  }
}
if (HAS_SINKS) {
  lsum += exp(sink - mx_);
}
float y[EV];
for (int e = 0; e < EV; e++) {
  y[e] = acc[e] / lsum;
  if (HAS_MEAN) {
    y[e] += mean[(b * n_kv + kvh) * DV + lane * EV + e];
  }
}
if (UNROTATE) {
  oiq_wht<EV>(y, lane, rot_scale);
  for (int e = 0; e < EV; e++) {
    y[e] *= signs[lane * EV + e];
  }
}
for (int e = 0; e < EV; e++) {
  out[size_t(g) * DV + lane * EV + e] = y[e];
}
