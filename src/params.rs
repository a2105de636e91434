//! Options and input validation. Every check runs before any kernel and fails with a
//! `candle_core::Error` naming the argument, the rule and the value received.

use candle_core::{DType, Layout, Tensor};

/// Head dimensions with a compiled GPU kernel. The CPU path accepts any head dim up to 256.
pub const SUPPORTED_HEAD_DIMS: &[usize] = &[64, 128, 256];

/// Largest head dimension accepted at all.
pub const MAX_HEAD_DIM: usize = 256;

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
    /// Multiplies `q . k`; `None` means `1 / sqrt(head_dim)`. Any finite value on the CPU; the
    /// GPU kernels take a scale > 0 (otherwise an error naming the option).
    pub softmax_scale: Option<f32>,
    /// The mask; bottom-right aligned.
    pub mask: Mask,
    /// If set, scores become `softcap * tanh(score / softcap)` before the mask (Gemma 2 style).
    pub softcap: Option<f32>,
    /// ALiBi slopes, f32 of shape `(heads_q,)`: adds `-slope[h] * |j - (i + seq_k - seq_q)|`.
    pub alibi_slopes: Option<Tensor>,
}

/// A validated problem: sizes, strides (in elements) and resolved options.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub dtype: DType,
    pub scale: f32,
    pub mask: Mask,
    pub softcap: Option<f32>,
    /// Whether ALiBi slopes were given (the tensor itself travels beside the problem).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub alibi: bool,
    /// Strides `(batch, row, head)` in elements for q, k, v; the last dim has stride 1.
    pub q_strides: [usize; 3],
    pub k_strides: [usize; 3],
    pub v_strides: [usize; 3],
}

impl Problem {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn window(&self) -> (Option<usize>, Option<usize>) {
        self.mask.bounds()
    }
    pub fn h_ratio(&self) -> usize {
        self.hq / self.hkv
    }
    pub fn out_dims(&self) -> (usize, usize, usize, usize) {
        (self.b, self.sq, self.hq, self.d)
    }
}

fn bad(arg: &str, rule: &str, got: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashcore: {arg}: {rule}, got {got}"))
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

/// Checks everything about the inputs that can be checked without running anything, coarse to
/// fine: rank, dtype, device, shape agreement, head ratio, head dim, strides, emptiness, scale,
/// softcap, ALiBi slopes.
pub(crate) fn validate(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> candle_core::Result<Problem> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            let layout = if name == "q" {
                "(batch, seq_q, heads_q, head_dim)"
            } else {
                "(batch, seq_k, heads_kv, head_dim)"
            };
            return Err(bad(
                name,
                &format!("must have rank 4 {layout}"),
                format!("rank {} with shape {:?}", t.rank(), t.dims()),
            ));
        }
    }
    let dtype = q.dtype();
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        return Err(bad(
            "q",
            "dtype must be f16, bf16, f32 or f64",
            format!("{dtype:?}"),
        ));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != dtype {
            return Err(bad(
                name,
                &format!("dtype must match q ({dtype:?})"),
                format!("{:?}", t.dtype()),
            ));
        }
    }
    for (name, t) in [("k", k), ("v", v)] {
        if !t.device().same_device(q.device()) {
            return Err(bad(
                name,
                &format!(
                    "must be on the same device as q ({:?})",
                    q.device().location()
                ),
                format!("{:?}", t.device().location()),
            ));
        }
    }
    let (b, sq, hq, d) = q.dims4()?;
    let (bk, sk, hkv, dk) = k.dims4()?;
    if v.dims() != k.dims() {
        return Err(bad(
            "v",
            &format!("shape must equal k's {:?}", k.dims()),
            format!("{:?}", v.dims()),
        ));
    }
    if bk != b {
        return Err(bad("k", &format!("batch must equal q's batch {b}"), bk));
    }
    if dk != d {
        return Err(bad(
            "k",
            &format!("head_dim must equal q's head_dim {d}"),
            dk,
        ));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(bad(
            "k",
            &format!("heads_q ({hq}) must be a multiple of heads_kv"),
            format!("heads_kv {hkv}"),
        ));
    }
    if d == 0 || d > MAX_HEAD_DIM || d % 8 != 0 {
        return Err(bad(
            "q",
            &format!("head_dim must be a multiple of 8 in 8..={MAX_HEAD_DIM}"),
            d,
        ));
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
    let scale = p.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() {
        return Err(bad("softmax_scale", "must be finite", scale));
    }
    if let Some(c) = p.softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(bad("softcap", "must be finite and > 0", c));
        }
    }
    if let Some(s) = &p.alibi_slopes {
        if s.dtype() != DType::F32 {
            return Err(bad(
                "alibi_slopes",
                "dtype must be f32",
                format!("{:?}", s.dtype()),
            ));
        }
        if s.dims() != [hq] {
            return Err(bad(
                "alibi_slopes",
                &format!("shape must be (heads_q,) = ({hq},)"),
                format!("{:?}", s.dims()),
            ));
        }
        if !s.device().same_device(q.device()) {
            return Err(bad(
                "alibi_slopes",
                &format!(
                    "must be on the same device as q ({:?})",
                    q.device().location()
                ),
                format!("{:?}", s.device().location()),
            ));
        }
    }
    Ok(Problem {
        b,
        sq,
        sk,
        hq,
        hkv,
        d,
        dtype,
        scale,
        mask: p.mask.canonical(),
        softcap: p.softcap,
        alibi: p.alibi_slopes.is_some(),
        q_strides,
        k_strides,
        v_strides,
    })
}
