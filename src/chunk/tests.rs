//! The piece decomposition on the CPU: the pieces' bounds against the reference's own visible
//! key ranges, and the wrappers (each piece on the CPU path without a chunk) against the CPU
//! path's native chunk, on dense, packed and paged batches.

use super::*;
use crate::params::{validate, validate_paged, validate_varlen};
use crate::reference::visible_keys;
use crate::Mask;
use candle_core::DType;

const MASKS: [Mask; 5] = [
    Mask::None,
    Mask::Causal,
    Mask::Window {
        left: Some(17),
        right: Some(3),
    },
    Mask::Window {
        left: Some(30),
        right: Some(0),
    },
    Mask::Window {
        left: None,
        right: Some(5),
    },
];

/// Every row of every piece sees, under every mask, the keys the whole problem gives it, shifted
/// to the piece: the reference's `visible_keys` of the chunked row equals that of the piece's
/// row (bottom-right aligned in the piece, no chunk) plus the piece's first key. Rows and (with
/// `tile_keys`) keys are covered in order, once.
#[test]
fn pieces_reproduce_every_row_range() {
    let masks = MASKS.into_iter().chain([Mask::Window {
        left: Some(0),
        right: Some(0),
    }]);
    let masks: Vec<Mask> = masks.collect();
    for sq in [0usize, 1, 2, 5, 50, 113] {
        for sk in [0usize, 1, 7, 64, 113, 200] {
            for c in [1usize, 2, 7, 16, 64, 113, 500] {
                for tile in [false, true] {
                    let ps = pieces(sq, sk, c, tile);
                    let what = format!("sq{sq} sk{sk} c{c} tile {tile}");
                    let (mut row, mut key) = (0, 0);
                    for p in &ps {
                        assert_eq!(p.q0, row, "{what}: rows in order {ps:?}");
                        row += p.nq;
                        if tile {
                            assert_eq!(p.k0, key, "{what}: keys in order {ps:?}");
                            key += p.nk;
                        }
                        assert!(p.nq + p.nk > 0, "{what}: empty piece {ps:?}");
                        for i in p.q0..p.q0 + p.nq {
                            for &m in &masks {
                                let (lo, hi) = visible_keys(i, sq, sk, m, Some(c));
                                let (plo, phi) = visible_keys(i - p.q0, p.nq, p.nk, m, None);
                                let got = if plo < phi {
                                    (plo + p.k0, phi + p.k0)
                                } else {
                                    (0, 0)
                                };
                                let want = if lo < hi { (lo, hi) } else { (0, 0) };
                                assert_eq!(got, want, "{what} row {i} {m:?}: piece {p:?}");
                            }
                        }
                    }
                    assert_eq!(row, sq, "{what}: every row {ps:?}");
                    if tile {
                        assert_eq!(key, sk, "{what}: every key {ps:?}");
                    }
                }
            }
        }
    }
}

fn randn(shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Options of case `which` (mod 6): plain, softcap, ALiBi `(hq,)`, ALiBi `(b, hq)`, sinks, all.
fn opts(mask: Mask, c: usize, which: usize, b: usize, hq: usize) -> Result<AttnParams> {
    let mut p = AttnParams {
        mask,
        chunk: Some(c),
        ..Default::default()
    };
    let which = which % 6;
    if which == 1 || which == 5 {
        p.softcap = Some(4.0);
    }
    if which == 2 || which == 5 {
        let s: Vec<f32> = (0..hq).map(|h| 0.03 + 0.07 * h as f32).collect();
        p.alibi_slopes = Some(Tensor::new(s.as_slice(), &Device::Cpu)?);
    }
    if which == 3 {
        let s: Vec<f32> = (0..b * hq).map(|x| 0.02 + 0.05 * x as f32).collect();
        p.alibi_slopes = Some(Tensor::from_vec(s, (b, hq), &Device::Cpu)?);
    }
    if which == 4 || which == 5 {
        let s: Vec<f32> = (0..hq).map(|h| 0.5 * h as f32 - 1.0).collect();
        p.sinks = Some(Tensor::new(s.as_slice(), &Device::Cpu)?);
    }
    Ok(p)
}

/// Max |a - b|, where equal infinities count as 0 and a NaN or an unequal infinity as infinite.
fn err(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes");
    let f = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (a, b) = (f(a)?, f(b)?);
    Ok(a.iter().zip(&b).fold(0f64, |m, (x, y)| {
        let e = if x == y { 0.0 } else { (x - y).abs() };
        m.max(if e.is_nan() { f64::INFINITY } else { e })
    }))
}

/// Asserts that the pieces' (O, LSE) match the native chunk's; returns whether the chunk
/// changed O (compared with `unchunked_o`).
fn check(
    what: &str,
    got: (Tensor, Option<Tensor>),
    want: (Tensor, Option<Tensor>),
    unchunked_o: &Tensor,
) -> Result<bool> {
    let tol = if want.0.dtype() == DType::F64 {
        1e-12
    } else {
        1e-5
    };
    let (gl, wl) = (got.1.expect("lse"), want.1.expect("lse"));
    let (eo, el) = (err(&got.0, &want.0)?, err(&gl, &wl)?);
    assert!(eo < tol && el < 1e-5, "{what}: O err {eo}, LSE err {el}");
    Ok(err(unchunked_o, &want.0)? > 1e-3)
}

/// Dense batches of awkward shapes (lengths 1 and 113, `c` not dividing `sk`, `sq > sk` and
/// `sq < sk`, GQA, one query row, `d_v != d_qk`) under every mask and option: the pieces (each
/// on the CPU path without a chunk, concatenated) against the CPU path's chunk, O and LSE.
#[test]
fn dense_pieces_match_the_cpu_chunk() -> Result<()> {
    // (b, sq, sk, hq, hkv, d, dv)
    let shapes = [
        (1, 1, 1, 1, 1, 8, 8),
        (2, 113, 113, 4, 2, 16, 16),
        (1, 113, 200, 4, 1, 16, 16),
        (2, 50, 20, 2, 2, 8, 8),
        (1, 37, 37, 8, 2, 32, 32),
        (2, 1, 130, 4, 4, 16, 16),
        (1, 70, 45, 4, 2, 16, 8),
    ];
    let (mut cases, mut changed) = (0, 0);
    for (si, &(b, sq, sk, hq, hkv, d, dv)) in shapes.iter().enumerate() {
        let dtype = if si % 3 == 1 { DType::F64 } else { DType::F32 };
        let q = randn(&[b, sq, hq, d], dtype)?;
        let k = randn(&[b, sk, hkv, d], dtype)?;
        let v = randn(&[b, sk, hkv, dv], dtype)?;
        for (mi, &mask) in MASKS.iter().enumerate() {
            for (ci, c) in [1usize, 7, 16, 64, 100].into_iter().enumerate() {
                let p = opts(mask, c, si + mi + ci, b, hq)?;
                let prob = validate(&q, &k, &v, &p)?;
                if prob.chunk.is_none() {
                    continue;
                }
                let what = format!("b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv} {mask:?} c{c}");
                let got = dense(&q, &k, &v, &prob, &p, true)?;
                let want = run(&q, &k, &v, &p, true)?;
                let (o, _) = dense(&q, &k, &v, &prob, &p, false)?;
                assert_eq!(err(&o, &got.0)?, 0.0, "{what}: O without the LSE");
                let free = run(&q, &k, &v, &unchunked(&p, p.alibi_slopes.clone()), false)?;
                cases += 1;
                changed += check(&what, got, want, &free.0)? as usize;
            }
        }
    }
    assert!(
        changed * 2 > cases,
        "the chunk changed {changed} of {cases}"
    );
    Ok(())
}

/// Packed q, k, v of the given (query rows, keys) per sequence, and their prefix sums.
fn packed(
    lens: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
) -> Result<(Tensor, Tensor, Tensor, Tensor, Tensor)> {
    let (tq, tk): (usize, usize) = (
        lens.iter().map(|l| l.0).sum(),
        lens.iter().map(|l| l.1).sum(),
    );
    let q = randn(&[tq, hq, d], DType::F32)?;
    let k = randn(&[tk, hkv, d], DType::F32)?;
    let v = randn(&[tk, hkv, d], DType::F32)?;
    let cu_q = Tensor::new(
        prefix_sums(lens.iter().map(|l| l.0)).as_slice(),
        &Device::Cpu,
    )?;
    let cu_k = Tensor::new(
        prefix_sums(lens.iter().map(|l| l.1)).as_slice(),
        &Device::Cpu,
    )?;
    Ok((q, k, v, cu_q, cu_k))
}

const LENS: [(usize, usize); 8] = [
    (0, 5),
    (5, 0),
    (0, 0),
    (113, 113),
    (1, 200),
    (40, 17),
    (30, 30),
    (7, 64),
];

/// Packed batches with sequences without rows or keys, one row, more rows than keys and keys of
/// chunks no query sees: the one packed call over the pieces against the CPU path's chunk.
#[test]
fn varlen_pieces_match_the_cpu_chunk() -> Result<()> {
    let (hq, hkv, d) = (4, 2, 16);
    let (q, k, v, cu_q, cu_k) = packed(&LENS, hq, hkv, d)?;
    let (max_q, max_k) = (113, 200);
    let seqs = Varlen {
        cu_q: &cu_q,
        cu_k: &cu_k,
        max_q,
        max_k,
    };
    let (mut cases, mut changed) = (0, 0);
    for (mi, &mask) in MASKS.iter().enumerate() {
        for (ci, c) in [1usize, 16, 33, 64, 150].into_iter().enumerate() {
            let p = opts(mask, c, mi + ci, LENS.len(), hq)?;
            let prob = validate_varlen(&q, &k, &v, &cu_q, &cu_k, max_q, max_k, &p)?;
            let what = format!("varlen {mask:?} c{c} opts {}", (mi + ci) % 6);
            let got = varlen(&q, &k, &v, &seqs, &prob, &p, true)?;
            let want = run_varlen(&q, &k, &v, &seqs, &p, true)?;
            let free = unchunked(&p, p.alibi_slopes.clone());
            let free = run_varlen(&q, &k, &v, &seqs, &free, false)?;
            cases += 1;
            changed += check(&what, got, want, &free.0)? as usize;
        }
    }
    assert!(
        changed * 2 > cases,
        "the chunk changed {changed} of {cases}"
    );
    Ok(())
}

/// A paged cache for packed keys `k`, `v` of sequences `lens`: pages of `ps` rows in a shuffled
/// order (a fixed permutation), unused table entries far outside the pool.
fn paged_cache(
    k: &Tensor,
    v: &Tensor,
    lens: &[(usize, usize)],
    ps: usize,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let b = lens.len();
    let max_pages = lens.iter().map(|l| l.1.div_ceil(ps)).max().unwrap_or(0) + 1;
    let owners: Vec<(usize, usize)> = (0..b)
        .flat_map(|i| (0..lens[i].1.div_ceil(ps)).map(move |j| (i, j)))
        .collect();
    let num_pages = owners.len() + 1;
    // Page n of the owners lands on physical page (step n + 3) mod num_pages: a permutation
    // with step coprime to num_pages.
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut step = 7;
    while gcd(step, num_pages) != 1 {
        step += 1;
    }
    let phys = |n: usize| (step * n + 3) % num_pages;
    let mut table = vec![u32::MAX - 7; b * max_pages];
    let total_k = k.dim(0)?;
    // pool row -> packed key row (total_k: a zero row)
    let mut src = vec![total_k as u32; num_pages * ps];
    let mut k0 = 0;
    let mut owner = 0;
    for (i, &(_, sk)) in lens.iter().enumerate() {
        for j in 0..sk.div_ceil(ps) {
            let pg = phys(owner);
            owner += 1;
            table[i * max_pages + j] = pg as u32;
            for r in 0..ps.min(sk - j * ps) {
                src[pg * ps + r] = (k0 + j * ps + r) as u32;
            }
        }
        k0 += sk;
    }
    let idx = Tensor::new(src.as_slice(), &Device::Cpu)?;
    let pool = |t: &Tensor| -> Result<Tensor> {
        let (_, h, d) = t.dims3()?;
        let zero = Tensor::zeros((1, h, d), t.dtype(), t.device())?;
        Tensor::cat(&[t, &zero], 0)?
            .index_select(&idx, 0)?
            .reshape((num_pages, ps, h, d))
    };
    let lens_k: Vec<u32> = lens.iter().map(|l| l.1 as u32).collect();
    Ok((
        pool(k)?,
        pool(v)?,
        Tensor::from_vec(table, (b, max_pages), &Device::Cpu)?,
        Tensor::new(lens_k.as_slice(), &Device::Cpu)?,
    ))
}

/// Paged caches with shuffled pages, packed q (with the sequences of [`LENS`]) and dense q
/// (decode: one piece per sequence, q stays dense; several rows: packed pieces): the one paged
/// call over the pieces against the CPU path's chunk. A chunk that is not a multiple of the page
/// size is an error naming `chunk` and the page size.
#[test]
fn paged_pieces_match_the_cpu_chunk() -> Result<()> {
    let (hq, hkv, d, ps) = (4, 2, 16, 8);
    let (q, k, v, cu_q, _) = packed(&LENS, hq, hkv, d)?;
    let (kp, vp, table, seqlens) = paged_cache(&k, &v, &LENS, ps)?;
    let kv = PagedKv {
        k_pages: &kp,
        v_pages: &vp,
        page_table: &table,
        seqlens_k: &seqlens,
    };
    let (mut cases, mut changed) = (0, 0);
    for (mi, &mask) in MASKS.iter().enumerate() {
        for (ci, c) in [8usize, 16, 40, 64].into_iter().enumerate() {
            let p = opts(mask, c, mi + ci, LENS.len(), hq)?;
            let packed_q = Some((&cu_q, 113));
            let prob = validate_paged(&q, &kp, &vp, &table, &seqlens, packed_q, &p)?;
            let what = format!("paged varlen {mask:?} c{c} opts {}", (mi + ci) % 6);
            let got = paged(&q, &kv, packed_q, &prob, &p, true)?;
            let want = run_paged(&q, &kv, packed_q, &p, true)?;
            let free = unchunked(&p, p.alibi_slopes.clone());
            let free = run_paged(&q, &kv, packed_q, &free, false)?;
            cases += 1;
            changed += check(&what, got, want, &free.0)? as usize;
        }
    }
    assert!(
        changed * 2 > cases,
        "the chunk changed {changed} of {cases}"
    );
    // Dense q: one row per sequence (decode) and five rows per sequence.
    for sq in [1usize, 5] {
        let lens = [(sq, 3), (sq, 0), (sq, 40), (sq, 130), (sq, 64)];
        let (q, k, v, _, _) = packed(&lens, hq, hkv, d)?;
        let q = q.reshape((lens.len(), sq, hq, d))?;
        let (kp, vp, table, seqlens) = paged_cache(&k, &v, &lens, ps)?;
        let kv = PagedKv {
            k_pages: &kp,
            v_pages: &vp,
            page_table: &table,
            seqlens_k: &seqlens,
        };
        for (mi, &mask) in MASKS.iter().enumerate() {
            for c in [8usize, 16, 32] {
                let p = opts(mask, c, mi + c, lens.len(), hq)?;
                let prob = validate_paged(&q, &kp, &vp, &table, &seqlens, None, &p)?;
                let what = format!("paged dense sq{sq} {mask:?} c{c}");
                let plan = paged_plan(&q, &kv, None, &prob, &p)?;
                assert_eq!(plan.dense.is_none(), sq == 1, "{what}: dense q kept");
                let got = paged(&q, &kv, None, &prob, &p, true)?;
                let want = run_paged(&q, &kv, None, &p, true)?;
                check(&what, got, want.clone(), &want.0)?;
            }
        }
    }
    // Not a multiple of the page size.
    let p = opts(Mask::Causal, 12, 0, LENS.len(), hq)?;
    let packed_q = Some((&cu_q, 113));
    let prob = validate_paged(&q, &kp, &vp, &table, &seqlens, packed_q, &p)?;
    let e = paged(&q, &kv, packed_q, &prob, &p, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chunk:") && e.contains("page_size (8)") && e.contains("got 12"),
        "{e}"
    );
    Ok(())
}
