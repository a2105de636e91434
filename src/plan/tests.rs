//! The planner against the dispatcher it replaced (a table of that dispatcher's decisions over a
//! fixed sweep), and rules of its own on made-up devices.

use super::*;
use crate::params::{Keys, Problem};

include!("sweep.rs");

fn device(row: &DeviceRow) -> Device {
    let &(_, major, minor, sm_count, smem_per_block, smem_per_sm, reserved, dram) = row;
    Device {
        major,
        minor,
        sm_count,
        smem_per_block,
        smem_per_sm,
        smem_reserved_per_block: reserved,
        dram_bytes_per_s: dram,
    }
}

/// A decision as the table states it (the format its generator wrote).
fn decision(p: &Problem, dev: &Device, opts: &Options) -> String {
    let plan = match plan(p, dev, opts) {
        Ok(plan) => plan,
        Err(e) => {
            // the gather's error comes after the kernel chosen for the paged problem
            let e = e.to_string();
            let e = match e.find(" [b=") {
                Some(i) => {
                    let j = e[i..].find(']').map_or(e.len(), |j| i + j + 1);
                    format!("{}{}", &e[..i], &e[j..])
                }
                None => e,
            };
            return match choose(p, dev, opts) {
                Ok(v) if matches!(p.keys, Keys::Paged { .. }) && v.kind != KKind::Decode => {
                    let g = gathered(p);
                    let blocks = g
                        .map(|g| {
                            (g.b * g.sk * g.hkv * g.d / 8)
                                .div_ceil(256)
                                .clamp(1, dev.sm_count.max(1) * 16)
                        })
                        .unwrap_or(0);
                    format!("{} gather[{blocks}] error {e}", v.symbol())
                }
                _ => format!("error {e}"),
            };
        }
    };
    let mut s = match plan.gather {
        Some(g) => format!(
            "{} gather[{}] -> {}",
            g.before.symbol(),
            g.blocks,
            plan.variant.symbol()
        ),
        None => plan.variant.symbol(),
    };
    let v = plan.variant;
    match plan.launch {
        Launch::Sm90 {
            grid,
            splits,
            dynamic,
            box_k,
            page_shift,
            v_slices,
        } => {
            if v_slices > 1 {
                s += &format!(" vslices{v_slices}");
            }
            s += &format!(
                " sm90 grid{:?} block{} smem{} cluster{} splits{splits} dyn{dynamic} box{box_k} shift{page_shift}",
                grid.grid, grid.block, grid.smem, grid.cluster
            );
        }
        Launch::Sm80 {
            block,
            smem,
            m_blocks,
            masked,
            head_chunk,
        } => {
            let r = &plan.runs;
            let nb = r.b.min(GRID_YZ);
            let nh = r.hq.min(head_chunk);
            let (gx, gy) = if masked {
                (nh, m_blocks)
            } else {
                (m_blocks, nh)
            };
            let launches = r.b.div_ceil(GRID_YZ) * r.hq.div_ceil(head_chunk);
            s +=
                &format!(" sm80 grid({gx}, {gy}, {nb}) block{block} smem{smem} launches{launches}");
        }
        Launch::Decode {
            grid,
            splits,
            even,
            split_budget,
            combine,
            ..
        } => {
            s += &format!(
                " decode grid{} block{} smem{} cluster{} splits{splits} even{even} budget{split_budget}",
                grid.grid.0, grid.block, grid.smem, grid.cluster
            );
            if let Some(c) = combine {
                s += &format!(
                    " combine[{}] {} checks{} part{} pdl{}",
                    c.rows,
                    variants::combine_symbol(v.family, v.dtype, v.head_dim),
                    c.checks,
                    c.partial_f32,
                    plan.pdl
                );
            }
        }
    }
    if let Some(blocks) = plan.check {
        s += &format!(" check[{blocks}] pdl{}", plan.pdl);
    }
    s
}

/// Compares the planner's decisions under `opts` with the lines of `table` tagged `tag` (empty:
/// untagged) for `sweep_problems(n)` on the sweep's devices.
fn compare(table: &str, tag: &str, n: usize, opts: &Options) {
    let probs = sweep_problems(n);
    let mut want = table
        .lines()
        .filter(|l| !l.starts_with("# "))
        .filter_map(|l| match tag {
            "" => Some(l),
            t => l.strip_prefix(t).and_then(|l| l.strip_prefix(' ')),
        });
    let mut bad = Vec::new();
    let mut count = 0;
    for (i, (label, p)) in probs.iter().enumerate() {
        let mut prev = String::new();
        for row in SWEEP_DEVICES {
            let got = decision(p, &device(row), opts);
            let line = want
                .next()
                .expect("the table has a line per problem and device");
            let head = format!("#{i} {} ", row.0);
            assert!(
                line.starts_with(&head),
                "table line {line:?}, expected {head:?}"
            );
            let old = match &line[head.len()..] {
                "=" => prev.clone(),
                rest => rest.strip_prefix("=> ").expect("`=> ` or `=`").to_string(),
            };
            if got != old {
                bad.push(format!(
                    "#{i} {} {label}\n  table:   {old}\n  planner: {got}",
                    row.0
                ));
            }
            prev = old;
            count += 1;
        }
    }
    assert!(want.next().is_none(), "the table has more lines");
    assert_eq!(count, n * SWEEP_DEVICES.len());
    assert!(
        bad.is_empty(),
        "{tag}: {} of {count} decisions differ:\n{}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n")
    );
}

/// Every decision of the table: the same kernel, gather, grid, block, shared memory, clusters,
/// splits, schedule, paged boxes, combine and check (or the same error) as the dispatcher the
/// planner replaced, for 1000 problems on six devices.
#[test]
fn decisions_match_the_table() {
    compare(include_str!("decisions.txt"), "", 1000, &Options::default());
}

/// The same with the A/B knobs set, as the table's two settings state them.
#[test]
fn decisions_with_knobs_match_the_table() {
    let table = include_str!("decisions-knobs.txt");
    let skip = [
        "d64_causal_128x128".to_string(),
        "d128_nomask_128x128".to_string(),
    ];
    let a = Options {
        skip_variants: &skip,
        paged_gather: true,
        sm90_causal_static: true,
        sm90_kv_splits: Some(4),
        decode_even: true,
        decode_full_occupancy: true,
        decode_cluster_off: true,
        ..Options::default()
    };
    compare(table, "a", 400, &a);
    let b = Options {
        arch: Some(Arch::Sm80),
        smem_limit: Some(101376),
        sm90_kv_splits: Some(1),
        ..Options::default()
    };
    compare(table, "b", 400, &b);
}

const H100: Device = Device {
    major: 9,
    minor: 0,
    sm_count: 132,
    smem_per_block: 232448,
    smem_per_sm: 233472,
    smem_reserved_per_block: 1024,
    dram_bytes_per_s: 3.35e12,
};

const SM86: Device = Device {
    major: 8,
    minor: 6,
    sm_count: 82,
    smem_per_block: 101376,
    smem_per_sm: 102400,
    smem_reserved_per_block: 1024,
    dram_bytes_per_s: 0.936e12,
};

/// A dense bf16 problem with contiguous `(b, s, h, d)` operands.
fn dense(
    b: usize,
    sq: usize,
    sk: usize,
    (hq, hkv): (usize, usize),
    d: usize,
    mask: Mask,
) -> Problem {
    Problem {
        b,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv: d,
        dtype: candle_core::DType::BF16,
        scale: 1.0 / (d as f32).sqrt(),
        scale_f64: 1.0 / (d as f64).sqrt(),
        mask: crate::params::normalise_mask(mask, sq, sk),
        chunk: None,
        softcap: None,
        alibi: false,
        alibi_per_batch: false,
        seqs: Seqs::Dense,
        keys: Keys::Rows,
        q_strides: [sq * hq * d, hq * d, d],
        k_strides: [sk * hkv * d, hkv * d, d],
        v_strides: [sk * hkv * d, hkv * d, d],
        kv_fp8: false,
    }
}

/// The same problem over a paged pool of `page_size`-row pages (whole pages, a page per
/// sequence's `sk / page_size` slots).
fn paged(p: Problem, page_size: usize) -> Problem {
    let max_pages = p.sk.div_ceil(page_size);
    let page = page_size * p.hkv * p.d;
    Problem {
        sk: max_pages * page_size,
        keys: Keys::Paged {
            page_size,
            num_pages: p.b * max_pages,
            max_pages,
        },
        k_strides: [page, p.hkv * p.d, p.d],
        v_strides: [page, p.hkv * p.d, p.d],
        ..p
    }
}

fn planned(p: &Problem, dev: &Device) -> Plan {
    plan(p, dev, &Options::default()).unwrap_or_else(|e| panic!("{}: {e}", shape_str(p)))
}

/// A sliding window with a right bound runs the sm90 window kernels on sm_90 at every length, on
/// the dynamic schedule (a windowed query tile walks a few key tiles: one CTA per tile would
/// spend its time starting up); the static schedule knob sends it to the sm80 family.
#[test]
fn windows_take_the_sm90_window_kernels_at_every_length() {
    let window = Mask::Window {
        left: Some(512),
        right: Some(0),
    };
    let short = planned(&dense(1, 4096, 4096, (8, 8), 128, window), &H100);
    assert_eq!(
        (short.variant.family, short.variant.mask),
        ("sm90", KMask::Local),
        "{}",
        short.variant.symbol()
    );
    let bm = short.variant.block_m as usize;
    assert!(4096usize.div_ceil(bm) <= 32);
    let long_sq = 33 * bm;
    let long = planned(&dense(1, long_sq, long_sq, (8, 8), 128, window), &H100);
    assert_eq!(
        (long.variant.family, long.variant.mask),
        ("sm90", KMask::Local),
        "{}",
        long.variant.symbol()
    );
    assert!(
        matches!(long.launch, Launch::Sm90 { dynamic: true, .. }),
        "{:?}",
        long.launch
    );
    // the static schedule turns the sm90 window kernels off at any length
    let static_ = Options {
        sm90_causal_static: true,
        ..Options::default()
    };
    let p = dense(1, 4096, 4096, (8, 8), 128, window);
    assert_eq!(plan(&p, &H100, &static_).unwrap().variant.family, "sm80");
}

/// A decode's key-range splits grow as the sequences (and so the grid's working CTAs) get
/// fewer, and a grid that fills the SMs by itself takes one split (then the clusters of two).
#[test]
fn decode_splits_grow_with_fewer_sequences() {
    let splits =
        |b: usize| match planned(&dense(b, 1, 32768, (32, 8), 128, Mask::None), &H100).launch {
            Launch::Decode {
                splits,
                grid,
                combine,
                ..
            } => (splits, grid.cluster, combine.is_some()),
            l => panic!("b{b}: not a decode: {l:?}"),
        };
    let got: Vec<_> = [1, 2, 4, 8, 16, 64].map(splits).to_vec();
    for w in got.windows(2) {
        assert!(w[0].0 >= w[1].0, "splits by batch 1..64: {got:?}");
    }
    assert!(got[0].0 > got[3].0 && got[3].0 > 1, "{got:?}");
    assert_eq!(got[5], (1, 2, false), "b64 fills the SMs: {got:?}");
    assert!(got[0].2, "several splits are combined: {got:?}");
}

/// A device of 99 KB per block never gets a kernel or a launch needing more, whatever the
/// problem; a big one planned as one (`smem_limit`) gets the same kernels, and only the decode's
/// occupancy cap on sm_90 pads a launch's shared memory past the limit (up to the device's own:
/// `decode_capped_smem`).
#[test]
fn a_99_kb_device_never_gets_more() {
    let limit = Options {
        smem_limit: Some(101376),
        ..Options::default()
    };
    let mut n = 0;
    for (_, p) in sweep_problems(400) {
        for (dev, opts) in [(&SM86, &Options::default()), (&H100, &limit)] {
            let Ok(plan) = plan(&p, dev, opts) else {
                continue;
            };
            let smem = match plan.launch {
                Launch::Sm90 { grid, .. } | Launch::Decode { grid, .. } => grid.smem,
                Launch::Sm80 { smem, .. } => smem,
            };
            let padded = matches!(
                plan.launch,
                Launch::Decode {
                    capped: Some(_),
                    ..
                }
            );
            assert!(
                plan.variant.smem_bytes() <= 101376
                    && (smem <= 101376 || (padded && dev.major == 9)),
                "{} on {}: {} B",
                plan.variant.symbol(),
                shape_str(&p),
                smem
            );
            if let Some(g) = plan.gather {
                assert!(g.before.smem_bytes() <= 101376, "{}", g.before.symbol());
            }
            n += 1;
        }
    }
    assert!(n > 400, "{n} plans");
}

/// Paged prefill: the sm80 family gathers the pages first (then runs on the gathered rows with
/// the keys in use); the sm90 kernels read pages of 64 through the page table (boxes of 64 rows,
/// a page shift of 6) unless the gather is forced; a paged batch is checked by one block per
/// sequence.
#[test]
fn paged_prefill_gathers_only_where_the_kernel_cannot_read_pages() {
    let p = paged(dense(2, 512, 4096, (32, 8), 128, Mask::Causal), 64);
    let a = planned(&p, &SM86);
    let g = a.gather.expect("sm80 gathers");
    assert_eq!(g.rows, 2 * 4096);
    assert_eq!(a.runs.keys, Keys::Used);
    assert_eq!(a.check, Some(2));
    let h = planned(&p, &H100);
    assert!(h.gather.is_none(), "{}", h.variant.symbol());
    match h.launch {
        Launch::Sm90 {
            box_k, page_shift, ..
        } => assert_eq!((box_k, page_shift), (64, 6), "{}", h.variant.symbol()),
        l => panic!("{l:?}"),
    }
    let forced = Options {
        paged_gather: true,
        ..Options::default()
    };
    let f = plan(&p, &H100, &forced).unwrap();
    assert!(f.gather.is_some() && f.runs.keys == Keys::Used);
    assert!(matches!(f.launch, Launch::Sm90 { page_shift: 0, .. }));
}

/// Causal sm90 d128: the dynamic schedule (persistent grid of at most one CTA per SM) up to 32
/// query tiles, one CTA per tile beyond; the key-split twins on grids that leave most SMs idle.
#[test]
fn sm90_schedules() {
    let grid =
        |b: usize, sq: usize| match planned(&dense(b, sq, sq, (32, 8), 128, Mask::Causal), &H100)
            .launch
        {
            Launch::Sm90 {
                grid,
                dynamic,
                splits,
                ..
            } => (grid.grid, dynamic, splits),
            l => panic!("{l:?}"),
        };
    assert_eq!(grid(4, 2048), ((132, 1, 1), true, 1));
    assert_eq!(grid(4, 8192), ((64, 32, 4), false, 1));
    // 1 x 2 heads x 4096 rows of d64: 32 x 2 = 64 tiles of 128 rows, two CTAs each fit the 132
    // SMs: clusters of two
    let p = dense(1, 4096, 4096, (2, 2), 64, Mask::Causal);
    let kvs = planned(&p, &H100);
    assert!(kvs.variant.kv_split, "{}", kvs.variant.symbol());
    assert!(matches!(
        kvs.launch,
        Launch::Sm90 {
            splits: 2,
            grid: Grid {
                grid: (128, 1, 1),
                cluster: 2,
                ..
            },
            ..
        }
    ));
}

/// d_v != d_qk runs unpadded wherever K/V are in q's dtype: DeepSeek's (192, 128) on sm_90 takes
/// the separate-V kernel, on an sm80 device the d256 kernel; a gathered pool keeps V at d_v
/// (strides of 128-column rows); the d512 kernels launch once per 256 V columns.
#[test]
fn head_dims_apart_and_v_slices() {
    let with_dv = |p: Problem, dv: usize| Problem {
        dv,
        v_strides: [p.sk * p.hkv * dv, p.hkv * dv, dv],
        ..p
    };
    let p = with_dv(dense(2, 1024, 1024, (16, 16), 192, Mask::Causal), 128);
    let h = plan_head_dims(&p, &H100, &Options::default()).unwrap();
    assert!(takes_head_dims_apart(&h));
    assert!(
        h.variant.symbol().ends_with("_v128"),
        "{}",
        h.variant.symbol()
    );
    assert_eq!((h.runs.d, h.runs.dv), (192, 128));
    let a = plan_head_dims(&p, &SM86, &Options::default()).unwrap();
    assert!(takes_head_dims_apart(&a));
    assert_eq!((a.variant.head_dim, a.runs.dv), (256, 128));
    // paged pools of 16 rows on sm80: gathered at two widths
    let pool = paged(dense(2, 300, 4096, (16, 16), 192, Mask::Causal), 16);
    let pool = Problem {
        dv: 128,
        v_strides: [16 * 16 * 128, 16 * 128, 128],
        ..pool
    };
    let g = plan_head_dims(&pool, &SM86, &Options::default()).unwrap();
    assert!(g.gather.is_some() && takes_head_dims_apart(&g));
    assert_eq!(g.runs.k_strides, [4096 * 16 * 192, 16 * 192, 192]);
    assert_eq!(g.runs.v_strides, [4096 * 16 * 128, 16 * 128, 128]);
    // d512: two launches over V; (512, 256) one
    for (dv, slices) in [(512, 2), (256, 1)] {
        let p = with_dv(dense(1, 8192, 8192, (32, 4), 512, Mask::Causal), dv);
        let h = plan_head_dims(&p, &H100, &Options::default()).unwrap();
        match h.launch {
            Launch::Sm90 { v_slices, .. } => assert_eq!(v_slices, slices),
            l => panic!("{l:?}"),
        }
        assert!(plan_head_dims(&p, &SM86, &Options::default()).is_err());
    }
}
