// A fixed sweep of problems and device descriptions for the planner's decision table
// (src/plan/decisions.txt). The same file generated that table from the dispatcher the planner
// replaced, so the two agree problem for problem. Deterministic: a small linear congruential
// generator picks the combinations.

/// (name, major, minor, SMs, opt-in smem per block, smem per SM, reserved per block, DRAM B/s)
pub(crate) type DeviceRow = (&'static str, i32, i32, usize, u32, u32, u32, f64);

pub(crate) const SWEEP_DEVICES: &[DeviceRow] = &[
    ("h100", 9, 0, 132, 232448, 233472, 1024, 3.35e12),
    ("h200", 9, 0, 132, 232448, 233472, 1024, 4.8e12),
    ("a100", 8, 0, 108, 166912, 167936, 1024, 1.555e12),
    ("sm86", 8, 6, 82, 101376, 102400, 1024, 0.936e12),
    ("l4", 8, 9, 58, 101376, 102400, 1024, 0.3e12),
    ("b200", 10, 0, 148, 232448, 233472, 1024, 8.0e12),
];

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next() as usize) % xs.len()]
    }
}

/// `n` problems: a label and the validated problem as the dispatcher receives it.
pub(crate) fn sweep_problems(n: usize) -> Vec<(String, crate::params::Problem)> {
    use crate::params::{normalise_mask, Keys, Mask, Problem, Seqs};
    use candle_core::DType;
    let mut r = Lcg(0x5eed_1234);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let dtype = r.pick(&[DType::BF16, DType::F16]);
        let d = r.pick(&[32usize, 64, 64, 80, 96, 128, 128, 128, 160, 192, 256, 256]);
        let (hq, hkv) = r.pick(&[
            (32usize, 8usize),
            (8, 8),
            (16, 4),
            (4, 4),
            (32, 32),
            (64, 8),
            (2, 1),
            (1, 1),
        ]);
        let b = r.pick(&[1usize, 1, 2, 4, 8, 16, 24, 48, 64, 128]);
        let sq = r.pick(&[
            1usize, 1, 2, 4, 8, 16, 17, 32, 33, 64, 100, 128, 256, 500, 512, 1000, 1024, 1025,
            1500, 2048, 2049, 4096, 8192, 16384,
        ]);
        let sk = match r.pick(&[0u8, 1, 2, 3, 4]) {
            0 => sq,
            1 => sq.max(r.pick(&[512usize, 1024, 4096, 8192])),
            2 => r.pick(&[4096usize, 8192, 16384, 32768]),
            3 => sq + r.pick(&[0usize, 64, 300, 2048]),
            _ => r.pick(&[100usize, 256, 1000, 2048]),
        };
        let mask = match r.pick(&[0u8, 1, 1, 2, 3, 4]) {
            0 => Mask::None,
            1 => Mask::Causal,
            2 => Mask::Window {
                left: Some(r.pick(&[16usize, 128, 256, 1024, 4096])),
                right: Some(0),
            },
            3 => Mask::Window {
                left: Some(r.pick(&[64usize, 512, 2048])),
                right: Some(r.pick(&[0usize, 64, 512])),
            },
            _ => Mask::Window {
                left: Some(r.pick(&[128usize, 1024])),
                right: None,
            },
        };
        let mask = normalise_mask(mask, sq, sk);
        let softcap = if r.next().is_multiple_of(7) { Some(30.0) } else { None };
        let alibi = r.next().is_multiple_of(9);
        let alibi_per_batch = alibi && r.next().is_multiple_of(2);
        let scale = if r.next().is_multiple_of(41) {
            2048.0
        } else {
            1.0 / (d as f32).sqrt()
        };
        let kv_fp8 = r.next().is_multiple_of(13);
        let row_q = hq * d;
        let row_k = hkv * d;
        let mut p = Problem {
            b,
            sq,
            sk,
            hq,
            hkv,
            d,
            dv: d,
            dtype,
            scale,
            scale_f64: scale as f64,
            mask,
            chunk: None,
            softcap,
            alibi,
            alibi_per_batch,
            seqs: Seqs::Dense,
            keys: Keys::Rows,
            q_strides: [sq * row_q, row_q, d],
            k_strides: [sk * row_k, row_k, d],
            v_strides: [sk * row_k, row_k, d],
            kv_fp8,
        };
        let layout = r.pick(&[0u8, 0, 0, 1, 2, 3, 3]);
        let kind = match layout {
            1 => {
                let (tq, tk) = (b * sq - b / 2, b * sk - b / 3);
                p.seqs = Seqs::Varlen {
                    total_q: tq,
                    total_k: tk,
                };
                p.q_strides = [0, row_q, d];
                p.k_strides = [0, row_k, d];
                p.v_strides = [0, row_k, d];
                "varlen"
            }
            2 => {
                p.keys = Keys::Used;
                "used"
            }
            3 => {
                let page_size = r.pick(&[1usize, 8, 16, 32, 64, 128, 256, 48]);
                let max_pages = sk.div_ceil(page_size);
                let num_pages = b * max_pages + 3;
                p.sk = max_pages * page_size;
                let whole = !r.next().is_multiple_of(5);
                let page = if whole {
                    page_size * row_k
                } else {
                    page_size * row_k + 8
                };
                p.keys = Keys::Paged {
                    page_size,
                    num_pages,
                    max_pages,
                };
                p.k_strides = [page, row_k, d];
                p.v_strides = [page, row_k, d];
                if r.next().is_multiple_of(3) {
                    p.seqs = Seqs::Varlen {
                        total_q: b * sq,
                        total_k: 0,
                    };
                    p.q_strides = [0, row_q, d];
                }
                p.mask = normalise_mask(p.mask, p.sq, p.sk);
                "paged"
            }
            _ => "dense",
        };
        let label = format!(
            "#{i} {kind} {dtype:?} b{b} sq{} sk{} h{hq}/{hkv} d{d} {:?} cap{} alibi{} fp8{} scale{} keys{:?} seqs{:?}",
            p.sq,
            p.sk,
            p.mask,
            softcap.is_some(),
            alibi,
            kv_fp8,
            scale,
            p.keys,
            p.seqs,
        );
        out.push((label, p));
    }
    out
}
