//! The CPU path: a fused reference computing the exact function of the crate docs (f32
//! accumulation for 16/32-bit inputs, f64 for f64), and the eager composition of candle ops.
//!
//! The fused path is a small flash-attention on the CPU: per (batch, KV head), K is converted
//! once to the accumulator type and transposed (`(d, seq_k)`, keys contiguous) and V converted
//! (read in place when it already is the accumulator type); tiles of [`MR`] query rows (the
//! query heads of a KV head and consecutive positions, row-major) run an online softmax over
//! key blocks of [`KB`] keys aligned to absolute key positions, so a row's result does not
//! depend on which tile or thread computed it. Threads take units of tiles from a shared
//! counter once the problem is big enough to pay for spawning them. On x86_64 the kernels are
//! also compiled with AVX2 + FMA and picked at run time.

use crate::params::{AttnParams, Mask, Problem};
use candle_core::{DType, Device, Result, Tensor, WithDType, D};
use std::any::TypeId;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Accumulation type of the CPU path.
pub(crate) trait Acc:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    const INF: Self;
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
    fn is_nan(self) -> bool;
    /// `a * b + c`, fused when `FMA` (only instantiated with `FMA` where the CPU has it).
    fn madd<const FMA: bool>(a: Self, b: Self, c: Self) -> Self;
    /// `exp` of every element of `xs`, whose elements are all `<= 0` or `-inf`.
    fn exp_nonpos(xs: &mut [Self]);
}

macro_rules! acc {
    ($t:ty, $exp_nonpos:expr) => {
        impl Acc for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            const INF: Self = <$t>::INFINITY;
            #[inline(always)]
            fn of(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn madd<const FMA: bool>(a: Self, b: Self, c: Self) -> Self {
                if FMA {
                    a.mul_add(b, c)
                } else {
                    a * b + c
                }
            }
            #[inline(always)]
            fn exp_nonpos(xs: &mut [Self]) {
                $exp_nonpos(xs)
            }
        }
    };
}
acc!(f32, exp_nonpos_f32);
acc!(f64, |xs: &mut [f64]| xs
    .iter_mut()
    .for_each(|x| *x = x.exp()));

/// `exp(x)` for `x <= 0` (or `-inf`, giving 0) in f32, written to vectorise: Cephes' expf
/// (range reduction by ln 2 in two parts, degree-6 polynomial, exponent bits), about 1 ulp.
#[inline(always)]
fn exp_nonpos_f32(xs: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer (to nearest) held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    for x in xs.iter_mut() {
        // NaN stays NaN (and comes out NaN); -inf and tiny values give 0 below.
        let xc = if *x < -87.0 { -87.0 } else { *x };
        let t = xc * LOG2E + MAGIC;
        let n = t - MAGIC;
        let r = xc - n * LN2_HI - n * LN2_LO;
        let mut y = 1.987_569_1e-4_f32;
        y = y * r + 1.398_199_9e-3;
        y = y * r + 8.333_452e-3;
        y = y * r + 4.166_579_6e-2;
        y = y * r + 0.166_666_65;
        y = y * r + 0.5;
        y = y * (r * r) + r + 1.0;
        // 2^n: n (in -126..=0) sits in t's low bits as t's bits - MAGIC's bits.
        let pow2 =
            f32::from_bits(t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23);
        *x = if *x < -87.0 { 0.0 } else { y * pow2 };
    }
}

/// Keys visible to query row `i`: the half-open range `lo..hi` (empty when `lo >= hi`), the
/// mask's band intersected with the row's chunk (`AttnParams::chunk`: keys
/// `[floor(p / c) * c, (floor(p / c) + 1) * c)` for the row's position `p = i + sk - sq`, floor
/// division, so a row at `p < 0` is in chunk -1 and sees nothing). Any bound or chunk (up to
/// `usize::MAX`, chunk >= 1) is handled: the arithmetic saturates, and a bound that saturates is
/// beyond every key anyway.
pub(crate) fn visible_keys(
    i: usize,
    sq: usize,
    sk: usize,
    mask: Mask,
    chunk: Option<usize>,
) -> (usize, usize) {
    let wide = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
    let diag = wide(i).saturating_add(wide(sk)).saturating_sub(wide(sq));
    let (left, right) = mask.bounds();
    let mut lo = left.map_or(0, |l| diag.saturating_sub(wide(l)).max(0));
    let mut hi = right.map_or(wide(sk), |r| {
        diag.saturating_add(wide(r))
            .saturating_add(1)
            .clamp(0, wide(sk))
    });
    if let Some(c) = chunk {
        // c >= 1 (validated); floor division puts rows at diag < 0 in chunk -1.
        let c = wide(c.max(1));
        let start = diag.div_euclid(c).saturating_mul(c);
        lo = lo.max(start.max(0));
        hi = hi.min(start.saturating_add(c).clamp(0, wide(sk)));
    }
    (lo.min(wide(sk)) as usize, hi as usize)
}

/// Query rows per tile (the micro-kernels' register block).
const MR: usize = 4;
/// Keys per micro-tile of `Q K^T`.
const NR: usize = 16;
/// Keys per online-softmax block (a multiple of `NR`; blocks start at multiples of `KB`).
const KB: usize = 64;
/// Length of the d-blocks that `qk_micro` sums separately.
const QK_BLOCK: usize = 32;
/// Below this much work (multiply-adds of `Q K^T`, about 100 us on one core) the call stays on
/// the calling thread: spawning costs tens of microseconds, and on a busy machine a second
/// thread can wait a whole time slice for a core.
const THREAD_MIN_WORK: usize = 1 << 21;

/// `src` as a slice of `U` when `T` and `U` are the same type.
fn same<T: 'static, U: 'static>(src: &[T]) -> Option<&[U]> {
    if TypeId::of::<T>() == TypeId::of::<U>() {
        // SAFETY: T and U are the same type.
        Some(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<U>(), src.len()) })
    } else {
        None
    }
}

fn same_mut<T: 'static, U: 'static>(dst: &mut [T]) -> Option<&mut [U]> {
    if TypeId::of::<T>() == TypeId::of::<U>() {
        // SAFETY: T and U are the same type.
        Some(unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<U>(), dst.len()) })
    } else {
        None
    }
}

/// Converts one row of inputs to the accumulator type (bulk conversions for the common pairs).
#[inline(always)]
fn load_row<T: WithDType, A: Acc>(src: &[T], dst: &mut [A]) {
    use half::slice::HalfFloatSliceExt;
    if let Some(s) = same::<T, A>(src) {
        dst.copy_from_slice(s);
    } else if let (Some(s), Some(d)) = (same::<T, half::f16>(src), same_mut::<A, f32>(dst)) {
        s.convert_to_f32_slice(d);
    } else if let (Some(s), Some(d)) = (same::<T, half::bf16>(src), same_mut::<A, f32>(dst)) {
        s.convert_to_f32_slice(d);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = A::of(s.to_f64());
        }
    }
}

/// Converts one output row from the accumulator type.
#[inline(always)]
fn store_row<T: WithDType, A: Acc>(src: &[A], dst: &mut [T]) {
    use half::slice::HalfFloatSliceExt;
    if let Some(d) = same_mut::<T, A>(dst) {
        d.copy_from_slice(src);
    } else if let (Some(s), Some(d)) = (same::<A, f32>(src), same_mut::<T, half::f16>(dst)) {
        d.convert_from_f32_slice(s);
    } else if let (Some(s), Some(d)) = (same::<A, f32>(src), same_mut::<T, half::bf16>(dst)) {
        d.convert_from_f32_slice(s);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f64(s.f64());
        }
    }
}

/// K and V of one (batch, KV head) in the accumulator type. With many query rows K is
/// transposed by tiles of `NR` keys, `kt` `(ceil(sk / NR), d, NR)` with the last tile padded
/// with zeros (each micro-kernel step reads 4 KB contiguous at d = 64 instead of `d` lines a
/// power of two apart, which thrash the cache sets); with few (decode) the transposition would
/// cost more than it saves and K stays row-major, `k` `(sk, d)`. `k` and `v` are empty when
/// read in place (the input already is the accumulator type).
struct KvBuf<A> {
    kt: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
}

/// Rows `j` of one (batch, KV head) of K or V: `data[base + j * stride..][..d]`.
#[derive(Clone, Copy)]
struct Rows<'a, A> {
    data: &'a [A],
    base: usize,
    stride: usize,
}

impl<'a, A> Rows<'a, A> {
    /// The input in place (`direct`, at `(base, stride)`) or a converted `(sk, d)` buffer.
    #[inline(always)]
    fn of(direct: Option<&'a [A]>, buf: &'a [A], (base, stride): (usize, usize), d: usize) -> Self {
        match direct {
            Some(data) => Rows { data, base, stride },
            None => Rows {
                data: buf,
                base: 0,
                stride: d,
            },
        }
    }

    #[inline(always)]
    fn row(&self, j: usize, d: usize) -> &[A] {
        let o = self.base + j * self.stride;
        &self.data[o..o + d]
    }
}

/// Tiles per (batch, KV head) up to which K stays row-major (see [`KvBuf`]).
const ROW_MAJOR_K_TILES: usize = 4;

/// A raw output pointer shared by the workers; every element is written by one tile only.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: workers write disjoint elements (each (batch, row, head) belongs to one tile).
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}

/// Everything a worker reads.
struct Ctx<'a, T, A> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    /// One sink logit per query head (`AttnParams::sinks`), or `None`.
    sinks: Option<&'a [f32]>,
    scale: A,
    /// `|scale| <= 1`: q is multiplied by the scale as it is loaded (the products can then only
    /// shrink); otherwise the dot product is scaled. Either way the score does not overflow
    /// while `sum_x |scale * q_x * k_x|` is finite.
    prescale: bool,
    softcap: Option<A>,
    ratio: usize,
    /// V read in place (the input already is the accumulator type).
    v_direct: Option<&'a [A]>,
    k_direct: Option<&'a [A]>,
    /// K transposed (many query rows) or row-major (few).
    k_transposed: bool,
    kv: Vec<OnceLock<KvBuf<A>>>,
    /// Tiles per (batch, KV head) and tiles per unit of work.
    tiles: usize,
    tiles_per_unit: usize,
    units: usize,
    next: AtomicUsize,
    out: OutPtr<T>,
    lse: OutPtr<f32>,
}

/// Per-thread scratch.
struct Scratch<A> {
    q: Vec<A>,
    s: Vec<A>,
    o: Vec<A>,
}

impl<T: WithDType, A: Acc> Ctx<'_, T, A> {
    #[inline(always)]
    fn kv_buf(&self, bi: usize, g: usize) -> &KvBuf<A> {
        self.kv[bi * self.p.hkv + g].get_or_init(|| {
            let (sk, d, p) = (self.p.sk, self.p.d, self.p);
            // Rows of `w` elements: K rows are d_qk wide, V rows d_v.
            let convert = |src: &[T], st: [usize; 3], w: usize| {
                let mut dst = vec![A::ZERO; sk * w];
                for j in 0..sk {
                    let o = bi * st[0] + j * st[1] + g * st[2];
                    load_row(&src[o..o + w], &mut dst[j * w..(j + 1) * w]);
                }
                dst
            };
            let v = match self.v_direct {
                Some(_) => Vec::new(),
                None => convert(self.v, p.v_strides, p.dv),
            };
            if !self.k_transposed {
                let k = match self.k_direct {
                    Some(_) => Vec::new(),
                    None => convert(self.k, p.k_strides, d),
                };
                return KvBuf {
                    kt: Vec::new(),
                    k,
                    v,
                };
            }
            let mut kt = vec![A::ZERO; sk.div_ceil(NR) * d * NR];
            let mut rows = vec![A::ZERO; NR * d];
            for j0 in (0..sk).step_by(NR) {
                let n = NR.min(sk - j0);
                for jj in 0..n {
                    let o = bi * p.k_strides[0] + (j0 + jj) * p.k_strides[1] + g * p.k_strides[2];
                    load_row(&self.k[o..o + d], &mut rows[jj * d..(jj + 1) * d]);
                }
                for x in 0..d {
                    let at = (j0 * d + x * NR)..(j0 * d + x * NR + n);
                    let dst = &mut kt[at];
                    for (jj, e) in dst.iter_mut().enumerate() {
                        *e = rows[jj * d + x];
                    }
                }
            }
            KvBuf {
                kt,
                k: Vec::new(),
                v,
            }
        })
    }

    /// Takes units from the shared counter until none is left.
    #[inline(always)]
    fn work<const FMA: bool>(&self) {
        let d = self.p.d;
        let mut sc = Scratch {
            q: vec![A::ZERO; MR * d],
            s: vec![A::ZERO; MR * KB],
            o: vec![A::ZERO; MR * self.p.dv],
        };
        let nbg = self.p.b * self.p.hkv;
        let chunks = self.units / nbg;
        loop {
            let u = self.next.fetch_add(1, Ordering::Relaxed);
            if u >= self.units {
                break;
            }
            // Latest rows (the most keys under a causal mask) first; (batch, KV head) fastest so
            // that threads convert different K/V at the start.
            let (chunk, bg) = (chunks - 1 - u / nbg, u % nbg);
            let (bi, g) = (bg / self.p.hkv, bg % self.p.hkv);
            let t0 = chunk * self.tiles_per_unit;
            for t in t0..(t0 + self.tiles_per_unit).min(self.tiles) {
                self.tile::<FMA>(bi, g, t, &mut sc);
            }
        }
    }

    /// One tile: virtual rows `t * MR ..` of (batch `bi`, KV head `g`); virtual row `r` is
    /// query row `r / ratio` of query head `g * ratio + r % ratio`.
    #[inline(always)]
    fn tile<const FMA: bool>(&self, bi: usize, g: usize, t: usize, sc: &mut Scratch<A>) {
        let p = self.p;
        // q and k rows are `d` (d_qk) wide, v and o rows `dv`.
        let (sq, sk, d, dv, hq, ratio) = (p.sq, p.sk, p.d, p.dv, p.hq, self.ratio);
        let v0 = t * MR;
        let nr = MR.min(sq * ratio - v0);
        let mut rows = [(0usize, 0usize, 0usize, 0usize); MR]; // (i, h, lo, hi)
        let (mut lo_t, mut hi_t) = (usize::MAX, 0);
        for (r, row) in rows.iter_mut().enumerate() {
            if r >= nr {
                continue;
            }
            let (i, h) = ((v0 + r) / ratio, g * ratio + (v0 + r) % ratio);
            let (lo, hi) = visible_keys(i, sq, sk, p.mask, p.chunk);
            *row = (i, h, lo, hi);
            if lo < hi {
                lo_t = lo_t.min(lo);
                hi_t = hi_t.max(hi);
            }
        }
        if lo_t >= hi_t {
            return; // O stays zero and LSE -inf (the sink's: `fused` starts every row there)
        }
        for (r, &(i, h, lo, hi)) in rows.iter().enumerate() {
            let dst = &mut sc.q[r * d..(r + 1) * d];
            if r < nr && lo < hi {
                let o = bi * p.q_strides[0] + i * p.q_strides[1] + h * p.q_strides[2];
                load_row(&self.q[o..o + d], dst);
                if self.prescale {
                    for x in dst.iter_mut() {
                        *x = *x * self.scale;
                    }
                }
            } else {
                dst.fill(A::ZERO);
            }
        }
        sc.o.fill(A::ZERO);
        let kv = self.kv_buf(bi, g);
        let at = |st: [usize; 3]| (bi * st[0] + g * st[2], st[1]);
        let vr = Rows::of(self.v_direct, &kv.v, at(p.v_strides), dv);
        let kr = Rows::of(self.k_direct, &kv.k, at(p.k_strides), d);
        let mut m = [A::NEG_INF; MR];
        let mut l = [A::ZERO; MR];
        if let Some(sinks) = self.sinks {
            // The sink is one more score of the row, seen before its keys, with a zero value
            // row: the online softmax starts at (m, l) = (sink, e^0) and O = 0. A -inf sink
            // leaves (-inf, 0), exactly no sink; a NaN one is applied at the end (below).
            for (r, &(_, h, lo, hi)) in rows.iter().enumerate() {
                if r >= nr || lo >= hi {
                    continue;
                }
                let s = A::of(sinks[h] as f64);
                if !s.is_nan() && s != A::NEG_INF {
                    m[r] = s;
                    l[r] = A::ONE;
                }
            }
        }
        let mut blk = lo_t / KB * KB;
        while blk < hi_t {
            let n = KB.min(hi_t - blk);
            if self.k_transposed {
                for c in (0..n).step_by(NR) {
                    let kt = &kv.kt[(blk + c) * d..(blk + c + NR) * d];
                    qk_micro::<A, FMA>(&sc.q, d, kt, &mut sc.s, c);
                }
            } else {
                qk_rows::<A, FMA>(&sc.q, d, kr, blk, n, &mut sc.s);
            }
            // Keys of the block each row sees, `a..z` relative to `blk`; empty for rows that
            // see none of them (and for padding rows).
            let mut rng = [(0usize, 0usize); MR];
            for (r, &(i, h, lo, hi)) in rows.iter().enumerate() {
                let srow = &mut sc.s[r * KB..r * KB + n];
                if r >= nr || lo >= hi || hi <= blk || lo >= blk + n {
                    srow.fill(A::ZERO);
                    continue;
                }
                if self.softcap.is_none() && self.slopes.is_none() {
                    if !self.prescale {
                        for e in srow.iter_mut() {
                            *e = *e * self.scale;
                        }
                    }
                } else {
                    let diag = i as f64 + sk as f64 - sq as f64;
                    // A non-finite slope makes its head's rows NaN (docs/numeric contract):
                    // `inf * 0` on the diagonal would otherwise depend on the mask.
                    let slope = self.slopes.map(|s| {
                        let s = s[h];
                        A::of(if s.is_finite() { s as f64 } else { f64::NAN })
                    });
                    for (jj, e) in srow.iter_mut().enumerate() {
                        let mut s = if self.prescale { *e } else { *e * self.scale };
                        if let Some(c) = self.softcap {
                            s = c * (s / c).tanh();
                        }
                        if let Some(sl) = slope {
                            s = s - sl * A::of(((blk + jj) as f64 - diag).abs());
                        }
                        *e = s;
                    }
                }
                // Keys outside lo..hi (the block holds at least one visible key).
                let (a, z) = (lo.saturating_sub(blk), (hi - blk).min(n));
                rng[r] = (a, z);
                srow[..a].fill(A::NEG_INF);
                srow[z..].fill(A::NEG_INF);
                // The max ignores NaN scores; they reach `l` through the sum below.
                let bm = lanes(&srow[a..z], A::NEG_INF, |m, x| if x > m { x } else { m });
                let m_new = if bm > m[r] { bm } else { m[r] };
                if m_new == A::NEG_INF {
                    // Every visible score so far is -inf (or NaN): no weight yet. A NaN score
                    // poisons the row through `l`.
                    if srow[a..z].iter().any(|&x| x.is_nan()) {
                        l[r] += A::of(f64::NAN);
                    }
                    srow.fill(A::ZERO);
                    continue;
                }
                if m_new == A::INF {
                    // The +inf scores share the row's weight (the softmax's limit); earlier
                    // finite scores get weight 0 (NaN kept).
                    if m[r] != A::INF {
                        for o in sc.o[r * dv..(r + 1) * dv].iter_mut() {
                            *o = *o * A::ZERO;
                        }
                        l[r] = l[r] * A::ZERO;
                    }
                    for e in srow.iter_mut() {
                        *e = if *e == A::INF {
                            A::ONE
                        } else if e.is_nan() {
                            *e
                        } else {
                            A::ZERO
                        };
                    }
                    l[r] += lanes(srow, A::ZERO, |a, x| a + x);
                    m[r] = m_new;
                    continue;
                }
                for e in srow.iter_mut() {
                    *e = *e - m_new;
                }
                A::exp_nonpos(srow);
                let sum = lanes(srow, A::ZERO, |a, x| a + x);
                if m_new > m[r] && l[r] > A::ZERO {
                    let alpha = (m[r] - m_new).exp();
                    for o in sc.o[r * dv..(r + 1) * dv].iter_mut() {
                        *o = *o * alpha;
                    }
                    l[r] = l[r] * alpha;
                }
                l[r] += sum;
                m[r] = m_new;
            }
            pv_block::<A, FMA>(&sc.s, &rng, vr, blk, &mut sc.o, dv);
            blk += KB;
        }
        for (r, &(i, h, lo, hi)) in rows.iter().enumerate() {
            // Rows that see no key, or whose visible scores are all -inf, stay zero with LSE
            // -inf or their sink's (a NaN score has made `l` NaN: that row is written, NaN).
            if r >= nr || lo >= hi || (m[r] == A::NEG_INF && !l[r].is_nan()) {
                continue;
            }
            // A NaN sink makes every row with weight NaN (as the GPU epilogue does).
            if self.sinks.is_some_and(|s| s[h].is_nan()) {
                l[r] = A::of(f64::NAN);
            }
            let orow = &mut sc.o[r * dv..(r + 1) * dv];
            for o in orow.iter_mut() {
                *o = *o / l[r];
            }
            let dst = ((bi * sq + i) * hq + h) * dv;
            // SAFETY: `out` has b * sq * hq * dv elements and row (bi, i, h) belongs to this tile
            // only; likewise the LSE entry.
            unsafe {
                store_row(
                    orow,
                    std::slice::from_raw_parts_mut(self.out.0.add(dst), dv),
                );
                *self.lse.0.add((bi * hq + h) * sq + i) = (m[r].f64() + l[r].f64().ln()) as f32;
            }
        }
    }
}

/// Reduces `xs` with `f` over 8 independent lanes (so that it vectorises), then across lanes.
#[inline(always)]
fn lanes<A: Acc>(xs: &[A], init: A, f: impl Fn(A, A) -> A) -> A {
    let mut acc = [init; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    let mut r = rest.iter().fold(init, |a, &x| f(a, x));
    for a in acc {
        r = f(r, a);
    }
    r
}

/// `s[r][j] = q[r] . K[j0 + j]` for the first `n` keys of the block, K row-major; `q` is
/// `(MR, d)`, `s` is `(MR, KB)`.
#[inline(always)]
fn qk_rows<A: Acc, const FMA: bool>(
    q: &[A],
    d: usize,
    k: Rows<'_, A>,
    j0: usize,
    n: usize,
    s: &mut [A],
) {
    let qr: [&[A]; MR] = std::array::from_fn(|r| &q[r * d..(r + 1) * d]);
    for j in 0..n {
        let kr = k.row(j0 + j, d);
        let mut acc = [[A::ZERO; 8]; MR];
        for (x, kc) in kr.chunks_exact(8).enumerate() {
            let kc: &[A; 8] = kc.try_into().unwrap();
            for (a, q) in acc.iter_mut().zip(&qr) {
                let qc: &[A; 8] = q[x * 8..x * 8 + 8].try_into().unwrap();
                for l in 0..8 {
                    a[l] = A::madd::<FMA>(qc[l], kc[l], a[l]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            s[r * KB + j] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        }
    }
}

/// `s[r][c..c + NR] = q[r] . K[j]` for the `NR` keys of the transposed tile `kt` (`(d, NR)`),
/// for the `MR` query rows of `q` (`(MR, d)`); `s` is `(MR, KB)`.
#[inline(always)]
fn qk_micro<A: Acc, const FMA: bool>(q: &[A], d: usize, kt: &[A], s: &mut [A], c: usize) {
    let qr: [&[A]; MR] = std::array::from_fn(|r| &q[r * d..(r + 1) * d]);
    // Summed in blocks of QK_BLOCK along d, each block from zero, then added up: one chain of d
    // FMAs makes the f32 rounding error grow with d (at d = 128 it was twice candle's matmul's).
    let mut total = [[A::ZERO; NR]; MR];
    for x0 in (0..d).step_by(QK_BLOCK) {
        let mut acc = [[A::ZERO; NR]; MR];
        let kb = &kt[x0 * NR..d.min(x0 + QK_BLOCK) * NR];
        for (x, kr) in kb.chunks_exact(NR).enumerate() {
            let kr: &[A; NR] = kr.try_into().unwrap();
            for r in 0..MR {
                let qv = qr[r][x0 + x];
                for (a, &k) in acc[r].iter_mut().zip(kr) {
                    *a = A::madd::<FMA>(qv, k, *a);
                }
            }
        }
        for (t, a) in total.iter_mut().zip(&acc) {
            for (t, &a) in t.iter_mut().zip(a) {
                *t += a;
            }
        }
    }
    for (r, a) in total.iter().enumerate() {
        s[r * KB + c..r * KB + c + NR].copy_from_slice(a);
    }
}

/// `o[r] += sum_{j in a_r..z_r} p[r][j] * V[j0 + j]` with `(a_r, z_r) = rng[r]`: each row reads
/// only the V rows of the keys it sees, so a NaN or Inf in a V row a row does not see never
/// reaches it (a masked key is skipped, not multiplied by 0). The keys every row with a
/// non-empty range sees run through [`pv_micro`] for all rows at once; the rest row by row.
#[inline(always)]
fn pv_block<A: Acc, const FMA: bool>(
    p: &[A],
    rng: &[(usize, usize); MR],
    v: Rows<'_, A>,
    j0: usize,
    o: &mut [A],
    d: usize,
) {
    let live: [bool; MR] = std::array::from_fn(|r| rng[r].0 < rng[r].1);
    if !live.iter().any(|&x| x) {
        return;
    }
    let (mut a, mut z) = (0, usize::MAX);
    for r in 0..MR {
        if live[r] {
            a = a.max(rng[r].0);
            z = z.min(rng[r].1);
        }
    }
    let z = z.max(a);
    if a < z {
        if d.is_multiple_of(16) {
            pv_micro::<A, FMA, 16>(p, a, z, v, j0, o, d, &live);
        } else {
            pv_micro::<A, FMA, 8>(p, a, z, v, j0, o, d, &live);
        }
    }
    for r in 0..MR {
        if !live[r] {
            continue;
        }
        let (ra, rz) = rng[r];
        let orow = &mut o[r * d..(r + 1) * d];
        let prow = &p[r * KB..(r + 1) * KB];
        // This row's keys outside the shared a..z: before it and after it.
        for (s, e) in [(ra, a.min(rz)), (z.max(ra), rz)] {
            for (j, &pv) in prow.iter().enumerate().take(e).skip(s) {
                for (oo, &x) in orow.iter_mut().zip(v.row(j0 + j, d)) {
                    *oo = A::madd::<FMA>(pv, x, *oo);
                }
            }
        }
    }
}

/// `o[r] += sum_{j in a..z} p[r][j] * V[j0 + j]` for the rows with `keep[r]` (the others are left
/// as they are); `p` is `(MR, KB)`, `o` is `(MR, d)`.
#[inline(always)]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)] // `j` indexes V and `p`
fn pv_micro<A: Acc, const FMA: bool, const W: usize>(
    p: &[A],
    a: usize,
    z: usize,
    v: Rows<'_, A>,
    j0: usize,
    o: &mut [A],
    d: usize,
    keep: &[bool; MR],
) {
    let pr: [&[A]; MR] = std::array::from_fn(|r| &p[r * KB..r * KB + z]);
    for c in (0..d).step_by(W) {
        let mut acc: [[A; W]; MR] =
            std::array::from_fn(|r| o[r * d + c..r * d + c + W].try_into().unwrap());
        for j in a..z {
            let vr: &[A; W] = v.row(j0 + j, d)[c..c + W].try_into().unwrap();
            for r in 0..MR {
                let pv = pr[r][j];
                for (a, &x) in acc[r].iter_mut().zip(vr) {
                    *a = A::madd::<FMA>(pv, x, *a);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            if keep[r] {
                o[r * d + c..r * d + c + W].copy_from_slice(a);
            }
        }
    }
}

fn worker<T: WithDType, A: Acc>(ctx: &Ctx<'_, T, A>) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { worker_avx2_fma(ctx) };
            return;
        }
    }
    ctx.work::<false>();
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn worker_avx2_fma<T: WithDType, A: Acc>(ctx: &Ctx<'_, T, A>) {
    ctx.work::<true>();
}

fn cpu_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Fused CPU attention over strided storage. `q`, `k`, `v` are the storages' full slices with
/// the layouts' start offsets already applied. Returns O `(b, sq, hq, d_v)` contiguous in `T`
/// and LSE `(b, hq, sq)` f32.
pub(crate) fn fused<T: WithDType, A: Acc>(
    q: &[T],
    k: &[T],
    v: &[T],
    p: &Problem,
    slopes: Option<&[f32]>,
    sinks: Option<&[f32]>,
) -> (Vec<T>, Vec<f32>) {
    let (b, sq, sk, hq, hkv, d) = (p.b, p.sq, p.sk, p.hq, p.hkv, p.d);
    let ratio = hq / hkv;
    let mut out = vec![T::zero(); b * sq * hq * p.dv];
    // Rows that see no key keep these: -inf, or their head's sink.
    let mut lse = vec![f32::NEG_INFINITY; b * hq * sq];
    if let Some(sinks) = sinks {
        for (i, x) in lse.iter_mut().enumerate() {
            *x = sinks[(i / sq) % hq];
        }
    }
    // Multiply-adds of Q K^T (as many again for P V).
    let work = b
        * hq
        * d
        * (0..sq)
            .map(|i| {
                let (lo, hi) = visible_keys(i, sq, sk, p.mask, p.chunk);
                hi.saturating_sub(lo)
            })
            .sum::<usize>();
    let nthreads = if work < THREAD_MIN_WORK {
        1
    } else {
        cpu_threads()
    };
    let tiles = (sq * ratio).div_ceil(MR);
    // Enough units per thread to balance causal rows, but whole tiles of real work each.
    let nbg = b * hkv;
    let want_chunks = if nthreads == 1 {
        1
    } else {
        (8 * nthreads).div_ceil(nbg)
    };
    let tiles_per_unit = tiles.div_ceil(want_chunks.min(tiles)).max(1);
    let chunks = tiles.div_ceil(tiles_per_unit);
    let ctx = Ctx {
        q,
        k,
        v,
        p,
        slopes,
        sinks,
        // The f64 path takes the scale in f64 (the default 1 / sqrt(d) computed in f64).
        scale: if std::mem::size_of::<A>() == 8 {
            A::of(p.scale_f64)
        } else {
            A::of(p.scale as f64)
        },
        prescale: p.scale.abs() <= 1.0,
        softcap: p.softcap.map(|c| A::of(c as f64)),
        ratio,
        v_direct: same::<T, A>(v),
        k_direct: same::<T, A>(k),
        k_transposed: tiles > ROW_MAJOR_K_TILES,
        kv: (0..nbg).map(|_| OnceLock::new()).collect(),
        tiles,
        tiles_per_unit,
        units: chunks * nbg,
        next: AtomicUsize::new(0),
        out: OutPtr(out.as_mut_ptr()),
        lse: OutPtr(lse.as_mut_ptr()),
    };
    let nthreads = nthreads.min(ctx.units);
    if nthreads <= 1 {
        worker(&ctx);
    } else {
        std::thread::scope(|s| {
            let ctx = &ctx;
            for _ in 1..nthreads {
                s.spawn(move || worker(ctx));
            }
            worker(ctx);
        });
    }
    drop(ctx);
    (out, lse)
}

/// `(1 or batch, heads_q, seq_q, seq_k)` ALiBi bias `-slope[b][h] * |j - (i + sk - sq)|` in
/// `dtype`, from slopes `(heads_q,)` or `(batch, heads_q)`; a non-finite slope becomes NaN (its
/// head's rows are NaN, as on the fused path).
fn alibi_bias(slopes: &Tensor, sq: usize, sk: usize, dtype: DType) -> Result<Tensor> {
    let dev = slopes.device();
    let i = Tensor::arange(0u32, sq as u32, dev)?
        .to_dtype(DType::F64)?
        .reshape((sq, 1))?;
    let j = Tensor::arange(0u32, sk as u32, dev)?
        .to_dtype(DType::F64)?
        .reshape((1, sk))?;
    let dist = j.broadcast_sub(&(i + (sk as f64 - sq as f64))?)?.abs()?;
    let flat: Vec<f32> = slopes.flatten_all()?.to_vec1::<f32>()?;
    let flat: Vec<f64> = flat
        .iter()
        .map(|&x| if x.is_finite() { x as f64 } else { f64::NAN })
        .collect();
    let (nb, h) = match slopes.dims() {
        [h] => (1, *h),
        [b, h] => (*b, *h),
        d => candle_core::bail!("flashcore: alibi_slopes: unexpected shape {d:?}"),
    };
    Tensor::from_vec(flat, (nb, h, 1, 1), dev)?
        .to_dtype(dtype)?
        .broadcast_mul(&dist.to_dtype(dtype)?.unsqueeze(0)?.unsqueeze(0)?)?
        .neg()
}

/// `(seq_q, seq_k)` u8: 1 where the key is visible (mask and chunk).
fn visible_mask(
    sq: usize,
    sk: usize,
    mask: Mask,
    chunk: Option<usize>,
    dev: &Device,
) -> Result<Tensor> {
    let mut m = vec![0u8; sq * sk];
    for i in 0..sq {
        let (lo, hi) = visible_keys(i, sq, sk, mask, chunk);
        for x in &mut m[i * sk + lo..i * sk + hi.max(lo)] {
            *x = 1;
        }
    }
    Tensor::from_vec(m, (sq, sk), dev)
}

/// Eager attention from candle ops in the input dtype: transpose, repeat K/V for GQA, matmul,
/// softcap, ALiBi, mask, softmax, matmul. Rows that see no key come out as zeros here too.
pub(crate) fn eager(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    eager_chunked(q, k, v, params, EAGER_MAX_ELEMS)
}

/// Largest intermediate (elements) the eager path builds at once: candle's element-wise CUDA
/// kernels take 32-bit element counts (CUDA_ERROR_INVALID_VALUE beyond), so bigger problems are
/// split over the batch, then over groups of KV heads.
const EAGER_MAX_ELEMS: usize = 1 << 30;

/// [`eager`] with every intermediate below `max_elems` elements where a batch or KV-head split
/// gets it there (a single (1 batch, 1 KV head) problem runs whole).
pub(crate) fn eager_chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
    max_elems: usize,
) -> Result<Tensor> {
    let p = crate::params::validate(q, k, v, params)?;
    let biggest = p.b * p.hq * p.sk * p.sq.max(p.d).max(p.dv);
    if biggest <= max_elems || (p.b == 1 && p.hkv == 1) {
        return eager_whole(q, k, v, params);
    }
    let parts = if p.b > 1 {
        let h = p.b / 2;
        let mut out = Vec::with_capacity(2);
        for (b0, n) in [(0, h), (h, p.b - h)] {
            let mut sub = params.clone();
            if p.alibi_per_batch {
                sub.alibi_slopes = match &params.alibi_slopes {
                    Some(sl) => Some(sl.narrow(0, b0, n)?),
                    None => None,
                };
            }
            out.push(eager_chunked(
                &q.narrow(0, b0, n)?,
                &k.narrow(0, b0, n)?,
                &v.narrow(0, b0, n)?,
                &sub,
                max_elems,
            )?);
        }
        out
    } else {
        // Query heads [g * ratio, (g + n) * ratio) read KV heads [g, g + n).
        let ratio = p.h_ratio();
        let h = p.hkv / 2;
        let mut out = Vec::with_capacity(2);
        for (g, n) in [(0, h), (h, p.hkv - h)] {
            let mut sub = params.clone();
            sub.alibi_slopes = match &params.alibi_slopes {
                Some(sl) => Some(sl.narrow(sl.rank() - 1, g * ratio, n * ratio)?),
                None => None,
            };
            sub.sinks = match &params.sinks {
                Some(sn) => Some(sn.narrow(0, g * ratio, n * ratio)?),
                None => None,
            };
            out.push(eager_chunked(
                &q.narrow(2, g * ratio, n * ratio)?,
                &k.narrow(2, g, n)?,
                &v.narrow(2, g, n)?,
                &sub,
                max_elems,
            )?);
        }
        out
    };
    Tensor::cat(&parts, if p.b > 1 { 0 } else { 2 })
}

/// The eager path computes in f32 (f64 for f64 inputs) and casts the result back, so f16 and
/// bf16 do not overflow where the fused path (which accumulates in f32) is finite; the numeric
/// rules are the fused path's (crate docs): masked keys never reach a row (their scores are
/// replaced, not added to, and with non-finite V rows each row reads only its visible keys),
/// +inf scores share the weight, a row whose visible scores are all -inf gives zeros.
fn eager_whole(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    let p = crate::params::validate(q, k, v, params)?;
    let dtype = p.dtype;
    let cd = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let scale = if cd == DType::F64 {
        p.scale_f64
    } else {
        p.scale as f64
    };
    let ratio = p.h_ratio();
    let q = q.transpose(1, 2)?.to_dtype(cd)?.contiguous()?; // (b, hq, sq, d)
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let t = t.transpose(1, 2)?.to_dtype(cd)?; // (b, hkv, sk, d)
        let t = if ratio == 1 {
            t
        } else {
            let (b, hkv, sk, d) = t.dims4()?;
            t.unsqueeze(2)?
                .broadcast_as((b, hkv, ratio, sk, d))?
                .reshape((b, hkv * ratio, sk, d))?
        };
        t.contiguous()
    };
    let k = repeat(k)?;
    let v = repeat(v)?;
    // As the fused path: a scale of at most 1 in magnitude is applied to q first (the products
    // can only shrink), a larger one to the dot products.
    let mut s = if scale.abs() <= 1.0 {
        (&q * scale)?.matmul(&k.t()?)?
    } else {
        (q.matmul(&k.t()?)? * scale)?
    };
    if let Some(c) = p.softcap {
        s = ((s / c as f64)?.tanh()? * c as f64)?;
    }
    if let Some(sl) = &params.alibi_slopes {
        s = s.broadcast_add(&alibi_bias(sl, p.sq, p.sk, cd)?)?;
    }
    let dev = s.device().clone();
    let vis = (p.mask != Mask::None || p.chunk.is_some())
        .then(|| visible_mask(p.sq, p.sk, p.mask, p.chunk, &dev))
        .transpose()?;
    let neg_inf = Tensor::full(f64::NEG_INFINITY, (), &dev)?.to_dtype(cd)?;
    if let Some(vis) = &vis {
        // Replaced, not added to: a NaN score of a masked key must not survive.
        s = vis
            .broadcast_as(s.shape())?
            .where_cond(&s, &neg_inf.broadcast_as(s.shape())?)?;
    }
    // Rows without weight from their keys (none visible, or only -inf scores): with sinks
    // they stay zeros whatever the sink (a NaN one included), as on the fused path.
    let keyless = match &params.sinks {
        Some(_) => {
            let none = s.max_keepdim(D::Minus1)?.eq(f64::NEG_INFINITY)?;
            let nan = s.ne(&s)?.max_keepdim(D::Minus1)?;
            Some((none * nan.eq(0u8)?)?)
        }
        None => None,
    };
    // Sinks: one more column of scores per row, the head's sink, whose weight is dropped
    // before P V (it carries no value).
    if let Some(sn) = &params.sinks {
        let col = sn
            .to_dtype(cd)?
            .reshape((1, p.hq, 1, 1))?
            .broadcast_as((p.b, p.hq, p.sq, 1))?
            .contiguous()?;
        s = Tensor::cat(&[&s, &col], D::Minus1)?;
    }
    let rmax = s.max_keepdim(D::Minus1)?;
    let mut w = candle_nn::ops::softmax_last_dim(&s)?;
    // +inf scores share the row's weight (the softmax's limit).
    let pinf = s.eq(f64::INFINITY)?.to_dtype(cd)?;
    let share = pinf.broadcast_div(&pinf.sum_keepdim(D::Minus1)?)?;
    let has_pinf = rmax.eq(f64::INFINITY)?.broadcast_as(w.shape())?;
    let nan_row = s.ne(&s)?.max_keepdim(D::Minus1)?;
    let has_nan = nan_row.broadcast_as(w.shape())?;
    let nan = Tensor::full(f64::NAN, (), &dev)?
        .to_dtype(cd)?
        .broadcast_as(w.shape())?;
    w = has_pinf.where_cond(&share, &w)?;
    // Rows whose visible scores are all -inf (no visible key included): zeros.
    let empty_row = (rmax.eq(f64::NEG_INFINITY)? * nan_row.eq(0u8)?)?;
    w = empty_row
        .broadcast_as(w.shape())?
        .where_cond(&w.zeros_like()?, &w)?;
    // A NaN score makes its row NaN (the max above may have skipped it).
    w = has_nan.where_cond(&nan, &w)?;
    if params.sinks.is_some() {
        w = w.narrow(D::Minus1, 0, p.sk)?.contiguous()?;
    }
    let v_finite = v
        .sub(&v)?
        .eq(0.0)?
        .min_keepdim(D::Minus1)?
        .flatten_all()?
        .min(0)?;
    let o = match (&vis, v_finite.to_scalar::<u8>()? == 1) {
        (Some(_), false) => {
            // A non-finite V row must reach only the rows that see it: row by row over the
            // visible range (w @ v would multiply it by the masked rows' 0).
            let (b, hq, sq, d) = (p.b, p.hq, p.sq, p.dv);
            let mut rows = Vec::with_capacity(sq);
            for i in 0..sq {
                let (lo, hi) = visible_keys(i, sq, p.sk, p.mask, p.chunk);
                let wi = w.narrow(2, i, 1)?;
                rows.push(if lo < hi {
                    let r = wi.narrow(3, lo, hi - lo)?.contiguous()?;
                    r.matmul(&v.narrow(2, lo, hi - lo)?.contiguous()?)?
                } else {
                    Tensor::zeros((b, hq, 1, d), cd, &dev)?
                });
            }
            Tensor::cat(&rows, 2)?
        }
        _ => w.matmul(&v)?,
    };
    // Those rows are zeros even where a visible V row holds NaN or Inf (no weight is given).
    let o = empty_row
        .broadcast_as(o.shape())?
        .where_cond(&o.zeros_like()?, &o)?;
    let o = match &keyless {
        Some(k) => k
            .broadcast_as(o.shape())?
            .where_cond(&o.zeros_like()?, &o)?,
        None => o,
    };
    o.transpose(1, 2)?.to_dtype(dtype)?.contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The eager twin splits big problems over the batch and KV-head groups (candle's CUDA
    /// element-wise kernels take 32-bit counts): split and whole must agree, ALiBi slopes and
    /// GQA included.
    #[test]
    fn eager_split_matches_whole() -> Result<()> {
        let dev = Device::Cpu;
        let (b, sq, sk, hq, hkv, d) = (3, 9, 21, 8, 2, 16);
        let q = Tensor::randn(0f32, 1., (b, sq, hq, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?;
        let slopes = Tensor::rand(0f32, 1., hq, &dev)?;
        let p = AttnParams {
            mask: Mask::Causal,
            alibi_slopes: Some(slopes),
            ..Default::default()
        };
        let whole = eager_whole(&q, &k, &v, &p)?;
        // Forces the split down to single (batch, KV head) pieces.
        let split = eager_chunked(&q, &k, &v, &p, 1)?;
        assert_eq!(split.dims(), whole.dims());
        let diff = (whole - split)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-6, "split eager differs from whole by {diff}");
        Ok(())
    }
}
