//! Options and input validation. Every check runs before any kernel and fails with a
//! `candle_core::Error` naming the argument, the rule and the value received.

use candle_core::{DType, Layout, Tensor};

/// Head dimensions with a compiled GPU kernel. Every other multiple of 8 up to 256 runs on the
/// next one up (the kernels zero-fill the extra columns in shared memory; nothing is copied).
pub const SUPPORTED_HEAD_DIMS: &[usize] = &[64, 128, 256];

/// Largest head dimension accepted at all (by the CPU path; see [`GPU_MAX_HEAD_DIM`]) for v and
/// the output, and for q and k when they share v's head dim.
pub const MAX_HEAD_DIM: usize = 512;

/// Largest head dimension of q and k (`d_qk`) on the CPU path: 576, MLA's absorbed decode (512
/// latent columns and 64 rotary ones, with `d_v` = 512).
pub const MAX_QK_HEAD_DIM: usize = 576;

/// Largest head dimension every GPU kernel family takes (see [`SM90_MAX_HEAD_DIM`]).
pub const GPU_MAX_HEAD_DIM: usize = 256;

/// Largest head dimension of q, k and v on a GPU: the sm90 kernels take up to 512 (Gemma 4's
/// global layers), the sm80 family up to [`GPU_MAX_HEAD_DIM`]; past it a GPU call is an error
/// naming the argument.
pub const SM90_MAX_HEAD_DIM: usize = 512;

/// Attention mask, aligned bottom-right (see the crate docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mask {
    /// Every query sees every key.
    #[default]
    None,
    /// Query `i` sees key `j` iff `j <= i + seq_k - seq_q`.
    Causal,
    /// Query `i` sees key `j` iff `i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right`;
    /// `None` leaves that side unbounded. `Window { left: None, right: Some(0) }` is causal.
    Window {
        left: Option<usize>,
        right: Option<usize>,
    },
}

impl Mask {
    /// `(left, right)` window bounds, `None` = unbounded.
    pub fn bounds(&self) -> (Option<usize>, Option<usize>) {
        match *self {
            Mask::None => (None, None),
            Mask::Causal => (None, Some(0)),
            Mask::Window { left, right } => (left, right),
        }
    }

    /// The same mask in canonical form: windows equal to "none" or "causal" become those.
    pub fn canonical(&self) -> Mask {
        match self.bounds() {
            (None, None) => Mask::None,
            (None, Some(0)) => Mask::Causal,
            (left, right) => Mask::Window { left, right },
        }
    }
}

/// Options of [`crate::attention`].
#[derive(Clone, Debug, Default)]
pub struct AttnParams {
    /// Multiplies `q . k`; `None` means `1 / sqrt(d_qk)` (q's and k's head dim, whatever v's).
    /// Any finite value on the CPU; the GPU kernels take `0 < scale <= 1024` (otherwise an
    /// error naming the option: they fold `scale * log2(e)` into the exponent of raw f32
    /// scores). For f64 inputs the default is computed in f64; a scale given here is an f32,
    /// used exactly (widened), so an f64 caller needing a scale that is not an f32 value has
    /// no way to pass it.
    pub softmax_scale: Option<f32>,
    /// The mask; bottom-right aligned.
    pub mask: Mask,
    /// If set, scores become `softcap * tanh(score / softcap)` before the mask (Gemma 2 style).
    pub softcap: Option<f32>,
    /// ALiBi slopes, f32 of shape `(heads_q,)` or `(batch, heads_q)` (one row per sequence):
    /// adds `-slope[b][h] * |j - (i + seq_k - seq_q)|`.
    pub alibi_slopes: Option<Tensor>,
    /// Learnable attention sinks (gpt-oss), f32 of shape `(heads_q,)`, contiguous, on q's device:
    /// one more logit `sinks[h]` in every softmax row of query head `h`, compared with the row's
    /// (scaled, capped, biased) scores but carrying no value. Row `i` of head `h` then outputs
    /// `sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m))` (m: the max over the row's
    /// visible scores and the sink) and its log-sum-exp includes the sink, `ln(e^lse + e^sink)`;
    /// a row that sees no key outputs zeros with LSE `sinks[h]`. A sink of `-inf` is exactly no
    /// sink; `+inf` takes the whole weight (O zeros, LSE `+inf`); NaN makes the rows of its head
    /// NaN (O and LSE), except rows without weight (no key, or only `-inf` scores): O zeros, LSE
    /// NaN (docs/numeric-contract.md).
    pub sinks: Option<Tensor>,
    /// Chunked attention (Llama 4): with `Some(c)`, the query row at bottom-right position
    /// `p = i + seq_k - seq_q` (per sequence for packed and paged batches) sees only keys in
    /// `[floor(p / c) * c, (floor(p / c) + 1) * c)`, intersected with the mask. A row with
    /// `p < 0` (more query rows than keys) lies in chunk -1 and sees no key. `c` must be >= 1.
    /// On a GPU it runs as pieces of unchunked attention (one call per chunk for dense batches;
    /// packed and paged tables are read on the host, and a paged cache needs chunks that start
    /// on a page): docs/decisions.md#chunked-attention.
    pub chunk: Option<usize>,
    /// The scales of F8E4M3 keys and values (an FP8 KV cache): required when k/v are
    /// `DType::F8E4M3`, refused otherwise. On a GPU the split-KV decode kernels read FP8 K/V
    /// (seq_q <= 16); other problems dequantize the K/V they read first (the slow path).
    pub kv_scales: Option<KvScales>,
    /// The FP8 forward: the f32 scale of F8E4M3 queries, `(heads_q,)` or `(1,)`, on q's device
    /// (q is read as `stored * q_scale[h]`), with k and v F8E4M3 and `kv_scales`; the output is
    /// bf16 (the LSE f32). Required when q is F8E4M3, refused otherwise. The CPU path
    /// dequantizes all three and runs the f32 path; no GPU kernel takes it yet (an error naming
    /// this option).
    pub q_scale: Option<Tensor>,
}

/// The f32 scales of F8E4M3 keys and values, each `(heads_kv,)` (one per K/V head) or `(1,)`
/// (one for all), contiguous, on the K/V device: a stored value `s` of head `h` stands for
/// `s * scale[h]`, and [`crate::append_kv_paged_fp8`] stores a row `x` as `x / scale[h]`
/// saturated to ±448 and rounded to e4m3 (vLLM's `k_scale` / `v_scale`).
#[derive(Clone, Debug)]
pub struct KvScales {
    pub k: Tensor,
    pub v: Tensor,
}

/// Where sequence `i`'s query rows and keys live: the one description of a batch that the CPU
/// path and every kernel read rows through (the kernels' `fc::seq_range`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seqs {
    /// `(b, s, h, d)` tensors: sequence `i` is batch entry `i`, with `sq` query rows and `sk` keys.
    Dense,
    /// Packed `(total, h, d)` tensors and `cu_seqlens_q` / `cu_seqlens_k` prefix sums (u32,
    /// `b + 1`): sequence `i` has rows `cu_q[i]..cu_q[i + 1]` and keys `cu_k[i]..cu_k[i + 1]`. The
    /// problem's `sq` / `sk` are then the `max_seqlen_q` / `max_seqlen_k` bounds.
    Varlen { total_q: usize, total_k: usize },
}

/// Where sequence `i`'s keys live (the K side of [`Seqs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    /// Rows of k/v: batch entry `i` (dense) or rows `cu_k[i]..cu_k[i + 1]` (packed).
    Rows,
    /// The first `seqlens_k[i]` rows of batch entry `i` of a `(b, sk, hkv, d)` k/v (`sk` the
    /// bound): what a paged cache is gathered into for the prefill kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Used,
    /// A paged cache: k/v are pools `(num_pages, page_size, hkv, d)`; sequence `i` has
    /// `seqlens_k[i]` keys, key `j` in row `j % page_size` of page `page_table[i][j / page_size]`.
    /// The problem's `sk` is the bound `max_pages * page_size`; k/v strides are (page, row, head).
    Paged {
        page_size: usize,
        num_pages: usize,
        max_pages: usize,
    },
}

/// A validated problem: sizes, strides (in elements) and resolved options.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    /// Head dim of q and k (`d_qk`).
    pub d: usize,
    /// Head dim of v and of the output (`d_v`). GPU launches of `d_v != d_qk` run on kernels
    /// that take both (every 16-bit kernel) or zero-padded to one head dim first (FP8 K/V)
    /// (docs/decisions.md#separate-v-head-dim).
    pub dv: usize,
    pub dtype: DType,
    /// The softmax scale as the kernels take it (f32).
    pub scale: f32,
    /// The same scale in f64, what the f64 CPU path multiplies by: the caller's f32 scale
    /// exactly, or the default `1 / sqrt(head_dim)` computed in f64.
    pub scale_f64: f64,
    /// The mask with its window bounds normalised ([`normalise_mask`]): every `Some(x)` bound
    /// satisfies `x < max(sq, sk)` (a left bound `< sk`, a right bound `< sq`); a bound that
    /// cannot change which keys any row sees is `None`, and the mask is canonical (so a window
    /// equal to causal or to no mask is exactly `Mask::Causal` / `Mask::None`). Everything that
    /// reads the problem (the CPU path, the kernel launches) gets bounds in that range.
    pub mask: Mask,
    /// The chunk length in canonical form ([`normalise_chunk`]): `None`, or `Some(c)` with
    /// `1 <= c <= sk`, kept only where it can change which keys some row sees.
    pub chunk: Option<usize>,
    pub softcap: Option<f32>,
    /// Whether ALiBi slopes were given (the tensor itself travels beside the problem), and
    /// whether they are `(batch, heads_q)` (else `(heads_q,)`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub alibi: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub alibi_per_batch: bool,
    /// Dense or packed variable-length sequences (q side; and k side when `keys` is `Rows`).
    pub seqs: Seqs,
    /// Where the keys live: rows of k/v, or a paged cache.
    pub keys: Keys,
    /// Strides `(batch, row, head)` in elements for q, k, v; the last dim has stride 1.
    pub q_strides: [usize; 3],
    pub k_strides: [usize; 3],
    pub v_strides: [usize; 3],
    /// K/V stored as F8E4M3 with `AttnParams::kv_scales` (only where a GPU kernel reads them
    /// as such: `fp8::in_kernel`; every other path widens FP8 K/V before validation).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub kv_fp8: bool,
}

impl Problem {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn window(&self) -> (Option<usize>, Option<usize>) {
        self.mask.bounds()
    }
    pub fn h_ratio(&self) -> usize {
        self.hq / self.hkv
    }
    /// Output shape: `(b, sq, hq, d_v)`, or `(total_q, hq, d_v)` for a packed batch.
    pub fn out_shape(&self) -> candle_core::Shape {
        match self.seqs {
            Seqs::Dense => (self.b, self.sq, self.hq, self.dv).into(),
            Seqs::Varlen { total_q, .. } => (total_q, self.hq, self.dv).into(),
        }
    }
    /// The same problem with q, k and v zero-padded to one head dim, `max(d_qk, d_v)`, as a GPU
    /// runs a problem with `d_v != d_qk` on kernels that take one head dim (FP8 K/V; the scale
    /// stays the one resolved from `d_qk`).
    pub fn padded(&self) -> Problem {
        let d = self.d.max(self.dv);
        Problem {
            d,
            dv: d,
            ..self.clone()
        }
    }
    /// Whether a GPU runs this problem zero-padded to one head dim ([`Problem::padded`]): only
    /// with `d_v != d_qk` and FP8 K/V read by a kernel (the e4m3 decode kernels take one head
    /// dim; `fp8::in_kernel` widens such K/V first, so none arrives today). Every 16-bit kernel
    /// reads v and writes o at `d_v` (`plan::takes_head_dims_apart`).
    pub fn gpu_pads(&self) -> bool {
        self.dv != self.d && self.kv_fp8
    }
    /// LSE shape: `(b, hq, sq)`, or `(hq, total_q)` for a packed batch.
    pub fn lse_shape(&self) -> candle_core::Shape {
        match self.seqs {
            Seqs::Dense => (self.b, self.hq, self.sq).into(),
            Seqs::Varlen { total_q, .. } => (self.hq, total_q).into(),
        }
    }
    /// Rows of q and of k/v over the whole batch (of a paged cache: the pool's rows).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn totals(&self) -> (usize, usize) {
        let (tq, tk) = match self.seqs {
            Seqs::Dense => (self.b * self.sq, self.b * self.sk),
            Seqs::Varlen { total_q, total_k } => (total_q, total_k),
        };
        match self.keys {
            Keys::Paged {
                page_size,
                num_pages,
                ..
            } => (tq, num_pages * page_size),
            _ => (tq, tk),
        }
    }
}

fn bad(arg: &str, rule: &str, got: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashcore: {arg}: {rule}, got {got}"))
}

/// `t` (argument `name`) must be on the device of `anchor` (argument `anchor_name`).
fn check_device(
    name: &str,
    t: &Tensor,
    (anchor_name, anchor): (&str, &Tensor),
) -> candle_core::Result<()> {
    if t.device().same_device(anchor.device()) {
        return Ok(());
    }
    Err(bad(
        name,
        &format!(
            "must be on the same device as {anchor_name} ({:?})",
            anchor.device().location()
        ),
        format!("{:?}", t.device().location()),
    ))
}

fn strides4(name: &str, l: &Layout) -> candle_core::Result<[usize; 3]> {
    let s = l.stride();
    if s[3] != 1 && l.dims()[3] > 1 {
        return Err(bad(
            name,
            "the last dimension (head_dim) must be contiguous (stride 1)",
            format!("stride {:?} for shape {:?}", s, l.dims()),
        ));
    }
    Ok([s[0], s[1], s[2]])
}

fn strides3(name: &str, l: &Layout) -> candle_core::Result<[usize; 3]> {
    let s = l.stride();
    if s[2] != 1 && l.dims()[2] > 1 {
        return Err(bad(
            name,
            "the last dimension (head_dim) must be contiguous (stride 1)",
            format!("stride {:?} for shape {:?}", s, l.dims()),
        ));
    }
    // A packed tensor has no batch stride: sequences are found through the prefix sums.
    Ok([0, s[0], s[1]])
}

fn check_rank(q: &Tensor, k: &Tensor, v: &Tensor, rank: usize) -> candle_core::Result<()> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != rank {
            let layout = match (rank, name) {
                (4, "q") => "(batch, seq_q, heads_q, head_dim)",
                (4, _) => "(batch, seq_k, heads_kv, head_dim)",
                (_, "q") => "(total_q, heads_q, head_dim)",
                _ => "(total_k, heads_kv, head_dim)",
            };
            return Err(bad(
                name,
                &format!("must have rank {rank} {layout}"),
                format!("rank {} with shape {:?}", t.rank(), t.dims()),
            ));
        }
    }
    Ok(())
}

/// The checks shared by dense and packed batches: dtype, device, K/V agreement, head ratio, head
/// dim, scale, softcap, ALiBi slopes (given `b` sequences). Returns the resolved scale and
/// whether the slopes are per sequence.
#[allow(clippy::too_many_arguments)]
fn check_common(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    b: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dk: usize,
    dv: usize,
    p: &AttnParams,
) -> candle_core::Result<(f32, f64, bool)> {
    let dtype = q.dtype();
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        return Err(bad(
            "q",
            "dtype must be f16, bf16, f32 or f64",
            format!("{dtype:?}"),
        ));
    }
    // F8E4M3 K/V come with `kv_scales` (checked by `fp8::kv_form` before validation).
    let fp8 = p.kv_scales.is_some() && k.dtype() == DType::F8E4M3;
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != dtype && !fp8 {
            return Err(bad(
                name,
                &format!("dtype must match q ({dtype:?})"),
                format!("{:?}", t.dtype()),
            ));
        }
    }
    for (name, t) in [("k", k), ("v", v)] {
        check_device(name, t, ("q", q))?;
    }
    // v is k's shape but for its head dim (d_v), which may differ from d_qk.
    let (kd, vd) = (k.dims(), v.dims());
    if vd.len() != kd.len() || vd[..vd.len() - 1] != kd[..kd.len() - 1] {
        return Err(bad(
            "v",
            &format!(
                "shape must equal k's {kd:?} but for the last dim (v's head_dim may differ from k's)"
            ),
            format!("{vd:?}"),
        ));
    }
    if dk != d {
        return Err(bad(
            "k",
            &format!("head_dim must equal q's head_dim {d}"),
            dk,
        ));
    }
    if hkv == 0 {
        return Err(bad("k", "heads_kv must be >= 1", format!("heads_kv {hkv}")));
    }
    if !hq.is_multiple_of(hkv) {
        return Err(bad(
            "k",
            &format!("heads_q ({hq}) must be a multiple of heads_kv"),
            format!("heads_kv {hkv}"),
        ));
    }
    for (name, x, max) in [("q", d, MAX_QK_HEAD_DIM), ("v", dv, MAX_HEAD_DIM)] {
        if x == 0 || x > max || !x.is_multiple_of(8) {
            return Err(bad(
                name,
                &format!("head_dim must be a multiple of 8 in 8..={max}"),
                x,
            ));
        }
    }
    // A GPU runs d_v != d_qk on a kernel of max(d_qk, d_v) (zero-filled or zero-padded): both
    // must fit one (the planner names the argument where a family stops at GPU_MAX_HEAD_DIM).
    for (name, x) in [("q", d), ("v", dv)] {
        if x > SM90_MAX_HEAD_DIM && !q.device().is_cpu() {
            return Err(bad(
                name,
                &format!(
                    "head_dim must be at most {SM90_MAX_HEAD_DIM} on a GPU (no kernel for larger head dims yet; the CPU path takes up to {MAX_HEAD_DIM}, q and k {MAX_QK_HEAD_DIM})"
                ),
                x,
            ));
        }
    }
    let scale = p.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() {
        return Err(bad("softmax_scale", "must be finite", scale));
    }
    // The default is 1 / sqrt(d_qk), whatever v's head dim. The f64 path's default is computed
    // in f64 (not the f32 value widened).
    let scale_f64 = p.softmax_scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
    if let Some(c) = p.softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(bad("softcap", "must be finite and > 0", c));
        }
    }
    let mut per_batch = false;
    if let Some(s) = &p.alibi_slopes {
        if s.dtype() != DType::F32 {
            return Err(bad(
                "alibi_slopes",
                "dtype must be f32",
                format!("{:?}", s.dtype()),
            ));
        }
        if s.dims() == [b, hq] {
            per_batch = true;
        } else if s.dims() != [hq] {
            return Err(bad(
                "alibi_slopes",
                &format!("shape must be (heads_q,) = ({hq},) or (batch, heads_q) = ({b}, {hq})"),
                format!("{:?}", s.dims()),
            ));
        }
        check_device("alibi_slopes", s, ("q", q))?;
    }
    if let Some(s) = &p.sinks {
        check_sinks(s, q, hq)?;
    }
    if p.chunk == Some(0) {
        return Err(bad(
            "chunk",
            "must be >= 1 (the number of key positions per chunk)",
            "0",
        ));
    }
    Ok((scale, scale_f64, per_batch))
}

/// Sinks: f32 `(heads_q,)`, contiguous, on q's device. Their values are never checked (a GPU
/// would need a sync): the field's docs say what non-finite ones do.
fn check_sinks(s: &Tensor, q: &Tensor, hq: usize) -> candle_core::Result<()> {
    if s.dtype() != DType::F32 {
        return Err(bad(
            "sinks",
            "dtype must be f32",
            format!("{:?}", s.dtype()),
        ));
    }
    if s.dims() != [hq] {
        return Err(bad(
            "sinks",
            &format!("shape must be (heads_q,) = ({hq},)"),
            format!("{:?}", s.dims()),
        ));
    }
    check_device("sinks", s, ("q", q))?;
    if !s.is_contiguous() {
        return Err(bad(
            "sinks",
            "must be contiguous",
            format!("strides {:?}", s.stride()),
        ));
    }
    Ok(())
}

/// `mask` with every window bound that cannot matter for a problem of at most `sq` query rows
/// and `sk` keys per sequence turned into `None`, then made canonical. Row `i` of a sequence of
/// `sq_i <= sq` rows and `sk_i <= sk` keys has its diagonal at `diag = i + sk_i - sq_i`, so
/// `sk_i - sq_i <= diag <= sk_i - 1`: a left bound `l >= sk` keeps `diag - l < 0` (every key
/// from 0 on is in range) and a right bound `r >= sq` keeps `diag + r >= sk_i - 1` (every key up
/// to the last). The bounds left are `< sk` (left) and `< sq` (right), so callers may add them
/// to row and key indices without overflow.
pub(crate) fn normalise_mask(mask: Mask, sq: usize, sk: usize) -> Mask {
    let (left, right) = mask.bounds();
    let mask = match mask {
        Mask::Window { .. } => Mask::Window {
            left: left.filter(|&l| l < sk),
            right: right.filter(|&r| r < sq),
        },
        m => m,
    };
    mask.canonical()
}

/// The one canonical form of `AttnParams::chunk` for a problem of at most `sk` keys per
/// sequence, under the already normalised `mask`. `rows_before_keys` says whether
/// a sequence may have more query rows than keys (packed or paged batches, or dense `sq > sk`),
/// i.e. rows at `p < 0`, which chunk -1 leaves without keys.
/// - No keys at all (`sk == 0`): `None` (every row sees nothing either way).
/// - `c >= sk`: a row at `0 <= p <= sk_i - 1 < c` is in chunk 0, `[0, c)`, which holds every key
///   of its sequence, so the chunk changes nothing for it. Rows at `p < 0` lose every key, which
///   changes nothing only when the mask already hides every key from them (a right bound of 0:
///   keys `j <= p < 0`) or when there are no such rows. Then `None`; otherwise `Some(sk)`, which
///   gives every row the same keys as `Some(c)` (chunk 0 still holds every key) and keeps the
///   value within the problem's key bound.
/// - `c < sk`: kept.
///
/// Exact for packed and paged batches because `sk` bounds every sequence's key count.
pub(crate) fn normalise_chunk(
    chunk: Option<usize>,
    mask: Mask,
    sk: usize,
    rows_before_keys: bool,
) -> Option<usize> {
    let c = chunk?;
    if sk == 0 {
        return None;
    }
    if c >= sk {
        let hidden_anyway = mask.bounds().1 == Some(0);
        return (rows_before_keys && !hidden_anyway).then_some(sk);
    }
    Some(c)
}

/// Checks everything about the inputs that can be checked without running anything, coarse to
/// fine: rank, dtype, device, shape agreement, head ratio, head dim, strides, emptiness, scale,
/// softcap, ALiBi slopes.
pub(crate) fn validate(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> candle_core::Result<Problem> {
    check_rank(q, k, v, 4)?;
    let (b, sq, hq, d) = q.dims4()?;
    let (bk, sk, hkv, dk) = k.dims4()?;
    let dv = v.dims()[3];
    let (scale, scale_f64, alibi_per_batch) = check_common(q, k, v, b, hq, hkv, d, dk, dv, p)?;
    if bk != b {
        return Err(bad("k", &format!("batch must equal q's batch {b}"), bk));
    }
    let q_strides = strides4("q", q.layout())?;
    let k_strides = strides4("k", k.layout())?;
    let v_strides = strides4("v", v.layout())?;
    if b == 0 || sq == 0 || hq == 0 {
        return Err(bad(
            "q",
            "must not be empty",
            format!("shape {:?}", q.dims()),
        ));
    }
    if sk == 0 {
        return Err(bad(
            "k",
            "must not be empty (seq_k >= 1)",
            format!("shape {:?}", k.dims()),
        ));
    }
    Ok(Problem {
        b,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv,
        dtype: q.dtype(),
        scale,
        scale_f64,
        mask: normalise_mask(p.mask, sq, sk),
        chunk: normalise_chunk(p.chunk, normalise_mask(p.mask, sq, sk), sk, sq > sk),
        softcap: p.softcap,
        alibi: p.alibi_slopes.is_some(),
        kv_fp8: p.kv_scales.is_some(),
        alibi_per_batch,
        seqs: Seqs::Dense,
        keys: Keys::Rows,
        q_strides,
        k_strides,
        v_strides,
    })
}

/// Largest packed row count (the kernels index rows with 32-bit integers).
const MAX_TOTAL_ROWS: usize = i32::MAX as usize;

/// [`validate`] for a packed batch: q `(total_q, hq, d)`, k/v `(total_k, hkv, d)`, prefix sums
/// u32 `(b + 1,)` on q's device. What needs the sums' values (first 0, monotone, last = total,
/// lengths within the bounds) is checked here only when they are on the CPU
/// ([`check_cu_seqlens`]); on a GPU that would cost a device sync, so the kernels clamp every
/// range into the tensors and a check kernel turns the output into NaN if the sums lie.
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Tensor,
    cu_seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    p: &AttnParams,
) -> candle_core::Result<Problem> {
    check_rank(q, k, v, 3)?;
    let (total_q, hq, d) = q.dims3()?;
    let (total_k, hkv, dk) = k.dims3()?;
    let mut b = 0;
    for (name, t) in [
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
    ] {
        b = check_cu(name, t, ("q", q))?;
    }
    if cu_seqlens_q.dims() != cu_seqlens_k.dims() {
        return Err(bad(
            "cu_seqlens_k",
            &format!(
                "must have cu_seqlens_q's shape {:?} (one entry per sequence)",
                cu_seqlens_q.dims()
            ),
            format!("{:?}", cu_seqlens_k.dims()),
        ));
    }
    let dv = v.dims()[2];
    let (scale, scale_f64, alibi_per_batch) = check_common(q, k, v, b, hq, hkv, d, dk, dv, p)?;
    let q_strides = strides3("q", q.layout())?;
    let k_strides = strides3("k", k.layout())?;
    let v_strides = strides3("v", v.layout())?;
    if hq == 0 {
        return Err(bad(
            "q",
            "must have heads_q >= 1",
            format!("shape {:?}", q.dims()),
        ));
    }
    for (name, total, what) in [("q", total_q, "total_q"), ("k", total_k, "total_k")] {
        if total > MAX_TOTAL_ROWS {
            return Err(bad(name, &format!("{what} must be < 2^31"), total));
        }
    }
    // Cheap necessary conditions on the bounds (no device values needed).
    for (name, max, total, what) in [
        ("max_seqlen_q", max_seqlen_q, total_q, "total_q"),
        ("max_seqlen_k", max_seqlen_k, total_k, "total_k"),
    ] {
        if max.saturating_mul(b) < total {
            return Err(bad(
                name,
                &format!("must bound every sequence: max_seqlen * batch ({b}) >= {what} ({total})"),
                max,
            ));
        }
        if max > MAX_TOTAL_ROWS {
            return Err(bad(name, "must be < 2^31", max));
        }
    }
    Ok(Problem {
        b,
        sq: max_seqlen_q,
        sk: max_seqlen_k,
        hq,
        hkv,
        d,
        dv,
        dtype: q.dtype(),
        scale,
        scale_f64,
        mask: normalise_mask(p.mask, max_seqlen_q, max_seqlen_k),
        // Any sequence may have fewer keys than query rows.
        chunk: normalise_chunk(
            p.chunk,
            normalise_mask(p.mask, max_seqlen_q, max_seqlen_k),
            max_seqlen_k,
            true,
        ),
        softcap: p.softcap,
        alibi: p.alibi_slopes.is_some(),
        kv_fp8: p.kv_scales.is_some(),
        alibi_per_batch,
        seqs: Seqs::Varlen { total_q, total_k },
        keys: Keys::Rows,
        q_strides,
        k_strides,
        v_strides,
    })
}

/// The values of host-side prefix sums: first 0, non-decreasing, last = `total`, every length <=
/// `max_seqlen`. Returns the sums as usize.
pub(crate) fn check_cu_seqlens(
    name: &str,
    max_name: &str,
    cu: &[u32],
    total: usize,
    max_seqlen: usize,
) -> candle_core::Result<Vec<usize>> {
    if cu[0] != 0 {
        return Err(bad(
            name,
            "must start at 0",
            format!("{:?}", &cu[..cu.len().min(8)]),
        ));
    }
    if let Some(i) = cu.iter().position(|&x| x as usize > total) {
        return Err(bad(
            name,
            &format!("every entry must be at most the packed tensor's row count {total}"),
            format!("entry {i} = {}", cu[i]),
        ));
    }
    for (i, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(
                name,
                "must be non-decreasing (prefix sums of the lengths)",
                format!("entry {} = {} after {}", i + 1, w[1], w[0]),
            ));
        }
        let len = (w[1] - w[0]) as usize;
        if len > max_seqlen {
            return Err(bad(
                max_name,
                &format!("must bound every sequence, but sequence {i} has length {len}"),
                max_seqlen,
            ));
        }
    }
    let last = *cu.last().unwrap_or(&0) as usize;
    if last != total {
        return Err(bad(
            name,
            &format!("must end at the packed tensor's row count {total}"),
            last,
        ));
    }
    Ok(cu.iter().map(|&x| x as usize).collect())
}

/// Checks a small index tensor beside q: dtype u32, the given rank and leading dims, contiguous,
/// on q's device.
fn check_index(
    name: &str,
    t: &Tensor,
    (anchor, q): (&str, &Tensor),
    dims: &[Option<usize>],
    layout: &str,
) -> candle_core::Result<()> {
    if t.dtype() != DType::U32 {
        return Err(bad(name, "dtype must be u32", format!("{:?}", t.dtype())));
    }
    let ok = t.rank() == dims.len()
        && dims
            .iter()
            .zip(t.dims())
            .all(|(want, got)| want.is_none_or(|w| w == *got));
    if !ok {
        return Err(bad(
            name,
            &format!("must have shape {layout}"),
            format!("shape {:?}", t.dims()),
        ));
    }
    check_device(name, t, (anchor, q))?;
    if !t.is_contiguous() {
        return Err(bad(
            name,
            "must be contiguous",
            format!("strides {:?}", t.stride()),
        ));
    }
    Ok(())
}

/// Checks prefix sums `(batch + 1,)` u32 beside `anchor` ([`check_index`]) with batch >= 1;
/// returns the batch.
fn check_cu(name: &str, t: &Tensor, anchor: (&str, &Tensor)) -> candle_core::Result<usize> {
    check_index(name, t, anchor, &[None], "(batch + 1,) with batch >= 1")?;
    if t.dims()[0] < 2 {
        return Err(bad(
            name,
            "must have shape (batch + 1,) with batch >= 1",
            format!("shape {:?}", t.dims()),
        ));
    }
    Ok(t.dims()[0] - 1)
}

/// [`validate`] for a paged KV cache: k/v pools `(num_pages, page_size, heads_kv, d)`, a page
/// table u32 `(batch, max_pages)`, the keys of each sequence u32 `(batch,)`, and q dense
/// `(batch, seq_q, heads_q, d)` or, with `packed_q = Some((cu_seqlens_q, max_seqlen_q))`, packed
/// `(total_q, heads_q, d)`. What needs the tables' values (page ids within the pool, lengths
/// within the table) is checked here only on the CPU ([`check_pages`]); on a GPU the kernels
/// clamp every page id into the pool and every length into the table, and the device-side check
/// turns the rows of a sequence whose table lies into NaN.
pub(crate) fn validate_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    packed_q: Option<(&Tensor, usize)>,
    p: &AttnParams,
) -> candle_core::Result<Problem> {
    for (name, t) in [("k_pages", k_pages), ("v_pages", v_pages)] {
        if t.rank() != 4 {
            return Err(bad(
                name,
                "must have rank 4 (num_pages, page_size, heads_kv, head_dim)",
                format!("rank {} with shape {:?}", t.rank(), t.dims()),
            ));
        }
    }
    let (num_pages, page_size, hkv, dk) = k_pages.dims4()?;
    let dv = v_pages.dims()[3];
    let (b, sq, hq, d, seqs) = match packed_q {
        None => {
            if q.rank() != 4 {
                return Err(bad(
                    "q",
                    "must have rank 4 (batch, seq_q, heads_q, head_dim)",
                    format!("rank {} with shape {:?}", q.rank(), q.dims()),
                ));
            }
            let (b, sq, hq, d) = q.dims4()?;
            (b, sq, hq, d, Seqs::Dense)
        }
        Some((cu_q, max_q)) => {
            if q.rank() != 3 {
                return Err(bad(
                    "q",
                    "must have rank 3 (total_q, heads_q, head_dim)",
                    format!("rank {} with shape {:?}", q.rank(), q.dims()),
                ));
            }
            let (total_q, hq, d) = q.dims3()?;
            let b = check_cu("cu_seqlens_q", cu_q, ("q", q))?;
            if total_q > MAX_TOTAL_ROWS {
                return Err(bad("q", "total_q must be < 2^31", total_q));
            }
            if max_q.saturating_mul(b) < total_q || max_q > MAX_TOTAL_ROWS {
                return Err(bad(
                    "max_seqlen_q",
                    &format!(
                        "must bound every sequence: max_seqlen * batch ({b}) >= total_q ({total_q}), and < 2^31"
                    ),
                    max_q,
                ));
            }
            let total_k = num_pages * page_size;
            (b, max_q, hq, d, Seqs::Varlen { total_q, total_k })
        }
    };
    check_index(
        "page_table",
        page_table,
        ("q", q),
        &[Some(b), None],
        &format!("(batch, max_pages_per_seq) with batch = {b}"),
    )?;
    check_index(
        "seqlens_k",
        seqlens_k,
        ("q", q),
        &[Some(b)],
        &format!("(batch,) = ({b},)"),
    )?;
    let max_pages = page_table.dims()[1];
    let (scale, scale_f64, alibi_per_batch) =
        check_common(q, k_pages, v_pages, b, hq, hkv, d, dk, dv, p)?;
    if page_size == 0 || num_pages == 0 || max_pages == 0 {
        return Err(bad(
            "k_pages",
            "must hold at least one page of at least one row, and page_table at least one column",
            format!(
                "k_pages {:?}, page_table {:?}",
                k_pages.dims(),
                page_table.dims()
            ),
        ));
    }
    for (name, rows) in [
        ("k_pages", num_pages.saturating_mul(page_size)),
        ("page_table", max_pages.saturating_mul(page_size)),
    ] {
        if rows > MAX_TOTAL_ROWS {
            return Err(bad(
                name,
                "must address fewer than 2^31 rows (pages * page_size)",
                rows,
            ));
        }
    }
    if hq == 0 || b == 0 || (seqs == Seqs::Dense && sq == 0) {
        return Err(bad(
            "q",
            "must not be empty",
            format!("shape {:?}", q.dims()),
        ));
    }
    let q_strides = match seqs {
        Seqs::Dense => strides4("q", q.layout())?,
        Seqs::Varlen { .. } => strides3("q", q.layout())?,
    };
    Ok(Problem {
        b,
        sq,
        sk: max_pages * page_size,
        hq,
        hkv,
        d,
        dv,
        dtype: q.dtype(),
        scale,
        scale_f64,
        mask: normalise_mask(p.mask, sq, max_pages * page_size),
        // Any sequence may hold fewer keys than its query rows.
        chunk: normalise_chunk(
            p.chunk,
            normalise_mask(p.mask, sq, max_pages * page_size),
            max_pages * page_size,
            true,
        ),
        softcap: p.softcap,
        alibi: p.alibi_slopes.is_some(),
        kv_fp8: p.kv_scales.is_some(),
        alibi_per_batch,
        seqs,
        keys: Keys::Paged {
            page_size,
            num_pages,
            max_pages,
        },
        q_strides,
        k_strides: strides4("k_pages", k_pages.layout())?,
        v_strides: strides4("v_pages", v_pages.layout())?,
    })
}

/// The values of host-side paging tables: every length within the table (`max_pages *
/// page_size`) and every page a sequence uses (the first `ceil(len / page_size)` of its row) a
/// page of the pool. Returns the lengths as usize.
pub(crate) fn check_pages(
    page_table: &[u32],
    seqlens_k: &[u32],
    page_size: usize,
    num_pages: usize,
    max_pages: usize,
) -> candle_core::Result<Vec<usize>> {
    let cap = max_pages * page_size;
    let mut lens = Vec::with_capacity(seqlens_k.len());
    for (i, &len) in seqlens_k.iter().enumerate() {
        let len = len as usize;
        if len > cap {
            return Err(bad(
                "seqlens_k",
                &format!(
                    "every length must fit the page table: max_pages ({max_pages}) * page_size ({page_size}) = {cap}"
                ),
                format!("entry {i} = {len}"),
            ));
        }
        for j in 0..len.div_ceil(page_size) {
            let page = page_table[i * max_pages + j] as usize;
            if page >= num_pages {
                return Err(bad(
                    "page_table",
                    &format!(
                        "every page a sequence uses must be a page of the pool (0..{num_pages})"
                    ),
                    format!("entry [{i}][{j}] = {page} (sequence {i} has {len} keys)"),
                ));
            }
        }
        lens.push(len);
    }
    Ok(lens)
}

/// `[0, l0, l0 + l1, ...]` as u32 (lengths already known to fit).
pub(crate) fn prefix_sums(lens: impl IntoIterator<Item = usize>) -> Vec<u32> {
    let mut cu = vec![0u32];
    let mut acc = 0usize;
    for l in lens {
        acc += l;
        cu.push(acc as u32);
    }
    cu
}

/// The geometry of an `append_kv_paged` call.
pub(crate) struct AppendGeom {
    pub b: usize,
    pub total: usize,
    pub hkv: usize,
    /// Head dims of the K pool and of the V pool.
    pub d: usize,
    pub dv: usize,
    pub page_size: usize,
    pub num_pages: usize,
    pub max_pages: usize,
}

/// Checks the shapes, dtypes and devices of `append_kv_paged`: k_new `(b, n_new, hkv, d)` and
/// v_new `(b, n_new, hkv, d_v)` (or packed `(total, hkv, ·)` with `cu_new` `(b + 1,)`), pools
/// `(num_pages, page_size, hkv, d)` and `(…, d_v)` of the same dtype, a page table u32 `(b, max_pages)` and positions u32 `(b,)`. The tables'
/// values are checked on the host only on the CPU (see the function's docs).
pub(crate) fn validate_append(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    positions: &Tensor,
    cu_new: Option<&Tensor>,
) -> candle_core::Result<AppendGeom> {
    for (name, t) in [("k_pages", k_pages), ("v_pages", v_pages)] {
        if t.rank() != 4 {
            return Err(bad(
                name,
                "must have rank 4 (num_pages, page_size, heads_kv, head_dim)",
                format!("rank {} with shape {:?}", t.rank(), t.dims()),
            ));
        }
    }
    // The V pool is the K pool's shape but for its head dim (d_v may differ from d_qk).
    let (kd, vd) = (k_pages.dims(), v_pages.dims());
    if vd[..3] != kd[..3] {
        return Err(bad(
            "v_pages",
            &format!("shape must equal k_pages' {kd:?} but for the last dim (head_dim may differ)"),
            format!("{vd:?}"),
        ));
    }
    let (num_pages, page_size, hkv, d) = k_pages.dims4()?;
    let dv = vd[3];
    // The pools are written row by row at (page, row, head) strides: the head dim must be dense,
    // as attention_paged requires when it reads them.
    strides4("k_pages", k_pages.layout())?;
    strides4("v_pages", v_pages.layout())?;
    let (rank, layout) = if cu_new.is_some() {
        (3, "(total_new, heads_kv, head_dim)")
    } else {
        (4, "(batch, n_new, heads_kv, head_dim)")
    };
    for (name, t, pool, pd) in [
        ("k_new", k_new, "k_pages", d),
        ("v_new", v_new, "v_pages", dv),
    ] {
        if t.rank() != rank {
            return Err(bad(
                name,
                &format!("must have rank {rank} {layout}"),
                format!("rank {} with shape {:?}", t.rank(), t.dims()),
            ));
        }
        let dims = t.dims();
        if dims[rank - 2..] != [hkv, pd] {
            return Err(bad(
                name,
                &format!("its last two dims must be {pool}' (heads_kv, head_dim) = ({hkv}, {pd})"),
                format!("{dims:?}"),
            ));
        }
        if t.stride()[rank - 1] != 1 && pd > 1 {
            return Err(bad(
                name,
                "the last dimension (head_dim) must be contiguous (stride 1)",
                format!("strides {:?}", t.stride()),
            ));
        }
    }
    if v_new.dims()[..rank - 1] != k_new.dims()[..rank - 1] {
        return Err(bad(
            "v_new",
            &format!(
                "shape must equal k_new's {:?} but for the last dim",
                k_new.dims()
            ),
            format!("{:?}", v_new.dims()),
        ));
    }
    for (name, t) in [("k_new", k_new), ("v_new", v_new), ("v_pages", v_pages)] {
        if t.dtype() != k_pages.dtype() {
            return Err(bad(
                name,
                &format!("dtype must match k_pages ({:?})", k_pages.dtype()),
                format!("{:?}", t.dtype()),
            ));
        }
        check_device(name, t, ("k_pages", k_pages))?;
    }
    for (name, x) in [("k_pages", d), ("v_pages", dv)] {
        if !x.is_multiple_of(8) || x == 0 {
            return Err(bad(name, "head_dim must be a multiple of 8", x));
        }
    }
    if page_size == 0 || num_pages == 0 {
        return Err(bad(
            "k_pages",
            "must hold at least one page of at least one row",
            format!("{:?}", k_pages.dims()),
        ));
    }
    let (b, total) = match cu_new {
        None => (k_new.dims()[0], k_new.dims()[0] * k_new.dims()[1]),
        Some(cu) => (
            check_cu("cu_seqlens_new", cu, ("k_pages", k_pages))?,
            k_new.dims()[0],
        ),
    };
    if b == 0 {
        return Err(bad(
            "page_table",
            "must describe at least one sequence",
            format!("batch {b}"),
        ));
    }
    check_index(
        "page_table",
        page_table,
        ("k_pages", k_pages),
        &[Some(b), None],
        &format!("(batch, max_pages_per_seq) with batch = {b}"),
    )?;
    check_index(
        "positions",
        positions,
        ("k_pages", k_pages),
        &[Some(b)],
        &format!("(batch,) = ({b},)"),
    )?;
    let max_pages = page_table.dims()[1];
    if max_pages == 0
        || total > MAX_TOTAL_ROWS
        || num_pages.saturating_mul(page_size) > MAX_TOTAL_ROWS
    {
        return Err(bad(
            "page_table",
            "must have at least one column, with fewer than 2^31 new rows and pool rows",
            format!("{:?} (new rows {total})", page_table.dims()),
        ));
    }
    Ok(AppendGeom {
        b,
        total,
        hkv,
        d,
        dv,
        page_size,
        num_pages,
        max_pages,
    })
}

/// The tensors beside q/k/v that a launch reads (on q's device): ALiBi slopes, sinks; for a packed
/// batch the prefix sums (`cu_k` only when the keys are rows of k/v); for a paged cache the page
/// table and the keys of each sequence.
#[derive(Clone, Default)]
pub(crate) struct Extra {
    pub alibi_slopes: Option<Tensor>,
    /// Attention sinks `(heads_q,)` f32 (`AttnParams::sinks`).
    pub sinks: Option<Tensor>,
    pub cu_q: Option<Tensor>,
    pub cu_k: Option<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub page_table: Option<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub seqlens_k: Option<Tensor>,
    /// F8E4M3 K/V read as they are by a GPU kernel (`fp8::in_kernel`): their scales.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub kv_scales: Option<KvScales>,
}

/// A paged cache's description as the caller gives it.
pub(crate) struct PagedKv<'a> {
    pub k_pages: &'a Tensor,
    pub v_pages: &'a Tensor,
    pub page_table: &'a Tensor,
    pub seqlens_k: &'a Tensor,
}

/// What an append into a paged pool writes: sequences, rows, and the pool's geometry (the CPU
/// and the CUDA append read the same value).
#[derive(Clone, Copy)]
pub(crate) struct Append<'a> {
    pub page_table: &'a Tensor,
    pub positions: &'a Tensor,
    /// Packed new rows: their prefix sums `(b + 1,)`; `None` for a dense `(b, n_new, hkv, d)`.
    pub cu_new: Option<&'a Tensor>,
    pub b: usize,
    pub total: usize,
    pub hkv: usize,
    pub d: usize,
    pub page_size: usize,
    pub num_pages: usize,
    pub max_pages: usize,
}
