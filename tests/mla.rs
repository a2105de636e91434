//! MLA's absorbed decode on the CPU through the general paged API: one latent pool holds
//! `(pages, page_size, 1, 576)` rows (512 latent + 64 rope columns), the keys are whole rows and
//! the values are the same rows' first 512 columns, passed as a view of the pool (no copy). 16
//! and 128 query heads share the one K/V head; pages of 64 in shuffled order; decode (one query
//! row) and a few speculative rows; against an f64 model written out here.

use candle_core::{DType, Device, Result, Tensor};
use flashcore::{attention_paged, AttnParams, Mask};

const D_QK: usize = 576;
const D_V: usize = 512;
const PAGE: usize = 64;

/// f64 model: for each sequence and head, softmax(scale q·k) over the visible latent rows, then
/// the weighted sum of their first 512 columns. Rows are (seq, row, head, d).
fn model(
    q: &[f64],
    pool: &[f64],
    table: &[Vec<u32>],
    lens: &[usize],
    sq: usize,
    hq: usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; lens.len() * sq * hq * D_V];
    for (s, &len) in lens.iter().enumerate() {
        let row = |j: usize| -> &[f64] {
            let page = table[s][j / PAGE] as usize;
            let at = (page * PAGE + j % PAGE) * D_QK;
            &pool[at..at + D_QK]
        };
        for i in 0..sq {
            // bottom-right causal: row i sees keys j <= i + len - sq
            let last = (i + len) as i64 - sq as i64;
            for h in 0..hq {
                let qa = ((s * sq + i) * hq + h) * D_QK;
                let qr = &q[qa..qa + D_QK];
                let keys: Vec<usize> = (0..len).filter(|&j| j as i64 <= last).collect();
                if keys.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|&j| scale * qr.iter().zip(row(j)).map(|(a, b)| a * b).sum::<f64>())
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                let oa = ((s * sq + i) * hq + h) * D_V;
                for (k, &j) in keys.iter().enumerate() {
                    for c in 0..D_V {
                        out[oa + c] += w[k] / z * row(j)[c];
                    }
                }
            }
        }
    }
    out
}

fn shuffled_table(lens: &[usize], seed: u64) -> (Vec<Vec<u32>>, usize) {
    let per: Vec<usize> = lens.iter().map(|l| l.div_ceil(PAGE).max(1)).collect();
    let total: usize = per.iter().sum();
    let mut ids: Vec<u32> = (0..total as u32).collect();
    let mut x = seed | 1;
    for i in (1..ids.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let width = *per.iter().max().unwrap_or(&1);
    let mut next = 0;
    let table = per
        .iter()
        .map(|&n| {
            let mut t: Vec<u32> = ids[next..next + n].to_vec();
            next += n;
            t.resize(width, 0);
            t
        })
        .collect();
    (table, total)
}

#[test]
fn mla_absorbed_decode_reads_values_as_a_view_of_the_latent_pool() -> Result<()> {
    let dev = Device::Cpu;
    let scale = 1.0 / (192f64).sqrt(); // DeepSeek's softmax scale (the unabsorbed q/k head dim)
    for (hq, sq, lens) in [
        (16, 1, vec![1usize, 113, 300, 64]),
        (128, 1, vec![257, 0, 5]),
        (16, 3, vec![130, 3, 64]),
    ] {
        let b = lens.len();
        let (table, pages) = shuffled_table(&lens, 0x5eed ^ hq as u64 ^ (sq as u64) << 8);
        let pool = Tensor::randn(0f32, 1., (pages, PAGE, 1, D_QK), &dev)?;
        let q = Tensor::randn(0f32, 1., (b, sq, hq, D_QK), &dev)?;
        let v_view = pool.narrow(3, 0, D_V)?; // the values: no copy
        assert!(!v_view.is_contiguous());
        let t_flat: Vec<u32> = table.iter().flatten().copied().collect();
        let t = Tensor::from_vec(t_flat, (b, table[0].len()), &dev)?;
        let l = Tensor::new(lens.iter().map(|&x| x as u32).collect::<Vec<_>>(), &dev)?;
        let p = AttnParams {
            softmax_scale: Some(scale as f32),
            mask: Mask::Causal,
            ..Default::default()
        };
        let o = attention_paged(&q, &pool, &v_view, &t, &l, &p)?;
        assert_eq!(o.dims(), &[b, sq, hq, D_V]);
        let qf: Vec<f64> = q.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let pf: Vec<f64> = pool.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let want = model(&qf, &pf, &table, &lens, sq, hq, scale);
        let got: Vec<f64> = o.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            err < 1e-4,
            "hq {hq} sq {sq} lens {lens:?}: max error {err:.2e}"
        );

        // The comparison sees which columns are the values: the last 512 instead of the first
        // 512 (a view at another offset) is far off the model.
        let wrong = attention_paged(&q, &pool, &pool.narrow(3, D_QK - D_V, D_V)?, &t, &l, &p)?;
        let wf: Vec<f64> = wrong.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let off = wf
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            off > 1e-2,
            "values at another offset went unnoticed ({off:.2e})"
        );
    }
    Ok(())
}
