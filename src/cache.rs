//! A small owner of a paged KV pool: hands out pages to sequences, appends their new rows
//! (`append_kv_paged`) and builds the page table and lengths that `attention_paged` reads. The
//! bookkeeping is on the host; the pools and tables live on the pool's device.

use candle_core::{DType, Device, Result, Tensor};

/// K/V pools `(num_pages, page_size, heads_kv, head_dim)` (the V pool may have its own head dim:
/// [`PagedKvCache::with_head_dims`]) and the pages each live sequence owns.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let mut cache = flashcore::PagedKvCache::new(64, 16, 2, 64, DType::F32, &dev)?;
/// let a = cache.add_sequence();
/// let k = Tensor::randn(0f32, 1., (1, 20, 2, 64), &dev)?; // 20 new rows of sequence `a`
/// cache.append(&[a], &k, &k)?;
/// let (table, lens) = cache.tables(&[a])?;
/// let q = Tensor::randn(0f32, 1., (1, 1, 8, 64), &dev)?;
/// let o = flashcore::attention_paged(&q, cache.k_pages(), cache.v_pages(), &table, &lens,
///                                    &Default::default())?;
/// assert_eq!(cache.len(a), Some(20));
/// assert_eq!(o.dims(), &[1, 1, 8, 64]);
/// # Ok(()) }
/// ```
pub struct PagedKvCache {
    k_pages: Tensor,
    v_pages: Tensor,
    page_size: usize,
    /// Pages no sequence owns, handed out from the end.
    free: Vec<u32>,
    /// Per sequence id: its pages and its length in rows, `None` once freed.
    seqs: Vec<Option<(Vec<u32>, usize)>>,
    /// The scales of F8E4M3 pools ([`PagedKvCache::with_kv_scales`]).
    kv_scales: Option<crate::KvScales>,
}

impl PagedKvCache {
    /// Zeroed pools of `num_pages` pages of `page_size` rows, K and V both `head_dim` wide.
    pub fn new(
        num_pages: usize,
        page_size: usize,
        heads_kv: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::with_head_dims(
            num_pages, page_size, heads_kv, head_dim, head_dim, dtype, device,
        )
    }

    /// Zeroed pools with different K and V head dims (DeepSeek-style `d_qk != d_v`): K pool
    /// `(num_pages, page_size, heads_kv, head_dim_k)`, V pool `(…, head_dim_v)`. Appends then
    /// take `k_new` `(…, head_dim_k)` and `v_new` `(…, head_dim_v)`.
    pub fn with_head_dims(
        num_pages: usize,
        page_size: usize,
        heads_kv: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if num_pages == 0 || page_size == 0 || num_pages > u32::MAX as usize {
            candle_core::bail!(
                "flashcore: PagedKvCache: num_pages and page_size must be >= 1 (num_pages < 2^32), got {num_pages} and {page_size}"
            )
        }
        if heads_kv == 0 || head_dim_k == 0 || head_dim_v == 0 {
            candle_core::bail!(
                "flashcore: PagedKvCache: heads_kv and the head dims must be >= 1, got heads_kv {heads_kv}, head_dim_k {head_dim_k}, head_dim_v {head_dim_v}"
            )
        }
        for head_dim in [head_dim_k, head_dim_v] {
            let elems = [page_size, heads_kv, head_dim]
                .iter()
                .try_fold(num_pages, |acc, &x| acc.checked_mul(x));
            let bytes = elems.and_then(|e| e.checked_mul(dtype.size_in_bytes()));
            if bytes.is_none_or(|e| e > isize::MAX as usize) {
                candle_core::bail!(
                    "flashcore: PagedKvCache: num_pages * page_size * heads_kv * head_dim must be addressable (< 2^63 bytes), got ({num_pages}, {page_size}, {heads_kv}, {head_dim})"
                )
            }
        }
        let shape = |d: usize| (num_pages, page_size, heads_kv, d);
        Ok(Self {
            k_pages: Tensor::zeros(shape(head_dim_k), dtype, device)?,
            v_pages: Tensor::zeros(shape(head_dim_v), dtype, device)?,
            page_size,
            free: (0..num_pages as u32).rev().collect(),
            seqs: Vec::new(),
            kv_scales: None,
        })
    }

    pub fn k_pages(&self) -> &Tensor {
        &self.k_pages
    }
    pub fn v_pages(&self) -> &Tensor {
        &self.v_pages
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Pages no sequence owns.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }
    /// Rows of sequence `id`, or `None` if it is not live.
    pub fn len(&self, id: usize) -> Option<usize> {
        self.seqs.get(id)?.as_ref().map(|s| s.1)
    }
    /// Whether no sequence is live.
    pub fn is_empty(&self) -> bool {
        self.seqs.iter().all(Option::is_none)
    }

    /// A new empty sequence; returns its id.
    pub fn add_sequence(&mut self) -> usize {
        self.seqs.push(Some((Vec::new(), 0)));
        self.seqs.len() - 1
    }

    /// Gives sequence `id`'s pages back to the pool.
    pub fn free_sequence(&mut self, id: usize) -> Result<()> {
        let (pages, _) = self.live(id)?.clone();
        self.free.extend(pages.iter().rev());
        self.seqs[id] = None;
        Ok(())
    }

    fn live(&self, id: usize) -> Result<&(Vec<u32>, usize)> {
        match self.seqs.get(id) {
            Some(Some(s)) => Ok(s),
            _ => candle_core::bail!("flashcore: PagedKvCache: sequence {id} is not live"),
        }
    }

    /// Pages sequence `id` still needs to hold `n_new` more rows.
    pub fn pages_needed(&self, id: usize, n_new: usize) -> Result<usize> {
        let (pages, len) = self.live(id)?;
        Ok((len + n_new)
            .div_ceil(self.page_size)
            .saturating_sub(pages.len()))
    }

    /// Appends `n_new` rows to each sequence of `ids` (distinct): `k_new` / `v_new` `(ids.len(),
    /// n_new, heads_kv, ·)` at the K and V pools' head dims. Pages are taken from the pool first; if they do not suffice,
    /// or the append rejects the rows, nothing is taken or written and the error says why.
    pub fn append(&mut self, ids: &[usize], k_new: &Tensor, v_new: &Tensor) -> Result<()> {
        let (b, n_new) = (k_new.dim(0)?, k_new.dim(1)?);
        if b != ids.len() {
            candle_core::bail!(
                "flashcore: PagedKvCache::append: k_new's batch {b} must equal the number of sequence ids {}",
                ids.len()
            )
        }
        let mut need = 0;
        for (n, &id) in ids.iter().enumerate() {
            if ids[..n].contains(&id) {
                candle_core::bail!("flashcore: PagedKvCache::append: sequence {id} appears twice")
            }
            need += self.pages_needed(id, n_new)?;
        }
        if need > self.free.len() {
            candle_core::bail!(
                "flashcore: PagedKvCache::append: needs {need} free pages, the pool has {}",
                self.free.len()
            )
        }
        let positions: Vec<u32> = ids
            .iter()
            .map(|&id| self.live(id).map(|s| s.1 as u32))
            .collect::<Result<_>>()?;
        // Taken tentatively: given back (in the same order) if the append fails, which writes
        // nothing when it fails.
        let free_before = self.free.len();
        let mut owned_before = Vec::with_capacity(ids.len());
        for &id in ids {
            let extra = self.pages_needed(id, n_new)?;
            let take = self.free.split_off(self.free.len() - extra);
            if let Some(Some((pages, _))) = self.seqs.get_mut(id) {
                owned_before.push(pages.len());
                pages.extend(take.iter().rev());
            }
        }
        let written = self.tables(ids).and_then(|(table, _)| {
            let pos = Tensor::new(positions.as_slice(), self.k_pages.device())?;
            let (kp, vp) = (&self.k_pages, &self.v_pages);
            match &self.kv_scales {
                None => crate::append_kv_paged(k_new, v_new, kp, vp, &table, &pos),
                Some(s) => crate::append_kv_paged_fp8(k_new, v_new, kp, vp, &table, &pos, s),
            }
        });
        if let Err(e) = written {
            // Back in reverse order of taking, so the free list is exactly as before.
            for (&id, &before) in ids.iter().zip(&owned_before).rev() {
                if let Some(Some((pages, _))) = self.seqs.get_mut(id) {
                    let taken = pages.split_off(before);
                    self.free.extend(taken.iter().rev());
                }
            }
            debug_assert_eq!(self.free.len(), free_before);
            return Err(e);
        }
        for &id in ids {
            if let Some(Some((_, len))) = self.seqs.get_mut(id) {
                *len += n_new;
            }
        }
        Ok(())
    }

    /// An FP8 KV cache: pools made with `DType::F8E4M3` take their scales here; appends then
    /// quantize the new rows with them (`append_kv_paged_fp8`), and attention over the pools
    /// passes the same scales as `AttnParams::kv_scales` ([`PagedKvCache::kv_scales`]).
    pub fn with_kv_scales(mut self, scales: crate::KvScales) -> Result<Self> {
        if self.k_pages.dtype() != DType::F8E4M3 {
            candle_core::bail!(
                "flashcore: PagedKvCache::with_kv_scales: kv_scales apply to F8E4M3 pools, these are {:?}",
                self.k_pages.dtype()
            )
        }
        self.kv_scales = Some(scales);
        Ok(self)
    }

    /// The scales of F8E4M3 pools, for `AttnParams::kv_scales`.
    pub fn kv_scales(&self) -> Option<&crate::KvScales> {
        self.kv_scales.as_ref()
    }

    /// The page table `(ids.len(), max_pages)` (unused entries 0) and lengths `(ids.len(),)`
    /// of the sequences `ids`, u32 on the pool's device: what `attention_paged` takes.
    pub fn tables(&self, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        let seqs = ids
            .iter()
            .map(|&id| self.live(id))
            .collect::<Result<Vec<_>>>()?;
        let width = seqs.iter().map(|s| s.0.len()).max().unwrap_or(0).max(1);
        let mut table = vec![0u32; ids.len() * width];
        for (i, (pages, _)) in seqs.iter().enumerate() {
            table[i * width..i * width + pages.len()].copy_from_slice(pages);
        }
        let lens: Vec<u32> = seqs.iter().map(|s| s.1 as u32).collect();
        let dev = self.k_pages.device();
        Ok((
            Tensor::from_vec(table, (ids.len(), width), dev)?,
            Tensor::new(lens.as_slice(), dev)?,
        ))
    }
}
