// OIQ decode attention, pass 1: score + online softmax + value sum over one
// slice of the cache, reading packed K/V (dequantized in registers) and the
// full-precision sink/recent segments in one loop.
//
// Grid (32, P, B*H_kv*NQC), threadgroup (32, TGP, 1): one simdgroup per
// (KV head, chunk of QB query rows, slice of keys).  Template: FT (dtype of
// the queries and of the full-precision segments), D (key and value head
// dimension), QB, TGP (slices per threadgroup; P is a multiple of it).  Lane l
// owns values [l*E, (l+1)*E) of every key and value; each key is read once
// for all QB query rows (the rep query heads sharing the KV head times the L
// positions).  Positions [0, S) are sinks, [S, S+NQ) packed, [S+NQ, S+NQ+NR)
// recent.
//
// Two domains (DESIGN.md section 5): the sink and recent rows are stored as
// the model gave them (minus the key mean) and are scored with q * scale; the
// packed rows are r((k - m) / lam) and are scored with r(q * scale * lam),
// rotated here in registers.  A slice never mixes segments: the first P_S
// slices cover the sinks, the next P_R the recent rows, empty slices pad them
// to P_F (P_S + P_R rounded up to TGP), and the slices from P_F on the packed
// rows (the last ones empty when P - P_F exceeds what they need).  A
// threadgroup's TGP slices are thus in one domain, and it writes one partial
// output: its slices merged by log-sum-exp in threadgroup memory, as the merge
// kernel merges the threadgroups' (TGP times fewer partials written and read
// back); the merge un-rotates only the packed threadgroups' share.
// params: n_sink, n_quant, n_recent, n_kv, rep, L, keys_per_part, n_qchunks,
// k_bits, v_bits, group size, mask mode (0 none, 1 causal, 2 keep where the
// float mask is nonzero, 3 additive), P_S, P_R, has key scales, rotated keys,
// has ranges, has key mean shift; all uniform over the launch.
// k_mean (with has key mean shift): (B, n_kv, 1, D) float32 key mean; the
// first slice of each program writes part_shift = scale * q . k_mean per query
// row (what centering the keys took from every score: the merge moves an
// attention-sink logit by as much).
// ranges (with has ranges): (B, 3) int32, what sequence b holds of a batch
// stacked on the padded lengths: its packed rows [0, ranges[b][0]) and its
// recent rows [ranges[b][1], ranges[b][2]) (positions within each segment); a
// slice reads only those rows, so a sequence shorter than the longest reads
// its own length (the padding is never read, and needs no mask).
// q is read through its strides (a transposed view is fine).  kc, ks, vc, vs,
// lam, mask, ranges and k_mean may be bound `constant` (fewer than 8 elements: a placeholder,
// or one packed vector at low bits): they are only indexed, or passed to the
// pointer-type template oiq_unpack.
// Outputs per (z, threadgroup of slices, query row): part_o (D floats),
// part_ml (max, sum); per (z, query row): part_shift (written only with has
// key mean shift).
constexpr int E = D / 32;
constexpr int KF = 2;

threadgroup float tg_o[TGP * QB * D];
threadgroup float tg_ml[TGP * QB * 2];

uint lane = thread_position_in_threadgroup.x;
int sg = int(thread_position_in_threadgroup.y);
int part = int(thread_position_in_grid.y);
int z = int(thread_position_in_grid.z);
int n_parts = int(threads_per_grid.y);

int n_sink = params[0];
int n_quant = params[1];
int n_recent = params[2];
int n_kv = params[3];
int rep = params[4];
int L = params[5];
int kpp = params[6];
int nqc = params[7];
uint kbits = uint(params[8]);
uint vbits = uint(params[9]);
int group = params[10];
int mask_mode = params[11];
int p_sink = params[12];
int p_recent = params[13];
bool has_lam = params[14] != 0;
bool k_rotated = params[15] != 0;
float khalf = float((1 << kbits) - 1) / 2.0f;
float vhalf = float((1 << vbits) - 1) / 2.0f;
int T = n_sink + n_quant + n_recent;
int n_q = n_kv * rep;

int qc = z % nqc;
int bh = z / nqc;
int b = bh / n_kv;
int kvh = bh % n_kv;

// this slice's segment and positions (t0 >= t1: an empty slice, padding)
int p_fp = (p_sink + p_recent + TGP - 1) / TGP * TGP;
int seg = part < p_sink ? 0 : (part < p_fp ? 2 : 1);
int seg_start = seg == 0 ? 0 : (seg == 1 ? n_sink : n_sink + n_quant);
int seg_end = seg == 0 ? n_sink : (seg == 1 ? n_sink + n_quant : T);
int t0 = seg_start + (part - (seg == 0 ? 0 : (seg == 1 ? p_fp : p_sink))) * kpp;
int t1 = min(seg_end, t0 + kpp);
if (params[16] != 0) {
  if (seg == 1) {
    t1 = min(t1, n_sink + ranges[b * 3]);
  } else if (seg == 2) {
    t0 = max(t0, n_sink + n_quant + ranges[b * 3 + 1]);
    t1 = min(t1, n_sink + n_quant + ranges[b * 3 + 2]);
  }
}

float qv[QB][E];
float qsum[QB];
int qhead[QB];
int qpos[QB];
bool qvalid[QB];
for (int i = 0; i < QB; i++) {
  int qq = qc * QB + i;
  qvalid[i] = qq < rep * L;
  int qqc = qvalid[i] ? qq : 0;
  qhead[i] = kvh * rep + qqc / L;
  qpos[i] = qqc % L;
  const device FT* qr = q + b * q_strides[0] + qhead[i] * q_strides[1] + qpos[i] * q_strides[2] + lane * E;
  for (int e = 0; e < E; e++) {
    qv[i][e] = qvalid[i] ? float(qr[e]) * scale : 0.0f;
  }
  if (part == 0 && params[17] != 0) {
    // part is uniform over the simdgroup, so every lane takes the simd_sum
    float acc = 0.0f;
    for (int e = 0; e < E; e++) {
      acc += qv[i][e] * k_mean[(b * n_kv + kvh) * D + lane * E + e];
    }
    acc = simd_sum(acc);
    if (lane == 0) {
      part_shift[z * QB + i] = acc;
    }
  }
  if (seg == 1) {
    // the packed keys' domain: r(q * scale * lam), as attention._prepare_queries + hadamard
    for (int e = 0; e < E; e++) {
      if (has_lam) {
        qv[i][e] *= lam[(b * n_kv + kvh) * D + lane * E + e];
      }
      if (k_rotated) {
        qv[i][e] *= k_signs[lane * E + e];
      }
    }
    if (k_rotated) {
      oiq_wht<E>(qv[i], lane, rot_scale);
    }
  }
  qsum[i] = 0.0f;
  for (int e = 0; e < E; e++) {
    qsum[i] += qv[i][e];
  }
}

float m[QB];
float lsum[QB];
float o[QB][E];
for (int i = 0; i < QB; i++) {
  m[i] = -INFINITY;
  lsum[i] = 0.0f;
  for (int e = 0; e < E; e++) {
    o[i][e] = 0.0f;
  }
}

// KF keys in flight: the loads and partial dot products of keys t .. t+KF-1 are
// issued before their simd_sums and softmax updates, which then run in order
// (the same float operations as one key at a time).  A slice never straddles
// two segments, so the segment branch is uniform over the whole loop.
bool fp_seg = seg != 1;
for (int t = t0; t < t1; t += KF) {
  float partial[KF][QB];
  float vv[KF][E];
  for (int j = 0; j < KF; j++) {
    // past the slice's end: re-read key t (in bounds) and skip its update below
    int tj = t + j < t1 ? t + j : t;
    if (fp_seg) {
      bool sink = seg == 0;
      int tr = sink ? tj : tj - n_sink - n_quant;
      const device FT* kr = sink
          ? sk + b * sk_strides[0] + kvh * sk_strides[1] + tr * sk_strides[2] + lane * E
          : rk + b * rk_strides[0] + kvh * rk_strides[1] + tr * rk_strides[2] + lane * E;
      const device FT* vr = sink
          ? sv + b * sv_strides[0] + kvh * sv_strides[1] + tr * sv_strides[2] + lane * E
          : rv + b * rv_strides[0] + kvh * rv_strides[1] + tr * rv_strides[2] + lane * E;
      float kk[E];
      for (int e = 0; e < E; e++) {
        kk[e] = float(kr[e]);
      }
      for (int i = 0; i < QB; i++) {
        float acc = 0.0f;
        for (int e = 0; e < E; e++) {
          acc += qv[i][e] * kk[e];
        }
        partial[j][i] = acc;
      }
      for (int e = 0; e < E; e++) {
        vv[j][e] = float(vr[e]);
      }
    } else {
      int tq = tj - n_sink;
      uint c[E];
      oiq_unpack<E>(kc + b * kc_strides[0] + kvh * kc_strides[1] + tq * kc_strides[2], kbits, lane, c);
      float ks_ = float(ks[b * ks_strides[0] + kvh * ks_strides[1] + tq * ks_strides[2] + lane * E / group]);
      float kf[E];
      for (int e = 0; e < E; e++) {
        kf[e] = float(c[e]);
      }
      // q . (s * (c - h)) = s * (q . c - h * sum(q)): one multiply per value.
      for (int i = 0; i < QB; i++) {
        float acc = 0.0f;
        for (int e = 0; e < E; e++) {
          acc += qv[i][e] * kf[e];
        }
        partial[j][i] = ks_ * (acc - khalf * qsum[i]);
      }
      uint cv[E];
      oiq_unpack<E>(vc + b * vc_strides[0] + kvh * vc_strides[1] + tq * vc_strides[2], vbits, lane, cv);
      float vs_ = float(vs[b * vs_strides[0] + kvh * vs_strides[1] + tq * vs_strides[2] + lane * E / group]);
      for (int e = 0; e < E; e++) {
        vv[j][e] = (float(cv[e]) - vhalf) * vs_;
      }
    }
  }
  float score[KF][QB];
  for (int j = 0; j < KF; j++) {
    for (int i = 0; i < QB; i++) {
      score[j][i] = simd_sum(partial[j][i]);
    }
  }
  for (int j = 0; j < KF && t + j < t1; j++) {
    int tj = t + j;
    for (int i = 0; i < QB; i++) {
      float s = score[j][i];
      if (mask_mode == 1) {
        s = tj <= T - L + qpos[i] ? s : -INFINITY;
      } else if (mask_mode >= 2) {
        float mv = mask[b * mask_strides[0] + qhead[i] * mask_strides[1] + qpos[i] * mask_strides[2] +
                        tj * mask_strides[3]];
        if (mask_mode == 2) {
          s = mv != 0.0f ? s : -INFINITY;
        } else {
          s += float(mv);
        }
      }
      // s is uniform across the simdgroup, so these branches are too.  One exp per
      // key, fast::exp (metal/README.md, "fast::exp"): its argument is <= 0 on both
      // sides.  A key below the running max adds its weight exp(s - m); a new max
      // rescales what came before by exp(m - s) and adds weight 1 (nothing to rescale
      // for the first key: m = -inf, f = 0, no exp of -inf).  NaN scores (a NaN group
      // in the cache) are let through so that they show: s > m is false for NaN, and
      // the weight is the NaN itself, not left to fast::exp.
      if (s > m[i]) {
        float f = m[i] == -INFINITY ? 0.0f : fast::exp(m[i] - s);
        lsum[i] = lsum[i] * f + 1.0f;
        for (int e = 0; e < E; e++) {
          o[i][e] = o[i][e] * f + vv[j][e];
        }
        m[i] = s;
      } else if (s != -INFINITY) {
        float p = s == s ? fast::exp(s - m[i]) : s;
        lsum[i] += p;
        for (int e = 0; e < E; e++) {
          o[i][e] += p * vv[j][e];
        }
      }
    }
  }
}

// The threadgroup's slices merged into one partial, as decode_merge.metal merges
// partials: precise exps, one per slice and query row; a slice whose max is
// -inf (empty, or every key masked) adds nothing.
for (int i = 0; i < QB; i++) {
  for (int e = 0; e < E; e++) {
    tg_o[(sg * QB + i) * D + lane * E + e] = o[i][e];
  }
  if (lane == 0) {
    tg_ml[(sg * QB + i) * 2] = m[i];
    tg_ml[(sg * QB + i) * 2 + 1] = lsum[i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  for (int i = 0; i < QB; i++) {
    float mm = -INFINITY;
    for (int s2 = 0; s2 < TGP; s2++) {
      mm = max(mm, tg_ml[(s2 * QB + i) * 2]);
    }
    float ls = 0.0f;
    float acc[E];
    for (int e = 0; e < E; e++) {
      acc[e] = 0.0f;
    }
    for (int s2 = 0; s2 < TGP; s2++) {
      float ms = tg_ml[(s2 * QB + i) * 2];
      if (ms > -INFINITY) {
        float f = exp(ms - mm);
        ls += tg_ml[(s2 * QB + i) * 2 + 1] * f;
        for (int e = 0; e < E; e++) {
          acc[e] += tg_o[(s2 * QB + i) * D + lane * E + e] * f;
        }
      }
    }
    size_t slot = (size_t(z) * (n_parts / TGP) + part / TGP) * QB + i;
    for (int e = 0; e < E; e++) {
      part_o[slot * D + lane * E + e] = acc[e];
    }
    if (lane == 0) {
      part_ml[slot * 2] = mm;
      part_ml[slot * 2 + 1] = ls;
    }
  }
}
