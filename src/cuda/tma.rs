//! TMA tensor maps for the sm90 family: one rank-4 map (d, seq, heads, batch) per operand, built
//! on the host with `cuTensorMapEncodeTiled` and passed by value as a `__grid_constant__`
//! kernel parameter. The recipe is the one kernels/sm90/fwd.cuh documents.

use super::variants::KDType;
use cudarc::driver::sys;

/// A `CUtensorMap` (128-byte aligned, 128 bytes) that can be pushed as a kernel argument.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(pub sys::CUtensorMap);

// SAFETY: an opaque, plain-old-data driver struct passed by value to the kernel.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// Operand geometry in elements.
pub(crate) struct Operand {
    pub base: u64,
    pub d: usize,
    pub seq: usize,
    pub heads: usize,
    pub batch: usize,
    /// (batch, row, head) strides in elements.
    pub strides: [usize; 3],
    /// Rows per TMA box (BLOCK_M for q, BLOCK_N for k and v).
    pub box_rows: u32,
}

/// Encodes the 128B-swizzled map; an error names the operand and the driver's answer.
pub(crate) fn encode(dtype: KDType, op: &Operand, name: &str) -> Result<TensorMap, String> {
    let [bs, rs, hs] = op.strides;
    let extent = (rs * op.seq)
        .max(hs * op.heads)
        .max(bs * op.batch)
        .max(op.d) as u64;
    // A size-1 dimension is never stepped: give it any valid stride (>= the extent, 16-B multiple).
    let fix = |stride: usize, size: usize| -> u64 {
        if size == 1 {
            (extent * 2).div_ceil(16) * 16
        } else {
            stride as u64 * 2
        }
    };
    let dims: [u64; 4] = [op.d as u64, op.seq as u64, op.heads as u64, op.batch as u64];
    let strides: [u64; 3] = [fix(rs, op.seq), fix(hs, op.heads), fix(bs, op.batch)];
    if strides
        .iter()
        .any(|s| !s.is_multiple_of(16) || *s >= 1 << 40)
        || !op.base.is_multiple_of(16)
    {
        return Err(format!("{name}: TMA needs a 16-byte aligned base and strides, got base {:#x} strides {strides:?} B", op.base));
    }
    let boxd: [u32; 4] = [64, op.box_rows, 1, 1];
    let es: [u32; 4] = [1, 1, 1, 1];
    let dt = match dtype {
        KDType::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        KDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: all arrays have the rank's length; the driver writes the 128-byte map.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            4,
            op.base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            es.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "{name}: cuTensorMapEncodeTiled failed with {r:?} (dims {dims:?}, strides {strides:?} B, box {boxd:?})"
        ));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }))
}
