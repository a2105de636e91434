//! TMA tensor maps for the sm90 family: one rank-4 map (d, seq, heads, batch) per operand (the
//! paged twins' K/V pools: rank 5, [`encode_pool`]), built
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
    let boxd: [u32; 4] = [64, op.box_rows, 1, 1];
    encode_tiled(dtype, op.base, &dims, &strides, &boxd, name)
}

/// The 128B-swizzled rank-R map over `base` (dims fastest first, strides in bytes of dims 1..R);
/// an error names the operand and the rule or the driver's answer.
fn encode_tiled<const R: usize, const S: usize>(
    dtype: KDType,
    base: u64,
    dims: &[u64; R],
    strides: &[u64; S],
    boxd: &[u32; R],
    name: &str,
) -> Result<TensorMap, String> {
    if strides
        .iter()
        .any(|s| !s.is_multiple_of(16) || *s >= 1 << 40)
        || !base.is_multiple_of(16)
    {
        return Err(format!("{name}: TMA needs a 16-byte aligned base and strides, got base {base:#x} strides {strides:?} B"));
    }
    const { assert!(S + 1 == R, "strides of dims 1..R") };
    let es = [1u32; R];
    let dt = match dtype {
        KDType::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        KDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: dims, box and element strides have the rank's length, strides one less; the
    // driver writes the 128-byte map.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            R as u32,
            base as *mut std::ffi::c_void,
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

/// A paged pool `(num_pages, page_size, heads, d)` as the paged twins read it (`Variant::paged`,
/// kernels/sm90/fwd.cuh `ILV`): rank 5, (64 columns, 8 rows, d / 64 column blocks, heads, the
/// pool's row groups of 8), so that one box of `box_rows` rows holds every column of those rows,
/// row group by row group. Needs d a multiple of 64 and pages stored whole (page stride =
/// page_size * row stride, so row groups follow each other at 8 row strides).
pub(crate) struct Pool {
    pub base: u64,
    pub d: usize,
    pub page_size: usize,
    pub heads: usize,
    pub num_pages: usize,
    /// (page, row, head) strides in elements.
    pub strides: [usize; 3],
    pub box_rows: u32,
}

/// Encodes a [`Pool`] map (128B swizzle); an error names the operand and the rule or the
/// driver's answer.
pub(crate) fn encode_pool(dtype: KDType, pool: &Pool, name: &str) -> Result<TensorMap, String> {
    let [ps, rs, hs] = pool.strides;
    if !pool.d.is_multiple_of(64)
        || !pool.page_size.is_multiple_of(8)
        || ps != pool.page_size * rs
        || !(pool.box_rows as usize).is_multiple_of(8)
    {
        return Err(format!(
            "{name}: the paged twin needs d a multiple of 64, whole pages of a multiple of 8 rows and boxes of whole row groups, got d {}, page_size {}, strides (page, row, head) {:?}, box {} rows",
            pool.d, pool.page_size, pool.strides, pool.box_rows
        ));
    }
    let groups = (pool.num_pages * pool.page_size / 8) as u64;
    let dims: [u64; 5] = [64, 8, (pool.d / 64) as u64, pool.heads as u64, groups];
    // a size-1 head dimension is never stepped: any valid stride
    let head = if pool.heads == 1 { 128 } else { hs as u64 * 2 };
    let strides: [u64; 4] = [rs as u64 * 2, 128, head, 8 * rs as u64 * 2];
    let boxd: [u32; 5] = [64, 8, (pool.d / 64) as u32, 1, pool.box_rows / 8];
    encode_tiled(dtype, pool.base, &dims, &strides, &boxd, name)
}
