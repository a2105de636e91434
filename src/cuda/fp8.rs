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
        S::U32(x) => (x.device_ptr(stream).0, 4),
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

/// Launches `sym` over the elements of `x` (a rank-4 view), `per_thread` of them per thread and
/// step, writing `out` (contiguous, fresh).
fn run(
    sym: &str,
    x: &Tensor,
    out: &Tensor,
    scale: Option<&Tensor>,
    per_thread: usize,
) -> Result<()> {
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
        grid_dim: (n.div_ceil(256 * per_thread).clamp(1, 65536) as u32, 1, 1),
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
    // SAFETY: the kernel writes every element of `out` (a grid-stride loop over all of them).
    let out = unsafe { Tensor::empty(x.shape(), DType::F8E4M3, x.device())? };
    run(sym, x, &out, Some(scale), 1)?;
    Ok(out)
}

/// Whether `x`'s elements come in 16-byte vectors of one row: the last dim contiguous and a
/// multiple of 16 long, the start and every other stride (of dims longer than 1) multiples of 16.
fn rows_of_16(x: &Tensor) -> bool {
    let (dims, strides) = (x.dims(), x.stride());
    let Some((&d, rest)) = dims.split_last() else {
        return false;
    };
    d.is_multiple_of(16)
        && strides.last() == Some(&1)
        && x.layout().start_offset().is_multiple_of(16)
        && rest
            .iter()
            .zip(strides)
            .all(|(&n, s)| n <= 1 || s.is_multiple_of(16))
}

/// `stored * scale` in `dtype` (bf16, f16 or f32), one rounding.
pub(crate) fn widen(x: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    let vec16 = rows_of_16(x);
    let sym = match (suffix(dtype, "dequantize")?, vec16) {
        ("bf16", true) => "fc_widen_e4m3_bf16_v16",
        ("f16", true) => "fc_widen_e4m3_f16_v16",
        (_, true) => "fc_widen_e4m3_f32_v16",
        ("bf16", false) => "fc_widen_e4m3_bf16",
        ("f16", false) => "fc_widen_e4m3_f16",
        (_, false) => "fc_widen_e4m3_f32",
    };
    // SAFETY: the kernel writes every element of `out` (a grid-stride loop over all of them, or
    // over all their 16-element vectors).
    let out = unsafe { Tensor::empty(x.shape(), dtype, x.device())? };
    run(sym, x, &out, Some(scale), if vec16 { 16 } else { 1 })?;
    Ok(out)
}

/// A contiguous copy of an e4m3 view.
pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    // SAFETY: the kernel writes every element of `out` (a grid-stride loop over all of them).
    let out = unsafe { Tensor::empty(x.shape(), DType::F8E4M3, x.device())? };
    run("fc_copy_e4m3", x, &out, None, 1)?;
    Ok(out)
}

/// `fc8::PagesWiden` (kernels/common/fp8.cuh), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PagesWiden {
    src: [u64; 2],
    dst: [u64; 2],
    scale: [u64; 2],
    s_page: [i64; 2],
    s_row: [i64; 2],
    s_head: [i64; 2],
    table: u64,
    seqlens: u64,
    out_table: u64,
    d: [i32; 2],
    per_head: [i32; 2],
    b: i32,
    max_pages: i32,
    page_size: i32,
    hkv: i32,
    num_pages: i32,
    parts: i32,
}
const _: () = assert!(std::mem::size_of::<PagesWiden>() == 160);

/// Vectors of this many e4m3 elements per thread and step in `fc_widen_pages_*`
/// (`fc8::WIDEN_ITER` of them per thread, 256 threads per block).
const WIDEN_VECTORS_PER_BLOCK: usize = 256 * 4;

/// The paged slow path's widening: the pages each sequence of the batch uses, read through
/// `page_table` on the device, widened (`stored * scale`, one rounding to `dtype`) into pools of
/// `batch * max_pages` pages in sequence order (slot `bi * max_pages + j` for table entry
/// `[bi][j]`), with the page table renumbered into them. Slots past a sequence's pages are not
/// written: no kernel reads a page past a sequence's length. A used entry whose page id is not
/// a page of the pool becomes -1 in the renumbered table (`u32::MAX`), so the call over the
/// widened pools clamps it and turns that sequence's rows into NaN, as a 16-bit pool's lying
/// table does; lengths are not read on the host. One launch for K and V, no host
/// synchronisation (kernels/common/fp8.cuh, `fc_widen_pages_*`). The pools, table and lengths
/// have passed `validate_paged` (rank 4, head dim contiguous; u32 tables, contiguous);
/// `max_pages` is the table's width.
pub(crate) fn widen_pages(
    kv: &crate::params::PagedKv,
    scales: &crate::KvScales,
    dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (k, v) = (kv.k_pages, kv.v_pages);
    let Device::Cuda(dev) = k.device() else {
        candle_core::bail!("flashcore: internal: paged e4m3 widening of a CPU pool")
    };
    let (num_pages, page_size, hkv, dk) = k.dims4()?;
    let dv = v.dim(3)?;
    let (b, max_pages) = kv.page_table.dims2()?;
    let slots = b * max_pages;
    if slots.saturating_mul(page_size) > i32::MAX as usize {
        candle_core::bail!(
            "flashcore: page_table: the FP8 slow path widens batch * max_pages pages of page_size rows: {b} * {max_pages} * {page_size} rows must be < 2^31"
        )
    }
    if page_size.saturating_mul(hkv).saturating_mul(dk.max(dv)) > i32::MAX as usize {
        candle_core::bail!(
            "flashcore: k_pages: the FP8 slow path widens pages of fewer than 2^31 elements (page_size * heads_kv * head_dim), got {page_size} * {hkv} * {}",
            dk.max(dv)
        )
    }
    let sym_t = suffix(dtype, "dequantize")?;
    // The widest vector every row start, stride and head dim allows (the column stride is 1).
    let fits = |t: &Tensor, n: usize| -> bool {
        let s = t.stride();
        t.dim(3).is_ok_and(|d| d.is_multiple_of(n))
            && t.layout().start_offset().is_multiple_of(n)
            && s[..3].iter().all(|x| x.is_multiple_of(n))
    };
    let vec = [16usize, 8]
        .into_iter()
        .find(|&n| fits(k, n) && fits(v, n))
        .unwrap_or(1);
    let sym = match (sym_t, vec) {
        ("bf16", 16) => "fc_widen_pages_e4m3_bf16_v16",
        ("bf16", 8) => "fc_widen_pages_e4m3_bf16_v8",
        ("bf16", _) => "fc_widen_pages_e4m3_bf16_v1",
        ("f16", 16) => "fc_widen_pages_e4m3_f16_v16",
        ("f16", 8) => "fc_widen_pages_e4m3_f16_v8",
        ("f16", _) => "fc_widen_pages_e4m3_f16_v1",
        (_, 16) => "fc_widen_pages_e4m3_f32_v16",
        (_, 8) => "fc_widen_pages_e4m3_f32_v8",
        _ => "fc_widen_pages_e4m3_f32_v1",
    };
    // SAFETY: the kernel writes every table entry and every slot a sequence uses; the paged
    // kernels read only those slots' rows (rows past a sequence's length in its last page are
    // masked, as in any pool) and, for a lying entry, its clamped slot inside the pools, whose
    // rows are then replaced by NaN.
    let (kw, vw, table) = unsafe {
        (
            Tensor::empty((slots, page_size, hkv, dk), dtype, k.device())?,
            Tensor::empty((slots, page_size, hkv, dv), dtype, k.device())?,
            Tensor::empty((b, max_pages), DType::U32, k.device())?,
        )
    };
    let stream = dev.cuda_stream();
    let shape = format!(
        "k_pages {:?} strides {:?}, v_pages {:?} strides {:?}, page_table {:?}",
        k.dims(),
        k.stride(),
        v.dims(),
        v.stride(),
        kv.page_table.dims()
    );
    let f = launch::function(&stream, "sm80", sym, 0, &shape)?;
    let units = page_size * hkv * dk.max(dv) / vec;
    let parts = units.div_ceil(WIDEN_VECTORS_PER_BLOCK).max(1);
    let (ks, vs) = (k.stride(), v.stride());
    // checked above: slots * page_size, and a page's elements, fit i32
    let p = PagesWiden {
        src: [address(k, &stream)?, address(v, &stream)?],
        dst: [address(&kw, &stream)?, address(&vw, &stream)?],
        scale: [address(&scales.k, &stream)?, address(&scales.v, &stream)?],
        s_page: [ks[0] as i64, vs[0] as i64],
        s_row: [ks[1] as i64, vs[1] as i64],
        s_head: [ks[2] as i64, vs[2] as i64],
        table: address(kv.page_table, &stream)?,
        seqlens: address(kv.seqlens_k, &stream)?,
        out_table: address(&table, &stream)?,
        d: [dk as i32, dv as i32],
        per_head: [
            i32::from(scales.k.elem_count() > 1),
            i32::from(scales.v.elem_count() > 1),
        ],
        b: b as i32,
        max_pages: max_pages as i32,
        page_size: page_size as i32,
        hkv: hkv as i32,
        num_pages: num_pages.min(i32::MAX as usize) as i32,
        parts: parts as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: ((slots * parts).clamp(1, 1 << 20) as u32, 2, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = [&p as *const PagesWiden as *mut std::ffi::c_void];
    // SAFETY: the signature as in kernels/common/fp8.cuh (one `PagesWiden` by value, alive for
    // the call). The pools are read only at pages 0..num_pages through their own strides (vectors
    // of `vec` bytes: every row start, stride and head dim is a multiple of it, so each vector
    // lies in one row of one head), the table and lengths at b * max_pages and b u32 entries
    // (shapes checked by validate_paged), the scales at one entry per head or one (checked by
    // fp8::kv_form); the outputs are fresh, contiguous, of exactly the sizes the kernel writes.
    unsafe { launch::launch(&stream, &f, cfg, &mut args, launch::Ex::NONE, sym, &shape)? };
    Ok((kw, vw, table))
}
