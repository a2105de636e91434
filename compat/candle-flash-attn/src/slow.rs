//! The slow path: attention composed of candle ops, for CUDA calls whose head dim is past
//! flashcore's GPU kernels (`flashcore::GPU_MAX_HEAD_DIM`) but within the original crate's 512
//! (Gemma 4's global layers run at 512). Every function of the crate routes such a call here
//! instead of failing; CPU calls and head dims the kernels take never come here.
//!
//! Per sequence and per block of query rows it computes `scale · q kᵀ` by matmul in f32 (f64
//! for f64 inputs), the softcap, the ALiBi bias, the mask (and `mm_prefix_ranges`) as an
//! explicit visibility matrix, the softmax (a row that sees no key gives zeros) and `· v`, then
//! casts to q's dtype. The key positions and mask bounds are i64 on q's device; the prefix sums,
//! block table and ranges of packed and paged calls are read on the host (a device sync).

use crate::Mask;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Largest head dim the original crate takes (and so this path).
pub(crate) const MAX_HEAD_DIM: usize = 512;

/// Score elements (heads × rows × keys) one block materialises; a block has at least one row.
/// Changed only by the tests ([`set_block_elems`]), to run many blocks on small problems.
static BLOCK_ELEMS: AtomicUsize = AtomicUsize::new(1 << 26);

/// Sets the score elements of one block (at least 1); the result does not depend on it.
pub(crate) fn set_block_elems(n: usize) {
    BLOCK_ELEMS.store(n.max(1), Ordering::Relaxed);
}

/// Bounds past every key position (a window side of `usize::MAX` included) in i64 arithmetic.
const FAR: i64 = 1 << 48;

/// Whether a call goes to the slow path: q on a CUDA device and q's or v's head dim above
/// flashcore's GPU limit, up to [`MAX_HEAD_DIM`] (beyond it flashcore's error is the answer).
pub(crate) fn wanted(q: &Tensor, v: &Tensor) -> bool {
    let hd = |t: &Tensor| t.dims().last().copied().unwrap_or(0);
    let d = hd(q).max(hd(v));
    q.device().is_cuda() && d > flashcore::GPU_MAX_HEAD_DIM && d <= MAX_HEAD_DIM
}

/// The options every sequence shares, after the crate's conversion of the original's
/// arguments (window sides to a [`Mask`], softcap `> 0` or none).
#[derive(Clone, Copy)]
pub(crate) struct Opts {
    pub mask: Mask,
    pub scale: f32,
    pub softcap: Option<f32>,
}

fn err(function: &str, name: &str, rule: &str, got: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "candle-flash-attn (flashcore): {function}: {name}: {rule}, got {got}"
    ))
}

/// What flashcore's validation checks of q (rank `q_rank`) and k/v (rank `kv_rank`: dense 4/4,
/// packed 3/3, paged 3/4), but for the GPU head-dim limit.
fn check_qkv(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (q_rank, kv_rank): (usize, usize),
) -> Result<()> {
    for (name, t, r) in [("q", q, q_rank), ("k", k, kv_rank), ("v", v, kv_rank)] {
        if t.rank() != r {
            return Err(err(
                function,
                name,
                &format!("must have rank {r}"),
                format!("{:?}", t.dims()),
            ));
        }
    }
    // f16/bf16 on a GPU, as the kernels (a CUDA f32 call at d128 fails there too); CPU tensors
    // (the tests) also take f32/f64.
    let cpu_wide = matches!(q.dtype(), DType::F32 | DType::F64) && q.device().is_cpu();
    if !(matches!(q.dtype(), DType::F16 | DType::BF16) || cpu_wide) {
        return Err(err(
            function,
            "q",
            "dtype must be f16 or bf16",
            format!("{:?}", q.dtype()),
        ));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(err(
                function,
                name,
                &format!("dtype must match q ({:?})", q.dtype()),
                format!("{:?}", t.dtype()),
            ));
        }
        if !t.device().same_device(q.device()) {
            return Err(err(
                function,
                name,
                "must be on q's device",
                format!("{:?}", t.device().location()),
            ));
        }
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    let d = qd[qd.len() - 1];
    for (name, x) in [("q", d), ("v", vd[vd.len() - 1])] {
        if x == 0 || x > MAX_HEAD_DIM || !x.is_multiple_of(8) {
            return Err(err(
                function,
                name,
                &format!("head_dim must be a multiple of 8 in 8..={MAX_HEAD_DIM}"),
                x,
            ));
        }
    }
    if kd[kd.len() - 1] != d {
        return Err(err(
            function,
            "k",
            &format!("head_dim must equal q's head_dim {d}"),
            kd[kd.len() - 1],
        ));
    }
    if vd[..vd.len() - 1] != kd[..kd.len() - 1] {
        return Err(err(
            function,
            "v",
            &format!("shape must equal k's {kd:?} but for the last dim"),
            format!("{vd:?}"),
        ));
    }
    let (hq, hkv) = (qd[qd.len() - 2], kd[kd.len() - 2]);
    if hq == 0 {
        return Err(err(function, "q", "heads must be >= 1", hq));
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(err(
            function,
            "k",
            &format!("heads_kv must divide heads_q ({hq})"),
            hkv,
        ));
    }
    Ok(())
}

fn check_opts(function: &str, o: &Opts) -> Result<()> {
    // The kernels' rule (a positive scale), kept so that a call does not change meaning with its
    // head dim.
    if !(o.scale.is_finite() && o.scale > 0.0) {
        return Err(err(
            function,
            "softmax_scale",
            "must be finite and > 0 on a GPU",
            o.scale,
        ));
    }
    if let Some(c) = o.softcap {
        if !c.is_finite() {
            return Err(err(function, "softcap", "must be finite", c));
        }
    }
    Ok(())
}

/// The slopes of sequence `i` as `(heads_q,)`: f32 `(heads_q,)` (shared) or `(batch, heads_q)`.
fn slopes_of(
    function: &str,
    slopes: Option<&Tensor>,
    i: usize,
    batch: usize,
    hq: usize,
    dev: &Device,
) -> Result<Option<Tensor>> {
    let Some(s) = slopes else { return Ok(None) };
    if s.dtype() != DType::F32 {
        return Err(err(
            function,
            "alibi_slopes",
            "dtype must be f32",
            format!("{:?}", s.dtype()),
        ));
    }
    if !s.device().same_device(dev) {
        return Err(err(
            function,
            "alibi_slopes",
            "must be on q's device",
            format!("{:?}", s.device().location()),
        ));
    }
    match s.dims() {
        [h] if *h == hq => Ok(Some(s.clone())),
        [b, h] if *b == batch && *h == hq => Ok(Some(s.get(i)?)),
        d => Err(err(
            function,
            "alibi_slopes",
            &format!("shape must be ({hq},) or ({batch}, {hq})"),
            format!("{d:?}"),
        )),
    }
}

/// u32 prefix sums of `batch + 1` entries, read on the host and checked: start at 0,
/// non-decreasing, end at `total` (when given), every length at most `max_len` (when given).
fn prefix_sums(
    function: &str,
    name: &str,
    t: &Tensor,
    total: Option<usize>,
    max_len: Option<usize>,
) -> Result<Vec<u32>> {
    if t.dtype() != DType::U32 || t.rank() != 1 || t.dims()[0] < 2 {
        return Err(err(
            function,
            name,
            "must be u32 prefix sums of shape (batch + 1,) with batch >= 1",
            format!("{:?} {:?}", t.dtype(), t.dims()),
        ));
    }
    let cu = t.to_vec1::<u32>()?;
    if cu[0] != 0 {
        return Err(err(function, name, "must start at 0", cu[0]));
    }
    for (i, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(err(
                function,
                name,
                "must be non-decreasing",
                format!("entry {} = {} after {}", i + 1, w[1], w[0]),
            ));
        }
        if let Some(m) = max_len {
            if (w[1] - w[0]) as usize > m {
                return Err(err(
                    function,
                    name,
                    &format!("sequence lengths must be at most the max_seqlen {m}"),
                    format!("sequence {i} of length {}", w[1] - w[0]),
                ));
            }
        }
    }
    if let Some(n) = total {
        if cu[cu.len() - 1] as usize != n {
            return Err(err(
                function,
                name,
                &format!("must end at the packed row count {n}"),
                cu[cu.len() - 1],
            ));
        }
    }
    Ok(cu)
}

/// One sequence of the batch.
struct Seq<'a> {
    /// `(sq, heads_q, d)`
    q: Tensor,
    /// `(sk, heads_kv, d)`
    k: Tensor,
    /// `(sk, heads_kv, dv)`
    v: Tensor,
    /// `(heads_q,)` f32
    slopes: Option<Tensor>,
    /// `[start, end)` key ranges visible to the queries inside them despite the mask.
    ranges: &'a [(i64, i64)],
}

/// Attention of one sequence, `(sq, heads_q, dv)` in q's dtype; rows aligned bottom-right
/// (query row `t` at position `t + sk - sq`).
fn attend(s: Seq, o: &Opts) -> Result<Tensor> {
    let (sq, hq, d) = s.q.dims3()?;
    let (sk, hkv, _) = s.k.dims3()?;
    let dv = s.v.dims()[2];
    let (dtype, dev) = (s.q.dtype(), s.q.device().clone());
    if sq == 0 || sk == 0 {
        return Tensor::zeros((sq, hq, dv), dtype, &dev);
    }
    let cd = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let ratio = hq / hkv;
    // (heads_kv, d, sk) and (heads_kv, sk, dv): query head h reads K/V head h / ratio, so the
    // queries of one K/V head are stacked along the rows of one matmul (nothing repeated).
    let kt = s.k.to_dtype(cd)?.transpose(0, 1)?.t()?.contiguous()?;
    let v = s.v.to_dtype(cd)?.transpose(0, 1)?.contiguous()?;
    let scale = o.scale as f64;
    let keys = Tensor::arange(0i64, sk as i64, &dev)?.reshape((1, sk))?;
    let (left, right) = o.mask.bounds();
    let far = |x: Option<usize>| x.map_or(FAR, |x| i64::try_from(x).unwrap_or(FAR).min(FAR));
    let (left, right) = (
        Tensor::new(&[far(left)], &dev)?,
        Tensor::new(&[far(right)], &dev)?,
    );
    let masked = o.mask != Mask::None;
    let neg_inf = Tensor::new(&[f32::NEG_INFINITY], &dev)?.to_dtype(cd)?;
    let rows = (BLOCK_ELEMS.load(Ordering::Relaxed) / (hq * sk)).clamp(1, sq);
    let mut outs = Vec::with_capacity(sq.div_ceil(rows));
    for r0 in (0..sq).step_by(rows) {
        let n = rows.min(sq - r0);
        let q =
            s.q.narrow(0, r0, n)?
                .to_dtype(cd)?
                .transpose(0, 1)?
                .contiguous()?; // (hq, n, d)
                                // As flashcore: a scale of at most 1 multiplies q first, a larger one the products.
        let mut sc = if scale <= 1.0 {
            (q * scale)?.reshape((hkv, ratio * n, d))?.matmul(&kt)?
        } else {
            (q.reshape((hkv, ratio * n, d))?.matmul(&kt)? * scale)?
        }
        .reshape((hq, n, sk))?;
        if let Some(c) = o.softcap {
            sc = ((sc / c as f64)?.tanh()? * c as f64)?;
        }
        let p0 = r0 as i64 + sk as i64 - sq as i64;
        let pos = Tensor::arange(p0, p0 + n as i64, &dev)?.reshape((n, 1))?;
        let rel = keys.broadcast_sub(&pos)?; // (n, sk): j - p
        if let Some(sl) = &s.slopes {
            let dist = rel.to_dtype(cd)?.abs()?.unsqueeze(0)?; // (1, n, sk)
            let bias = sl.to_dtype(cd)?.reshape((hq, 1, 1))?.broadcast_mul(&dist)?;
            sc = (sc - bias)?;
        }
        if masked {
            // >= 0 where visible: inside the band (j >= p - left and j <= p + right) ...
            let mut vis = rel
                .broadcast_add(&left)?
                .minimum(&right.broadcast_sub(&rel)?)?;
            // ... or with both p and j in one non-empty range.
            for &(a, b) in s.ranges.iter().filter(|(a, b)| a < b) {
                let (a, b1) = (Tensor::new(&[a], &dev)?, Tensor::new(&[b - 1], &dev)?);
                let row_in = pos.broadcast_sub(&a)?.minimum(&b1.broadcast_sub(&pos)?)?; // (n, 1)
                let key_in = keys.broadcast_sub(&a)?.minimum(&b1.broadcast_sub(&keys)?)?; // (1, sk)
                vis = vis.maximum(&row_in.broadcast_minimum(&key_in)?)?;
            }
            let vis = vis.ge(0i64)?.unsqueeze(0)?.broadcast_as(sc.shape())?;
            sc = vis.where_cond(&sc, &neg_inf.broadcast_as(sc.shape())?)?;
        }
        // Softmax over the visible keys; a row without any gives zeros.
        let m = sc.max_keepdim(2)?;
        let m = m.eq(f64::NEG_INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
        let e = sc.broadcast_sub(&m)?.exp()?;
        let z = e.sum_keepdim(2)?;
        let z = z.eq(0f64)?.where_cond(&z.ones_like()?, &z)?;
        let out = e
            .broadcast_div(&z)?
            .reshape((hkv, ratio * n, sk))?
            .matmul(&v)?
            .reshape((hq, n, dv))?
            .transpose(0, 1)?
            .to_dtype(dtype)?;
        outs.push(out);
    }
    Tensor::cat(&outs, 0)
}

/// A dense call: q `(batch, sq, heads_q, d)`, k/v `(batch, sk, heads_kv, d | dv)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    o: &Opts,
) -> Result<Tensor> {
    check_qkv(function, q, k, v, (4, 4))?;
    check_opts(function, o)?;
    let (b, sq, hq, _) = q.dims4()?;
    let (bk, sk, _, _) = k.dims4()?;
    for (name, x) in [("q", b), ("q", sq), ("k", sk)] {
        if x == 0 {
            return Err(err(
                function,
                name,
                "batch and sequence lengths must be >= 1",
                format!("{:?}", if name == "q" { q.dims() } else { k.dims() }),
            ));
        }
    }
    if bk != b {
        return Err(err(
            function,
            "k",
            &format!("batch must equal q's batch {b}"),
            bk,
        ));
    }
    let mut outs = Vec::with_capacity(b);
    for i in 0..b {
        let seq = Seq {
            q: q.get(i)?,
            k: k.get(i)?,
            v: v.get(i)?,
            slopes: slopes_of(function, alibi_slopes, i, b, hq, q.device())?,
            ranges: &[],
        };
        outs.push(attend(seq, o)?);
    }
    Tensor::stack(&outs, 0)
}

/// A packed call: q `(total_q, heads_q, d)`, k/v `(total_k, heads_kv, d | dv)`, u32 prefix sums.
#[allow(clippy::too_many_arguments)]
pub(crate) fn varlen(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    o: &Opts,
) -> Result<Tensor> {
    check_qkv(function, q, k, v, (3, 3))?;
    check_opts(function, o)?;
    let (total_q, hq, _) = q.dims3()?;
    let total_k = k.dims()[0];
    let cu_q = prefix_sums(
        function,
        "seqlens_q",
        seqlens_q,
        Some(total_q),
        Some(max_seqlen_q),
    )?;
    let cu_k = prefix_sums(
        function,
        "seqlens_k",
        seqlens_k,
        Some(total_k),
        Some(max_seqlen_k),
    )?;
    if cu_q.len() != cu_k.len() {
        return Err(err(
            function,
            "seqlens_k",
            &format!("must have seqlens_q's {} entries", cu_q.len()),
            cu_k.len(),
        ));
    }
    let b = cu_q.len() - 1;
    let mut outs = Vec::with_capacity(b);
    for i in 0..b {
        let (q0, sq) = (cu_q[i] as usize, (cu_q[i + 1] - cu_q[i]) as usize);
        let (k0, sk) = (cu_k[i] as usize, (cu_k[i + 1] - cu_k[i]) as usize);
        let seq = Seq {
            q: q.narrow(0, q0, sq)?,
            k: k.narrow(0, k0, sk)?,
            v: v.narrow(0, k0, sk)?,
            slopes: slopes_of(function, alibi_slopes, i, b, hq, q.device())?,
            ranges: &[],
        };
        outs.push(attend(seq, o)?);
    }
    Tensor::cat(&outs, 0)
}

/// The pool rows holding keys `0..sk` of sequence `i` (`table`: the u32 block table read on the
/// host, `max_pages` entries per sequence), each page id checked against the pool.
pub(crate) fn key_rows(
    function: &str,
    table: &[u32],
    i: usize,
    sk: usize,
    (num_pages, page_size, max_pages): (usize, usize, usize),
) -> Result<Vec<u32>> {
    if sk > max_pages * page_size {
        return Err(err(
            function,
            "seqlens_k",
            &format!("sequence {i} must fit block_table's {max_pages} pages of {page_size}"),
            format!("{sk} keys"),
        ));
    }
    (0..sk)
        .map(|j| {
            let page = table[i * max_pages + j / page_size] as usize;
            if page >= num_pages {
                return Err(err(
                    function,
                    "block_table",
                    &format!(
                        "entry [{i}][{}] must be a page of the pool (0..{num_pages})",
                        j / page_size
                    ),
                    page,
                ));
            }
            Ok((page * page_size + j % page_size) as u32)
        })
        .collect()
}

/// A paged call: q `(total_q, heads_q, d)`, pools `(num_pages, page_size, heads_kv, d | dv)`,
/// `block_table` `(batch, max_pages)` (u32), u32 prefix sums of both sides, optional ranges.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged(
    function: &str,
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    ranges: Option<&[Vec<(i64, i64)>]>,
    max_seqlen_q: usize,
    o: &Opts,
) -> Result<Tensor> {
    check_qkv(function, q, k_pages, v_pages, (3, 4))?;
    check_opts(function, o)?;
    let (total_q, _, d) = q.dims3()?;
    let (num_pages, ps, hkv, _) = k_pages.dims4()?;
    let dv = v_pages.dims()[3];
    let cu_q = prefix_sums(
        function,
        "seqlens_q",
        seqlens_q,
        Some(total_q),
        Some(max_seqlen_q),
    )?;
    let cu_k = prefix_sums(function, "seqlens_k", seqlens_k, None, None)?;
    let b = cu_q.len() - 1;
    if cu_k.len() != b + 1 {
        return Err(err(
            function,
            "seqlens_k",
            &format!("must have seqlens_q's {} entries", b + 1),
            cu_k.len(),
        ));
    }
    if block_table.rank() != 2 || block_table.dims()[0] != b {
        return Err(err(
            function,
            "block_table",
            &format!("shape must be (batch, max_pages) with batch = {b}"),
            format!("{:?}", block_table.dims()),
        ));
    }
    let max_pages = block_table.dims()[1];
    let table = block_table.flatten_all()?.to_vec1::<u32>()?;
    let flat_k = k_pages.reshape((num_pages * ps, hkv, d))?;
    let flat_v = v_pages.reshape((num_pages * ps, hkv, dv))?;
    let mut outs = Vec::with_capacity(b);
    for i in 0..b {
        let (q0, sq) = (cu_q[i] as usize, (cu_q[i + 1] - cu_q[i]) as usize);
        let sk = (cu_k[i + 1] - cu_k[i]) as usize;
        let rows = key_rows(function, &table, i, sk, (num_pages, ps, max_pages))?;
        let rows = Tensor::new(rows.as_slice(), q.device())?;
        let seq = Seq {
            q: q.narrow(0, q0, sq)?,
            k: flat_k.index_select(&rows, 0)?,
            v: flat_v.index_select(&rows, 0)?,
            slopes: None,
            ranges: ranges.map_or(&[][..], |r| &r[i][..]),
        };
        outs.push(attend(seq, o)?);
    }
    Tensor::cat(&outs, 0)
}
