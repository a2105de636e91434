//! `bench --verify`: each judged row's output against the CPU reference, with a stated tolerance
//! per dtype. Shared with tests/bench_verify.rs (included with `#[path]`), which shows the check
//! passing on correct outputs and failing on wrong ones.
//!
//! The rule: `max |out - ref| <= tol(dtype) * max |ref|` over the compared elements, where `ref`
//! is flashcore's CPU path in f32 on the same (already rounded) inputs. `tol` is 2e-2 for bf16,
//! 4e-3 for f16 and 1e-4 for f32: about 5-8 units in the last place of the output dtype (2^-8,
//! 2^-11), room for the kernels' rounding of the probabilities to the input dtype before the PV
//! product and of the output, and nothing like the error of a wrong tile, mask or scale. A
//! non-finite output element fails whatever the tolerance.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use flashcore::AttnParams;

/// The relative tolerance of `--verify` for outputs of `dtype` (see the module doc).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2e-2,
        DType::F16 => 4e-3,
        _ => 1e-4,
    }
}

/// One judged comparison.
#[derive(Clone, Copy, Debug)]
pub struct Verdict {
    /// max |out - ref| (infinite when `out` has a non-finite element).
    pub max_err: f64,
    /// max |ref|, the scale the tolerance is relative to.
    pub scale: f64,
    /// `tolerance(dtype)`.
    pub tol: f64,
}

impl Verdict {
    /// `max_err / scale` (with a tiny floor on the scale, so an all-zero reference still
    /// judges any error).
    pub fn rel_err(&self) -> f64 {
        self.max_err / self.scale.max(1e-30)
    }
    pub fn pass(&self) -> bool {
        self.rel_err() <= self.tol
    }
    /// The worse of two comparisons of the same row (e.g. two sequences of a packed batch).
    pub fn worst(self, other: Verdict) -> Verdict {
        if other.rel_err() > self.rel_err() {
            other
        } else {
            self
        }
    }
}

/// Compares `got` (any device, any float dtype; `perturb` is added to it first, the
/// `--perturb-output` knob that shows the check failing) with `want` (f32) under the
/// tolerance of `dtype`.
pub fn judge(got: &Tensor, want: &Tensor, dtype: DType, perturb: f64) -> Result<Verdict> {
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let got = if perturb != 0.0 {
        (got + perturb)?
    } else {
        got
    };
    let got = got.flatten_all()?.to_vec1::<f32>()?;
    let want = want.flatten_all()?.to_vec1::<f32>()?;
    anyhow::ensure!(
        got.len() == want.len(),
        "verify: {} output elements against {} reference elements",
        got.len(),
        want.len()
    );
    let mut max_err = 0f64;
    let mut scale = 0f64;
    for (&g, &w) in got.iter().zip(&want) {
        let e = if g.is_finite() {
            (g as f64 - w as f64).abs()
        } else {
            f64::INFINITY
        };
        max_err = max_err.max(e);
        scale = scale.max((w as f64).abs());
    }
    Ok(Verdict {
        max_err,
        scale,
        tol: tolerance(dtype),
    })
}

/// A dense row: the last (up to) 64 query rows of batch 0 of `out` against the CPU reference
/// on the same inputs. The last rows of a bottom-right aligned problem form a valid
/// sub-problem with the same keys.
pub fn check_dense(
    out: &Tensor,
    set: &(Tensor, Tensor, Tensor),
    p: &AttnParams,
    perturb: f64,
) -> Result<Verdict> {
    let (q, k, v) = set;
    let sq = q.dim(1)?;
    let r = sq.min(64);
    let cpu = Device::Cpu;
    let f32_cpu = |t: &Tensor| -> candle_core::Result<Tensor> {
        t.narrow(0, 0, 1)?.to_device(&cpu)?.to_dtype(DType::F32)
    };
    let q1 = f32_cpu(&q.narrow(1, sq - r, r)?)?;
    // the reference runs on the CPU: the sinks (on the run's device) go there too
    let p = AttnParams {
        sinks: p.sinks.as_ref().map(|s| s.to_device(&cpu)).transpose()?,
        ..p.clone()
    };
    let want = flashcore::attention(&q1, &f32_cpu(k)?, &f32_cpu(v)?, &p)?;
    let got = out.narrow(0, 0, 1)?.narrow(1, sq - r, r)?;
    judge(&got, &want, q.dtype(), perturb)
}

/// A packed (varlen) row: sequence `i` of the packed output `out` (rows `start..start + len`)
/// against the dense CPU reference on that sequence alone.
pub fn check_packed_seq(
    out: &Tensor,
    qkv: (&Tensor, &Tensor, &Tensor),
    start: usize,
    len: usize,
    p: &AttnParams,
    perturb: f64,
) -> Result<Verdict> {
    let cpu = Device::Cpu;
    let f = |t: &Tensor| -> candle_core::Result<Tensor> {
        t.narrow(0, start, len)?
            .unsqueeze(0)?
            .to_device(&cpu)?
            .to_dtype(DType::F32)
    };
    let want = flashcore::attention(&f(qkv.0)?, &f(qkv.1)?, &f(qkv.2)?, p)?;
    let got = out.narrow(0, start, len)?.unsqueeze(0)?;
    judge(&got, &want, qkv.0.dtype(), perturb)
}
