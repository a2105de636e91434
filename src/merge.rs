//! Merging attention results computed over disjoint key sets from their log-sum-exps.
//!
//! Attention over keys `A ∪ B` (disjoint) is a weighted mean of the attention over `A` and over
//! `B`: with `m = max(lse_a, lse_b)`, `w_x = exp(lse_x − m)`,
//! `o = (w_a·o_a + w_b·o_b) / (w_a + w_b)` and `lse = m + ln(w_a + w_b)`. A row that saw no key in
//! either part (both LSEs `-inf`) stays zeros with LSE `-inf`.

use candle_core::{DType, Result, Tensor, D};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashcore::merge_states: {msg}"))
}

/// Checks one part's (o, lse) pair and returns the lse laid out like o's first dims,
/// `(…, heads)` with a trailing unit axis so it broadcasts over the head dim.
fn lse_like_o(o: &Tensor, lse: &Tensor, part: &str) -> Result<Tensor> {
    if lse.dtype() != DType::F32 {
        return Err(err(format!(
            "lse_{part} must be f32 (as the `_with_lse` functions return it), got {:?}",
            lse.dtype()
        )));
    }
    match (o.dims(), lse.dims()) {
        // dense: o (b, sq, hq, d), lse (b, hq, sq)
        (&[b, sq, hq, _], &[lb, lh, ls]) if (lb, lh, ls) == (b, hq, sq) => {
            lse.transpose(1, 2)?.unsqueeze(3)
        }
        // packed: o (total, hq, d), lse (hq, total)
        (&[t, hq, _], &[lh, lt]) if (lh, lt) == (hq, t) => lse.t()?.unsqueeze(2),
        (od, ld) => Err(err(format!(
            "o_{part} {od:?} and lse_{part} {ld:?} do not match: o (batch, seq_q, heads_q, head_dim) \
             takes lse (batch, heads_q, seq_q), o (total_q, heads_q, head_dim) takes lse \
             (heads_q, total_q)"
        ))),
    }
}

/// Merges two attention results over disjoint key sets of the same queries into the result over
/// their union, from the log-sum-exps the `_with_lse` functions return.
///
/// `o_a`, `o_b`: `(batch, seq_q, heads_q, head_dim)` with `lse_a`, `lse_b` `(batch, heads_q,
/// seq_q)`, or packed `(total_q, heads_q, head_dim)` with `(heads_q, total_q)`; both parts of one
/// shape, dtype and device, the LSEs f32. Returns `(o, lse)` in the same layout, `o` in the input
/// dtype (the arithmetic is f32). This turns shared-prefix (cascade) attention into two calls and a
/// merge: the prefix's keys without a mask, then each sequence's own keys with its mask.
///
/// Runs as a handful of candle ops on the tensors' device (no custom kernel); it is
/// differentiable wherever the inputs are.
pub fn merge_states(
    o_a: &Tensor,
    lse_a: &Tensor,
    o_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if o_a.dims() != o_b.dims() {
        return Err(err(format!(
            "o_a {:?} and o_b {:?} must have the same shape",
            o_a.dims(),
            o_b.dims()
        )));
    }
    if o_a.dtype() != o_b.dtype() {
        return Err(err(format!(
            "o_a ({:?}) and o_b ({:?}) must have the same dtype",
            o_a.dtype(),
            o_b.dtype()
        )));
    }
    for (name, t) in [("o_b", o_b), ("lse_a", lse_a), ("lse_b", lse_b)] {
        if !t.device().same_device(o_a.device()) {
            return Err(err(format!("{name} must be on o_a's device")));
        }
    }
    let la = lse_like_o(o_a, lse_a, "a")?;
    let lb = lse_like_o(o_b, lse_b, "b")?;
    // m = max(la, lb), but 0 where both are -inf, so that both weights come out 0, not NaN.
    let m = la.maximum(&lb)?;
    let neg_inf = m.eq(f64::NEG_INFINITY)?;
    let m = neg_inf.where_cond(&m.zeros_like()?, &m)?;
    let wa = la.broadcast_sub(&m)?.exp()?;
    let wb = lb.broadcast_sub(&m)?.exp()?;
    let sum = (&wa + &wb)?;
    let lse = (sum.log()? + &m)?;
    // sum is 0 only for rows that saw no key: divide by 1 there (their outputs are zeros).
    let denom = sum.eq(0f64)?.where_cond(&sum.ones_like()?, &sum)?;
    let oa = o_a.to_dtype(DType::F32)?;
    let ob = o_b.to_dtype(DType::F32)?;
    let o = (oa.broadcast_mul(&wa)? + ob.broadcast_mul(&wb)?)?.broadcast_div(&denom)?;
    let o = o.to_dtype(o_a.dtype())?;
    // Back to the LSE layout the inputs used.
    let lse = lse.squeeze(D::Minus1)?;
    let lse = if o_a.rank() == 4 {
        lse.transpose(1, 2)?.contiguous()?
    } else {
        lse.t()?.contiguous()?
    };
    Ok((o, lse))
}
