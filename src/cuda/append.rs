//! Writing new K/V rows into a paged pool (`fc_append_paged`).

use super::{device_info, fp8_ptr, launch, ptr, side_ptr, Fmt};
use crate::params::Append;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Result};
use cudarc::driver::LaunchConfig;
use half::{bf16, f16};

/// Writes the new rows `src` into the pool (`fc_append_paged`, kernels/common/paged.cuh): one
/// launch for the whole batch. `name` is the pool's argument name (for errors).
pub(crate) fn append_paged(
    pool: (&mut CudaStorage, &Layout),
    src: (&CudaStorage, &Layout),
    a: &Append,
    name: &str,
) -> Result<()> {
    let sym = "fc_append_paged";
    let shape = Fmt(|f: &mut std::fmt::Formatter<'_>| {
        write!(
            f,
            "{name}: {} new rows into {} pages of {} x {} x {}, batch {}",
            a.total, a.num_pages, a.page_size, a.hkv, a.d, a.b
        )
    });
    if a.total == 0 {
        return Ok(());
    }
    let dev = pool.0.device.clone();
    let stream = dev.cuda_stream();
    let (pl, sl) = (pool.1, src.1);
    // The kernel moves 16-byte chunks of 16-bit elements: F8E4M3 rows move as rows of half as
    // many 16-bit elements (strides and head dim halved), so they need multiples of 16.
    use candle_core::backend::BackendStorage;
    let e = if pool.0.dtype() == DType::F8E4M3 {
        2
    } else {
        1
    };
    if e == 2 && !a.d.is_multiple_of(16) {
        candle_core::bail!(
            "flashcore: {name}: the GPU append into F8E4M3 pools needs a head_dim that is a multiple of 16, got {}",
            a.d
        )
    }
    if !pl.start_offset().is_multiple_of(8 * e)
        || pl.stride()[..3].iter().any(|s| !s.is_multiple_of(8 * e))
    {
        candle_core::bail!(
            "flashcore: {name}: the GPU append needs offset and strides that are multiples of {} elements, got offset {} strides {:?}",
            8 * e,
            pl.start_offset(),
            pl.stride()
        )
    }
    let rank = sl.dims().len();
    if !sl.start_offset().is_multiple_of(8 * e)
        || sl.stride()[..rank - 1]
            .iter()
            .any(|s| !s.is_multiple_of(8 * e))
    {
        return Err(launch::err(
            sym,
            &shape,
            format!(
                "internal: misaligned new rows (offset {}, strides {:?})",
                sl.start_offset(),
                sl.stride()
            ),
        ));
    }
    let ss = sl.stride();
    let (s_b, s_r, s_h) = if a.cu_new.is_some() {
        (0, ss[0], ss[1])
    } else {
        (ss[0], ss[1], ss[2])
    };
    let ps = pl.stride();
    let (dst, src_ptr) = match pool.0.dtype() {
        DType::F8E4M3 => (
            fp8_ptr(pool.0, pl, name, &stream)?,
            fp8_ptr(src.0, sl, "new rows", &stream)?,
        ),
        DType::BF16 => (
            ptr::<bf16>(pool.0, pl, &stream)?.0,
            ptr::<bf16>(src.0, sl, &stream)?.0,
        ),
        DType::F16 => (
            ptr::<f16>(pool.0, pl, &stream)?.0,
            ptr::<f16>(src.0, sl, &stream)?.0,
        ),
        dt => candle_core::bail!(
            "flashcore: {name}: no CUDA append for dtype {dt:?} yet (the GPU kernels take f16 and bf16)"
        ),
    };
    let pt = side_ptr::<u32>(a.page_table, "page_table", &stream)?;
    let pos = side_ptr::<u32>(a.positions, "positions", &stream)?;
    let cu = match a.cu_new {
        Some(t) => side_ptr::<u32>(t, "cu_seqlens_new", &stream)?,
        None => 0,
    };
    let n_new = if a.cu_new.is_some() { 0 } else { a.total / a.b };
    let f = launch::function(&stream, "sm80", sym, 0, &shape)?;
    let chunks = a.total * a.hkv * a.d / e / 8;
    let sms = device_info(&dev)?.sm_count.max(1);
    let cfg = LaunchConfig {
        grid_dim: (chunks.div_ceil(256).clamp(1, sms * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let i = |x: usize| (x / e) as i64;
    let n32 = |x: usize| x as i32;
    let (sb, sr, sh) = (i(s_b), i(s_r), i(s_h));
    let (pp, pr, ph) = (i(ps[0]), i(ps[1]), i(ps[2]));
    let (b, nn, total, hkv, d) = (n32(a.b), n32(n_new), n32(a.total), n32(a.hkv), n32(a.d / e));
    let (psz, np, mp) = (n32(a.page_size), n32(a.num_pages), n32(a.max_pages));
    let arg = |x: &i64| x as *const i64 as *mut std::ffi::c_void;
    let arg32 = |x: &i32| x as *const i32 as *mut std::ffi::c_void;
    let arg64 = |x: &u64| x as *const u64 as *mut std::ffi::c_void;
    let mut args = [
        arg64(&src_ptr),
        arg64(&dst),
        arg64(&pt),
        arg64(&pos),
        arg64(&cu),
        arg(&sb),
        arg(&sr),
        arg(&sh),
        arg(&pp),
        arg(&pr),
        arg(&ph),
        arg32(&b),
        arg32(&nn),
        arg32(&total),
        arg32(&hkv),
        arg32(&d),
        arg32(&psz),
        arg32(&np),
        arg32(&mp),
    ];
    // SAFETY: signature as fc_append_paged in kernels/common/paged.cuh, each argument alive for
    // the call; src holds `total` rows of the given strides, the pool `num_pages` pages, the
    // tables b (x max_pages) u32 entries; the kernel writes only rows whose page id is inside the
    // pool.
    unsafe { launch::launch(&stream, &f, cfg, &mut args, launch::Ex::NONE, sym, &shape) }
}
