//! Every public function of the compat crate on CPU tensors (f32), against an independent
//! float64 transliteration of what candle-flash-attn 0.11.1 makes FlashAttention 2 compute: its
//! host-side window conversion (`None` or `> seqlen_k` is -1, causal is `(-1, 0)`, a lone
//! bounded side sets the other to `seqlen_k`), FA2's kernel mask, its ALiBi bias (`+slope * j`
//! under causal, `-slope * |i + sk - sq - j|` otherwise) and its softcap (`> 0` only). None of
//! it goes through the crate's own conversion or through flashcore.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_flash_attn as cfa;

/// f32 agreement per element at head dim 64. Rounding in a score grows with the length of its
/// dot product, so `check` scales this with the head dim past 64 (inputs are unseeded randn).
const TOL: f64 = 2e-5;

fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// FA2's options as candle-flash-attn 0.11.1 passes them.
#[derive(Clone, Copy)]
struct Fa2<'a> {
    scale: f32,
    left: Option<usize>,
    right: Option<usize>,
    softcap: f32,
    /// Slopes for each query head of this sequence.
    slopes: Option<&'a [f32]>,
    /// `mm_prefix_ranges` of this sequence: `[start, end)` key ranges that bypass the mask for
    /// the queries inside them.
    mm: &'a [(i64, i64)],
}

/// One sequence: q `(sq, hq, d)`, k/v `(sk, hkv, d)` as f64 vectors, `bound` the length the
/// host code compares the window sizes with (seqlen_k, or max_seqlen_k for varlen). Returns
/// `(sq, hq, d)`.
#[allow(clippy::too_many_arguments)]
fn fa2_sequence(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (sq, sk, hq, hkv, d): (usize, usize, usize, usize, usize),
    bound: usize,
    o: &Fa2,
) -> Vec<f64> {
    // Host side (candle-flash-attn's cuda_fwd_t, then flash_api.cu).
    let side = |w: Option<usize>| w.filter(|&w| w <= bound).map(|w| w as i64).unwrap_or(-1);
    let (mut wl, mut wr) = (side(o.left), side(o.right));
    // With ranges, the original runs the causal mask as a window of left = bound (the same keys).
    if !o.mm.is_empty() && wl < 0 && wr == 0 {
        wl = bound as i64;
    }
    let is_causal = wl < 0 && wr == 0;
    if wl < 0 && wr >= 0 {
        wl = bound as i64;
    }
    if wl >= 0 && wr < 0 {
        wr = bound as i64;
    }
    let is_local = (wl >= 0 || wr >= 0) && !is_causal;
    let (softcap, scale) = (o.softcap as f64, o.scale as f64);
    let mut out = vec![0f64; sq * hq * d];
    for h in 0..hq {
        let hk = h / (hq / hkv);
        for i in 0..sq {
            let diag = i as i64 + sk as i64 - sq as i64;
            let mut s = vec![f64::NEG_INFINITY; sk];
            for (j, sj) in s.iter_mut().enumerate() {
                let jj = j as i64;
                let visible = if is_causal {
                    jj <= diag
                } else if is_local {
                    jj >= diag - wl && jj <= diag + wr
                } else {
                    true
                };
                // FA2's `mm_prefix_allowed`: both the query's position and the key in one
                // non-empty range (keys below the sequence's length only).
                let allowed =
                    o.mm.iter()
                        .any(|&(s, e)| s < e && s <= diag && diag < e && s <= jj && jj < e);
                if !(visible || allowed) {
                    continue;
                }
                let mut x = 0f64;
                for c in 0..d {
                    x += q[(i * hq + h) * d + c] * k[(j * hkv + hk) * d + c];
                }
                x *= scale;
                if softcap > 0.0 {
                    x = softcap * (x / softcap).tanh();
                }
                if let Some(sl) = o.slopes {
                    let sl = sl[h] as f64;
                    if is_causal {
                        x += sl * jj as f64;
                    } else {
                        x -= sl * (diag - jj).abs() as f64;
                    }
                }
                *sj = x;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue; // a row that sees no key outputs zeros
            }
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = p.iter().sum();
            for c in 0..d {
                let mut acc = 0f64;
                for (j, pj) in p.iter().enumerate() {
                    acc += pj * v[(j * hkv + hk) * d + c];
                }
                out[(i * hq + h) * d + c] = acc / z;
            }
        }
    }
    out
}

fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Slopes of sequence `b`: `(hq,)` slopes for every sequence, `(batch, hq)` one row each.
fn slopes_of(slopes: Option<&Tensor>, b: usize) -> Result<Option<Vec<f32>>> {
    Ok(match slopes {
        None => None,
        Some(s) if s.rank() == 1 => Some(s.to_vec1::<f32>()?),
        Some(s) => Some(s.i(b)?.to_vec1::<f32>()?),
    })
}

/// Dense reference: q `(b, sq, hq, d)`, k/v `(b, sk, hkv, d)`.
#[allow(clippy::too_many_arguments)]
fn fa2_dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    slopes: Option<&Tensor>,
    scale: f32,
    left: Option<usize>,
    right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let mut out = Vec::new();
    for bi in 0..b {
        let sl = slopes_of(slopes, bi)?;
        let o = Fa2 {
            scale,
            left,
            right,
            softcap,
            slopes: sl.as_deref(),
            mm: &[],
        };
        out.extend(fa2_sequence(
            &f64s(&q.i(bi)?)?,
            &f64s(&k.i(bi)?)?,
            &f64s(&v.i(bi)?)?,
            (sq, sk, hq, hkv, d),
            sk,
            &o,
        ));
    }
    Tensor::from_vec(out, (b, sq, hq, d), &Device::Cpu)
}

/// Varlen reference: q `(total_q, hq, d)`, k/v `(total_k, hkv, d)`, prefix sums on the host.
#[allow(clippy::too_many_arguments)]
fn fa2_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    slopes: Option<&Tensor>,
    cu_q: &[u32],
    cu_k: &[u32],
    max_seqlen_k: usize,
    scale: f32,
    left: Option<usize>,
    right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let (total_q, hq, d) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    let mut out = Vec::new();
    for bi in 0..cu_q.len() - 1 {
        let (q0, sq) = (cu_q[bi] as usize, (cu_q[bi + 1] - cu_q[bi]) as usize);
        let (k0, sk) = (cu_k[bi] as usize, (cu_k[bi + 1] - cu_k[bi]) as usize);
        let sl = slopes_of(slopes, bi)?;
        let o = Fa2 {
            scale,
            left,
            right,
            softcap,
            slopes: sl.as_deref(),
            mm: &[],
        };
        out.extend(fa2_sequence(
            &f64s(&q.narrow(0, q0, sq)?)?,
            &f64s(&k.narrow(0, k0, sk)?)?,
            &f64s(&v.narrow(0, k0, sk)?)?,
            (sq, sk, hq, hkv, d),
            max_seqlen_k,
            &o,
        ));
    }
    Tensor::from_vec(out, (total_q, hq, d), &Device::Cpu)
}

fn check(name: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    let e = max_abs_diff(got, want)?;
    let d = *got.dims().last().unwrap_or(&1);
    let tol = TOL * (d as f64 / 64.0).max(1.0);
    assert!(e < tol, "{name}: max |diff| {e:.3e} >= {tol:.1e} (d {d})");
    Ok(())
}

/// Asserts that two outputs are far apart: the option under test changes the result.
fn differs(name: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    let e = max_abs_diff(a, b)?;
    assert!(e > 1e-2, "{name}: the option made no difference ({e:.3e})");
    Ok(())
}

fn alibi_heads(hq: usize) -> Result<Tensor> {
    let s: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1) * 2.0).collect();
    Tensor::from_vec(s, hq, &Device::Cpu)
}

#[test]
fn window_mask_follows_candle_flash_attn() {
    use flashcore::Mask;
    let w = |l, r| Mask::Window { left: l, right: r };
    let sk = 10;
    assert_eq!(cfa::window_mask(None, None, sk), Mask::None);
    assert_eq!(cfa::window_mask(None, Some(0), sk), Mask::Causal);
    assert_eq!(cfa::window_mask(Some(11), Some(0), sk), Mask::Causal);
    assert_eq!(cfa::window_mask(Some(11), Some(11), sk), Mask::None);
    assert_eq!(
        cfa::window_mask(Some(10), Some(0), sk),
        w(Some(10), Some(0))
    );
    assert_eq!(cfa::window_mask(Some(3), None, sk), w(Some(3), Some(10)));
    assert_eq!(
        cfa::window_mask(Some(3), Some(20), sk),
        w(Some(3), Some(10))
    );
    assert_eq!(cfa::window_mask(None, Some(2), sk), w(None, Some(2)));
    assert_eq!(cfa::window_mask(Some(0), Some(0), sk), w(Some(0), Some(0)));
}

#[test]
fn flash_attn_plain_and_causal() -> Result<()> {
    // GQA 6/2, seq_q != seq_k (bottom-right causal) and seq_q == seq_k, d 40 (not a kernel size).
    for (b, sq, sk) in [(2, 7, 11), (1, 9, 9), (2, 1, 13)] {
        let (q, k, v) = (
            randn(&[b, sq, 6, 40])?,
            randn(&[b, sk, 2, 40])?,
            randn(&[b, sk, 2, 40])?,
        );
        let scale = 0.3;
        let mut outs = Vec::new();
        for causal in [false, true] {
            let got = cfa::flash_attn(&q, &k, &v, scale, causal)?;
            let right = if causal { Some(0) } else { None };
            let want = fa2_dense(&q, &k, &v, None, scale, None, right, 0.0)?;
            check(
                &format!("flash_attn b{b} {sq}x{sk} causal={causal}"),
                &got,
                &want,
            )?;
            // The hand reference against candle ops (flashcore's eager twin).
            let p = flashcore::AttnParams {
                softmax_scale: Some(scale),
                mask: if causal {
                    flashcore::Mask::Causal
                } else {
                    flashcore::Mask::None
                },
                ..Default::default()
            };
            check(
                &format!("reference vs candle ops b{b} {sq}x{sk} causal={causal}"),
                &flashcore::attention_slow(&q, &k, &v, &p)?,
                &want,
            )?;
            outs.push(got);
        }
        if sq > 1 {
            differs(&format!("causal b{b} {sq}x{sk}"), &outs[0], &outs[1])?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_windowed_all_side_combinations() -> Result<()> {
    let scale = 0.25;
    // (sq, sk): decode-like chunk, square, and more queries than keys (where FA2's
    // "right = seqlen_k" differs from unbounded).
    for (sq, sk) in [(9, 12), (12, 12), (12, 4)] {
        let (q, k, v) = (
            randn(&[2, sq, 4, 32])?,
            randn(&[2, sk, 4, 32])?,
            randn(&[2, sk, 4, 32])?,
        );
        let plain = cfa::flash_attn(&q, &k, &v, scale, false)?;
        let causal = cfa::flash_attn(&q, &k, &v, scale, true)?;
        let cases = [
            (None, None),
            (None, Some(0)),
            (Some(3), Some(0)),
            (Some(2), Some(1)),
            (Some(0), Some(0)),
            (None, Some(2)),
            (Some(2), None),
            (Some(100), Some(0)),
            (Some(100), None),
            (Some(1), Some(100)),
        ];
        for (l, r) in cases {
            let name = format!("windowed {sq}x{sk} ({l:?}, {r:?})");
            let got = cfa::flash_attn_windowed(&q, &k, &v, scale, l, r)?;
            check(&name, &got, &fa2_dense(&q, &k, &v, None, scale, l, r, 0.0)?)?;
            // The windows that bite must change the answer.
            match (l, r) {
                (Some(3), Some(0)) | (Some(0), Some(0)) if sk > 4 => differs(&name, &got, &causal)?,
                (Some(2), Some(1)) | (None, Some(2)) | (Some(2), None) => {
                    differs(&name, &got, &plain)?
                }
                _ => {}
            }
        }
        // 12 queries over 4 keys, left 1 and right unbounded: FA2 sets right = seqlen_k = 4, so
        // rows 0..3 (which would reach key j <= i - 4 < 0) see nothing and output zeros.
        if sq == 12 && sk == 4 {
            let got = cfa::flash_attn_windowed(&q, &k, &v, scale, Some(1), None)?;
            let head = got.narrow(1, 0, 4)?.abs()?.flatten_all()?.max(0)?;
            assert_eq!(head.to_scalar::<f32>()?, 0.0, "rows 0..3 must be zero");
        }
    }
    Ok(())
}

#[test]
fn flash_attn_alibi_head_and_batch_slopes() -> Result<()> {
    let (b, sq, sk, hq) = (2, 6, 10, 4);
    let (q, k, v) = (
        randn(&[b, sq, hq, 32])?,
        randn(&[b, sk, 2, 32])?,
        randn(&[b, sk, 2, 32])?,
    );
    let heads = alibi_heads(hq)?;
    // (batch, heads_q) slopes (flashcore extension; candle-flash-attn takes (heads_q,) only).
    let rows = Tensor::stack(&[&heads, &(&heads * 3.0)?], 0)?;
    for causal in [false, true] {
        let right = if causal { Some(0) } else { None };
        let none = cfa::flash_attn(&q, &k, &v, 0.2, causal)?;
        let got = cfa::flash_attn_alibi(&q, &k, &v, &heads, 0.2, causal)?;
        let want = fa2_dense(&q, &k, &v, Some(&heads), 0.2, None, right, 0.0)?;
        check(&format!("alibi (h,) causal={causal}"), &got, &want)?;
        differs(&format!("alibi (h,) causal={causal}"), &got, &none)?;
        let got_b = cfa::flash_attn_alibi(&q, &k, &v, &rows, 0.2, causal)?;
        let want_b = fa2_dense(&q, &k, &v, Some(&rows), 0.2, None, right, 0.0)?;
        check(&format!("alibi (b, h) causal={causal}"), &got_b, &want_b)?;
        differs(
            &format!("alibi (b, h) vs (h,) causal={causal}"),
            &got_b,
            &got,
        )?;
    }
    Ok(())
}

#[test]
fn flash_attn_alibi_windowed_matches() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 8, 4, 16])?,
        randn(&[1, 11, 4, 16])?,
        randn(&[1, 11, 4, 16])?,
    );
    let heads = alibi_heads(4)?;
    for (l, r) in [
        (Some(2), Some(0)),
        (None, Some(0)),
        (Some(3), Some(2)),
        (Some(4), None),
    ] {
        let got = cfa::flash_attn_alibi_windowed(&q, &k, &v, &heads, 0.3, l, r)?;
        let want = fa2_dense(&q, &k, &v, Some(&heads), 0.3, l, r, 0.0)?;
        check(&format!("alibi windowed ({l:?}, {r:?})"), &got, &want)?;
    }
    let causal = cfa::flash_attn_alibi(&q, &k, &v, &heads, 0.3, true)?;
    let windowed = cfa::flash_attn_alibi_windowed(&q, &k, &v, &heads, 0.3, Some(2), Some(0))?;
    differs("alibi window 2 vs causal", &windowed, &causal)
}

#[test]
fn flash_attn_alibi_windowed_softcap_zero_is_off() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 5, 4, 24])?,
        randn(&[2, 9, 2, 24])?,
        randn(&[2, 9, 2, 24])?,
    );
    let heads = alibi_heads(4)?;
    // A large scale so that a softcap of 2 bites.
    let scale = 1.5;
    for slopes in [None, Some(&heads)] {
        for (l, r) in [(None, None), (None, Some(0)), (Some(3), Some(1))] {
            let name = format!("softcap slopes={} ({l:?}, {r:?})", slopes.is_some());
            let off = cfa::flash_attn_alibi_windowed_softcap(&q, &k, &v, slopes, scale, l, r, 0.0)?;
            check(
                &format!("{name} 0.0"),
                &off,
                &fa2_dense(&q, &k, &v, slopes, scale, l, r, 0.0)?,
            )?;
            let negative =
                cfa::flash_attn_alibi_windowed_softcap(&q, &k, &v, slopes, scale, l, r, -1.0)?;
            check(&format!("{name} -1.0 is off"), &negative, &off)?;
            let on = cfa::flash_attn_alibi_windowed_softcap(&q, &k, &v, slopes, scale, l, r, 2.0)?;
            check(
                &format!("{name} 2.0"),
                &on,
                &fa2_dense(&q, &k, &v, slopes, scale, l, r, 2.0)?,
            )?;
            differs(&name, &on, &off)?;
        }
    }
    Ok(())
}

/// A packed batch of three sequences, one of them a single query over a single key.
struct Packed {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
    max_q: usize,
    max_k: usize,
}

impl Packed {
    fn new(lens_q: &[usize], lens_k: &[usize], hq: usize, hkv: usize, d: usize) -> Result<Self> {
        let sums = |lens: &[usize]| {
            let mut v = vec![0u32];
            for l in lens {
                v.push(v.last().unwrap() + *l as u32);
            }
            v
        };
        let (cu_q, cu_k) = (sums(lens_q), sums(lens_k));
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        Ok(Self {
            q: randn(&[tq, hq, d])?,
            k: randn(&[tk, hkv, d])?,
            v: randn(&[tk, hkv, d])?,
            max_q: *lens_q.iter().max().unwrap(),
            max_k: *lens_k.iter().max().unwrap(),
            cu_q,
            cu_k,
        })
    }
    fn cu(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::new(self.cu_q.as_slice(), &Device::Cpu)?,
            Tensor::new(self.cu_k.as_slice(), &Device::Cpu)?,
        ))
    }
    fn reference(
        &self,
        slopes: Option<&Tensor>,
        scale: f32,
        l: Option<usize>,
        r: Option<usize>,
        softcap: f32,
    ) -> Result<Tensor> {
        fa2_varlen(
            &self.q, &self.k, &self.v, slopes, &self.cu_q, &self.cu_k, self.max_k, scale, l, r,
            softcap,
        )
    }
}

fn packed_cases() -> Result<Vec<Packed>> {
    Ok(vec![
        // Same lengths on both sides, one of length 1.
        Packed::new(&[5, 1, 8], &[5, 1, 8], 4, 2, 32)?,
        // Chunked prefill: keys longer than queries; the length-1 query sees 6 keys.
        Packed::new(&[3, 1, 7], &[9, 6, 12], 6, 3, 16)?,
    ])
}

#[test]
fn flash_attn_varlen_matches() -> Result<()> {
    for (n, p) in packed_cases()?.iter().enumerate() {
        let (cq, ck) = p.cu()?;
        let mut outs = Vec::new();
        for causal in [false, true] {
            let got =
                cfa::flash_attn_varlen(&p.q, &p.k, &p.v, &cq, &ck, p.max_q, p.max_k, 0.3, causal)?;
            let right = if causal { Some(0) } else { None };
            check(
                &format!("varlen case {n} causal={causal}"),
                &got,
                &p.reference(None, 0.3, None, right, 0.0)?,
            )?;
            outs.push(got);
        }
        differs(&format!("varlen case {n} causal"), &outs[0], &outs[1])?;
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_windowed_matches() -> Result<()> {
    for (n, p) in packed_cases()?.iter().enumerate() {
        let (cq, ck) = p.cu()?;
        let causal =
            cfa::flash_attn_varlen(&p.q, &p.k, &p.v, &cq, &ck, p.max_q, p.max_k, 0.3, true)?;
        // Left 6 exceeds some sequences' own key counts but not max_seqlen_k: still a bound.
        for (l, r) in [
            (Some(2), Some(0)),
            (Some(6), Some(0)),
            (Some(1), Some(1)),
            (Some(3), None),
            (None, Some(1)),
            (Some(50), Some(0)),
        ] {
            let got = cfa::flash_attn_varlen_windowed(
                &p.q, &p.k, &p.v, &cq, &ck, p.max_q, p.max_k, 0.3, l, r,
            )?;
            let name = format!("varlen windowed case {n} ({l:?}, {r:?})");
            check(&name, &got, &p.reference(None, 0.3, l, r, 0.0)?)?;
            if (l, r) == (Some(2), Some(0)) {
                differs(&name, &got, &causal)?;
            }
        }
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_alibi_matches() -> Result<()> {
    for (n, p) in packed_cases()?.iter().enumerate() {
        let (cq, ck) = p.cu()?;
        let hq = p.q.dims()[1];
        let heads = alibi_heads(hq)?;
        let rows = Tensor::stack(&[&heads, &(&heads * 2.0)?, &(&heads * 0.5)?], 0)?;
        for causal in [false, true] {
            let right = if causal { Some(0) } else { None };
            let none =
                cfa::flash_attn_varlen(&p.q, &p.k, &p.v, &cq, &ck, p.max_q, p.max_k, 0.3, causal)?;
            for slopes in [&heads, &rows] {
                let name = format!("varlen alibi case {n} {:?} causal={causal}", slopes.dims());
                let got = cfa::flash_attn_varlen_alibi(
                    &p.q, &p.k, &p.v, slopes, &cq, &ck, p.max_q, p.max_k, 0.3, causal,
                )?;
                check(
                    &name,
                    &got,
                    &p.reference(Some(slopes), 0.3, None, right, 0.0)?,
                )?;
                differs(&name, &got, &none)?;
            }
        }
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_alibi_windowed_matches() -> Result<()> {
    for (n, p) in packed_cases()?.iter().enumerate() {
        let (cq, ck) = p.cu()?;
        let heads = alibi_heads(p.q.dims()[1])?;
        for (l, r) in [(Some(2), Some(0)), (Some(1), Some(2)), (None, Some(0))] {
            let got = cfa::flash_attn_varlen_alibi_windowed(
                &p.q, &p.k, &p.v, &heads, &cq, &ck, p.max_q, p.max_k, 0.3, l, r,
            )?;
            check(
                &format!("varlen alibi windowed case {n} ({l:?}, {r:?})"),
                &got,
                &p.reference(Some(&heads), 0.3, l, r, 0.0)?,
            )?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_alibi_windowed_softcap_matches() -> Result<()> {
    for (n, p) in packed_cases()?.iter().enumerate() {
        let (cq, ck) = p.cu()?;
        let heads = alibi_heads(p.q.dims()[1])?;
        for slopes in [None, Some(&heads)] {
            for (l, r) in [(None, Some(0)), (Some(2), Some(1))] {
                let run = |c: f32| {
                    cfa::flash_attn_varlen_alibi_windowed_softcap(
                        &p.q, &p.k, &p.v, slopes, &cq, &ck, p.max_q, p.max_k, 1.5, l, r, c,
                    )
                };
                let name = format!(
                    "varlen softcap case {n} slopes={} ({l:?}, {r:?})",
                    slopes.is_some()
                );
                let (off, on) = (run(0.0)?, run(2.0)?);
                check(
                    &format!("{name} 0.0"),
                    &off,
                    &p.reference(slopes, 1.5, l, r, 0.0)?,
                )?;
                check(
                    &format!("{name} 2.0"),
                    &on,
                    &p.reference(slopes, 1.5, l, r, 2.0)?,
                )?;
                differs(&name, &on, &off)?;
            }
        }
    }
    Ok(())
}

/// `p`'s keys scattered into pages of `ps` rows in reverse order (sequence `i`'s page `j` is pool
/// page `num_pages - 1 - (i * max_pages + j)`), with the i32 block table the original's callers
/// build: `(k_pages, v_pages, block_table)`.
fn paged_pools(p: &Packed, ps: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let b = p.cu_k.len() - 1;
    let max_pages = p.max_k.div_ceil(ps);
    let num_pages = b * max_pages;
    // sequence i's page j is pool page num_pages - 1 - (i * max_pages + j)
    let mut rows = vec![0u32; num_pages * ps];
    let mut table = vec![0i32; b * max_pages];
    for i in 0..b {
        for j in 0..max_pages {
            let page = num_pages - 1 - (i * max_pages + j);
            table[i * max_pages + j] = page as i32;
            for s in 0..ps {
                let key = (j * ps + s).min((p.cu_k[i + 1] - p.cu_k[i]).saturating_sub(1) as usize);
                rows[page * ps + s] = p.cu_k[i] + key as u32;
            }
        }
    }
    let idx = Tensor::new(rows.as_slice(), &Device::Cpu)?;
    let pool = |t: &Tensor| -> Result<Tensor> {
        let (_, h, d) = t.dims3()?;
        t.index_select(&idx, 0)?.reshape((num_pages, ps, h, d))
    };
    let bt = Tensor::from_vec(table, (b, max_pages), &Device::Cpu)?;
    Ok((pool(&p.k)?, pool(&p.v)?, bt))
}

/// The paged function against the same batch packed (`flash_attn_varlen_windowed`, itself
/// checked against the f64 transliteration above) and against that transliteration directly:
/// the keys scattered into 16-row pages in reverse order, the block table i32 as the original's
/// callers build it, a causal window and a local one, softcap on. The error for a wrong
/// `page_block_size`.
#[test]
fn flash_attn_varlen_paged_windowed_matches_packed() -> Result<()> {
    let ps = 16;
    let p = Packed::new(&[5, 1, 3], &[40, 16, 3], 4, 2, 32)?;
    let (cq, ck) = p.cu()?;
    let (kp, vp, bt) = paged_pools(&p, ps)?;
    for (l, r, cap) in [(None, Some(0), None), (Some(7), Some(2), Some(3.0))] {
        let paged = cfa::flash_attn_varlen_paged_windowed(
            &p.q, &kp, &vp, &cq, &ck, &bt, None, p.max_q, p.max_k, 0.3, l, r, ps, cap,
        )?;
        let packed = cfa::flash_attn_varlen_alibi_windowed_softcap(
            &p.q,
            &p.k,
            &p.v,
            None,
            &cq,
            &ck,
            p.max_q,
            p.max_k,
            0.3,
            l,
            r,
            cap.unwrap_or(0.0),
        )?;
        check("paged vs packed", &paged, &packed)?;
        check(
            "paged vs fa2",
            &paged,
            &p.reference(None, 0.3, l, r, cap.unwrap_or(0.0))?,
        )?;
    }
    let run = |mm: Option<&Tensor>, page: usize| {
        cfa::flash_attn_varlen_paged_windowed(
            &p.q, &kp, &vp, &cq, &ck, &bt, mm, p.max_q, p.max_k, 0.3, None, None, page, None,
        )
    };
    let msg = run(None, 32).expect_err("page_block_size").to_string();
    assert!(msg.contains("page_block_size"), "{msg}");
    Ok(())
}

/// `mm_prefix_ranges` (ranges of keys that bypass the causal/window mask for the queries inside
/// them, as multimodal prefixes use them) against the f64 transliteration of FA2's
/// `mm_prefix_allowed`: bidirectional blocks inside a prefill, a block covering a chunk's queries
/// and earlier keys, overlapping ranges, empty and partly negative ranges, a sequence without
/// ranges; causal, windows and softcap; pages shuffled. Ranges change the causal result; without
/// a mask they change nothing; bad ranges are errors naming them.
#[test]
fn flash_attn_varlen_paged_windowed_mm_prefix_ranges() -> Result<()> {
    let ps = 16;
    let p = Packed::new(&[5, 1, 12, 20], &[40, 16, 12, 20], 4, 2, 32)?;
    let (cq, ck) = p.cu()?;
    let (kp, vp, bt) = paged_pools(&p, ps)?;
    let b = p.cu_q.len() - 1;
    // Per sequence, padded with empty (0, 0) ranges to 3.
    let mm: Vec<Vec<(i64, i64)>> = vec![
        vec![(30, 40), (36, 38)],
        vec![],
        vec![(2, 7), (9, 12), (5, 5)],
        vec![(-3, 2), (4, 11), (8, 15)],
    ];
    let mut flat = Vec::new();
    for r in &mm {
        for n in 0..3 {
            let (s, e) = r.get(n).copied().unwrap_or((0, 0));
            flat.extend([s as i32, e as i32]);
        }
    }
    let ranges = Tensor::from_vec(flat, (b, 3, 2), &Device::Cpu)?;
    let (hq, hkv, d) = (4, 2, 32);
    for (l, r, cap) in [
        (None, Some(0), 0.0),
        (Some(3), Some(0), 0.0),
        (Some(2), Some(1), 3.0),
        (None, None, 0.0),
    ] {
        let name = format!("mm_prefix_ranges ({l:?}, {r:?}) softcap {cap}");
        let softcap = (cap > 0.0).then_some(cap);
        let run = |mm: Option<&Tensor>| {
            cfa::flash_attn_varlen_paged_windowed(
                &p.q, &kp, &vp, &cq, &ck, &bt, mm, p.max_q, p.max_k, 0.3, l, r, ps, softcap,
            )
        };
        let got = run(Some(&ranges))?;
        let mut want = Vec::new();
        for (i, seq_mm) in mm.iter().enumerate() {
            let (q0, sq) = (p.cu_q[i] as usize, (p.cu_q[i + 1] - p.cu_q[i]) as usize);
            let (k0, sk) = (p.cu_k[i] as usize, (p.cu_k[i + 1] - p.cu_k[i]) as usize);
            let o = Fa2 {
                scale: 0.3,
                left: l,
                right: r,
                softcap: cap,
                slopes: None,
                mm: seq_mm,
            };
            want.extend(fa2_sequence(
                &f64s(&p.q.narrow(0, q0, sq)?)?,
                &f64s(&p.k.narrow(0, k0, sk)?)?,
                &f64s(&p.v.narrow(0, k0, sk)?)?,
                (sq, sk, hq, hkv, d),
                p.max_k,
                &o,
            ));
        }
        let want = Tensor::from_vec(want, got.shape(), &Device::Cpu)?;
        check(&name, &got, &want)?;
        let plain = run(None)?;
        if (l, r) == (None, None) {
            check(&format!("{name}: no mask, nothing to bypass"), &got, &plain)?;
        } else {
            differs(&name, &got, &plain)?;
        }
    }
    let run = |mm: &Tensor| {
        cfa::flash_attn_varlen_paged_windowed(
            &p.q,
            &kp,
            &vp,
            &cq,
            &ck,
            &bt,
            Some(mm),
            p.max_q,
            p.max_k,
            0.3,
            None,
            Some(0),
            ps,
            None,
        )
    };
    for bad in [
        Tensor::zeros((b, 1, 2), DType::U32, &Device::Cpu)?,
        Tensor::zeros((b + 1, 1, 2), DType::I32, &Device::Cpu)?,
        Tensor::zeros((b, 1, 3), DType::I32, &Device::Cpu)?,
    ] {
        let msg = run(&bad).expect_err("bad mm_prefix_ranges").to_string();
        assert!(msg.contains("mm_prefix_ranges:"), "{msg}");
    }
    Ok(())
}

/// Decreasing key prefix sums are the prefix-sum error, not a panic of candle's u32
/// subtraction (debug builds) or a wrapped length (release).
#[test]
fn flash_attn_varlen_paged_windowed_decreasing_seqlens_k() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[4, 2, 32])?;
    let pool = randn(&[4, 16, 2, 32])?;
    let cq = Tensor::new(&[0u32, 2, 4], &dev)?;
    let ck = Tensor::new(&[0u32, 20, 5], &dev)?;
    let bt = Tensor::new(&[[0u32, 1], [2, 3]], &dev)?;
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cfa::flash_attn_varlen_paged_windowed(
            &q,
            &pool,
            &pool,
            &cq,
            &ck,
            &bt,
            None,
            2,
            20,
            0.3,
            None,
            Some(0),
            16,
            None,
        )
        .map(|_| ())
    }));
    let msg = got
        .expect("decreasing seqlens_k panicked")
        .expect_err("decreasing seqlens_k accepted")
        .to_string();
    assert!(
        msg.contains("seqlens_k") && msg.contains("non-decreasing"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn head_dims_to_512_on_the_cpu_and_no_further() -> Result<()> {
    // candle-flash-attn takes head dims up to 512: so does the CPU path here (a GPU runs the slow
    // path past 256, tested on CPU tensors below); 520 is refused.
    for d in [320, 512] {
        let (q, k, v) = (
            randn(&[1, 5, 2, d])?,
            randn(&[1, 7, 2, d])?,
            randn(&[1, 7, 2, d])?,
        );
        let got = cfa::flash_attn(&q, &k, &v, 0.1, true)?;
        let want = fa2_dense(&q, &k, &v, None, 0.1, None, Some(0), 0.0)?;
        let e = max_abs_diff(&got, &want)?;
        assert!(e < 1e-5, "d {d}: {e}");
    }
    let q = randn(&[1, 4, 2, 520])?;
    let msg = cfa::flash_attn(&q, &q, &q, 0.1, true)
        .expect_err("d 520 must be refused")
        .to_string();
    assert!(msg.contains("head_dim"), "{msg}");
    Ok(())
}

#[test]
fn flash_attn_custom_op_struct() -> Result<()> {
    use candle_core::CustomOp3;
    let (b, sq, sk) = (2, 6, 9);
    let q = randn(&[b, sq, 4, 32])?;
    // Strided K/V: transposed views of (b, h, s, d).
    let k = randn(&[b, 2, sk, 32])?.transpose(1, 2)?;
    let v = randn(&[b, 2, sk, 32])?.transpose(1, 2)?;
    let heads = alibi_heads(4)?;
    let op = cfa::FlashAttn {
        softmax_scale: 0.4,
        alibi_slopes: Some(heads.clone()),
        window_size_left: Some(3),
        window_size_right: Some(0),
        softcap: Some(3.0),
    };
    assert_eq!(op.name(), "flash-attn");
    let got = q.apply_op3(&k, &v, op)?;
    let want = fa2_dense(&q, &k, &v, Some(&heads), 0.4, Some(3), Some(0), 3.0)?;
    check("FlashAttn op", &got, &want)?;
    let direct = cfa::flash_attn_alibi_windowed_softcap(
        &q,
        &k,
        &v,
        Some(&heads),
        0.4,
        Some(3),
        Some(0),
        3.0,
    )?;
    check("FlashAttn op vs function", &got, &direct)
}

// ---------------------------------------------------------------------------------------------
// The slow path (CUDA calls past flashcore's GPU head dims) run on CPU tensors: the same candle
// ops a GPU runs, against the f64 transliteration, in blocks of one or a few query rows as well
// as whole.

/// Runs `f` with the slow path's blocks at `elems` score elements and at the default.
fn for_block_sizes(mut f: impl FnMut(&str) -> Result<()>) -> Result<()> {
    for (name, elems) in [
        ("blocks of 1 row", 1usize),
        ("small blocks", 72),
        ("whole", 1 << 26),
    ] {
        cfa::slow_path::set_block_elems(elems);
        let r = f(name);
        cfa::slow_path::set_block_elems(1 << 26);
        r?;
    }
    Ok(())
}

#[test]
fn slow_path_dense_every_option() -> Result<()> {
    for d in [64, 320, 512] {
        let (b, sq, sk, hq, hkv) = (2, 6, 9, 4, 2);
        let q = randn(&[b, sq, hq, d])?;
        let k = randn(&[b, sk, hkv, d])?;
        let v = randn(&[b, sk, hkv, d])?;
        let heads = alibi_heads(hq)?;
        let per_batch = Tensor::stack(&[heads.clone(), (&heads * 0.5)?], 0)?;
        for_block_sizes(|blocks| {
            let mut outs = Vec::new();
            for (slopes, l, r, cap) in [
                (None, None, None, 0.0),
                (None, None, Some(0), 0.0),
                (None, Some(2), Some(1), 0.0),
                (None, Some(3), None, 0.0),
                (Some(&heads), None, Some(0), 0.0),
                (Some(&per_batch), Some(4), Some(0), 0.0),
                (None, None, Some(0), 2.0),
                (Some(&heads), Some(2), Some(1), 2.0),
            ] {
                let name = format!(
                    "slow dense d{d} {blocks} slopes={} ({l:?}, {r:?}) softcap {cap}",
                    slopes.map(|s| s.rank()).unwrap_or(0)
                );
                let got = cfa::slow_path::dense(&q, &k, &v, slopes, 0.2, l, r, cap)?;
                let want = fa2_dense(&q, &k, &v, slopes, 0.2, l, r, cap)?;
                check(&name, &got, &want)?;
                outs.push(got);
            }
            // every option changed the result (plain vs causal, windows, slopes, softcap)
            for i in 1..outs.len() {
                differs(
                    &format!("slow dense d{d} option {i}"),
                    &outs[i],
                    &outs[i - 1],
                )?;
            }
            Ok(())
        })?;
        // a causal call with more query rows than keys: the first rows see nothing (zeros)
        let q = randn(&[1, 5, 2, d])?;
        let k = randn(&[1, 3, 2, d])?;
        let got = cfa::slow_path::dense(&q, &k, &k, None, 0.2, None, Some(0), 0.0)?;
        check(
            &format!("slow dense d{d} sq > sk"),
            &got,
            &fa2_dense(&q, &k, &k, None, 0.2, None, Some(0), 0.0)?,
        )?;
        let first = got
            .narrow(1, 0, 2)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(first, 0.0, "rows without keys must be zeros");
    }
    Ok(())
}

#[test]
fn slow_path_varlen_matches() -> Result<()> {
    for d in [16, 320] {
        for p in [
            Packed::new(&[5, 1, 8], &[5, 1, 8], 4, 2, d)?,
            Packed::new(&[3, 1, 7, 0], &[9, 6, 12, 4], 6, 3, d)?,
        ] {
            let (cq, ck) = p.cu()?;
            let hq = p.q.dims()[1];
            let heads = alibi_heads(hq)?;
            for_block_sizes(|blocks| {
                for (slopes, l, r, cap) in [
                    (None, None, Some(0), 0.0),
                    (Some(&heads), Some(2), Some(1), 2.0),
                    (None, Some(3), None, 0.0),
                ] {
                    let got = cfa::slow_path::varlen(
                        &p.q, &p.k, &p.v, slopes, &cq, &ck, p.max_q, p.max_k, 0.4, l, r, cap,
                    )?;
                    check(
                        &format!("slow varlen d{d} {blocks} ({l:?}, {r:?}) {cap}"),
                        &got,
                        &p.reference(slopes, 0.4, l, r, cap)?,
                    )?;
                }
                Ok(())
            })?;
        }
    }
    Ok(())
}

/// The paged slow path against the function's CPU path (flashcore plus the crate's explicit
/// recomputation of the rows that `mm_prefix_ranges` change): two implementations, one
/// result, with and without ranges; both checked against the transliteration elsewhere.
#[test]
fn slow_path_paged_matches_the_cpu_path() -> Result<()> {
    let ps = 16;
    for d in [32, 320] {
        let p = Packed::new(&[5, 1, 12, 20], &[40, 16, 12, 20], 4, 2, d)?;
        let (cq, ck) = p.cu()?;
        let (kp, vp, bt) = paged_pools(&p, ps)?;
        let b = p.cu_q.len() - 1;
        let mut flat = Vec::new();
        for r in [
            vec![(30, 40)],
            vec![],
            vec![(2, 7), (9, 12)],
            vec![(-3, 2), (4, 11)],
        ] {
            for n in 0..2 {
                let (s, e) = r.get(n).copied().unwrap_or((0, 0));
                flat.extend([s, e]);
            }
        }
        let ranges = Tensor::from_vec(flat, (b, 2, 2), &Device::Cpu)?;
        for_block_sizes(|blocks| {
            for (mm, l, r, cap) in [
                (None, None, Some(0), None),
                (Some(&ranges), None, Some(0), None),
                (Some(&ranges), Some(2), Some(1), Some(3.0)),
            ] {
                let name = format!(
                    "slow paged d{d} {blocks} mm={} ({l:?}, {r:?})",
                    mm.is_some()
                );
                let got = cfa::slow_path::paged(
                    &p.q, &kp, &vp, &cq, &ck, &bt, mm, p.max_q, p.max_k, 0.3, l, r, cap,
                )?;
                let want = cfa::flash_attn_varlen_paged_windowed(
                    &p.q, &kp, &vp, &cq, &ck, &bt, mm, p.max_q, p.max_k, 0.3, l, r, ps, cap,
                )?;
                check(&name, &got, &want)?;
                if mm.is_none() {
                    check(
                        &format!("{name} vs fa2"),
                        &got,
                        &p.reference(None, 0.3, l, r, 0.0)?,
                    )?;
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// The slow path's own validation (flashcore's is bypassed there): bad arguments are errors
/// naming them, never panics.
#[test]
fn slow_path_errors_name_the_argument() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[1, 4, 2, 320])?;
    let k = randn(&[1, 6, 2, 320])?;
    let err = |r: Result<Tensor>| r.expect_err("must be refused").to_string();
    let d520 = randn(&[1, 4, 2, 520])?;
    let msg = err(cfa::slow_path::dense(
        &d520, &d520, &d520, None, 0.1, None, None, 0.0,
    ));
    assert!(msg.contains("q: head_dim"), "{msg}");
    let k_other = randn(&[1, 6, 2, 312])?;
    let msg = err(cfa::slow_path::dense(
        &q, &k_other, &k_other, None, 0.1, None, None, 0.0,
    ));
    assert!(msg.contains("k: head_dim"), "{msg}");
    let k3 = randn(&[1, 6, 3, 320])?;
    let msg = err(cfa::slow_path::dense(
        &q, &k3, &k3, None, 0.1, None, None, 0.0,
    ));
    assert!(msg.contains("heads_kv"), "{msg}");
    let msg = err(cfa::slow_path::dense(
        &q, &k, &k, None, -0.1, None, None, 0.0,
    ));
    assert!(msg.contains("softmax_scale"), "{msg}");
    let msg = err(cfa::slow_path::dense(
        &q,
        &k,
        &k,
        None,
        0.1,
        None,
        None,
        f32::INFINITY,
    ));
    assert!(msg.contains("softcap"), "{msg}");
    let bad_slopes = Tensor::ones(3, DType::F32, &dev)?;
    let msg = err(cfa::slow_path::dense(
        &q,
        &k,
        &k,
        Some(&bad_slopes),
        0.1,
        None,
        None,
        0.0,
    ));
    assert!(msg.contains("alibi_slopes"), "{msg}");
    let (pq, pk) = (randn(&[6, 2, 320])?, randn(&[6, 2, 320])?);
    for (cu, name) in [
        (vec![0u32, 4, 2], "non-decreasing"),
        (vec![1u32, 6], "start at 0"),
        (vec![0u32, 5], "end at"),
        (vec![0u32, 6], "at most"),
    ] {
        let c = Tensor::new(cu.as_slice(), &dev)?;
        let ok = Tensor::new(&[0u32, 6], &dev)?;
        let msg = err(cfa::slow_path::varlen(
            &pq, &pk, &pk, None, &c, &ok, 5, 6, 0.1, None, None, 0.0,
        ));
        assert!(msg.contains("seqlens_q") && msg.contains(name), "{msg}");
    }
    // a block table pointing past the pool
    let pool = randn(&[2, 4, 2, 320])?;
    let cq = Tensor::new(&[0u32, 2], &dev)?;
    let ck = Tensor::new(&[0u32, 6], &dev)?;
    let bt = Tensor::new(&[[0u32, 7]], &dev)?;
    let msg = err(cfa::slow_path::paged(
        &randn(&[2, 2, 320])?,
        &pool,
        &pool,
        &cq,
        &ck,
        &bt,
        None,
        2,
        6,
        0.1,
        None,
        None,
        None,
    ));
    assert!(msg.contains("block_table"), "{msg}");
    Ok(())
}
