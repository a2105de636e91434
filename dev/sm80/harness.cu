// sm80 forward harness: correctness vs f64 CPU reference + timing. Usage: ./h check|rand N|time
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
#include <vector>
#include <string>
#include <algorithm>
#include <chrono>
#include <omp.h>
#include "common/params.h"
#include "reg.h"
#include "sm80/fwd.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1);} } while (0)

static std::vector<KEntry> g_k;

static inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull; x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull; return x ^ (x >> 31);
}
static inline float u01(uint64_t s) { return (mix(s) >> 40) * (1.0f / 16777216.0f); }
static inline uint16_t f2t(float f, int dt) {
  if (dt == 0) { __nv_bfloat16 h = __float2bfloat16_rn(f); uint16_t u; memcpy(&u, &h, 2); return u; }
  __half h = __float2half_rn(f); uint16_t u; memcpy(&u, &h, 2); return u;
}
static inline float t2f(uint16_t u, int dt) {
  if (dt == 0) { uint32_t x = (uint32_t)u << 16; float f; memcpy(&f, &x, 4); return f; }
  __half h; memcpy(&h, &u, 2); return __half2float(h);
}

struct Prob {
  int dt, b, hq, hkv, sq, sk, d, mask, wl, wr, layout;
  float qscale; uint64_t seed;
};
struct Strides { int64_t bs, rs, hs; int64_t size; };

static Strides make_strides(int layout, int b, int s, int h, int d, uint64_t seed, int which) {
  Strides st;
  if (layout == 0) { st.hs = d; st.rs = (int64_t)h * d; st.bs = (int64_t)s * st.rs; }
  else if (layout == 2) {  // padded
    st.hs = d + 8 * (1 + mix(seed + which) % 3); st.rs = h * st.hs + 8 * (mix(seed + 7 + which) % 4);
    st.bs = s * st.rs + 8 * (mix(seed + 13 + which) % 5);
  } else {  // layout 3: (b, h, s, d)
    st.rs = d; st.hs = (int64_t)s * d + 8; st.bs = h * st.hs + 16;
  }
  st.size = (b - 1) * st.bs + (int64_t)(s - 1) * st.rs + (int64_t)(h - 1) * st.hs + d;
  return st;
}

struct Res { double err, err_naive, rel_l2, lse_err; bool ok; std::string why; };

static const KEntry* find_k(int dt, int d, int mask, int cfg_idx) {
  int n = 0;
  for (auto& k : g_k) if (k.dt == dt && k.d == d && k.mask == mask) { if (n == cfg_idx) return &k; n++; }
  return nullptr;
}

// The entry with the same tile as `name` (a mask-0 name) and mask `mask`.
static const KEntry* find_named(const std::string& name, int mask) {
  std::string want = name;
  size_t at = want.find("_m0_");
  if (at == std::string::npos) return nullptr;
  want[at + 2] = (char)('0' + mask);
  for (auto& k : g_k) if (k.name == want) return &k;
  return nullptr;
}

static void launch(const KEntry& k, const FcParams& p, cudaStream_t st = 0) {
  int smem = fc_sm80::fwd_smem_bytes(k.d, k.bm, k.bn, k.warps, k.stages, k.opt);
  static const void* last_set[4096]; static int nset = 0;
  bool found = false;
  for (int i = 0; i < nset; i++) if (last_set[i] == k.fn) found = true;
  if (!found) {
    CK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    last_set[nset++] = k.fn;
  }
  // masked kernels: (heads, query blocks, batch), heaviest query blocks first (kernels/sm80/fwd.cuh)
  dim3 grid = k.mask ? dim3(p.hq, (p.sq + k.bm - 1) / k.bm, p.b) : dim3((p.sq + k.bm - 1) / k.bm, p.hq, p.b);
  void* args[] = {(void*)&p};
  CK(cudaLaunchKernel(k.fn, grid, dim3(k.warps * 32), args, smem, st));
  CK(cudaGetLastError());
}

static Res run_check(const KEntry& K, const Prob& P) {
  Res R{0, 0, 0, 0, true, ""};
  const int d = P.d, dt = P.dt;
  Strides qs, ks, vs, os;
  int64_t koff = 0, voff = 0, qkv_size = 0;
  bool packed = (P.layout == 1);
  if (packed) {  // q,k,v narrowed views of one (b, s, hq+2hkv, d) buffer; requires sq == sk
    int H = P.hq + 2 * P.hkv;
    Strides t; t.hs = d; t.rs = (int64_t)H * d; t.bs = (int64_t)P.sq * t.rs;
    qs = ks = vs = t; koff = (int64_t)P.hq * d; voff = (int64_t)(P.hq + P.hkv) * d;
    qkv_size = (P.b - 1) * t.bs + (int64_t)(P.sq - 1) * t.rs + (int64_t)(H - 1) * t.hs + d;
    os = make_strides(2, P.b, P.sq, P.hq, d, P.seed, 3);
  } else {
    qs = make_strides(P.layout, P.b, P.sq, P.hq, d, P.seed, 0);
    ks = make_strides(P.layout, P.b, P.sk, P.hkv, d, P.seed, 1);
    vs = make_strides(P.layout, P.b, P.sk, P.hkv, d, P.seed, 2);
    os = make_strides(P.layout, P.b, P.sq, P.hq, d, P.seed, 3);
  }
  std::vector<uint16_t> hq_, hk_, hv_;
  auto fill = [&](std::vector<uint16_t>& v, int64_t n, uint64_t seed, float sc) {
    v.resize(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      float a = u01(seed * 1000003ull + 2 * i), bb = u01(seed * 1000003ull + 2 * i + 1);
      float x = (a + bb - 1.0f) * 2.4f;  // triangular, var ~0.96
      v[i] = f2t(x * sc, dt);
    }
  };
  if (packed) fill(hq_, qkv_size, P.seed + 1, 1.0f);
  else { fill(hq_, qs.size, P.seed + 1, P.qscale); fill(hk_, ks.size, P.seed + 2, 1.0f); fill(hv_, vs.size, P.seed + 3, 1.0f); }
  if (packed && P.qscale != 1.0f) {  // scale q heads in place
    for (int b = 0; b < P.b; b++) for (int i = 0; i < P.sq; i++) for (int h = 0; h < P.hq; h++)
      for (int c = 0; c < d; c++) { int64_t o = b * qs.bs + i * qs.rs + h * qs.hs + c; hq_[o] = f2t(t2f(hq_[o], dt) * P.qscale, dt); }
  }
  const uint16_t* Q = hq_.data();
  const uint16_t* Kh = packed ? hq_.data() + koff : hk_.data();
  const uint16_t* Vh = packed ? hq_.data() + voff : hv_.data();

  void *dq, *dk = nullptr, *dv = nullptr, *dov; float* dl;
  int64_t lse_n = (int64_t)P.b * P.hq * P.sq;
  if (packed) { CK(cudaMalloc(&dq, qkv_size * 2)); CK(cudaMemcpy(dq, hq_.data(), qkv_size * 2, cudaMemcpyHostToDevice)); }
  else {
    CK(cudaMalloc(&dq, qs.size * 2)); CK(cudaMalloc(&dk, ks.size * 2)); CK(cudaMalloc(&dv, vs.size * 2));
    CK(cudaMemcpy(dq, hq_.data(), qs.size * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, hk_.data(), ks.size * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv_.data(), vs.size * 2, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&dov, os.size * 2 + 64)); CK(cudaMalloc(&dl, lse_n * 4 + 64));
  CK(cudaMemset(dov, 0xFF, os.size * 2 + 64));  // 0xFFFF: NaN in f16 and bf16
  CK(cudaMemset(dl, 0xFF, lse_n * 4 + 64));     // NaN f32
  FcParams p; memset(&p, 0, sizeof(p));
  p.q = dq; p.k = packed ? (void*)((uint16_t*)dq + koff) : dk; p.v = packed ? (void*)((uint16_t*)dq + voff) : dv;
  p.o = dov; p.lse = dl;
  p.q_batch_stride = qs.bs; p.q_row_stride = qs.rs; p.q_head_stride = qs.hs;
  p.k_batch_stride = ks.bs; p.k_row_stride = ks.rs; p.k_head_stride = ks.hs;
  p.v_batch_stride = vs.bs; p.v_row_stride = vs.rs; p.v_head_stride = vs.hs;
  p.o_batch_stride = os.bs; p.o_row_stride = os.rs; p.o_head_stride = os.hs;
  p.b = P.b; p.hq = P.hq; p.hkv = P.hkv; p.sq = P.sq; p.sk = P.sk; p.d = d; p.h_ratio = P.hq / P.hkv;
  p.lse_batch_stride = (int64_t)P.hq * P.sq; p.lse_head_stride = P.sq;  // dense LSE (b, hq, sq)
  p.scale = 1.0f / sqrtf((float)d); p.scale_log2 = p.scale * 1.4426950408889634f; p.softcap = 0;
  p.window_left = P.mask == 1 ? -1 : (P.mask == 2 ? P.wl : -1);
  p.window_right = P.mask == 1 ? 0 : (P.mask == 2 ? P.wr : -1);
  p.num_splits = 1;
  launch(K, p);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> ho(os.size + 32); std::vector<float> hl(lse_n + 16);
  CK(cudaMemcpy(ho.data(), dov, os.size * 2 + 64, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl.data(), dl, lse_n * 4 + 64, cudaMemcpyDeviceToHost));
  CK(cudaFree(dq)); if (dk) CK(cudaFree(dk)); if (dv) CK(cudaFree(dv)); CK(cudaFree(dov)); CK(cudaFree(dl));

  // 1. every in-view O element finite, everything outside the view still poison; LSE never NaN
  std::vector<uint8_t> cov(os.size + 32, 0);
  int64_t bad_nan = 0, bad_poison = 0;
  for (int b = 0; b < P.b; b++) for (int i = 0; i < P.sq; i++) for (int h = 0; h < P.hq; h++) {
    int64_t base = b * os.bs + i * os.rs + h * os.hs;
    for (int c = 0; c < d; c++) { cov[base + c] = 1; if (!std::isfinite(t2f(ho[base + c], dt))) bad_nan++; }
  }
  for (int64_t i = 0; i < os.size + 32; i++) if (!cov[i] && ho[i] != 0xFFFF) bad_poison++;
  for (int64_t i = 0; i < lse_n; i++) if (std::isnan(hl[i]) || hl[i] == INFINITY) bad_nan++;
  for (int64_t i = lse_n; i < lse_n + 16; i++) { uint32_t u; memcpy(&u, &hl[i], 4); if (u != 0xFFFFFFFFu) bad_poison++; }
  if (bad_nan || bad_poison) { R.ok = false; R.why = "nan=" + std::to_string(bad_nan) + " poison=" + std::to_string(bad_poison); }

  // 2. sampled rows vs f64 reference
  int64_t nrows = (int64_t)P.b * P.hq * P.sq;
  std::vector<int64_t> rows;
  if (nrows <= 3000) { for (int64_t r = 0; r < nrows; r++) rows.push_back(r); }
  else {
    for (int s = 0; s < 1500; s++) rows.push_back(mix(P.seed * 31 + s) % nrows);
    for (int h = 0; h < P.hq; h++) { rows.push_back((int64_t)h * P.sq); rows.push_back((int64_t)h * P.sq + P.sq - 1); }
  }
  const double scale = 1.0 / sqrt((double)d);
  double err = 0, errn = 0, lerr = 0, se = 0, sr = 0;
  int64_t bad_empty = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(max: err, errn, lerr) reduction(+: se, sr, bad_empty)
  for (size_t ri = 0; ri < rows.size(); ri++) {
    int64_t r = rows[ri];
    int b = r / ((int64_t)P.hq * P.sq), h = (r / P.sq) % P.hq, i = r % P.sq;
    int hk = h / (P.hq / P.hkv);
    int diag = i + P.sk - P.sq, lo = 0, hi = P.sk;
    if (P.mask == 1) hi = std::min(hi, diag + 1);
    if (P.mask == 2) { if (P.wr >= 0) hi = std::min(hi, diag + P.wr + 1); if (P.wl >= 0) lo = std::max(lo, diag - P.wl); }
    const uint16_t* qrow = Q + b * qs.bs + (int64_t)i * qs.rs + h * qs.hs;
    const uint16_t* orow = ho.data() + b * os.bs + (int64_t)i * os.rs + h * os.hs;
    float lk = hl[((int64_t)b * P.hq + h) * P.sq + i];
    if (hi <= lo) {
      for (int c = 0; c < d; c++) if (orow[c] != 0) bad_empty++;
      if (lk != -INFINITY) bad_empty++;
      continue;
    }
    std::vector<double> qd(d), s(hi - lo), o(d, 0.0), on(d, 0.0);
    for (int c = 0; c < d; c++) qd[c] = t2f(qrow[c], dt);
    double m = -1e300;
    for (int j = lo; j < hi; j++) {
      const uint16_t* kr = Kh + b * ks.bs + (int64_t)j * ks.rs + hk * ks.hs;
      double a = 0; for (int c = 0; c < d; c++) a += qd[c] * t2f(kr[c], dt);
      s[j - lo] = a * scale; m = std::max(m, s[j - lo]);
    }
    double l = 0;
    for (int j = lo; j < hi; j++) {
      double pj = exp(s[j - lo] - m); l += pj;
      double pn = t2f(f2t((float)pj, dt), dt);  // same-precision naive: P rounded to T
      const uint16_t* vr = Vh + b * vs.bs + (int64_t)j * vs.rs + hk * vs.hs;
      for (int c = 0; c < d; c++) { double vv = t2f(vr[c], dt); o[c] += pj * vv; on[c] += pn * vv; }
    }
    for (int c = 0; c < d; c++) {
      double ref = o[c] / l, nv = t2f(f2t((float)(on[c] / l), dt), dt), kv = t2f(orow[c], dt);
      err = std::max(err, fabs(kv - ref)); errn = std::max(errn, fabs(nv - ref));
      se += (kv - ref) * (kv - ref); sr += ref * ref;
    }
    double lse = m + log(l);
    lerr = std::max(lerr, std::isfinite(lk) ? fabs(lk - lse) : 1e30);
  }
  R.err = err; R.err_naive = errn; R.lse_err = lerr; R.rel_l2 = sr > 0 ? sqrt(se / sr) : sqrt(se);
  double floor_ = dt == 0 ? 2e-3 : 3e-4;
  if (bad_empty) { R.ok = false; R.why += " empty_rows_bad=" + std::to_string(bad_empty); }
  if (!(err <= 2 * errn + floor_)) { R.ok = false; R.why += " err"; }
  if (!(lerr <= 2e-3)) { R.ok = false; R.why += " lse"; }
  if (!(R.rel_l2 <= (dt == 0 ? 1e-2 : 2e-3))) { R.ok = false; R.why += " relL2"; }
  return R;
}

static int nfail = 0, npass = 0;
static void check_one(const KEntry& K, const Prob& P, bool verbose) {
  Res r = run_check(K, P);
  if (r.ok) npass++; else nfail++;
  if (verbose || !r.ok)
    printf("%s %-34s b%d h%d/%d sq%5d sk%5d L%d w(%d,%d) qs%.1f: err %.2e naive %.2e relL2 %.2e lse %.1e %s\n",
           r.ok ? "PASS" : "FAIL", K.name.c_str(), P.b, P.hq, P.hkv, P.sq, P.sk, P.layout, P.wl, P.wr,
           P.qscale, r.err, r.err_naive, r.rel_l2, r.lse_err, r.why.c_str());
  fflush(stdout);
}

__global__ void fill_rand(uint16_t* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t z = i * 0x9e3779b97f4a7c15ull + seed; z ^= z >> 29; z *= 0xbf58476d1ce4e5b9ull; z ^= z >> 32;
    float f = ((z & 0xFFFFFF) / 16777216.0f - 0.5f) * 3.4f;
    __nv_bfloat16 h = __float2bfloat16_rn(f); x[i] = *(uint16_t*)&h;
  }
}

// Buffers of the fa3-grid timings (16k tokens x up to 2048 features each, random), the events
// and the 256 MB L2 flush buffer (like triton's do_bench).
struct TimeBufs {
  uint16_t *q, *k, *v, *o; float* l;
  cudaEvent_t e0, e1;
  void* flush;
  static constexpr size_t FLUSH_BYTES = (size_t)256 << 20;
  TimeBufs() {
    const size_t maxn = (size_t)16384 * 2048;
    CK(cudaMalloc(&q, maxn * 2)); CK(cudaMalloc(&k, maxn * 2)); CK(cudaMalloc(&v, maxn * 2)); CK(cudaMalloc(&o, maxn * 2));
    CK(cudaMalloc(&l, 16384 * 32 * 4));
    fill_rand<<<1024, 256>>>(q, maxn, 1); fill_rand<<<1024, 256>>>(k, maxn, 2); fill_rand<<<1024, 256>>>(v, maxn, 3);
    CK(cudaDeviceSynchronize());
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaMalloc(&flush, FLUSH_BYTES));
  }
  // fa3-grid problem of head dim d (h = 32 / 16 / 8 heads for d64 / d128 / d256), seqlen s.
  FcParams params(int d, int s, bool causal) const {
    const int h = d == 64 ? 32 : d == 128 ? 16 : 8, b = 16384 / s;
    FcParams p; memset(&p, 0, sizeof(p));
    p.q = q; p.k = k; p.v = v; p.o = o; p.lse = l;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = (int64_t)h * d;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = (int64_t)s * h * d;
    p.b = b; p.hq = h; p.hkv = h; p.sq = s; p.sk = s; p.d = d; p.h_ratio = 1;
    p.lse_batch_stride = (int64_t)h * s; p.lse_head_stride = s;
    p.scale = 1.0f / sqrtf((float)d); p.scale_log2 = p.scale * 1.4426950408889634f;
    p.window_left = -1; p.window_right = causal ? 0 : -1; p.num_splits = 1;
    return p;
  }
  // Median seconds of `reps` event-timed calls, each after a flush; `it` numbers the flushes.
  double median(const KEntry& K, const FcParams& p, int reps, int& it) {
    std::vector<float> ts;
    for (int j = 0; j < reps; j++, it++) {
      CK(cudaMemsetAsync(flush, it & 0xff, FLUSH_BYTES));
      CK(cudaEventRecord(e0)); launch(K, p); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2] * 1e-3;
  }
};

static double fa3_tflops(const FcParams& p, bool causal, double t) {
  const double avg_sk = causal ? (double)p.sk / 2 : p.sk;  // sq == sk: (0 + sk)/2
  return 4.0 * p.b * p.hq * (double)p.sq * avg_sk * p.d / t / 1e12;
}

static void time_all(const char* only) {
  const int seqs[6] = {512, 1024, 2048, 4096, 8192, 16384};
  TimeBufs B;
  printf("TIME config                            seq causal    us     TFLOPS\n");
  for (auto& K : g_k) {
    if (K.dt != 0 || K.mask == 2) continue;
    if (only && !strstr(K.name.c_str(), only)) continue;
    for (int s : seqs) {
      const FcParams p = B.params(K.d, s, K.mask == 1);
      for (int w = 0; w < 3; w++) launch(K, p);
      CK(cudaDeviceSynchronize());
      int it = 0;
      const double t = B.median(K, p, 30, it);
      printf("TIME %-34s %5d %d %9.1f %7.1f\n", K.name.c_str(), s, K.mask, t * 1e6, fa3_tflops(p, K.mask == 1, t));
      fflush(stdout);
    }
  }
}

// Sustained timing: the H100 holds its 700 W cap (nvidia-smi clocks_event_reasons 0x4, SW power cap)
// during any long run, so what counts between tile configs is throughput at the capped clock.
// Per config and shape: `heat_s` seconds of back-to-back calls (with the L2 flush), then 40 timed
// calls, median. Two passes, configs in forward then reverse order (temperature drifts upward).
static void time_sustained(double heat_s, const char* only) {
  const int seqs[3] = {2048, 16384, 16384};
  const int causal[3] = {0, 0, 1};
  TimeBufs B;
  std::vector<const KEntry*> ks;
  for (auto& K : g_k)
    if (K.dt == 0 && K.mask == 0 && (!only || strstr(K.name.c_str(), only))) ks.push_back(&K);
  for (int pass = 0; pass < 2; pass++)
    for (size_t i = 0; i < ks.size(); i++) {
      const KEntry& K0 = *ks[pass ? ks.size() - 1 - i : i];
      for (int si = 0; si < 3; si++) {
        const KEntry* kp = causal[si] ? find_named(K0.name, 1) : &K0;
        if (!kp) continue;
        const KEntry& K = *kp;
        const FcParams p = B.params(K.d, seqs[si], causal[si]);
        auto t0 = std::chrono::steady_clock::now();
        int it = 0;
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < heat_s) {
          for (int j = 0; j < 8; j++, it++) { CK(cudaMemsetAsync(B.flush, it & 0xff, TimeBufs::FLUSH_BYTES)); launch(K, p); }
          CK(cudaDeviceSynchronize());
        }
        const double t = B.median(K, p, 40, it);
        printf("SUST %-34s %5d %d pass%d %9.1f %7.1f\n", K.name.c_str(), seqs[si], causal[si], pass, t * 1e6,
               fa3_tflops(p, causal[si], t));
        fflush(stdout);
      }
    }
}

int main(int argc, char** argv) {
  reg_d64(g_k); reg_d128(g_k); reg_d256(g_k);
  const char* mode = argc > 1 ? argv[1] : "check";
  cudaFree(0);
  if (!strcmp(mode, "check")) {
    // Sweep on the primary config (index 0) per d; all dtypes, masks none/causal.
    const int seqs[6] = {1, 7, 113, 256, 1023, 4224};
    const int gq[3][2] = {{8, 8}, {8, 2}, {8, 1}};
    int n = 0;
    for (int dt = 0; dt < 2; dt++) for (int d : {64, 128, 256}) for (int mask = 0; mask < 2; mask++)
      for (int a = 0; a < 6; a++) for (int c = 0; c < 6; c++) {
        Prob P; P.dt = dt; P.d = d; P.mask = mask; P.sq = seqs[a]; P.sk = seqs[c];
        int g = n % 3; P.hq = gq[g][0]; P.hkv = gq[g][1];
        P.b = (P.sq * P.sk <= 256 * 256) ? 2 : 1; P.wl = -1; P.wr = mask ? 0 : -1;
        P.layout = (n % 5 == 4) ? 2 : 0; P.qscale = 1.0f; P.seed = 1000 + n; n++;
        for (int ci = 0; find_k(dt, d, mask, ci); ci++) { P.seed += 100000; check_one(*find_k(dt, d, mask, ci), P, false); }
      }
    printf("sweep: %d pass %d fail\n", npass, nfail);
    // strided: q/k/v as narrowed views of a packed qkv buffer; (b,h,s,d) layout; padded
    for (int dt = 0; dt < 2; dt++) for (int d : {64, 128, 256}) for (int mask = 0; mask < 3; mask++) {
      Prob P{dt, 2, 8, 2, 300, 300, d, mask, mask == 2 ? 40 : -1, mask == 2 ? 7 : (mask ? 0 : -1), 1, 1.0f, 77ull + d + mask};
      for (int ci = 0; find_k(dt, d, mask, ci); ci++) {
        P.layout = 1; P.sq = P.sk = 300; P.seed++;
        check_one(*find_k(dt, d, mask, ci), P, ci == 0);
        P.layout = 3; P.sq = 129; P.sk = 517; P.seed++;
        check_one(*find_k(dt, d, mask, ci), P, ci == 0);
      }
    }
    printf("after strided: %d pass %d fail\n", npass, nfail);
  }
  if (!strcmp(mode, "check") || !strcmp(mode, "rand")) {
    int N = argc > 2 ? atoi(argv[2]) : 500;
    int p0 = npass, f0 = nfail;
    for (int t = 0; t < N; t++) {
      uint64_t s = 0xabc000 + t;
      Prob P; P.dt = mix(s) & 1; int dsel = mix(s + 1) % 3; P.d = dsel == 0 ? 64 : dsel == 1 ? 128 : 256;
      P.mask = mix(s + 2) % 3;
      auto rlen = [&](uint64_t z) { double u = u01(z); return std::max(1, (int)exp(u * log(1500.0))); };
      P.sq = rlen(s + 3); P.sk = rlen(s + 4);
      if (mix(s + 5) % 4 == 0) P.sk = P.sq;
      int rat[4] = {1, 2, 4, 8}; P.hkv = 1 + mix(s + 6) % 3; P.hq = P.hkv * rat[mix(s + 7) % 4];
      P.b = 1 + mix(s + 8) % 3;
      P.wl = (mix(s + 9) % 3 == 0) ? -1 : (int)(mix(s + 10) % 300);
      P.wr = (mix(s + 11) % 3 == 0) ? -1 : (int)(mix(s + 12) % 300);
      if (P.mask == 0) { P.wl = P.wr = -1; } if (P.mask == 1) { P.wl = -1; P.wr = 0; }
      P.layout = mix(s + 13) % 4; if (P.layout == 1 && P.sq != P.sk) P.layout = 0;
      P.qscale = 1.0f + 3.0f * u01(s + 14); P.seed = s;
      int ncfg = 0; while (find_k(P.dt, P.d, P.mask, ncfg)) ncfg++;
      if (ncfg == 0) continue;  // no kernel of this head dim in this build
      check_one(*find_k(P.dt, P.d, P.mask, mix(s + 15) % ncfg), P, false);
    }
    printf("random: %d pass %d fail (of %d)\n", npass - p0, nfail - f0, N);
  }
  if (!strcmp(mode, "time")) time_all(argc > 2 ? argv[2] : nullptr);
  if (!strcmp(mode, "sustain")) time_sustained(argc > 2 ? atof(argv[2]) : 2.0, argc > 3 ? argv[3] : nullptr);
  printf("TOTAL: %d pass %d fail\n", npass, nfail);
  return nfail ? 1 : 0;
}
