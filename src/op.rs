//! The `CustomOp3` over (q, k, v): CPU reference path and CUDA dispatch.

use crate::params::{validate, AttnParams, Problem};
use crate::reference;
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

pub(crate) struct FlashAttn {
    pub problem: Problem,
    pub alibi_slopes: Option<Tensor>,
    /// Set by the forward when the caller asked for the log-sum-exp.
    pub want_lse: bool,
    pub lse: Arc<Mutex<Option<Storage>>>,
}

impl FlashAttn {
    fn stash_lse(&self, s: Storage) {
        if self.want_lse {
            *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
        }
    }

    fn cpu_typed<T: candle_core::WithDType>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        offsets: [usize; 3],
    ) -> Result<Vec<T>> {
        let slopes = match &self.alibi_slopes {
            Some(s) => Some(s.to_vec1::<f32>()?),
            None => None,
        };
        let (q, k, v) = (&q[offsets[0]..], &k[offsets[1]..], &v[offsets[2]..]);
        let (o, lse) = if T::DTYPE == DType::F64 {
            reference::fused::<T, f64>(q, k, v, &self.problem, slopes.as_deref())
        } else {
            reference::fused::<T, f32>(q, k, v, &self.problem, slopes.as_deref())
        };
        self.stash_lse(Storage::Cpu(CpuStorage::F32(lse)));
        Ok(o)
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flashcore-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let offs = [l1.start_offset(), l2.start_offset(), l3.start_offset()];
        let shape = Shape::from(self.problem.out_dims());
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                CpuStorage::F32(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                CpuStorage::F64(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F16(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                CpuStorage::BF16(self.cpu_typed(q, k, v, offs)?)
            }
            _ => candle_core::bail!(
                "flashcore: q, k, v: dtype must be one of f16, bf16, f32, f64 and agree, got {:?}",
                [s1.dtype(), s2.dtype(), s3.dtype()]
            ),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (o, lse) = crate::cuda::forward(
            &self.problem,
            self.alibi_slopes.as_ref(),
            (s1, l1),
            (s2, l2),
            (s3, l3),
        )?;
        self.stash_lse(Storage::Cuda(lse));
        Ok((o, Shape::from(self.problem.out_dims())))
    }
}

fn strides3(t: &Tensor) -> [usize; 3] {
    let s = t.stride();
    [s[0], s[1], s[2]]
}

/// Validates, runs the op (recorded for backprop so that a backward pass fails loudly with
/// `BackwardNotSupported`), and returns the output and, if asked, the log-sum-exp.
pub(crate) fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let problem = validate(q, k, v, params)?;
    // The GPU kernels load 16-byte vectors: a view whose offset or strides are not multiples of
    // 8 elements is copied to a contiguous tensor first (the only copy flashcore ever makes).
    let aligned = |t: &Tensor| -> Result<Tensor> {
        let l = t.layout();
        if t.device().is_cuda()
            && (!l.start_offset().is_multiple_of(8)
                || l.stride()[..3].iter().any(|s| !s.is_multiple_of(8)))
        {
            t.contiguous()
        } else {
            Ok(t.clone())
        }
    };
    let (q, k, v) = (&aligned(q)?, &aligned(k)?, &aligned(v)?);
    let problem = Problem {
        q_strides: strides3(q),
        k_strides: strides3(k),
        v_strides: strides3(v),
        ..problem
    };
    let lse_shape = Shape::from((problem.b, problem.hq, problem.sq));
    let slot = Arc::new(Mutex::new(None));
    let op = FlashAttn {
        problem,
        alibi_slopes: params.alibi_slopes.clone(),
        want_lse,
        lse: slot.clone(),
    };
    let o = q.apply_op3_arc(k, v, Arc::new(Box::new(op)))?;
    let lse = if want_lse {
        let s = slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg("flashcore: internal: forward produced no lse".into())
            })?;
        Some(Tensor::from_storage(
            s,
            lse_shape,
            BackpropOp::none(),
            false,
        ))
    } else {
        None
    };
    Ok((o, lse))
}
