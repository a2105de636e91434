//! Deterministic property test of the public CPU API against an independent f64 model of the
//! numeric contract (README): random shapes (lengths 0, 1, odd, seq_q != seq_k, GQA 1/4/8),
//! v head dims of their own (d_v != d_qk), masks (huge window bounds included), scales, softcap,
//! ALiBi, dtypes, packed prefix sums and
//! paged tables (shuffled, sometimes lying), strided views, and non-finite or huge values. Every
//! call must return the right answer within the dtype's tolerance, or, when the case is invalid,
//! an error naming one of the arguments at fault; never a panic, a wrong answer, or NaN where the
//! model is finite.
//!
//! `FLASHCORE_FUZZ_SEED` (u64, decimal or 0x-hex) and `FLASHCORE_FUZZ_CASES` pick the run; the
//! default is a CI-sized run.

#![allow(clippy::needless_range_loop)] // rows, heads and columns index several arrays at once

use candle_core::{DType, Device, Result, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};

const DEFAULT_SEED: u64 = 0x5eed_0053;
const DEFAULT_CASES: usize = 20_000;

/// splitmix64: a tiny deterministic generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n >= 1).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// Approximately normal (sum of uniforms).
    fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.unit()).sum::<f64>() * 1.732 - 3.464
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let s = std::env::var(name).ok()?;
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Dense,
    Slow,
    Varlen,
    Paged,
    PagedVarlen,
}

/// One generated call and what the model needs to judge it.
struct Case {
    api: Api,
    dtype: DType,
    hq: usize,
    hkv: usize,
    /// Head dim of q and k, and of v (and the output).
    d: usize,
    dv: usize,
    params: flashcore::AttnParams,
    /// Per sequence: query rows, keys (as the model sees them, f64 of the stored values).
    seqs: Vec<SeqData>,
    /// Argument names one of which an error must name; empty = the call must succeed.
    bad: Vec<&'static str>,
    /// Inputs as tensors, by API.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Option<Tensor>,
    cu_k: Option<Tensor>,
    max_q: usize,
    max_k: usize,
    table: Option<Tensor>,
    seqlens: Option<Tensor>,
    /// Row of sequence i's first query row in the output (packed), or batch index (dense).
    desc: String,
}

struct SeqData {
    sq: usize,
    sk: usize,
    q: Vec<f64>, // (sq, hq, d)
    k: Vec<f64>, // (sk, hkv, d)
    v: Vec<f64>, // (sk, hkv, dv)
    /// Slopes of this sequence `(hq,)`, if any.
    slopes: Option<Vec<f32>>,
}

fn values(rng: &mut Rng, n: usize, big: bool) -> Vec<f32> {
    let mag = if big {
        rng.pick(&[1e19f64, 1e30, 1e4])
    } else {
        1.0
    };
    (0..n).map(|_| (rng.normal() * mag) as f32).collect()
}

/// Puts a NaN or an infinity at a random element, sometimes.
fn poison(rng: &mut Rng, xs: &mut [f32]) {
    if !xs.is_empty() && rng.chance(0.08) {
        let at = rng.below(xs.len());
        xs[at] = rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
    }
}

/// The values as stored in `dtype` and read back as f64.
fn stored(xs: &[f32], dtype: DType) -> Result<(Tensor, Vec<f64>)> {
    let t = Tensor::new(xs, &Device::Cpu)?.to_dtype(dtype)?;
    let back = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok((t, back))
}

/// `t` `(rows, h, d)` as the same values in a strided view: heads padded (narrowed) or rows and
/// heads transposed in storage.
fn strided3(rng: &mut Rng, t: &Tensor) -> Result<Tensor> {
    let (r, h, d) = t.dims3()?;
    if rng.chance(0.5) {
        let pad = Tensor::zeros((r, 1, d), t.dtype(), t.device())?;
        Tensor::cat(&[&pad, t, &pad], 1)?.narrow(1, 1, h)
    } else {
        t.transpose(0, 1)?.contiguous()?.transpose(0, 1)
    }
}

/// The same for `(b, s, h, d)`.
fn strided4(rng: &mut Rng, t: &Tensor) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    if rng.chance(0.5) {
        let pad = Tensor::zeros((b, s, 1, d), t.dtype(), t.device())?;
        Tensor::cat(&[&pad, t, &pad], 2)?.narrow(2, 1, h)
    } else {
        t.transpose(1, 2)?.contiguous()?.transpose(1, 2)
    }
}

fn bound(rng: &mut Rng, n: usize) -> Option<usize> {
    if rng.chance(0.2) {
        return None;
    }
    Some(rng.pick(&[
        0,
        1,
        2,
        3,
        n,
        n + 1,
        (1 << 31) - 1,
        1 << 31,
        (1u64 << 32) as usize,
        (1u64 << 40) as usize,
        i64::MAX as usize,
        usize::MAX,
    ]))
}

fn gen_case(rng: &mut Rng) -> Result<Case> {
    let dev = Device::Cpu;
    let api = rng.pick(&[
        Api::Dense,
        Api::Dense,
        Api::Slow,
        Api::Varlen,
        Api::Paged,
        Api::PagedVarlen,
    ]);
    let dtype = rng.pick(&[DType::F32, DType::F64, DType::F16, DType::BF16]);
    let mut bad: Vec<&'static str> = Vec::new();
    let hkv = if rng.chance(0.02) {
        0
    } else {
        rng.pick(&[1usize, 2])
    };
    let ratio = rng.pick(&[1, 4, 8]);
    let mut hq = hkv * ratio;
    if rng.chance(0.02) {
        hq += 1; // not a multiple
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        bad.push("k");
    }
    let d = if rng.chance(0.02) {
        12
    } else {
        rng.pick(&[8usize, 16, 24])
    };
    if !d.is_multiple_of(8) {
        bad.push("q");
    }
    // v's head dim: mostly q's, sometimes its own (narrower or wider), rarely not a multiple of 8.
    let dv = if rng.chance(0.3) {
        if rng.chance(0.05) {
            20
        } else {
            rng.pick(&[8usize, 16, 32, 40])
        }
    } else {
        d
    };
    if !dv.is_multiple_of(8) {
        bad.push("v");
    }
    let b = 1 + rng.below(3);
    // Mostly 1..=9, sometimes 0, sometimes past a 64-key block.
    let len = |rng: &mut Rng| -> usize {
        if rng.chance(0.1) {
            64 + rng.below(10)
        } else if rng.chance(0.04) {
            0
        } else {
            1 + rng.below(9)
        }
    };
    // Options.
    let mut params = flashcore::AttnParams::default();
    let max_len = 80;
    params.mask = match rng.below(4) {
        0 => flashcore::Mask::None,
        1 => flashcore::Mask::Causal,
        _ => flashcore::Mask::Window {
            left: bound(rng, max_len),
            right: bound(rng, max_len),
        },
    };
    if rng.chance(0.2) {
        let c = rng.pick(&[0usize, 1, 2, 3, 5, 8, 64, max_len, usize::MAX]);
        if c == 0 {
            bad.push("chunk");
        }
        params.chunk = Some(c);
    }
    params.softmax_scale = match rng.below(20) {
        0 => {
            bad.push("softmax_scale");
            Some(rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]))
        }
        1..=3 => Some(rng.pick(&[0.0, -1.0, f32::MAX, 1e-30, 2e-38, 3.0, -0.5, 1e20])),
        4..=9 => Some((rng.unit() * 2.0 - 0.5) as f32),
        _ => None,
    };
    if rng.chance(0.2) {
        let c = if rng.chance(0.1) {
            rng.pick(&[0.0, -1.0, f32::NAN, f32::INFINITY])
        } else {
            rng.pick(&[0.5f32, 5.0, 30.0, f32::MAX, 1e-30])
        };
        if !(c.is_finite() && c > 0.0) {
            bad.push("softcap");
        }
        params.softcap = Some(c);
    }
    // 0 (hq,), 1 (b, hq), 2 a wrong shape, 3 none
    let slopes_kind = if rng.chance(0.25) {
        if rng.chance(0.05) {
            2
        } else {
            rng.below(2)
        }
    } else {
        3
    };
    let slope_vals = |rng: &mut Rng, n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                if rng.chance(0.05) {
                    rng.pick(&[1e38f32, f32::NAN, f32::INFINITY, -1.0])
                } else {
                    rng.unit() as f32
                }
            })
            .collect()
    };
    let mut slopes_all: Option<Vec<f32>> = None;
    match slopes_kind {
        0 => {
            let s = slope_vals(rng, hq);
            params.alibi_slopes = Some(Tensor::new(s.as_slice(), &dev)?);
            slopes_all = Some(s);
        }
        1 => {
            let s = slope_vals(rng, b * hq);
            params.alibi_slopes = Some(Tensor::from_vec(s.clone(), (b, hq), &dev)?);
            slopes_all = Some(s);
        }
        2 => {
            bad.push("alibi_slopes");
            params.alibi_slopes = Some(Tensor::new(vec![0.5f32; hq + 1].as_slice(), &dev)?);
        }
        _ => {}
    }
    let slopes_of = |i: usize| -> Option<Vec<f32>> {
        slopes_all.as_ref().map(|s| {
            if slopes_kind == 1 {
                s[i * hq..(i + 1) * hq].to_vec()
            } else {
                s.clone()
            }
        })
    };
    let big = rng.chance(0.05);
    let gen = |rng: &mut Rng, n: usize| -> Result<(Tensor, Vec<f64>)> {
        let mut x = values(rng, n, big);
        poison(rng, &mut x);
        stored(&x, dtype)
    };
    let strided = rng.chance(0.3);
    let mut seqs = Vec::new();
    let (q, k, v, mut cu_q, mut cu_k, mut max_q, mut max_k, mut table, mut seqlens);
    (cu_q, cu_k, table, seqlens) = (None, None, None, None);
    match api {
        Api::Dense | Api::Slow => {
            let (sq, sk) = (len(rng), len(rng));
            if sq == 0 {
                bad.push("q");
            }
            if sk == 0 {
                bad.push("k");
            }
            let (qt, qv) = gen(rng, b * sq * hq * d)?;
            let (kt, kv) = gen(rng, b * sk * hkv * d)?;
            let (vt, vv) = gen(rng, b * sk * hkv * dv)?;
            let (mut qt, mut kt, mut vt) = (
                qt.reshape((b, sq, hq, d))?,
                kt.reshape((b, sk, hkv, d))?,
                vt.reshape((b, sk, hkv, dv))?,
            );
            if strided && hq > 0 && hkv > 0 && sq > 0 && sk > 0 {
                qt = strided4(rng, &qt)?;
                kt = strided4(rng, &kt)?;
                vt = strided4(rng, &vt)?;
            }
            (q, k, v) = (qt, kt, vt);
            for i in 0..b {
                let (qs, ks, vs) = (sq * hq * d, sk * hkv * d, sk * hkv * dv);
                seqs.push(SeqData {
                    sq,
                    sk,
                    q: qv[i * qs..(i + 1) * qs].to_vec(),
                    k: kv[i * ks..(i + 1) * ks].to_vec(),
                    v: vv[i * vs..(i + 1) * vs].to_vec(),
                    slopes: slopes_of(i),
                });
            }
            (max_q, max_k) = (sq, sk);
        }
        Api::Varlen | Api::PagedVarlen | Api::Paged => {
            let lq: Vec<usize> = (0..b).map(|_| len(rng)).collect();
            let lk: Vec<usize> = (0..b).map(|_| len(rng)).collect();
            let lq = if api == Api::Paged {
                let sq = len(rng);
                if sq == 0 {
                    bad.push("q");
                }
                vec![sq; b]
            } else {
                lq
            };
            let (tq, tk) = (lq.iter().sum::<usize>(), lk.iter().sum::<usize>());
            let (qt, qv) = gen(rng, tq * hq * d)?;
            let (kt, kv) = gen(rng, tk * hkv * d)?;
            let (vt, vv) = gen(rng, tk * hkv * dv)?;
            let (mut qt, mut kt, mut vt) = (
                qt.reshape((tq, hq, d))?,
                kt.reshape((tk, hkv, d))?,
                vt.reshape((tk, hkv, dv))?,
            );
            if strided && hq > 0 && hkv > 0 && tq > 0 && tk > 0 {
                qt = strided3(rng, &qt)?;
                kt = strided3(rng, &kt)?;
                vt = strided3(rng, &vt)?;
            }
            let (mut oq, mut ok) = (0, 0);
            for i in 0..b {
                seqs.push(SeqData {
                    sq: lq[i],
                    sk: lk[i],
                    q: qv[oq * hq * d..(oq + lq[i]) * hq * d].to_vec(),
                    k: kv[ok * hkv * d..(ok + lk[i]) * hkv * d].to_vec(),
                    v: vv[ok * hkv * dv..(ok + lk[i]) * hkv * dv].to_vec(),
                    slopes: slopes_of(i),
                });
                oq += lq[i];
                ok += lk[i];
            }
            let prefix = |l: &[usize]| {
                let mut c = vec![0u32];
                for &x in l {
                    c.push(c.last().unwrap() + x as u32);
                }
                c
            };
            let (mut cq, mut ck) = (prefix(&lq), prefix(&lk));
            max_q = lq.iter().copied().max().unwrap_or(0)
                + if rng.chance(0.2) { rng.below(3) } else { 0 };
            max_k = lk.iter().copied().max().unwrap_or(0)
                + if rng.chance(0.2) { rng.below(3) } else { 0 };
            // Lies about the packing.
            if api != Api::Paged && rng.chance(0.1) {
                let which = rng.below(4);
                let (name_cu, name_max, cu, max) = if rng.chance(0.5) || api == Api::PagedVarlen {
                    ("cu_seqlens_q", "max_seqlen_q", &mut cq, &mut max_q)
                } else {
                    ("cu_seqlens_k", "max_seqlen_k", &mut ck, &mut max_k)
                };
                let longest = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
                match which {
                    0 if cu.len() > 2 && cu[1] > 0 => {
                        cu.swap(1, 2); // not monotone unless equal
                        if cu[1] != cu[2] {
                            bad.extend([name_cu, name_max]);
                        }
                    }
                    1 => {
                        cu[0] += 1;
                        bad.extend([name_cu, name_max]);
                    }
                    2 => {
                        *cu.last_mut().unwrap() += 1;
                        bad.extend([name_cu, name_max]);
                    }
                    _ if longest > 0 => {
                        *max = longest - 1;
                        bad.extend([name_cu, name_max]);
                    }
                    _ => {}
                }
            }
            match api {
                Api::Varlen => {
                    q = qt;
                    k = kt;
                    v = vt;
                    cu_q = Some(Tensor::new(cq.as_slice(), &dev)?);
                    cu_k = Some(Tensor::new(ck.as_slice(), &dev)?);
                    if hq == 0 {
                        bad.push("q");
                    }
                }
                _ => {
                    // A paged pool: each sequence's keys in shuffled pages of `ps` rows.
                    let ps = 1 + rng.below(5);
                    let pages: Vec<usize> = lk.iter().map(|&l| l.div_ceil(ps)).collect();
                    let used: usize = pages.iter().sum();
                    let num_pages = used + rng.below(3) + 1;
                    let max_pages = pages.iter().copied().max().unwrap_or(0).max(1) + rng.below(2);
                    let mut ids: Vec<usize> = (0..num_pages).collect();
                    for i in (1..ids.len()).rev() {
                        ids.swap(i, rng.below(i + 1));
                    }
                    // Each pool at its own head dim (k: d, v: dv).
                    let fill = |src: &Tensor| -> Result<Tensor> {
                        let w = src.dim(2)?;
                        let row = hkv * w;
                        // Unused pool rows hold NaN: they must never be read.
                        let mut pool = vec![f64::NAN; num_pages * ps * row];
                        let src = src.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                        let (mut next, mut off) = (0, 0);
                        for i in 0..b {
                            for p in 0..pages[i] {
                                let page = ids[next];
                                next += 1;
                                for r in 0..ps {
                                    let j = p * ps + r;
                                    if j < lk[i] {
                                        let dst = (page * ps + r) * row;
                                        pool[dst..dst + row].copy_from_slice(
                                            &src[(off + j) * row..(off + j + 1) * row],
                                        );
                                    }
                                }
                            }
                            off += lk[i];
                        }
                        Tensor::from_vec(pool, (num_pages, ps, hkv, w), &dev)?.to_dtype(dtype)
                    };
                    let kp = fill(&kt)?;
                    let vp = fill(&vt)?;
                    // The table (same construction as in `fill`).
                    let mut tab = vec![0u32; b * max_pages];
                    let mut next = 0;
                    for i in 0..b {
                        for p in 0..pages[i] {
                            tab[i * max_pages + p] = ids[next] as u32;
                            next += 1;
                        }
                        for p in pages[i]..max_pages {
                            tab[i * max_pages + p] =
                                (rng_fill(i, p) % (2 * num_pages as u64 + 1)) as u32;
                        }
                    }
                    let mut lens: Vec<u32> = lk.iter().map(|&l| l as u32).collect();
                    if rng.chance(0.1) && b > 0 {
                        let i = rng.below(b);
                        if rng.chance(0.5) && pages[i] > 0 {
                            tab[i * max_pages + rng.below(pages[i])] =
                                (num_pages + rng.below(3)) as u32;
                            bad.push("page_table");
                        } else {
                            lens[i] = (max_pages * ps + 1 + rng.below(3)) as u32;
                            bad.push("seqlens_k");
                        }
                    }
                    k = kp;
                    v = vp;
                    table = Some(Tensor::from_vec(tab, (b, max_pages), &dev)?);
                    seqlens = Some(Tensor::new(lens.as_slice(), &dev)?);
                    if api == Api::PagedVarlen {
                        q = qt;
                        cu_q = Some(Tensor::new(cq.as_slice(), &dev)?);
                    } else {
                        let sq = lq[0];
                        q = qt.contiguous()?.reshape((b, sq, hq, d))?;
                        max_q = sq;
                    }
                    if hq == 0 {
                        bad.push("q");
                    }
                }
            }
        }
    }
    let desc = format!(
        "{api:?} {dtype:?} b{b} h{hq}/{hkv} d{d} dv{dv} lens {:?} max ({max_q}, {max_k}) {:?} chunk {:?} scale {:?} softcap {:?} slopes {:?} strided {strided} big {big}",
        seqs.iter().map(|s| (s.sq, s.sk)).collect::<Vec<_>>(),
        params.mask,
        params.chunk,
        params.softmax_scale,
        params.softcap,
        slopes_all.as_ref().map(|s| s.len()),
    );
    Ok(Case {
        api,
        dtype,
        hq,
        hkv,
        d,
        dv,
        params,
        seqs,
        bad,
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        table,
        seqlens,
        desc,
    })
}

/// Garbage for unused page-table entries, a function of the position only (so that the table
/// built in two places agrees).
fn rng_fill(i: usize, p: usize) -> u64 {
    let mut r = Rng((i as u64) << 32 | p as u64);
    r.next()
}

/// The model's answer for one row: `None` = no claim (the scores are beyond what the contract
/// promises, e.g. a dot product whose terms overflow the accumulator).
struct RowWant {
    o: Vec<f64>,
    lse: f64,
    /// Tolerance on O (absolute) and on the LSE.
    tol: f64,
    tol_lse: f64,
}

/// Visible keys `lo..hi` of row `i` (i128, independent of the crate's arithmetic): the mask's
/// band, intersected with the row's chunk `[floor(diag / c) * c, ... + c)` when chunked.
fn visible(
    i: usize,
    sq: usize,
    sk: usize,
    mask: flashcore::Mask,
    chunk: Option<usize>,
) -> (usize, usize) {
    let diag = i as i128 + sk as i128 - sq as i128;
    let (l, r) = mask.bounds();
    let mut lo = l.map_or(0, |l| (diag - l as i128).max(0));
    let mut hi = r.map_or(sk as i128, |r| (diag + r as i128 + 1).min(sk as i128));
    if let Some(c) = chunk.filter(|&c| c > 0) {
        let c = c as i128;
        let start = diag.div_euclid(c) * c;
        lo = lo.max(start);
        hi = hi.min(start + c);
    }
    let lo = lo.max(0);
    let lo = lo.min(sk as i128);
    (lo as usize, hi.max(lo) as usize)
}

#[allow(clippy::too_many_arguments)]
fn model_row(
    s: &SeqData,
    i: usize,
    h: usize,
    hq: usize,
    hkv: usize,
    (d, dv): (usize, usize),
    acc32: bool,
    scale: f64,
    p: &flashcore::AttnParams,
) -> Option<RowWant> {
    let rnd = |x: f64| if acc32 { x as f32 as f64 } else { x };
    let eps = if acc32 { 6e-8 } else { 1.2e-16 };
    let limit = if acc32 { 1e37 } else { 1e300 };
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return None;
    }
    let g = h / (hq / hkv);
    let (lo, hi) = visible(i, s.sq, s.sk, p.mask, p.chunk);
    let qrow = &s.q[(i * hq + h) * d..(i * hq + h + 1) * d];
    let diag = i as f64 + s.sk as f64 - s.sq as f64;
    let pre = scale.abs() <= 1.0;
    let maxf = if acc32 { f32::MAX as f64 } else { f64::MAX };
    let mut scores = Vec::with_capacity(hi - lo);
    let mut errs = Vec::with_capacity(hi - lo);
    for j in lo..hi {
        let krow = &s.k[(j * hkv + g) * d..(j * hkv + g + 1) * d];
        let (mut dot, mut mag) = (0.0, 0.0);
        for x in 0..d {
            let t = if pre {
                rnd(scale * qrow[x]) * krow[x]
            } else {
                qrow[x] * krow[x]
            };
            dot += t;
            if t.is_finite() {
                mag += t.abs();
            }
        }
        // Partial sums may overflow the accumulator beyond this: no claim.
        if mag > limit {
            return None;
        }
        let (sc0, mut e) = if pre {
            (dot, mag * eps * (d as f64 + 4.0))
        } else {
            (scale * dot, mag * scale.abs() * eps * (d as f64 + 4.0))
        };
        // Whether the score overflows is decided by rounding: no claim.
        if sc0.is_finite() && sc0.abs() - e <= maxf && sc0.abs() + e >= maxf {
            return None;
        }
        let mut sc = rnd(sc0);
        if !sc.is_finite() {
            e = 0.0;
        }
        if let Some(c) = p.softcap {
            let c = c as f64;
            sc = rnd(c * rnd(rnd(sc / c).tanh()));
            e = e.min(2.0 * c) + c * eps * 8.0;
        }
        if let Some(sl) = &s.slopes {
            let sl = sl[h];
            let sl = if sl.is_finite() { sl as f64 } else { f64::NAN };
            let bias = rnd(sl * (j as f64 - diag).abs());
            let before = sc;
            sc = rnd(sc - bias);
            if sc.is_finite() && (sc.abs() + e >= maxf) {
                return None;
            }
            e = if sc.is_finite() {
                e + (bias.abs() + before.abs()) * eps * 4.0
            } else {
                0.0
            };
        }
        scores.push(sc);
        errs.push(e);
    }
    let vrow = |j: usize| &s.v[(j * hkv + g) * dv..(j * hkv + g + 1) * dv];
    let out_eps = if acc32 { 1e-6 } else { 1e-13 };
    if scores.iter().any(|x| x.is_nan()) {
        return Some(RowWant {
            o: vec![f64::NAN; dv],
            lse: f64::NAN,
            tol: 0.0,
            tol_lse: 0.0,
        });
    }
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return Some(RowWant {
            o: vec![0.0; dv],
            lse: f64::NEG_INFINITY,
            tol: 0.0,
            tol_lse: 0.0,
        });
    }
    // The score error of the keys that carry weight.
    let err = if m == f64::INFINITY {
        0.0
    } else {
        scores
            .iter()
            .zip(&errs)
            .filter(|(s, e)| s.is_finite() && **s + **e >= m - 40.0)
            .map(|(_, e)| *e)
            .fold(0.0, f64::max)
    };
    let w: Vec<f64> = scores
        .iter()
        .map(|&x| {
            if m == f64::INFINITY {
                (x == f64::INFINITY) as u8 as f64
            } else {
                (x - m).exp()
            }
        })
        .collect();
    let l: f64 = w.iter().sum();
    let mut vmax: f64 = 0.0;
    let mut o = vec![0.0; dv];
    for (jj, &wj) in w.iter().enumerate() {
        for (x, &vx) in vrow(lo + jj).iter().enumerate() {
            o[x] += wj * vx;
            if vx.is_finite() {
                vmax = vmax.max(vx.abs());
            }
        }
    }
    for x in o.iter_mut() {
        *x /= l;
    }
    let lse = if m == f64::INFINITY {
        f64::INFINITY
    } else {
        m + l.ln()
    };
    // Score errors move weights by about 2 * err (relative); the exp and the division a few
    // rounding steps.
    let rel = 4.0 * err + 64.0 * out_eps;
    Some(RowWant {
        o,
        lse,
        tol: rel * vmax + 1e-30,
        tol_lse: 4.0 * err + 1e-5 * (1.0 + lse.abs()),
    })
}

/// Output rounding of the dtype (relative).
fn out_rel(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
        DType::F32 => 1e-6,
        _ => 1e-13,
    }
}

fn run_case(c: &Case) -> Result<(Tensor, Option<Tensor>)> {
    use flashcore::*;
    let p = &c.params;
    match c.api {
        Api::Dense => attention_with_lse(&c.q, &c.k, &c.v, p).map(|(o, l)| (o, Some(l))),
        Api::Slow => attention_slow(&c.q, &c.k, &c.v, p).map(|o| (o, None)),
        Api::Varlen => attention_varlen_with_lse(
            &c.q,
            &c.k,
            &c.v,
            c.cu_q.as_ref().unwrap(),
            c.cu_k.as_ref().unwrap(),
            c.max_q,
            c.max_k,
            p,
        )
        .map(|(o, l)| (o, Some(l))),
        Api::Paged => attention_paged_with_lse(
            &c.q,
            &c.k,
            &c.v,
            c.table.as_ref().unwrap(),
            c.seqlens.as_ref().unwrap(),
            p,
        )
        .map(|(o, l)| (o, Some(l))),
        Api::PagedVarlen => attention_paged_varlen_with_lse(
            &c.q,
            &c.k,
            &c.v,
            c.table.as_ref().unwrap(),
            c.seqlens.as_ref().unwrap(),
            c.cu_q.as_ref().unwrap(),
            c.max_q,
            p,
        )
        .map(|(o, l)| (o, Some(l))),
    }
}

/// Whether `msg` names `arg` as a whole word.
fn names(msg: &str, arg: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    msg.match_indices(arg).any(|(at, _)| {
        !msg[..at].chars().next_back().is_some_and(ident)
            && !msg[at + arg.len()..].chars().next().is_some_and(ident)
    })
}

/// Checks one case; returns a description of what is wrong, if anything.
fn check(c: &Case) -> Option<String> {
    let got = catch_unwind(AssertUnwindSafe(|| run_case(c)));
    let got = match got {
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return Some(format!("PANIC: {msg}"));
        }
        Ok(r) => r,
    };
    let (o, lse) = match (got, c.bad.is_empty()) {
        (Err(e), false) => {
            let msg = e.to_string();
            return if c.bad.iter().any(|a| names(&msg, a)) {
                None
            } else {
                Some(format!("error names none of {:?}: {msg}", c.bad))
            };
        }
        (Err(e), true) => return Some(format!("unexpected error: {e}")),
        (Ok(_), false) => {
            return Some(format!(
                "accepted an invalid case (expected an error naming one of {:?})",
                c.bad
            ))
        }
        (Ok(r), true) => r,
    };
    let acc32 = c.dtype != DType::F64;
    let scale = match c.params.softmax_scale {
        Some(s) => s as f64,
        None if acc32 => (1.0 / (c.d as f32).sqrt()) as f64,
        None => 1.0 / (c.d as f64).sqrt(),
    };
    // The default scale is 1 / sqrt(d_qk), whatever v's head dim.
    let (hq, d, dv) = (c.hq, c.d, c.dv);
    if o.dims().last() != Some(&dv) {
        return Some(format!(
            "output shape {:?}: last dim is not v's {dv}",
            o.dims()
        ));
    }
    let o = o
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1::<f64>());
    let o = match o {
        Ok(o) => o,
        Err(e) => return Some(format!("output unreadable: {e}")),
    };
    let lse = lse.map(|l| {
        l.to_dtype(DType::F64)
            .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
            .unwrap()
    });
    let packed = matches!(c.api, Api::Varlen | Api::PagedVarlen);
    let total_q: usize = c.seqs.iter().map(|s| s.sq).sum();
    let mut row0 = 0;
    let orel = out_rel(c.dtype);
    for (si, s) in c.seqs.iter().enumerate() {
        for i in 0..s.sq {
            for h in 0..hq {
                let Some(want) = model_row(s, i, h, hq, c.hkv, (d, dv), acc32, scale, &c.params)
                else {
                    continue;
                };
                let at = ((row0 + i) * hq + h) * dv;
                let got = &o[at..at + dv];
                for x in 0..dv {
                    let (g, w) = (got[x], want.o[x]);
                    let ok = if w.is_nan() {
                        g.is_nan()
                    } else if !w.is_finite() {
                        !g.is_finite()
                    } else {
                        g.is_finite()
                            && (g - w).abs() <= want.tol + orel * (w.abs() + want.tol) + 1e-300
                    };
                    if !ok {
                        return Some(format!(
                            "seq {si} row {i} head {h} col {x}: got {g}, model {w} (tol {:.3e})",
                            want.tol
                        ));
                    }
                }
                if let Some(lse) = &lse {
                    let li = if packed {
                        h * total_q + row0 + i
                    } else {
                        (si * hq + h) * s.sq + i
                    };
                    let (g, w) = (lse[li], want.lse);
                    let ok = if w.is_nan() {
                        g.is_nan()
                    } else if w.is_infinite() {
                        g == w || (w.abs() > 3e38 && g.is_infinite())
                    } else {
                        (g - w).abs() <= want.tol_lse || (w.abs() > 3e38 && g.is_infinite())
                    };
                    if !ok {
                        return Some(format!("seq {si} row {i} head {h}: lse {g}, model {w}"));
                    }
                }
            }
        }
        row0 += s.sq;
    }
    None
}

#[test]
fn fuzz_public_cpu_api() -> Result<()> {
    let seed = env_u64("FLASHCORE_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let cases = env_u64("FLASHCORE_FUZZ_CASES").map_or(DEFAULT_CASES, |n| n as usize);
    let start = std::time::Instant::now();
    // Panics are caught and reported as findings: keep the default hook from printing each.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut findings = Vec::new();
    let mut rng = Rng(seed);
    let (mut errors, mut ok) = (0usize, 0usize);
    for n in 0..cases {
        let case_seed = rng.next();
        let mut crng = Rng(case_seed);
        let c = match catch_unwind(AssertUnwindSafe(|| gen_case(&mut crng))) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => panic!("case {n} (seed {case_seed:#x}): generator failed: {e}"),
            Err(_) => panic!("case {n} (seed {case_seed:#x}): generator panicked"),
        };
        match check(&c) {
            Some(f) => findings.push(format!(
                "case {n} (case seed {case_seed:#x}) {}: {f}",
                c.desc
            )),
            None if c.bad.is_empty() => ok += 1,
            None => errors += 1,
        }
        if findings.len() >= 20 {
            break;
        }
    }
    std::panic::set_hook(hook);
    eprintln!(
        "fuzz: seed {seed:#x}, {cases} cases ({ok} answered, {errors} rejected as expected), {} findings, {:.1} s",
        findings.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(
        findings.is_empty(),
        "{} findings:\n{}",
        findings.len(),
        findings.join("\n")
    );
    Ok(())
}

/// One random `append_kv_paged` / `append_kv_paged_varlen` call against a model of the write:
/// either the pools afterwards are the pools before with exactly the new rows written at their
/// slots, or the call fails naming an argument at fault and neither pool changed.
fn append_case(rng: &mut Rng) -> Result<Option<String>> {
    let dev = Device::Cpu;
    let dtype = rng.pick(&[DType::F32, DType::F64, DType::F16, DType::BF16]);
    let (np, ps, h, d) = (
        1 + rng.below(6),
        1 + rng.below(5),
        1 + rng.below(2),
        8 * (1 + rng.below(2)),
    );
    // The V pool's head dim: mostly K's, sometimes its own.
    let dv = if rng.chance(0.3) {
        8 * (1 + rng.below(3))
    } else {
        d
    };
    let b = 1 + rng.below(3);
    let max_pages = 1 + rng.below(4);
    let packed = rng.chance(0.5);
    let counts: Vec<usize> = if packed {
        (0..b).map(|_| rng.below(5)).collect()
    } else {
        vec![rng.below(5); b]
    };
    let total: usize = counts.iter().sum();
    let mut bad: Vec<&'static str> = Vec::new();
    let pool_vals = |rng: &mut Rng, d: usize| -> Result<Tensor> {
        let x: Vec<f32> = (0..np * ps * h * d).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(x, (np, ps, h, d), &dev)?.to_dtype(dtype)
    };
    let k_pages = pool_vals(rng, d)?;
    let mut v_pages = pool_vals(rng, dv)?;
    let new_vals = |rng: &mut Rng, d: usize| -> Result<Tensor> {
        let x: Vec<f32> = (0..total * h * d).map(|_| rng.normal() as f32).collect();
        let t = Tensor::from_vec(x, (total, h, d), &dev)?.to_dtype(dtype)?;
        if packed {
            Ok(t)
        } else {
            t.reshape((b, counts[0], h, d))
        }
    };
    let k_new = new_vals(rng, d)?;
    let mut v_new = new_vals(rng, dv)?;
    // Tables: mostly distinct pages per sequence, sometimes shared or outside the pool.
    let mut table = vec![0u32; b * max_pages];
    for e in table.iter_mut() {
        *e = if rng.chance(0.03) {
            (np + rng.below(3)) as u32
        } else {
            rng.below(np) as u32
        };
    }
    let pos: Vec<u32> = (0..b)
        .map(|_| {
            if rng.chance(0.03) {
                (max_pages * ps + rng.below(3)) as u32
            } else {
                rng.below(max_pages * ps) as u32
            }
        })
        .collect();
    // The model of the slots.
    let mut slots: Vec<(usize, usize, usize)> = Vec::new(); // (pool row, seq, row)
    for i in 0..b {
        for j in 0..counts[i] {
            let at = pos[i] as usize + j;
            if at >= max_pages * ps {
                bad.push("positions");
                continue;
            }
            let page = table[i * max_pages + at / ps] as usize;
            if page >= np {
                bad.push("page_table");
                continue;
            }
            let slot = page * ps + at % ps;
            if slots.iter().any(|s| s.0 == slot) {
                bad.push("page_table");
            }
            slots.push((slot, i, j));
        }
    }
    // Structural faults.
    match rng.below(40) {
        0 => {
            v_pages = Tensor::zeros((np, ps, dv, h), dtype, &dev)?.transpose(2, 3)?;
            if h > 1 {
                bad.push("v_pages");
            }
        }
        1 if total > 0 && !packed && counts[0] <= ps => {
            v_new = v_pages
                .narrow(0, 0, 1)?
                .narrow(1, 0, counts[0])?
                .broadcast_as((b, counts[0], h, dv))?;
            // A broadcast view of the pool: same storage.
            bad.push("v_new");
        }
        2 if dv == d => {
            v_pages = k_pages.clone();
            bad.push("v_pages");
        }
        3 => {
            // New V rows at another head dim than their pool's.
            v_new = new_vals(rng, dv + 8)?;
            bad.push("v_new");
        }
        _ => {}
    }
    let before_k = k_pages
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let before_v = v_pages
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let table_t = Tensor::from_vec(table, (b, max_pages), &dev)?;
    let pos_t = Tensor::new(pos.as_slice(), &dev)?;
    let cu: Vec<u32> = std::iter::once(0)
        .chain(counts.iter().scan(0u32, |a, &c| {
            *a += c as u32;
            Some(*a)
        }))
        .collect();
    let cu_t = Tensor::new(cu.as_slice(), &dev)?;
    let got = catch_unwind(AssertUnwindSafe(|| {
        if packed {
            flashcore::append_kv_paged_varlen(
                &k_new, &v_new, &k_pages, &v_pages, &table_t, &cu_t, &pos_t,
            )
        } else {
            flashcore::append_kv_paged(&k_new, &v_new, &k_pages, &v_pages, &table_t, &pos_t)
        }
    }));
    let desc = format!("append {dtype:?} pool ({np}, {ps}, {h}, {d}/{dv}) b{b} counts {counts:?} packed {packed} pos {pos:?} bad {bad:?}");
    let got = match got {
        Err(_) => return Ok(Some(format!("{desc}: PANIC"))),
        Ok(r) => r,
    };
    let after_k = k_pages
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let after_v = v_pages
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    match (got, bad.is_empty()) {
        (Err(e), false) => {
            let msg = e.to_string();
            if !bad.iter().any(|a| names(&msg, a)) {
                return Ok(Some(format!("{desc}: error names none of {bad:?}: {msg}")));
            }
            let same =
                |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same(&before_k, &after_k) || !same(&before_v, &after_v) {
                return Ok(Some(format!("{desc}: rejected but a pool was written")));
            }
            Ok(None)
        }
        (Err(e), true) => Ok(Some(format!("{desc}: unexpected error {e}"))),
        (Ok(()), false) => Ok(Some(format!("{desc}: accepted"))),
        (Ok(()), true) => {
            let (row, vrow) = (h * d, h * dv);
            let (kn, vn) = (
                k_new
                    .to_dtype(DType::F64)?
                    .flatten_all()?
                    .to_vec1::<f64>()?,
                v_new
                    .to_dtype(DType::F64)?
                    .flatten_all()?
                    .to_vec1::<f64>()?,
            );
            let (mut want_k, mut want_v) = (before_k, before_v);
            for &(slot, i, j) in &slots {
                let (src, vsrc) = ((cu[i] as usize + j) * row, (cu[i] as usize + j) * vrow);
                want_k[slot * row..(slot + 1) * row].copy_from_slice(&kn[src..src + row]);
                want_v[slot * vrow..(slot + 1) * vrow].copy_from_slice(&vn[vsrc..vsrc + vrow]);
            }
            if want_k != after_k || want_v != after_v {
                return Ok(Some(format!("{desc}: pools differ from the model")));
            }
            Ok(None)
        }
    }
}

#[test]
fn fuzz_append_kv_paged() -> Result<()> {
    let seed = env_u64("FLASHCORE_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let cases = env_u64("FLASHCORE_FUZZ_CASES").map_or(DEFAULT_CASES, |n| n as usize) / 4;
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut rng = Rng(seed ^ 0xa99e_4d00);
    let mut findings = Vec::new();
    for n in 0..cases {
        let case_seed = rng.next();
        if let Some(f) = append_case(&mut Rng(case_seed))? {
            findings.push(format!("case {n} (case seed {case_seed:#x}) {f}"));
            if findings.len() >= 20 {
                break;
            }
        }
    }
    std::panic::set_hook(hook);
    eprintln!(
        "fuzz append: seed {seed:#x}, {cases} cases, {} findings",
        findings.len()
    );
    assert!(findings.is_empty(), "{}", findings.join("\n"));
    Ok(())
}
