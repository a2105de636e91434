//! Executing a plan: the operands' device addresses, the outputs, the gather, the parameter
//! block (built once, from the plan), the kernel launches and the table check, in that order.

use super::launch::{self, Ex};
use super::params::FcParams;
use super::scratch::{grown, tile_counter, with_scratch};
use super::{alloc_out, fp8_ptr, plan_on, poison_on, ptr, side_ptr, tma, variants, ShapeOf};
use crate::params::{Extra, Keys, Problem, Seqs};
use crate::plan::{Combine, Grid, Launch, Plan, GRID_YZ};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Tensor};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use half::{bf16, f16};
use std::sync::Arc;

type Stream = Arc<CudaStream>;

/// Runs the forward on CUDA storages; returns O and, when `want_lse`, the LSE (otherwise the
/// kernels write it to the stream's scratch: no allocation).
pub(crate) fn forward(
    p: &Problem,
    extra: &Extra,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    want_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let dev = q.0.device.clone();
    // Validation dropped every window bound no row can reach (left >= sk, right >= sq), so the
    // bounds fit the kernels' int32 band arithmetic and Window{huge, 0} runs the causal kernel.
    debug_assert_eq!(p.mask, crate::params::normalise_mask(p.mask, p.sq, p.sk));
    let plan = plan_on(&dev, p)?;
    if p.dv != p.d && !crate::plan::takes_head_dims_apart(&plan) {
        // op::apply pads such problems to one head dim before they reach this kernel.
        candle_core::bail!(
            "flashcore: internal: {} needs d_v == d_qk, got {} and {}",
            plan.variant.symbol(),
            p.dv,
            p.d
        )
    }
    match p.dtype {
        DType::BF16 => run_typed::<bf16>(&dev, p, &plan, extra, q, k, v, want_lse),
        DType::F16 => run_typed::<f16>(&dev, p, &plan, extra, q, k, v, want_lse),
        _ => unreachable!("the planner admits only f16 and bf16"),
    }
}

/// Device addresses of everything a launch reads or writes (0: absent).
#[derive(Clone, Copy, Default)]
struct Addrs {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    alibi_slopes: u64,
    sinks: u64,
    cu_q: u64,
    cu_k: u64,
    seqused_k: u64,
    page_table: u64,
    k_scales: u64,
    v_scales: u64,
    /// 1: FP8 scales per K/V head; 0: one per tensor (or none).
    kv_scale_stride: i32,
}

/// What the kernels need besides the problem's addresses, from the plan: the tile counter and
/// the split-KV partials (0: none).
#[derive(Clone, Copy, Default)]
struct Extras {
    tile_counter: u64,
    o_partial: u64,
}

#[allow(clippy::too_many_arguments)]
fn run_typed<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Problem,
    plan: &Plan,
    extra: &Extra,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    want_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let shape = ShapeOf(p);
    let stream = dev.cuda_stream();
    check_aligned(p, plan, q.1, k.1, v.1, &shape)?;
    // the FP8 scales as the kernel takes them, alive to the end of the call
    let scales = kv_scales(p, extra, &shape)?;
    let mut addrs = inputs::<T>(p, extra, q, k, v, scales.as_ref(), &stream, &shape)?;
    // Outputs: O, and the LSE or the stream's LSE scratch (written by the kernels, read by
    // nobody: calls may share it). The guards and `_lse_scratch` live to the end of the call,
    // after every launch that writes them.
    let o: CudaSlice<T> = alloc_out(dev, plan.out_elems, &shape)?;
    let lse: Option<CudaSlice<f32>> = match want_lse {
        true => Some(alloc_out(dev, plan.lse_elems, &shape)?),
        false => None,
    };
    let (op, _og) = o.device_ptr(&stream);
    addrs.o = op;
    let (_lg, _lse_scratch) = match &lse {
        Some(l) => {
            let (lp, g) = l.device_ptr(&stream);
            addrs.lse = lp;
            (Some(g), None)
        }
        None => {
            let n = plan.lse_elems;
            let (lp, keep) = with_scratch(&stream, |s| grown(&mut s.lse, &stream, n))
                .map_err(|e| alloc_err(plan, &shape, format!("{n} f32 of LSE scratch: {e}")))?;
            addrs.lse = lp;
            (None, Some(keep))
        }
    };
    if poison_on() {
        launch::fill(&stream, addrs.o, plan.out_elems, 2, 0x7FFF)?;
        launch::fill(&stream, addrs.lse, plan.lse_elems, 4, 0x7FC0_0000)?;
    }
    // The caller's tables and pools: what the gather and the check read.
    let source = fc_params(p, &addrs, None, Extras::default());
    let _gathered = match plan.gather {
        Some(_) => {
            let (scratch, dk, dv) = gather_paged::<T>(dev, plan, &source, &shape)?;
            (addrs.k, addrs.v, addrs.page_table) = (dk, dv, 0);
            Some(scratch)
        }
        None => None,
    };
    let checked = launch_kernels(dev, plan, &addrs, &shape)?;
    if let (Some(blocks), false) = (plan.check, checked) {
        check_seqlens(&stream, &source, plan, blocks, &shape)?;
    }
    drop((_og, _lg, _lse_scratch));
    Ok((
        CudaStorage::wrap_cuda_slice(o, dev.clone()),
        lse.map(|l| CudaStorage::wrap_cuda_slice(l, dev.clone())),
    ))
}

/// An allocation error of the plan's kernel.
fn alloc_err(plan: &Plan, shape: launch::Shape, what: String) -> candle_core::Error {
    launch::err(
        &variants::symbol(plan.variant),
        shape,
        format!("allocating {what}"),
    )
}

/// The kernels load 16-byte vectors: op::run makes misaligned views contiguous first.
fn check_aligned(
    p: &Problem,
    plan: &Plan,
    q: &Layout,
    k: &Layout,
    v: &Layout,
    shape: launch::Shape,
) -> Result<()> {
    // elements per 16-byte vector of k / v
    let kv_vec = if p.kv_fp8 { 16 } else { 8 };
    for (name, l, m) in [("q", q, 8), ("k", k, kv_vec), ("v", v, kv_vec)] {
        let rank = l.dims().len();
        if !l.start_offset().is_multiple_of(m)
            || l.stride()[..rank - 1].iter().any(|s| !s.is_multiple_of(m))
        {
            return Err(launch::err(
                &variants::symbol(plan.variant),
                shape,
                format!("{name}: offset and strides must be multiples of {m} elements, got offset {} strides {:?}", l.start_offset(), l.stride()),
            ));
        }
    }
    Ok(())
}

/// F8E4M3 K/V: their scales, both per head or both per tensor (a `(1,)` one beside a
/// `(heads_kv,)` one is broadcast to it; the kernel takes one stride for both).
fn kv_scales(p: &Problem, extra: &Extra, shape: launch::Shape) -> Result<Option<(Tensor, Tensor)>> {
    match &extra.kv_scales {
        Some(s) if p.kv_fp8 => {
            let per_head = |t: &Tensor| -> Result<Tensor> {
                if t.dims() == [p.hkv] {
                    Ok(t.clone())
                } else {
                    t.broadcast_as(p.hkv)?.contiguous()
                }
            };
            Ok(Some(if s.k.dims() == s.v.dims() {
                (s.k.clone(), s.v.clone())
            } else {
                (per_head(&s.k)?, per_head(&s.v)?)
            }))
        }
        None if !p.kv_fp8 => Ok(None),
        _ => candle_core::bail!("flashcore: internal: F8E4M3 k/v without their scales [{shape}]"),
    }
}

/// The device addresses of the inputs: q, k, v, the FP8 scales, the score modifiers' tensors
/// and where the sequences live (prefix sums of packed q, and of packed k when the keys are rows;
/// keys in use per sequence; the page table).
#[allow(clippy::too_many_arguments)]
fn inputs<T: candle_core::cuda_backend::CudaDType>(
    p: &Problem,
    extra: &Extra,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    scales: Option<&(Tensor, Tensor)>,
    stream: &Stream,
    shape: launch::Shape,
) -> Result<Addrs> {
    let (kp, vp) = if p.kv_fp8 {
        (
            fp8_ptr(k.0, k.1, "k", stream)?,
            fp8_ptr(v.0, v.1, "v", stream)?,
        )
    } else {
        (ptr::<T>(k.0, k.1, stream)?.0, ptr::<T>(v.0, v.1, stream)?.0)
    };
    let (k_scales, v_scales, kv_scale_stride) = match scales {
        Some((ks, vs)) => (
            side_ptr::<f32>(ks, "kv_scales.k", stream)?,
            side_ptr::<f32>(vs, "kv_scales.v", stream)?,
            i32::from(ks.dims() != [1]),
        ),
        None => (0, 0, 0),
    };
    let f32_side = |t: &Option<Tensor>, name: &str| match t {
        None => Ok(0),
        Some(t) => side_ptr::<f32>(t, name, stream),
    };
    let side = |t: &Option<Tensor>, name: &str, want: bool| -> Result<u64> {
        match (t, want) {
            (_, false) => Ok(0),
            (Some(t), true) => side_ptr::<u32>(t, name, stream),
            (None, true) => candle_core::bail!("flashcore: internal: {name} missing [{shape}]"),
        }
    };
    let varlen_q = p.seqs != Seqs::Dense;
    Ok(Addrs {
        q: ptr::<T>(q.0, q.1, stream)?.0,
        k: kp,
        v: vp,
        o: 0,
        lse: 0,
        alibi_slopes: f32_side(&extra.alibi_slopes, "alibi_slopes")?,
        sinks: f32_side(&extra.sinks, "sinks")?,
        cu_q: side(&extra.cu_q, "cu_seqlens_q", varlen_q)?,
        cu_k: side(
            &extra.cu_k,
            "cu_seqlens_k",
            varlen_q && p.keys == Keys::Rows,
        )?,
        seqused_k: side(&extra.seqlens_k, "seqlens_k", p.keys != Keys::Rows)?,
        page_table: side(
            &extra.page_table,
            "page_table",
            matches!(p.keys, Keys::Paged { .. }),
        )?,
        k_scales,
        v_scales,
        kv_scale_stride,
    })
}

/// The parameter block of problem `p` at `a`, with the launch's splits, page walk, tile counter
/// and partials where `launch` is given (the block of the attention kernel; without it, the
/// caller's tables as the gather and the check read them).
fn fc_params(p: &Problem, a: &Addrs, launch: Option<&Launch>, x: Extras) -> FcParams {
    let (total_q, total_k) = p.totals();
    let varlen_q = p.seqs != Seqs::Dense;
    let (page_size, page_table_stride) = match p.keys {
        Keys::Paged {
            page_size,
            max_pages,
            ..
        } => (page_size as i32, max_pages as i32),
        _ => (0, 0),
    };
    let (wl, wr) = p.window();
    let [qb, qr, qh] = p.q_strides.map(|x| x as i64);
    let [kb, kr, kh] = p.k_strides.map(|x| x as i64);
    let [vb, vr, vh] = p.v_strides.map(|x| x as i64);
    // O (b, sq, hq, d) or (total_q, hq, d) contiguous; LSE (b, hq, sq) or (hq, total_q).
    let (o_batch_stride, lse_batch_stride, lse_head_stride) = if varlen_q {
        (0, 0, total_q as i64)
    } else {
        (
            (p.sq * p.hq * p.dv) as i64,
            (p.hq * p.sq) as i64,
            p.sq as i64,
        )
    };
    let (mut num_splits, mut page_shift, mut split_budget, mut combine_checks) = (1, 0, 0, 0);
    let mut lse_partial = 0;
    match launch {
        Some(Launch::Sm90 {
            splits,
            page_shift: s,
            ..
        }) => (num_splits, page_shift) = (*splits as i32, *s),
        Some(Launch::Decode {
            splits,
            split_budget: b,
            combine,
            ..
        }) => {
            (num_splits, split_budget) = (*splits as i32, *b);
            if let Some(c) = combine {
                combine_checks = i32::from(c.checks);
                if x.o_partial != 0 {
                    // the O partials (`splits * rows` rows of the kernel's head dim), then the LSE
                    lse_partial = x.o_partial + 4 * (c.partial_f32 - splits * c.rows) as u64;
                }
            }
        }
        _ => {}
    }
    FcParams {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.o,
        lse: a.lse,
        alibi_slopes: a.alibi_slopes,
        sinks: a.sinks,
        o_partial: x.o_partial,
        lse_partial,
        q_batch_stride: qb,
        q_row_stride: qr,
        q_head_stride: qh,
        k_batch_stride: kb,
        k_row_stride: kr,
        k_head_stride: kh,
        v_batch_stride: vb,
        v_row_stride: vr,
        v_head_stride: vh,
        o_batch_stride,
        o_row_stride: (p.hq * p.dv) as i64,
        o_head_stride: p.dv as i64,
        lse_batch_stride,
        lse_head_stride,
        cu_seqlens_q: a.cu_q,
        cu_seqlens_k: a.cu_k,
        seqused_k: a.seqused_k,
        page_table: a.page_table,
        page_table_stride,
        page_size,
        total_q: total_q as i32,
        total_k: total_k as i32,
        alibi_batch_stride: if p.alibi_per_batch { p.hq as i32 } else { 0 },
        page_shift,
        b: p.b as i32,
        hq: p.hq as i32,
        hkv: p.hkv as i32,
        sq: p.sq as i32,
        sk: p.sk as i32,
        d: p.d as i32,
        h_ratio: p.h_ratio() as i32,
        scale: p.scale,
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        softcap: p.softcap.unwrap_or(0.0),
        window_left: crate::plan::kernel_bound(wl, p.sk),
        window_right: crate::plan::kernel_bound(wr, p.sq),
        num_splits,
        combine_checks,
        split_budget,
        kv_scale_stride: a.kv_scale_stride,
        tile_counter: x.tile_counter,
        k_scales: a.k_scales,
        v_scales: a.v_scales,
        dv: p.dv as i32,
    }
}

/// Launches the plan's attention kernel(s) on the problem it runs, with the parameter block
/// built once here. Returns whether the kernels checked the tables themselves (the split-KV
/// combine: then no check kernel follows).
fn launch_kernels(dev: &CudaDevice, plan: &Plan, a: &Addrs, shape: launch::Shape) -> Result<bool> {
    let stream = dev.cuda_stream();
    let p = &plan.runs;
    let v = plan.variant;
    let symbol = variants::symbol(v);
    match plan.launch {
        Launch::Sm90 { grid, dynamic, .. } => {
            let counter = if dynamic {
                tile_counter(&stream).map_err(|e| {
                    launch::err(&symbol, shape, format!("allocating the tile counter: {e}"))
                })?
            } else {
                0
            };
            let x = Extras {
                tile_counter: counter,
                ..Extras::default()
            };
            let prm = fc_params(p, a, Some(&plan.launch), x);
            let f = launch::function(&stream, v.family, &symbol, grid.smem, shape)?;
            sm90_fwd(&stream, plan, &prm, &f, &symbol, shape)?;
            Ok(false)
        }
        Launch::Sm80 { smem, .. } => {
            let prm = fc_params(p, a, Some(&plan.launch), Extras::default());
            let f = launch::function(&stream, v.family, &symbol, smem, shape)?;
            sm80_fwd(&stream, plan, prm, &f, &symbol, shape)?;
            Ok(false)
        }
        Launch::Decode { grid, combine, .. } => {
            let f = launch::function(&stream, v.family, &symbol, grid.smem, shape)?;
            match combine {
                None => {
                    let prm = fc_params(p, a, Some(&plan.launch), Extras::default());
                    let ex = Ex::clusters(grid.cluster);
                    launch::launch_params(&stream, &f, config(&grid), &prm, ex, &symbol, shape)?;
                    Ok(false)
                }
                Some(c) => decode_split(&stream, plan, a, &f, c, &symbol, shape),
            }
        }
    }
}

fn config(g: &Grid) -> LaunchConfig {
    LaunchConfig {
        grid_dim: g.grid,
        block_dim: (g.block, 1, 1),
        shared_mem_bytes: g.smem,
    }
}

/// The sm90 forward: one launch with the tensor maps of q, k, v and o (in clusters of the key
/// splits for the key-split twins); the d512 kernels one per slice of v and o (`v_slices`), each
/// with `prm`'s v and o moved to its first column and its width as `dv`.
fn sm90_fwd(
    stream: &Stream,
    plan: &Plan,
    prm: &FcParams,
    f: &CudaFunction,
    symbol: &str,
    shape: launch::Shape,
) -> Result<()> {
    let Launch::Sm90 {
        grid,
        box_k,
        v_slices,
        ..
    } = plan.launch
    else {
        unreachable!("sm90_fwd runs sm90 plans")
    };
    let (p, v) = (&plan.runs, plan.variant);
    let (total_q, total_k) = p.totals();
    // (batch, row, head) strides in elements. Packed operands are one batch entry of `total`
    // rows (the kernel's batch coordinate is 0 for them).
    // `d`: the operand's head dim (q, k: d_qk; v, o: d_v)
    let enc = |base: u64, d, (seq, batch): (usize, usize), heads, strides, box_rows, name: &str| {
        let op = tma::Operand {
            base,
            d,
            seq,
            heads,
            batch,
            strides,
            box_rows,
        };
        tma::encode(v.dtype, &op, name).map_err(|e| launch::err(symbol, shape, e))
    };
    // (rows, batch entries) of each map: packed operands are one batch entry of `total` rows; a
    // paged pool is `num_pages` entries of `page_size` rows.
    let varlen_q = p.seqs != Seqs::Dense;
    let dims_q = if varlen_q { (total_q, 1) } else { (p.sq, p.b) };
    let dims_k = match p.keys {
        Keys::Paged {
            page_size,
            num_pages,
            ..
        } => (page_size, num_pages),
        _ if varlen_q && p.keys == Keys::Rows => (total_k, 1),
        _ => (p.sk, p.b),
    };
    let tm_q = enc(prm.q, p.d, dims_q, p.hq, p.q_strides, v.block_m, "q")?;
    let pool = |base: u64, strides: [usize; 3], name: &str| {
        let (page_size, num_pages) = dims_k;
        let pool = tma::Pool {
            base,
            d: p.d,
            page_size,
            heads: p.hkv,
            num_pages,
            strides,
            box_rows: box_k,
        };
        tma::encode_pool(v.dtype, &pool, name).map_err(|e| launch::err(symbol, shape, e))
    };
    let tm_k = if v.paged {
        pool(prm.k, p.k_strides, "k_pages")?
    } else {
        enc(prm.k, p.d, dims_k, p.hkv, p.k_strides, box_k, "k")?
    };
    let o_strides = [prm.o_batch_stride, prm.o_row_stride, prm.o_head_stride].map(|x| x as usize);
    let width = if v_slices > 1 {
        v.v_width as usize
    } else {
        p.dv
    };
    for slice in 0..v_slices as usize {
        let (first, dv) = (slice * width, width.min(p.dv - slice * width));
        let at = |base: u64| base + 2 * first as u64;
        let prm_s = FcParams {
            v: at(prm.v),
            o: at(prm.o),
            dv: dv as i32,
            ..*prm
        };
        let tm_v = if v.paged {
            pool(prm_s.v, p.v_strides, "v_pages")?
        } else {
            enc(prm_s.v, dv, dims_k, p.hkv, p.v_strides, box_k, "v")?
        };
        // O (written by the op, strides as in `prm`): each consumer warpgroup stores 64 rows
        // (varlen: 16-byte stores instead; the map is still encoded, unused).
        let tm_o = enc(prm_s.o, dv, dims_q, p.hq, o_strides, 64, "o")?;
        let arg = |x: &tma::TensorMap| x as *const tma::TensorMap as *mut std::ffi::c_void;
        let mut args = [
            &prm_s as *const FcParams as *mut std::ffi::c_void,
            arg(&tm_q),
            arg(&tm_k),
            arg(&tm_v),
            arg(&tm_o),
        ];
        let ex = Ex::clusters(grid.cluster);
        // SAFETY: signature (FcParams, CUtensorMap x4) as in kernels/sm90/fwd.cuh, each argument
        // alive for the call; the maps describe the live q/k/v/o buffers (v and o from the
        // slice's first column, `dv` columns of them) whose pointers are in `prm_s`.
        unsafe { launch::launch(stream, f, config(&grid), &mut args, ex, symbol, shape)? }
    }
    Ok(())
}

/// The sm80 forward ([`Launch::Sm80`]): the kernels walk the query blocks heaviest first. Grids
/// past the y / z limit fold into several launches over slices of the batch and, without a
/// mask, of the heads (whole K/V head groups): each slice's block is `prm` with its pointers
/// moved to the slice.
fn sm80_fwd(
    stream: &Stream,
    plan: &Plan,
    prm: FcParams,
    f: &CudaFunction,
    symbol: &str,
    shape: launch::Shape,
) -> Result<()> {
    let Launch::Sm80 {
        block,
        smem,
        m_blocks,
        masked,
        head_chunk,
    } = plan.launch
    else {
        unreachable!("sm80_fwd runs sm80 plans")
    };
    let p = &plan.runs;
    let ratio = p.h_ratio();
    let esz = 2u64;
    for b0 in (0..p.b).step_by(GRID_YZ) {
        let nb = (p.b - b0).min(GRID_YZ);
        for h0 in (0..p.hq).step_by(head_chunk) {
            let nh = (p.hq - h0).min(head_chunk);
            let mut c = prm;
            let (b0i, h0i) = (b0 as i64, h0 as i64);
            let hk0 = (h0 / ratio) as i64;
            c.b = nb as i32;
            c.hq = nh as i32;
            c.hkv = (nh / ratio) as i32;
            c.q = prm.q + esz * (b0i * prm.q_batch_stride + h0i * prm.q_head_stride) as u64;
            c.k = prm.k + esz * (b0i * prm.k_batch_stride + hk0 * prm.k_head_stride) as u64;
            c.v = prm.v + esz * (b0i * prm.v_batch_stride + hk0 * prm.v_head_stride) as u64;
            c.o = prm.o + esz * (b0i * prm.o_batch_stride + h0i * prm.o_head_stride) as u64;
            c.lse = prm.lse + 4 * (b0i * prm.lse_batch_stride + h0i * prm.lse_head_stride) as u64;
            if prm.alibi_slopes != 0 {
                c.alibi_slopes =
                    prm.alibi_slopes + 4 * (b0i * prm.alibi_batch_stride as i64 + h0i) as u64;
            }
            if prm.sinks != 0 {
                c.sinks = prm.sinks + 4 * h0 as u64;
            }
            // the batch slice's entries of the per-sequence tables (0 = absent stays 0)
            let at = |ptr: u64| if ptr == 0 { 0 } else { ptr + 4 * b0 as u64 };
            c.cu_seqlens_q = at(prm.cu_seqlens_q);
            c.cu_seqlens_k = at(prm.cu_seqlens_k);
            c.seqused_k = at(prm.seqused_k);
            let (gx, gy) = if masked {
                (nh, m_blocks)
            } else {
                (m_blocks, nh)
            };
            let cfg = LaunchConfig {
                grid_dim: (gx as u32, gy as u32, nb as u32),
                block_dim: (block, 1, 1),
                shared_mem_bytes: smem,
            };
            launch::launch_params(stream, f, cfg, &c, Ex::NONE, symbol, shape)?;
        }
    }
    Ok(())
}

/// A split-KV decode of several splits: the split grid writes f32 partials that the combine
/// merges by their LSE. Returns whether the combine checked the tables.
fn decode_split(
    stream: &Stream,
    plan: &Plan,
    a: &Addrs,
    f: &CudaFunction,
    c: Combine,
    symbol: &str,
    shape: launch::Shape,
) -> Result<bool> {
    let Launch::Decode { grid, splits, .. } = plan.launch else {
        unreachable!("decode_split runs decode plans")
    };
    let v = plan.variant;
    let csym = variants::combine_symbol_of(v);
    let cf = launch::function(stream, v.family, &csym, 0, shape)?;
    let ccfg = LaunchConfig {
        grid_dim: (c.rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let cshape =
        super::Fmt(|fm: &mut std::fmt::Formatter<'_>| write!(fm, "{shape} splits={splits}"));
    // The partials live in the stream's scratch, which another host thread's call on the same
    // stream would overwrite: the scratch stays locked until both grids are enqueued, so no
    // other call's launches come between this split grid and its combine.
    with_scratch(stream, |scratch| {
        let n = c.partial_f32;
        let (opp, _keep) = grown(&mut scratch.part, stream, n).map_err(|e| {
            launch::err(
                symbol,
                shape,
                format!("allocating {n} f32 of split-KV scratch: {e}"),
            )
        })?;
        if poison_on() {
            launch::fill(stream, opp, n, 4, 0x7FC0_0000)?;
        }
        let x = Extras {
            o_partial: opp,
            ..Extras::default()
        };
        let prm = fc_params(&plan.runs, a, Some(&plan.launch), x);
        launch::launch_params(stream, f, config(&grid), &prm, Ex::NONE, symbol, shape)?;
        // A programmatic dependent where the sm_90 SASS waits (`Plan::pdl`): scheduled while
        // the split grid drains.
        launch::launch_params(stream, &cf, ccfg, &prm, Ex::pdl(plan.pdl), &csym, &cshape)
    })?;
    Ok(c.checks)
}

/// After a packed or paged batch's kernels: `fc_check_seqlens` (kernels/common/seqlens.cuh)
/// turns the whole O and LSE into NaN when the tables lie (checked on the device: no host sync).
/// `prm`: the caller's tables (page table included), O and LSE.
fn check_seqlens(
    stream: &Stream,
    prm: &FcParams,
    plan: &Plan,
    blocks: u32,
    shape: launch::Shape,
) -> Result<()> {
    let sym = "fc_check_seqlens";
    let f = launch::function(stream, "sm80", sym, 0, shape)?;
    // one block per sequence checks its pages (block 0 also the prefix sums)
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (no, nl) = (plan.out_elems as u64, plan.lse_elems as u64);
    let mut args = [
        prm as *const FcParams as *mut std::ffi::c_void,
        &no as *const u64 as *mut std::ffi::c_void,
        &nl as *const u64 as *mut std::ffi::c_void,
    ];
    // On 9.x the check reads the tables while the attention kernel drains and waits for it
    // (griddepcontrol.wait) only before filling NaN: its launch leaves the critical path.
    // SAFETY: signature (FcParams, u64, u64), each argument alive for the call; the pointers in
    // `prm` are the live O, LSE and table buffers of this call, O holding `no` 16-bit and LSE
    // `nl` f32 elements.
    unsafe { launch::launch(stream, &f, cfg, &mut args, Ex::pdl(plan.pdl), sym, shape) }
}

/// Dense K and V scratch a paged cache is gathered into.
type Scratch<T> = (CudaSlice<T>, CudaSlice<T>);

/// Gathers the caller's paged K/V (`prm`: the pools, page table and lengths) into dense
/// `(b, sk, hkv, d)` scratch (`fc_gather_paged`, kernels/common/paged.cuh; rows past a
/// sequence's length zero), the K/V of the problem the plan runs: the scratch and its two
/// addresses.
fn gather_paged<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    plan: &Plan,
    prm: &FcParams,
    shape: launch::Shape,
) -> Result<(Scratch<T>, u64, u64)> {
    let sym = "fc_gather_paged";
    let Some(g) = plan.gather else {
        unreachable!("gather_paged runs plans that gather")
    };
    let stream = dev.cuda_stream();
    let n = |d: usize| g.rows * plan.runs.hkv * d;
    let dk: CudaSlice<T> = alloc_out(dev, n(plan.runs.d), shape)?;
    let dv: CudaSlice<T> = alloc_out(dev, n(plan.runs.dv), shape)?;
    let (dkp, _gk) = dk.device_ptr(&stream);
    let (dvp, _gv) = dv.device_ptr(&stream);
    let f = launch::function(&stream, "sm80", sym, 0, shape)?;
    let cfg = LaunchConfig {
        grid_dim: (g.blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = [
        prm as *const FcParams as *mut std::ffi::c_void,
        &dkp as *const u64 as *mut std::ffi::c_void,
        &dvp as *const u64 as *mut std::ffi::c_void,
    ];
    // SAFETY: signature (FcParams, uint4*, uint4*), each argument alive for the call; `prm`
    // describes the live pools, page table and lengths, dk / dv hold b * sk * hkv * d and
    // b * sk * hkv * dv elements of 16 bits.
    unsafe { launch::launch(&stream, &f, cfg, &mut args, Ex::NONE, sym, shape) }?;
    drop((_gk, _gv));
    Ok(((dk, dv), dkp, dvp))
}
