//! Chunked attention (`AttnParams::chunk`) on paths without a chunk in their kernels: the
//! problem runs as ordinary attention over pieces (docs/decisions.md#chunked-attention).
//!
//! Why pieces are exact: within one sequence of `sq` query rows and `sk` keys, row `i` sits at
//! `p = i + sk - sq` and, with chunk `c`, sees only keys of `[n c, (n + 1) c)`, `n = floor(p / c)`.
//! The rows of one chunk `n` are contiguous; the piece pairs them with the keys
//! `[n c, min(sk, (n + 1) c))`. The piece's last row sits at the piece's last key: either it is
//! the sequence's last row (`p = sk - 1`, and `sk <= (n + 1) c`), or the next row is in chunk
//! `n + 1`, so `p = (n + 1) c - 1 <= sk - 1`. Bottom-right alignment inside the piece therefore
//! puts every row at `p - n c` and every key at `j - n c`: the causal and window masks and ALiBi
//! (functions of `p - j`), softcap and sinks (per score, per head) see the same values as in the
//! whole problem, and the piece holds exactly the row's chunk. Rows at `p < 0` (chunk -1) see no
//! key: a piece without keys (zeros, LSE -inf or the sink).

use crate::op::{run, run_paged, run_varlen, PagedKv, Varlen};
use crate::params::{check_cu_seqlens, check_pages, prefix_sums, AttnParams, Keys, Problem, Seqs};
use candle_core::{Device, Result, Tensor};

/// One piece of a sequence: query rows `q0..q0 + nq` and keys `k0..k0 + nk`, both counted from
/// the sequence's first row / key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub q0: usize,
    pub nq: usize,
    pub k0: usize,
    pub nk: usize,
}

/// The pieces of one sequence of `sq` query rows and `sk` keys under chunk `c >= 1`, in row
/// order: first the rows at `p < 0` (if any) with no keys, then one piece per chunk that holds
/// query rows. With `tile_keys`, chunks without query rows are kept as pieces without rows
/// (consecutive ones merged), so the pieces also cover every key in order, as a packed batch's
/// prefix sums must; without it they are dropped.
pub(crate) fn pieces(sq: usize, sk: usize, c: usize, tile_keys: bool) -> Vec<Piece> {
    let c = c.max(1);
    let mut out = Vec::new();
    // Rows at p < 0: i < sq - sk.
    let before = sq.saturating_sub(sk);
    if before > 0 {
        out.push(Piece {
            q0: 0,
            nq: before,
            k0: 0,
            nk: 0,
        });
    }
    // The first row at position >= pos: i = pos - (sk - sq), clamped into 0..=sq.
    let row_at = |pos: usize| pos.saturating_add(sq).saturating_sub(sk).min(sq);
    for k0 in (0..sk).step_by(c) {
        let end = k0.saturating_add(c);
        let (i0, i1) = (row_at(k0), row_at(end));
        let piece = Piece {
            q0: i0,
            nq: i1 - i0,
            k0,
            nk: end.min(sk) - k0,
        };
        if piece.nq == 0 {
            if !tile_keys {
                continue;
            }
            // Rows are monotone in the chunk, so pieces without rows come before every piece
            // with rows at p >= 0: merging them keeps the keys in order.
            if let Some(last) = out.last_mut().filter(|l| l.nq == 0) {
                last.nk += piece.nk;
                continue;
            }
        }
        out.push(piece);
    }
    out
}

/// The problem's chunk (callers run this module only for a chunk that survived normalisation).
fn chunk_of(problem: &Problem) -> Result<usize> {
    problem
        .chunk
        .ok_or_else(|| candle_core::Error::Msg("flashcore: internal: no chunk to split".into()))
}

/// `params` for a piece: no chunk, and the given ALiBi slopes (per piece when they were per
/// sequence).
fn unchunked(params: &AttnParams, alibi_slopes: Option<Tensor>) -> AttnParams {
    AttnParams {
        chunk: None,
        alibi_slopes,
        ..params.clone()
    }
}

/// ALiBi slopes for pieces of sequences `seq` (piece order): `(batch, heads_q)` slopes become
/// one row per piece; `(heads_q,)` slopes stay.
fn piece_slopes(params: &AttnParams, problem: &Problem, seq: &[u32]) -> Result<Option<Tensor>> {
    match &params.alibi_slopes {
        Some(s) if problem.alibi_per_batch => {
            let idx = Tensor::new(seq, s.device())?;
            Ok(Some(s.index_select(&idx, 0)?.contiguous()?))
        }
        s => Ok(s.clone()),
    }
}

/// Output and LSE of `n` query rows (per batch entry) that see no key: O zeros `(b, n, hq, d_v)`,
/// LSE `(b, hq, n)` at -inf, or at each head's sink.
fn keyless_rows(
    q: &Tensor,
    problem: &Problem,
    n: usize,
    sinks: Option<&Tensor>,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, hq) = (problem.b, problem.hq);
    let o = Tensor::zeros((b, n, hq, problem.dv), q.dtype(), q.device())?;
    if !want_lse {
        return Ok((o, None));
    }
    let lse = match sinks {
        None => Tensor::full(f32::NEG_INFINITY, (b, hq, n), q.device())?,
        Some(s) => s
            .reshape((1, hq, 1))?
            .broadcast_as((b, hq, n))?
            .contiguous()?,
    };
    Ok((o, Some(lse)))
}

/// A dense batch with a chunk: every batch entry has the same pieces, so each piece is one call
/// on views of q, k and v narrowed along the sequence (no copy), and the outputs and LSEs are
/// concatenated along it. One kernel call per chunk that holds query rows.
pub(crate) fn dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    problem: &Problem,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let c = chunk_of(problem)?;
    let sub = unchunked(params, params.alibi_slopes.clone());
    let (mut os, mut ls) = (Vec::new(), Vec::new());
    for pc in pieces(problem.sq, problem.sk, c, false) {
        let (o, l) = if pc.nk == 0 {
            keyless_rows(q, problem, pc.nq, params.sinks.as_ref(), want_lse)?
        } else {
            run(
                &q.narrow(1, pc.q0, pc.nq)?,
                &k.narrow(1, pc.k0, pc.nk)?,
                &v.narrow(1, pc.k0, pc.nk)?,
                &sub,
                want_lse,
            )?
        };
        os.push(o);
        ls.extend(l);
    }
    let o = Tensor::cat(&os, 1)?;
    let lse = if want_lse {
        Some(Tensor::cat(&ls, 2)?)
    } else {
        None
    };
    Ok((o, lse))
}

/// Pieces of a whole batch, in sequence order: the sequence of each piece and the piece.
type Plan = Vec<(u32, Piece)>;

/// The plan of a packed batch, its prefix sums read to the host (one device-to-host copy on a
/// GPU) and checked there: pieces tile both q and k/v, so the packed tensors are used as they
/// are with prefix sums per piece.
fn varlen_plan(seqs: &Varlen, problem: &Problem, c: usize) -> Result<Plan> {
    let Seqs::Varlen { total_q, total_k } = problem.seqs else {
        candle_core::bail!("flashcore: internal: packed chunk plan of a dense problem")
    };
    let cq = seqs.cu_q.to_vec1::<u32>()?;
    let cq = check_cu_seqlens("cu_seqlens_q", "max_seqlen_q", &cq, total_q, problem.sq)?;
    let ck = seqs.cu_k.to_vec1::<u32>()?;
    let ck = check_cu_seqlens("cu_seqlens_k", "max_seqlen_k", &ck, total_k, problem.sk)?;
    let mut plan = Plan::new();
    for s in 0..problem.b {
        let (sq, sk) = (cq[s + 1] - cq[s], ck[s + 1] - ck[s]);
        plan.extend(pieces(sq, sk, c, true).into_iter().map(|p| (s as u32, p)));
    }
    Ok(plan)
}

/// Prefix sums of the pieces' row counts (`rows`) or key counts, and the longest piece.
fn piece_sums(plan: &Plan, rows: bool, dev: &Device) -> Result<(Tensor, usize)> {
    let lens = plan.iter().map(|(_, p)| if rows { p.nq } else { p.nk });
    let max = lens.clone().max().unwrap_or(0);
    Ok((Tensor::new(prefix_sums(lens).as_slice(), dev)?, max))
}

/// A packed batch with a chunk: one packed call over all pieces of all sequences.
pub(crate) fn varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &Varlen,
    problem: &Problem,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut plan = varlen_plan(seqs, problem, chunk_of(problem)?)?;
    if plan.is_empty() {
        // Only empty sequences: one empty piece keeps the prefix sums well formed.
        plan.push((
            0,
            Piece {
                q0: 0,
                nq: 0,
                k0: 0,
                nk: 0,
            },
        ));
    }
    let seq: Vec<u32> = plan.iter().map(|(s, _)| *s).collect();
    let sub = unchunked(params, piece_slopes(params, problem, &seq)?);
    let (cu_q, max_q) = piece_sums(&plan, true, q.device())?;
    let (cu_k, max_k) = piece_sums(&plan, false, q.device())?;
    let seqs = Varlen {
        cu_q: &cu_q,
        cu_k: &cu_k,
        max_q,
        max_k,
    };
    run_varlen(q, k, v, &seqs, &sub, want_lse)
}

/// A paged problem recast as pieces: each piece a sequence of its own whose page table is its
/// sequence's table shifted to the chunk's first page.
pub(crate) struct PagedPlan {
    /// q as the pieces' call takes it: dense as given when every sequence is one piece,
    /// otherwise packed (`(b * sq, hq, d)` for dense q).
    pub q: Tensor,
    pub page_table: Tensor,
    pub seqlens_k: Tensor,
    /// The pieces' prefix sums and longest piece when q is packed.
    pub packed_q: Option<(Tensor, usize)>,
    /// `(b, sq)` when dense q was packed (the outputs are reshaped back).
    pub dense: Option<(usize, usize)>,
    pub params: AttnParams,
    /// How many pieces (for the route description).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub pieces: usize,
}

/// The pieces of a paged problem. The tables (and packed q's prefix sums) are read to the host
/// (one device-to-host copy on a GPU) and checked there ([`check_pages`]). A piece starts at key
/// `n c` of its sequence, which must be the first key of a page: `c` must be a multiple of the
/// page size (an error naming `chunk` otherwise, whatever the lengths, so that a call does not
/// start failing once a sequence grows past its first chunk).
pub(crate) fn paged_plan(
    q: &Tensor,
    kv: &PagedKv,
    packed_q: Option<(&Tensor, usize)>,
    problem: &Problem,
    params: &AttnParams,
) -> Result<PagedPlan> {
    let c = chunk_of(problem)?;
    let Keys::Paged {
        page_size,
        num_pages,
        max_pages,
    } = problem.keys
    else {
        candle_core::bail!("flashcore: internal: paged chunk plan without pages")
    };
    if !c.is_multiple_of(page_size) {
        candle_core::bail!(
            "flashcore: chunk: must be a multiple of page_size ({page_size}) with a paged cache on a GPU (chunked attention runs as pieces that start at chunk boundaries, which must be page boundaries), got {c}"
        )
    }
    let table = kv.page_table.flatten_all()?.to_vec1::<u32>()?;
    let seqlens = kv.seqlens_k.to_vec1::<u32>()?;
    let lens = check_pages(&table, &seqlens, page_size, num_pages, max_pages)?;
    let rows: Vec<usize> = match packed_q {
        None => vec![problem.sq; problem.b],
        Some((cu, _)) => {
            let (total_q, _) = problem.totals();
            let cq = cu.to_vec1::<u32>()?;
            let cq = check_cu_seqlens("cu_seqlens_q", "max_seqlen_q", &cq, total_q, problem.sq)?;
            cq.windows(2).map(|w| w[1] - w[0]).collect()
        }
    };
    let mut plan = Plan::new();
    for (s, (&sq, &sk)) in rows.iter().zip(&lens).enumerate() {
        plan.extend(pieces(sq, sk, c, false).into_iter().map(|p| (s as u32, p)));
    }
    if plan.is_empty() {
        plan.push((
            0,
            Piece {
                q0: 0,
                nq: 0,
                k0: 0,
                nk: 0,
            },
        ));
    }
    let width = plan
        .iter()
        .map(|(_, p)| p.nk.div_ceil(page_size))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut tbl = vec![0u32; plan.len() * width];
    for (i, (s, p)) in plan.iter().enumerate() {
        let src = *s as usize * max_pages + p.k0 / page_size;
        let n = p.nk.div_ceil(page_size);
        tbl[i * width..i * width + n].copy_from_slice(&table[src..src + n]);
    }
    let dev = q.device();
    let seq: Vec<u32> = plan.iter().map(|(s, _)| *s).collect();
    let nk: Vec<u32> = plan.iter().map(|(_, p)| p.nk as u32).collect();
    let params = unchunked(params, piece_slopes(params, problem, &seq)?);
    let page_table = Tensor::from_vec(tbl, (plan.len(), width), dev)?;
    let seqlens_k = Tensor::new(nk.as_slice(), dev)?;
    // Dense q with one piece per sequence (decode, or every row in one chunk) stays dense.
    let one_each = packed_q.is_none() && plan.len() == problem.b;
    let (q, packed_q, dense) = if one_each {
        (q.clone(), None, None)
    } else {
        let (cu, max_q) = piece_sums(&plan, true, dev)?;
        let (b, sq, hq, d) = (problem.b, problem.sq, problem.hq, problem.d);
        match packed_q {
            Some(_) => (q.clone(), Some((cu, max_q)), None),
            None => (
                q.reshape((b * sq, hq, d))?,
                Some((cu, max_q)),
                Some((b, sq)),
            ),
        }
    };
    Ok(PagedPlan {
        q,
        page_table,
        seqlens_k,
        packed_q,
        dense,
        params,
        pieces: plan.len(),
    })
}

/// A paged problem with a chunk: one paged call over all pieces ([`paged_plan`]).
pub(crate) fn paged(
    q: &Tensor,
    kv: &PagedKv,
    packed_q: Option<(&Tensor, usize)>,
    problem: &Problem,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let plan = paged_plan(q, kv, packed_q, problem, params)?;
    let kv = PagedKv {
        k_pages: kv.k_pages,
        v_pages: kv.v_pages,
        page_table: &plan.page_table,
        seqlens_k: &plan.seqlens_k,
    };
    let packed = plan.packed_q.as_ref().map(|(cu, m)| (cu, *m));
    let (o, lse) = run_paged(&plan.q, &kv, packed, &plan.params, want_lse)?;
    let Some((b, sq)) = plan.dense else {
        return Ok((o, lse));
    };
    let (hq, dv) = (problem.hq, problem.dv);
    let o = o.reshape((b, sq, hq, dv))?;
    // (hq, b * sq) -> (b, hq, sq)
    let lse = lse
        .map(|l| l.reshape((hq, b, sq))?.transpose(0, 1)?.contiguous())
        .transpose()?;
    Ok((o, lse))
}

/// `"in N pieces (chunk C): R"` for routes `routes` of the pieces that run a kernel, the
/// distinct routes counted in order of first appearance (`"2 × R1; 1 × R2"`).
#[cfg(feature = "cuda")]
pub(crate) fn route_summary(c: usize, pieces: usize, routes: &[String]) -> String {
    let mut distinct: Vec<(&String, usize)> = Vec::new();
    for r in routes {
        match distinct.iter_mut().find(|(d, _)| *d == r) {
            Some((_, n)) => *n += 1,
            None => distinct.push((r, 1)),
        }
    }
    let body = match distinct.as_slice() {
        [(r, _)] => (*r).clone(),
        _ => distinct
            .iter()
            .map(|(r, n)| format!("{n} × {r}"))
            .collect::<Vec<_>>()
            .join("; "),
    };
    format!("in {pieces} pieces (chunk {c}): {body}")
}

/// `cuda::describe` of a dense problem with a chunk: the route of each piece's call.
#[cfg(feature = "cuda")]
pub(crate) fn describe_dense(
    dev: &candle_core::CudaDevice,
    params: &AttnParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    problem: &Problem,
) -> Result<String> {
    let c = chunk_of(problem)?;
    let sub = unchunked(params, params.alibi_slopes.clone());
    let all = pieces(problem.sq, problem.sk, c, false);
    let mut routes = Vec::new();
    for pc in all.iter().filter(|p| p.nk > 0) {
        routes.push(crate::cuda::describe(
            dev,
            &sub,
            &q.narrow(1, pc.q0, pc.nq)?,
            &k.narrow(1, pc.k0, pc.nk)?,
            &v.narrow(1, pc.k0, pc.nk)?,
        )?);
    }
    Ok(route_summary(c, all.len(), &routes))
}

#[cfg(test)]
mod tests;
