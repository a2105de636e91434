//! CPU tests of the paged KV cache: `attention_paged` / `attention_paged_varlen` against the
//! packed (varlen) path on the same keys, `append_kv_paged` against rows placed by hand, and the
//! errors that name a lying table. The pools are built by scattering packed rows into shuffled
//! pages (tests/common `Paged`), with NaN in every pool row no sequence uses and page ids far
//! outside the pool in the table's unused entries, so reading either fails a test.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use flashcore::{AttnParams, Mask};

fn opts(which: usize, mask: Mask, b: usize, hq: usize) -> Result<AttnParams> {
    let dev = Device::Cpu;
    Ok(AttnParams {
        mask,
        softcap: (which % 3 == 1).then_some(20.0),
        alibi_slopes: match which % 3 {
            2 => Some(Tensor::rand(0f32, 1., (b, hq), &dev)?),
            _ => None,
        },
        ..Default::default()
    })
}

/// Paged (packed q) and varlen on the same keys agree exactly (same reference path on the same
/// values); so does the dense-q twin when the query lengths are equal.
#[test]
fn paged_matches_varlen_on_the_cpu() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::from_clock("paged_matches_varlen");
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(7),
            right: Some(2),
        },
    ];
    // (lengths (seq_q, seq_k), page size, pages shared by sequences 0 and 1)
    type Case<'a> = (&'a [(usize, usize)], usize, usize);
    let cases: [Case; 5] = [
        (&[(1, 33), (1, 16), (1, 1), (1, 0)], 16, 0),
        (&[(5, 40), (3, 100), (0, 7), (9, 9)], 16, 2),
        (&[(17, 64), (17, 65)], 64, 1),
        (&[(4, 300), (4, 257), (4, 1)], 7, 3),
        (&[(2, 513)], 256, 0),
    ];
    let mut n = 0;
    for (ci, &(lens, page_size, shared)) in cases.iter().enumerate() {
        for (hq, hkv) in [(4, 4), (8, 2), (8, 1)] {
            let mut vl = Varlen::random(lens, hq, hkv, 32, DType::F32, ci % 2 == 1, &dev)?;
            if shared > 0 {
                vl = vl.share_prefix(shared * page_size)?;
            }
            let pg = Paged::from_varlen(&vl, page_size, shared, &mut rng)?;
            for (mi, &mask) in masks.iter().enumerate() {
                let p = opts(ci + mi + hkv, mask, lens.len(), hq)?;
                let what = format!("case {ci} h{hq}/{hkv} page {page_size} {}", opts_name(&p));
                let (o_ref, l_ref) = vl.run(&p)?;
                let (o, l) = pg.run_varlen(&vl, &p)?;
                assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output");
                let e = max_abs_diff(&o, &o_ref)?;
                assert!(e < 1e-6, "{what}: paged varlen differs from varlen by {e}");
                assert!(lse_err(&l, &l_ref)? < 1e-6, "{what}: lse");
                if lens.iter().all(|l| l.0 == lens[0].0 && l.0 > 0) {
                    let (o, l) = pg.run_dense(&vl, &p)?;
                    let e = max_abs_diff(&o, &o_ref)?;
                    assert!(e < 1e-6, "{what}: dense-q paged differs by {e}");
                    assert!(lse_err(&l, &l_ref)? < 1e-6, "{what}: dense-q lse");
                }
                n += 1;
            }
        }
    }
    println!("{n} paged cases");
    Ok(())
}

/// The paged result against the independent float64 reference of tests/common on one
/// sequence, so the comparison above cannot pass by sharing a bug with the varlen path.
#[test]
fn paged_matches_the_f64_reference() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::from_clock("paged_f64");
    let vl = Varlen::random(&[(3, 50)], 4, 2, 16, DType::F32, false, &dev)?;
    let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let (o, _) = pg.run_dense(&vl, &p)?;
    let (q, k, v) = vl.seq(0)?;
    let want = reference_f64(&q, &k, &v, &p)?.0.squeeze(0)?;
    let e = max_abs_diff(&o, &want)?;
    assert!(e < 1e-5, "paged vs f64 reference: {e}");
    Ok(())
}

/// Rows written by `append_kv_paged` land where the table says, at every page boundary case:
/// a start mid-page, rows crossing into the next page, ending exactly at a page end, a write of
/// one row, page size 1; the packed twin too. Everything else in the pools stays as it was.
#[test]
fn append_places_rows_through_the_table() -> Result<()> {
    let dev = Device::Cpu;
    let (hkv, d) = (2, 8);
    for &(page_size, n_new, ref starts) in &[
        (4usize, 3usize, vec![0u32, 1, 2, 5]),
        (4, 4, vec![4, 0, 8, 3]),
        (16, 1, vec![15, 16, 0, 31]),
        (1, 2, vec![0, 3, 1, 5]),
    ] {
        let b = starts.len();
        let max_pages = (40usize).div_ceil(page_size);
        let num_pages = b * max_pages + 3;
        // sequence i owns pages (i * max_pages + j) reversed, so page order != position order
        let table: Vec<u32> = (0..b * max_pages)
            .map(|x| (num_pages - 1 - x) as u32)
            .collect();
        let pt = Tensor::from_vec(table.clone(), (b, max_pages), &dev)?;
        let k0 = Tensor::randn(0f32, 1., (num_pages, page_size, hkv, d), &dev)?;
        let v0 = Tensor::randn(0f32, 1., (num_pages, page_size, hkv, d), &dev)?;
        let (kp, vp) = (k0.copy()?, v0.copy()?);
        let kn = Tensor::randn(0f32, 1., (b, n_new, hkv, d), &dev)?;
        let vn = Tensor::randn(0f32, 1., (b, n_new, hkv, d), &dev)?;
        let pos = Tensor::new(starts.as_slice(), &dev)?;
        flashcore::append_kv_paged(&kn, &vn, &kp, &vp, &pt, &pos)?;
        // the expected pools, placed by hand
        let mut ek = k0.flatten_all()?.to_vec1::<f32>()?;
        let mut ev = v0.flatten_all()?.to_vec1::<f32>()?;
        let kn_v = kn.flatten_all()?.to_vec1::<f32>()?;
        let vn_v = vn.flatten_all()?.to_vec1::<f32>()?;
        let row = hkv * d;
        for i in 0..b {
            for j in 0..n_new {
                let at = starts[i] as usize + j;
                let page = table[i * max_pages + at / page_size] as usize;
                let dst = (page * page_size + at % page_size) * row;
                let src = (i * n_new + j) * row;
                ek[dst..dst + row].copy_from_slice(&kn_v[src..src + row]);
                ev[dst..dst + row].copy_from_slice(&vn_v[src..src + row]);
            }
        }
        assert_eq!(
            kp.flatten_all()?.to_vec1::<f32>()?,
            ek,
            "k pool, page {page_size}"
        );
        assert_eq!(
            vp.flatten_all()?.to_vec1::<f32>()?,
            ev,
            "v pool, page {page_size}"
        );

        // packed twin: sequence i appends i + 1 rows
        let (kp, vp) = (k0.copy()?, v0.copy()?);
        let counts: Vec<usize> = (0..b).map(|i| i + 1).collect();
        let total: usize = counts.iter().sum();
        let kn = Tensor::randn(0f32, 1., (total, hkv, d), &dev)?;
        let vn = Tensor::randn(0f32, 1., (total, hkv, d), &dev)?;
        let cu = Tensor::new(prefix_sums(counts.iter().copied()).as_slice(), &dev)?;
        flashcore::append_kv_paged_varlen(&kn, &vn, &kp, &vp, &pt, &cu, &pos)?;
        let mut ek = k0.flatten_all()?.to_vec1::<f32>()?;
        let kn_v = kn.flatten_all()?.to_vec1::<f32>()?;
        let mut r = 0;
        for (i, &c) in counts.iter().enumerate() {
            for j in 0..c {
                let at = starts[i] as usize + j;
                let page = table[i * max_pages + at / page_size] as usize;
                let dst = (page * page_size + at % page_size) * row;
                ek[dst..dst + row].copy_from_slice(&kn_v[r * row..(r + 1) * row]);
                r += 1;
            }
        }
        assert_eq!(
            kp.flatten_all()?.to_vec1::<f32>()?,
            ek,
            "packed k pool, page {page_size}"
        );
    }
    Ok(())
}

/// Append then attend: a cache grown by appends equals attention over the same keys packed.
#[test]
fn append_then_attend() -> Result<()> {
    let dev = Device::Cpu;
    let (b, hq, hkv, d, page_size, max_pages) = (3, 4, 2, 16, 16, 8);
    let num_pages = b * max_pages;
    let table: Vec<u32> = (0..num_pages as u32).rev().collect();
    let pt = Tensor::from_vec(table, (b, max_pages), &dev)?;
    let kp = Tensor::zeros((num_pages, page_size, hkv, d), DType::F32, &dev)?;
    let vp = kp.copy()?;
    let mut ks: Vec<Tensor> = Vec::new();
    let mut vs: Vec<Tensor> = Vec::new();
    let mut len = 0;
    for n_new in [5usize, 11, 1, 1, 20] {
        let kn = Tensor::randn(0f32, 1., (b, n_new, hkv, d), &dev)?;
        let vn = Tensor::randn(0f32, 1., (b, n_new, hkv, d), &dev)?;
        let pos = Tensor::new(vec![len as u32; b].as_slice(), &dev)?;
        flashcore::append_kv_paged(&kn, &vn, &kp, &vp, &pt, &pos)?;
        ks.push(kn);
        vs.push(vn);
        len += n_new;
    }
    let k = Tensor::cat(&ks, 1)?;
    let v = Tensor::cat(&vs, 1)?;
    let q = Tensor::randn(0f32, 1., (b, 4, hq, d), &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let lens = Tensor::new(vec![len as u32; b].as_slice(), &dev)?;
    let o = flashcore::attention_paged(&q, &kp, &vp, &pt, &lens, &p)?;
    let want = flashcore::attention(&q, &k, &v, &p)?;
    let e = max_abs_diff(&o, &want)?;
    assert!(e < 1e-6, "append + paged attention vs dense: {e}");
    Ok(())
}

/// Tables that lie, and bad shapes, are errors naming the argument (and nothing is written).
#[test]
fn paged_errors_name_the_argument() -> Result<()> {
    let dev = Device::Cpu;
    let (b, hq, hkv, d, ps, np, mp) = (2, 4, 2, 16, 16, 6, 3);
    let q = Tensor::randn(0f32, 1., (b, 1, hq, d), &dev)?;
    let kp = Tensor::randn(0f32, 1., (np, ps, hkv, d), &dev)?;
    let vp = Tensor::randn(0f32, 1., (np, ps, hkv, d), &dev)?;
    let pt = |v: Vec<u32>| Tensor::from_vec(v, (b, mp), &dev);
    let lens = |v: Vec<u32>| Tensor::new(v.as_slice(), &dev);
    let p = AttnParams::default();
    let good_pt = pt(vec![0, 1, 2, 3, 4, 5])?;
    let run = |pt: &Tensor, l: &Tensor| flashcore::attention_paged(&q, &kp, &vp, pt, l, &p);
    run(&good_pt, &lens(vec![48, 1])?)?;
    let e = run(&pt(vec![0, 9, 2, 3, 4, 5])?, &lens(vec![20, 1])?).unwrap_err();
    assert!(names(&e.to_string(), "page_table"), "{e}");
    // an out-of-pool id past the sequence's length is never read: fine
    run(&pt(vec![0, 9, 9, 3, 4, 5])?, &lens(vec![16, 1])?)?;
    let e = run(&good_pt, &lens(vec![49, 1])?).unwrap_err();
    assert!(names(&e.to_string(), "seqlens_k"), "{e}");
    let e = run(&good_pt, &lens(vec![1, 1, 1])?).unwrap_err();
    assert!(names(&e.to_string(), "seqlens_k"), "{e}");
    let e = run(&good_pt.to_dtype(DType::F32)?, &lens(vec![1, 1])?).unwrap_err();
    assert!(names(&e.to_string(), "page_table"), "{e}");
    let e = flashcore::attention_paged(
        &q,
        &kp,
        &vp.narrow(0, 0, 5)?,
        &good_pt,
        &lens(vec![1, 1])?,
        &p,
    )
    .unwrap_err();
    assert!(names(&e.to_string(), "v"), "{e}");
    let flat = kp.reshape((np * ps, hkv, d))?;
    let e =
        flashcore::attention_paged(&q, &flat, &vp, &good_pt, &lens(vec![1, 1])?, &p).unwrap_err();
    assert!(names(&e.to_string(), "k_pages"), "{e}");

    // append: a position beyond the table, a page outside the pool; the pools stay untouched
    let before = kp.flatten_all()?.to_vec1::<f32>()?;
    let kn = Tensor::randn(0f32, 1., (b, 2, hkv, d), &dev)?;
    let e =
        flashcore::append_kv_paged(&kn, &kn, &kp, &vp, &good_pt, &lens(vec![47, 0])?).unwrap_err();
    assert!(names(&e.to_string(), "positions"), "{e}");
    let e = flashcore::append_kv_paged(
        &kn,
        &kn,
        &kp,
        &vp,
        &pt(vec![0, 1, 2, 7, 4, 5])?,
        &lens(vec![0, 0])?,
    )
    .unwrap_err();
    assert!(names(&e.to_string(), "page_table"), "{e}");
    assert_eq!(
        kp.flatten_all()?.to_vec1::<f32>()?,
        before,
        "a failed append wrote"
    );
    let e = flashcore::append_kv_paged(
        &kn.to_dtype(DType::F64)?,
        &kn,
        &kp,
        &vp,
        &good_pt,
        &lens(vec![0, 0])?,
    )
    .unwrap_err();
    assert!(names(&e.to_string(), "k_new"), "{e}");
    Ok(())
}

/// `PagedKvCache`: sequences grow by appends of different sizes, one is freed and its pages go
/// to a new one; attention over the cache equals dense attention over each sequence's rows; an
/// append the pool cannot hold is an error that takes no page and writes nothing.
#[test]
fn paged_kv_cache_grows_frees_and_reuses() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hkv, d, ps) = (4, 2, 16, 8);
    let mut cache = flashcore::PagedKvCache::new(12, ps, hkv, d, DType::F32, &dev)?;
    let mut rows: Vec<Vec<(Tensor, Tensor)>> = Vec::new();
    let ids: Vec<usize> = (0..3).map(|_| cache.add_sequence()).collect();
    rows.resize(3, Vec::new());
    for n_new in [3usize, 8, 1, 13] {
        let k = Tensor::randn(0f32, 1., (3, n_new, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (3, n_new, hkv, d), &dev)?;
        cache.append(&ids, &k, &v)?;
        for (i, r) in rows.iter_mut().enumerate() {
            r.push((k.narrow(0, i, 1)?, v.narrow(0, i, 1)?));
        }
    }
    // 25 rows each: 4 pages each (7 rows spare in the last), all 12 in use; 8 more need a page
    assert_eq!(cache.free_pages(), 0);
    let k = Tensor::randn(0f32, 1., (1, 8, hkv, d), &dev)?;
    let e = cache.append(&[ids[0]], &k, &k).unwrap_err().to_string();
    assert!(e.contains("free pages"), "{e}");
    assert_eq!(
        cache.len(ids[0]),
        Some(25),
        "a failed append changed the length"
    );
    cache.free_sequence(ids[1])?;
    assert_eq!(cache.free_pages(), 4);
    let new = cache.add_sequence();
    let kn = Tensor::randn(0f32, 1., (1, 30, hkv, d), &dev)?;
    let vn = Tensor::randn(0f32, 1., (1, 30, hkv, d), &dev)?;
    cache.append(&[new], &kn, &vn)?;
    let live = [ids[0], new, ids[2]];
    let dense_kv = |i: usize| -> Result<(Tensor, Tensor)> {
        if i == 1 {
            return Ok((kn.clone(), vn.clone()));
        }
        let (ks, vs): (Vec<Tensor>, Vec<Tensor>) = rows[i].iter().cloned().unzip();
        Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
    };
    let (table, lens) = cache.tables(&live)?;
    assert_eq!(lens.to_vec1::<u32>()?, vec![25, 30, 25]);
    let q = Tensor::randn(0f32, 1., (3, 2, hq, d), &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let o = flashcore::attention_paged(&q, cache.k_pages(), cache.v_pages(), &table, &lens, &p)?;
    for i in 0..3 {
        let (k, v) = dense_kv(i)?;
        let want = flashcore::attention(&q.narrow(0, i, 1)?, &k, &v, &p)?;
        let e = max_abs_diff(&o.narrow(0, i, 1)?, &want)?;
        assert!(e < 1e-6, "sequence {i}: paged cache vs dense {e}");
    }
    Ok(())
}
