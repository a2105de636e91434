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
        } => {
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
                    "{} {label}\n  table:   {old}\n  planner: {got}",
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
