//! The e4m3 conversions on a GPU (kernels/common/fp8.cuh): candle 0.11 has no CUDA cast to or
//! from `F8E4M3` that it can find (it looks the kernels up under other names) and no strided
//! `F8E4M3` copy, so flashcore quantizes, widens and copies e4m3 tensors with its own kernels.

use super::launch;
use candle_core::{DType, Device, Result, Tensor};
use cudarc::driver::{DevicePtr, LaunchConfig};

/// A tensor's view as the kernels walk it: rank 1 to 4, padded with leading 1s.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct View4 {
    dims: [i64; 4],
    strides: [i64; 4],
}

fn view_of(t: &Tensor, what: &str) -> Result<View4> {
    let (dims, strides) = (t.dims(), t.stride());
    if dims.is_empty() || dims.len() > 4 {
        candle_core::bail!(
            "flashcore: {what}: the e4m3 conversions take tensors of rank 1 to 4, got shape {dims:?}"
        )
    }
    let mut v = View4 {
        dims: [1; 4],
        strides: [0; 4],
    };
    let pad = 4 - dims.len();
    for (i, (&d, &s)) in dims.iter().zip(strides).enumerate() {
        v.dims[pad + i] = d as i64;
        v.strides[pad + i] = s as i64;
    }
    Ok(v)
}

/// Device address of `t`'s first element.
fn address(t: &Tensor, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<u64> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("flashcore: internal: e4m3 conversion of a tensor not on a CUDA device")
    };
    let off = l.start_offset();
    let (base, elem) = match &s.slice {
        S::F8E4M3(x) => (x.device_ptr(stream).0, 1),
        S::BF16(x) => (x.device_ptr(stream).0, 2),
        S::F16(x) => (x.device_ptr(stream).0, 2),
        S::F32(x) => (x.device_ptr(stream).0, 4),
        _ => candle_core::bail!(
            "flashcore: internal: e4m3 conversion of a {:?} tensor",
            t.dtype()
        ),
    };
    Ok(base + (off * elem) as u64)
}

fn suffix(dtype: DType, what: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        dt => candle_core::bail!(
            "flashcore: {what}: the GPU e4m3 conversions take bf16, f16 or f32, got {dt:?}"
        ),
    })
}

/// Launches `sym` over the elements of `x` (a rank-4 view), writing `out` (contiguous, fresh).
fn run(sym: &str, x: &Tensor, out: &Tensor, scale: Option<&Tensor>) -> Result<()> {
    let Device::Cuda(dev) = x.device() else {
        candle_core::bail!("flashcore: internal: {sym} on a CPU tensor")
    };
    let n = x.elem_count();
    if n == 0 {
        return Ok(());
    }
    let shape = format!("{:?} strides {:?}", x.dims(), x.stride());
    let stream = dev.cuda_stream();
    let view = view_of(x, sym)?;
    let f = launch::function(&stream, "sm80", sym, 0, &shape)?;
    let (src, dst) = (address(x, &stream)?, address(out, &stream)?);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65536) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (sp, per_head) = match scale {
        Some(s) => (address(s, &stream)?, i32::from(s.elem_count() > 1)),
        None => (0, 0),
    };
    let arg = |p: *const std::ffi::c_void| p as *mut std::ffi::c_void;
    let mut args = vec![
        arg(&src as *const u64 as _),
        arg(&view as *const View4 as _),
        arg(&dst as *const u64 as _),
    ];
    if scale.is_some() {
        args.push(arg(&sp as *const u64 as _));
        args.push(arg(&per_head as *const i32 as _));
    }
    // SAFETY: signatures as in kernels/common/fp8.cuh, each argument alive for the call; `x` is
    // read through its own view (every offset inside its storage), `out` holds `n` fresh
    // contiguous elements, the scale (f32, contiguous, checked by the caller) has one entry per
    // K/V head (dim 2) or one in all.
    unsafe { launch::launch(&stream, &f, cfg, &mut args, launch::Ex::NONE, sym, &shape) }
}

/// `x / scale` saturated and rounded to e4m3 (`x`: bf16, f16 or f32, any strides; the scale
/// f32 `(heads,)` for dim -2 or `(1,)`).
pub(crate) fn quantize(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let sym = match suffix(x.dtype(), "quantize")? {
        "bf16" => "fc_quantize_e4m3_bf16",
        "f16" => "fc_quantize_e4m3_f16",
        _ => "fc_quantize_e4m3_f32",
    };
    let out = Tensor::zeros(x.shape(), DType::F8E4M3, x.device())?;
    run(sym, x, &out, Some(scale))?;
    Ok(out)
}

/// `stored * scale` in `dtype` (bf16, f16 or f32), one rounding.
pub(crate) fn widen(x: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    let sym = match suffix(dtype, "dequantize")? {
        "bf16" => "fc_widen_e4m3_bf16",
        "f16" => "fc_widen_e4m3_f16",
        _ => "fc_widen_e4m3_f32",
    };
    let out = Tensor::zeros(x.shape(), dtype, x.device())?;
    run(sym, x, &out, Some(scale))?;
    Ok(out)
}

/// A contiguous copy of an e4m3 view.
pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    let out = Tensor::zeros(x.shape(), DType::F8E4M3, x.device())?;
    run("fc_copy_e4m3", x, &out, None)?;
    Ok(out)
}
