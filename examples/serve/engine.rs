//! Three ways to serve a list of requests with the LLaMA example's model, timed the same way:
//!
//! * [`serve_continuous`]: continuous batching over one paged K/V pool. Every step packs one
//!   decode token of each running request and chunks of new prompts (up to a token budget) into
//!   one forward pass ([`PagedBatch`]); pages are handed out as sequences grow and given back
//!   when they finish; when the pool runs dry the newest request is preempted and later
//!   recomputed (its prompt and the tokens it already produced are prefilled again).
//! * [`serve_static`]: static batching: requests grouped in arrival order into batches of a
//!   fixed size, each padded to its longest prompt and run until its longest generation ends,
//!   over a dense `(batch, max_seq)` cache.
//! * [`serve_sequential`]: one request at a time (the llama example's own path).
//!
//! Each returns every request's tokens with the times they reached the host, so the summary
//! (throughput, time to first token, inter-token latency) is computed the same way for all.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::generate::{generate, Sampler};
use crate::model::{Config, KvCache, Model, PagedBatch, Pools, SeqStep};

/// One request: prompt ids, a cap on new tokens, and when it arrives (seconds after the start).
#[derive(Clone, Debug)]
pub struct Request {
    pub id: usize,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub arrival: f64,
}

/// What the engines share: sampling and stopping.
#[derive(Clone, Debug)]
pub struct Options {
    /// Tokens that end a request (kept in its output); empty to always run to `max_new_tokens`.
    pub eos: Vec<u32>,
    /// 0 is greedy.
    pub temperature: f64,
    pub top_p: f64,
    /// Request `id` samples with seed `seed + id` in every engine, so sampled runs compare too.
    pub seed: u64,
    /// Print progress on stderr.
    pub progress: bool,
}

impl Options {
    fn sampler(&self, id: usize) -> Sampler {
        if self.temperature > 0.0 {
            Sampler::new(
                self.temperature,
                self.top_p,
                self.seed.wrapping_add(id as u64),
            )
        } else {
            Sampler::greedy()
        }
    }
}

/// Continuous-batching limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most requests running at once.
    pub max_seqs: usize,
    /// Most new tokens per step (decode tokens count one each; prompts are chunked to fit).
    pub max_batch_tokens: usize,
}

/// A request's result: its new tokens and the time (seconds after the start) each reached the
/// host.
#[derive(Clone, Debug)]
pub struct Finished {
    pub id: usize,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub arrival: f64,
    pub token_times: Vec<f64>,
    pub hit_eos: bool,
    pub preempted: usize,
}

/// One engine step: its wall time, what it ran, and the K/V rows its attention read.
#[derive(Clone, Debug, Default)]
pub struct Step {
    pub seconds: f64,
    /// Host time from the step's start until its forward pass was enqueued (the batch tables
    /// built and uploaded, every layer's kernels launched): when close to `seconds`, the step
    /// is host-bound.
    pub host: f64,
    pub decode_tokens: usize,
    pub prefill_tokens: usize,
    pub kv_rows: usize,
    pub pages_used: usize,
}

pub struct RunReport {
    pub mode: &'static str,
    pub finished: Vec<Finished>,
    pub wall: f64,
    pub steps: Vec<Step>,
    pub preemptions: usize,
    /// Pages in the pool and the largest number in use (continuous batching only).
    pub pool_pages: usize,
    pub page_size: usize,
    /// Static batching: the batch size.
    pub batch_size: usize,
}

/// Per-layer K/V pools `(num_pages, page_size, heads_kv, head_dim)` sharing one page
/// allocator: a page id means the same rows in every layer.
pub struct KvPool {
    /// `[rank][layer]` K/V page buffers.
    layers: Pools,
    page_size: usize,
    free: Vec<u32>,
}

impl KvPool {
    /// Bytes of one page over all layers (K and V) on each of `tp` ranks (each holds
    /// `heads_kv / tp` heads).
    pub fn page_bytes(cfg: &Config, page_size: usize, dtype: DType, tp: usize) -> usize {
        2 * cfg.num_hidden_layers
            * page_size
            * (cfg.num_key_value_heads / tp.max(1))
            * cfg.head_dim
            * dtype.size_in_bytes()
    }

    /// `num_pages` pages on every rank of `model` (a page number names the same rows on all).
    pub fn new(model: &Model, num_pages: usize, page_size: usize, dtype: DType) -> Result<KvPool> {
        if num_pages == 0 || page_size == 0 || num_pages > u32::MAX as usize {
            bail!("kv pool: need at least one page of at least one row (got {num_pages} pages of {page_size})")
        }
        let layers = model.kv_buffers(num_pages, page_size, dtype)?;
        Ok(KvPool {
            layers,
            page_size,
            free: (0..num_pages as u32).rev().collect(),
        })
    }

    pub fn num_pages(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.first())
            .map(|(k, _)| k.dim(0).unwrap_or(0))
            .unwrap_or(0)
    }

    fn pages_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.page_size)
    }
}

/// Nearest-rank percentile of unsorted values (`None` when empty).
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// A one-line progress display on stderr (carriage-return updates on a terminal, a line per
/// tenth of the requests otherwise).
struct Progress {
    mode: &'static str,
    total: usize,
    enabled: bool,
    tty: bool,
    last: Instant,
    last_tenth: usize,
}

impl Progress {
    fn new(mode: &'static str, total: usize, enabled: bool) -> Progress {
        Progress {
            mode,
            total,
            enabled,
            tty: std::io::stderr().is_terminal(),
            last: Instant::now(),
            last_tenth: 0,
        }
    }

    fn update(&mut self, done: usize, detail: impl FnOnce() -> String) {
        if !self.enabled {
            return;
        }
        let tenth = done * 10 / self.total.max(1);
        let show = if self.tty {
            self.last.elapsed() > Duration::from_millis(250) || done == self.total
        } else {
            tenth > self.last_tenth
        };
        if !show {
            return;
        }
        self.last = Instant::now();
        self.last_tenth = tenth;
        let width = 30;
        let filled = done * width / self.total.max(1);
        let line = format!(
            "[{}] [{}{}] {done}/{} {}",
            self.mode,
            "#".repeat(filled),
            "-".repeat(width - filled),
            self.total,
            detail()
        );
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r{line}\x1b[K");
            if done == self.total {
                let _ = writeln!(err);
            }
        } else {
            let _ = writeln!(err, "{line}");
        }
    }
}

/// Sleeps until `at` seconds after `start` (no-op if that has passed).
fn wait_until(start: Instant, at: f64) {
    let now = start.elapsed().as_secs_f64();
    if at > now {
        std::thread::sleep(Duration::from_secs_f64(at - now));
    }
}

/// Next token of each row of `(n, vocab)` f32 logits: one argmax on the device when every
/// sampler is greedy, the samplers row by row otherwise.
fn sample_rows(logits: &Tensor, samplers: &mut [&mut Sampler]) -> Result<Vec<u32>> {
    if samplers.iter().all(|s| s.is_greedy()) {
        return Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
    }
    samplers
        .iter_mut()
        .enumerate()
        .map(|(i, s)| s.sample(&logits.narrow(0, i, 1)?))
        .collect()
}

/// A request inside the continuous engine.
struct Seq {
    id: usize,
    /// Prompt then the tokens generated so far; rows `..cached` are in the pool.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    arrival: f64,
    cached: usize,
    pages: Vec<u32>,
    sampler: Sampler,
    times: Vec<f64>,
    preempted: usize,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// Continuous batching over `pool` (see the module doc). Requests must be sorted by arrival.
pub fn serve_continuous(
    model: &Model,
    requests: &[Request],
    opt: &Options,
    limits: &Limits,
    pool: &mut KvPool,
) -> Result<RunReport> {
    let page_size = pool.page_size;
    let capacity = pool.num_pages();
    if limits.max_seqs == 0 || limits.max_batch_tokens == 0 {
        bail!("continuous batching: --max-seqs and --max-batch-tokens must be positive")
    }
    for r in requests {
        let rows = r.prompt.len() + r.max_new_tokens;
        if r.prompt.is_empty() {
            bail!("request {}: empty prompt", r.id)
        }
        if pool.pages_for(rows) > capacity {
            bail!(
                "request {} needs {} pages ({rows} rows) but the pool has {capacity} pages of {page_size} rows: raise --kv-pages",
                r.id,
                pool.pages_for(rows)
            )
        }
    }
    let device = model_device(pool);
    let devices = model.devices();
    let mut arrivals: VecDeque<&Request> = requests.iter().collect();
    let mut waiting: VecDeque<Seq> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut finished = Vec::with_capacity(requests.len());
    let mut steps = Vec::new();
    let mut preemptions = 0;
    let mut progress = Progress::new("continuous", requests.len(), opt.progress);
    let start = Instant::now();

    // Gives a sequence's pages back and queues it (first) for recomputation.
    fn preempt(mut s: Seq, pool: &mut KvPool, waiting: &mut VecDeque<Seq>) {
        pool.free.append(&mut s.pages);
        s.cached = 0;
        s.preempted += 1;
        waiting.push_front(s);
    }

    loop {
        let now = start.elapsed().as_secs_f64();
        while arrivals.front().is_some_and(|r| r.arrival <= now) {
            let r = arrivals.pop_front().expect("front");
            waiting.push_back(Seq {
                id: r.id,
                tokens: r.prompt.clone(),
                prompt_len: r.prompt.len(),
                max_new: r.max_new_tokens,
                arrival: r.arrival,
                cached: 0,
                pages: Vec::new(),
                sampler: opt.sampler(r.id),
                times: Vec::new(),
                preempted: 0,
            });
        }
        if running.is_empty() && waiting.is_empty() {
            match arrivals.front() {
                None => break,
                Some(r) => {
                    wait_until(start, r.arrival);
                    continue;
                }
            }
        }

        // Plan the step: (index into `running`, new tokens). Decodes first, oldest first; a
        // decode that needs a page nobody has preempts the newest running request.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < running.len() {
            if running[i].tokens.len() - running[i].cached != 1 {
                i += 1;
                continue;
            }
            let need = pool
                .pages_for(running[i].cached + 1)
                .saturating_sub(running[i].pages.len());
            while need > pool.free.len() && running.len() > i + 1 {
                let victim = running.pop().expect("newer request");
                preempt(victim, pool, &mut waiting);
                preemptions += 1;
            }
            if need > pool.free.len() {
                let me = running.remove(i);
                preempt(me, pool, &mut waiting);
                preemptions += 1;
                continue;
            }
            let at = pool.free.len() - need;
            let taken = pool.free.split_off(at);
            running[i].pages.extend(taken);
            plan.push((i, 1));
            i += 1;
        }
        let mut budget = limits.max_batch_tokens.saturating_sub(plan.len());
        // Prompts already started, then new admissions, chunked to the budget and the pages.
        let take_chunk = |s: &mut Seq, budget: &mut usize, pool: &mut KvPool| -> usize {
            let pending = s.tokens.len() - s.cached;
            let fit = (s.pages.len() + pool.free.len()) * page_size - s.cached;
            let n = pending.min(*budget).min(fit);
            if n > 0 {
                let need = pool.pages_for(s.cached + n).saturating_sub(s.pages.len());
                let at = pool.free.len() - need;
                let taken = pool.free.split_off(at);
                s.pages.extend(taken);
                *budget -= n;
            }
            n
        };
        for (i, s) in running.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            if s.tokens.len() - s.cached > 1 {
                let n = take_chunk(s, &mut budget, pool);
                if n > 0 {
                    plan.push((i, n));
                }
            }
        }
        // Admit while the whole remaining prompt (plus the first new token) fits in free pages,
        // so that admitted prompts are rarely preempted half-way.
        while budget > 0 && running.len() < limits.max_seqs {
            let Some(s) = waiting.front() else { break };
            if pool.pages_for(s.tokens.len() + 1) > pool.free.len() {
                break;
            }
            let mut s = waiting.pop_front().expect("front");
            let n = take_chunk(&mut s, &mut budget, pool);
            running.push(s);
            plan.push((running.len() - 1, n));
        }
        if plan.is_empty() {
            // Every running request is a prompt that cannot get a page: free the newest.
            match running.pop() {
                Some(victim) => {
                    preempt(victim, pool, &mut waiting);
                    preemptions += 1;
                    continue;
                }
                None => bail!("continuous batching: nothing can run (pool of {capacity} pages)"),
            }
        }
        // Decode groups first, then prompt chunks (two attention calls per layer at most).
        plan.sort_by_key(|&(i, n)| (n > 1, i));

        let t0 = Instant::now();
        let seqs: Vec<SeqStep> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &running[i];
                SeqStep {
                    tokens: &s.tokens[s.cached..s.cached + n],
                    cached: s.cached,
                    pages: &s.pages,
                }
            })
            .collect();
        let batch = PagedBatch::new(&seqs, page_size, &devices)?;
        let logits = model.forward_paged(&batch, &pool.layers)?;
        let host = t0.elapsed().as_secs_f64();
        // Sequences whose new tokens reach their end get a next token, sampled in running
        // order (each with its own sampler): (running index, row of the logits).
        let mut complete: Vec<(usize, usize)> = plan
            .iter()
            .enumerate()
            .filter(|(_, &(i, n))| running[i].cached + n == running[i].tokens.len())
            .map(|(row, &(i, _))| (i, row))
            .collect();
        complete.sort_unstable();
        let next = if complete.is_empty() {
            Vec::new()
        } else {
            let rows: Vec<u32> = complete.iter().map(|&(_, row)| row as u32).collect();
            let picked = logits.index_select(&Tensor::new(rows.as_slice(), &device)?, 0)?;
            let mut want = complete.iter().map(|&(i, _)| i).peekable();
            let mut samplers: Vec<&mut Sampler> = Vec::with_capacity(complete.len());
            for (i, s) in running.iter_mut().enumerate() {
                if want.peek() == Some(&i) {
                    samplers.push(&mut s.sampler);
                    want.next();
                }
            }
            sample_rows(&picked, &mut samplers)?
        };
        let now = start.elapsed().as_secs_f64();
        let mut step = Step {
            seconds: t0.elapsed().as_secs_f64(),
            host,
            ..Default::default()
        };
        for &(i, n) in &plan {
            let s = &mut running[i];
            if n == 1 && s.cached >= s.prompt_len {
                step.decode_tokens += 1;
            } else {
                step.prefill_tokens += n;
            }
            s.cached += n;
            step.kv_rows += s.cached;
        }
        for (&(i, _), &t) in complete.iter().zip(&next) {
            running[i].tokens.push(t);
            running[i].times.push(now);
        }
        // Retire the finished requests (highest index first, so indices stay valid).
        let mut done_idx: Vec<usize> = running
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                s.generated() >= s.max_new
                    || (s.generated() > 0 && opt.eos.contains(s.tokens.last().expect("token")))
            })
            .map(|(i, _)| i)
            .collect();
        done_idx.sort_unstable_by(|a, b| b.cmp(a));
        for i in done_idx {
            let mut s = running.remove(i);
            pool.free.append(&mut s.pages);
            let hit_eos = opt.eos.contains(s.tokens.last().expect("token"));
            finished.push(Finished {
                id: s.id,
                prompt_tokens: s.prompt_len,
                tokens: s.tokens[s.prompt_len..].to_vec(),
                arrival: s.arrival,
                token_times: s.times,
                hit_eos,
                preempted: s.preempted,
            });
        }
        step.pages_used = capacity - pool.free.len();
        steps.push(step);
        let (nr, nw, used) = (running.len(), waiting.len(), capacity - pool.free.len());
        progress.update(finished.len(), || {
            format!(
                "running {nr} waiting {nw} pool {:.0}% preempted {preemptions}",
                100.0 * used as f64 / capacity as f64
            )
        });
    }
    finished.sort_by_key(|f| f.id);
    Ok(RunReport {
        mode: "continuous",
        finished,
        wall: start.elapsed().as_secs_f64(),
        steps,
        preemptions,
        pool_pages: capacity,
        page_size,
        batch_size: limits.max_seqs,
    })
}

fn model_device(pool: &KvPool) -> Device {
    pool.layers
        .first()
        .and_then(|l| l.first())
        .map(|(k, _)| k.device().clone())
        .unwrap_or(Device::Cpu)
}

/// Static batching: requests in arrival order, `batch_size` at a time; a batch starts when its
/// last request has arrived, is prefilled padded to its longest prompt (right padding: causal
/// attention keeps the padding out of every real token's view; sub-batches of at most
/// `max_batch_tokens` padded tokens, as the continuous engine's step), and decodes until its
/// longest generation is done, every row computing a token per step. The K/V memory is a dense
/// `(batch, longest prompt + longest generation)` cache per layer, seen as a pool of one page
/// per row so that each row reads and writes its own positions. Tokens past a request's end
/// are computed and discarded.
pub fn serve_static(
    model: &Model,
    requests: &[Request],
    opt: &Options,
    batch_size: usize,
    max_batch_tokens: usize,
    dtype: DType,
) -> Result<RunReport> {
    if batch_size == 0 {
        bail!("static batching: the batch size must be positive")
    }
    let devices = model.devices();
    let mut finished = Vec::with_capacity(requests.len());
    let mut steps = Vec::new();
    let mut progress = Progress::new("static", requests.len(), opt.progress);
    let start = Instant::now();
    for group in requests.chunks(batch_size) {
        wait_until(start, group.iter().map(|r| r.arrival).fold(0.0, f64::max));
        let b = group.len();
        let p_max = group.iter().map(|r| r.prompt.len()).max().unwrap_or(1);
        let g_max = group.iter().map(|r| r.max_new_tokens).max().unwrap_or(0);
        let max_seq = p_max + g_max;
        let cache = KvPool::new(model, b, max_seq, dtype)?;
        let pages: Vec<[u32; 1]> = (0..b as u32).map(|i| [i]).collect();
        let mut samplers: Vec<Sampler> = group.iter().map(|r| opt.sampler(r.id)).collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); b];
        let mut live: Vec<bool> = group.iter().map(|r| r.max_new_tokens > 0).collect();

        // Prefill, padded.
        let padded: Vec<Vec<u32>> = group
            .iter()
            .map(|r| {
                let mut p = r.prompt.clone();
                p.resize(p_max, 0);
                p
            })
            .collect();
        let per_pass = (max_batch_tokens / p_max).max(1);
        let mut next = Vec::with_capacity(b);
        for first in (0..b).step_by(per_pass) {
            let t0 = Instant::now();
            let rows = first..(first + per_pass).min(b);
            let seqs: Vec<SeqStep> = rows
                .clone()
                .map(|k| SeqStep {
                    tokens: &padded[k],
                    cached: 0,
                    pages: &pages[k],
                })
                .collect();
            let last: Vec<usize> = rows.clone().map(|k| group[k].prompt.len() - 1).collect();
            let batch = PagedBatch::new(&seqs, max_seq, &devices)?.logits_at(&last)?;
            let logits = model.forward_paged(&batch, &cache.layers)?;
            let mut refs: Vec<&mut Sampler> = samplers[rows.clone()].iter_mut().collect();
            next.extend(sample_rows(&logits, &mut refs)?);
            steps.push(Step {
                seconds: t0.elapsed().as_secs_f64(),
                prefill_tokens: rows.len() * p_max,
                kv_rows: rows.len() * p_max,
                ..Default::default()
            });
        }
        let mut step_no = 0;
        loop {
            let now = start.elapsed().as_secs_f64();
            for k in 0..b {
                if live[k] {
                    out[k].push(next[k]);
                    times[k].push(now);
                    if out[k].len() >= group[k].max_new_tokens || opt.eos.contains(&next[k]) {
                        live[k] = false;
                    }
                }
            }
            let done = finished.len() + live.iter().filter(|l| !**l).count();
            progress.update(done, || format!("batch of {b}, step {step_no}"));
            if !live.iter().any(|l| *l) {
                break;
            }
            // Every row decodes (finished rows too: that is static batching's cost).
            let t0 = Instant::now();
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let seqs: Vec<SeqStep> = (0..b)
                .map(|k| SeqStep {
                    tokens: &toks[k],
                    cached: group[k].prompt.len() + step_no,
                    pages: &pages[k],
                })
                .collect();
            let batch = PagedBatch::new(&seqs, max_seq, &devices)?;
            let logits = model.forward_paged(&batch, &cache.layers)?;
            let host = t0.elapsed().as_secs_f64();
            let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
            next = sample_rows(&logits, &mut refs)?;
            step_no += 1;
            steps.push(Step {
                seconds: t0.elapsed().as_secs_f64(),
                host,
                decode_tokens: b,
                kv_rows: group.iter().map(|r| r.prompt.len() + step_no).sum(),
                ..Default::default()
            });
        }
        for (k, r) in group.iter().enumerate() {
            let hit_eos = out[k].last().is_some_and(|t| opt.eos.contains(t));
            finished.push(Finished {
                id: r.id,
                prompt_tokens: r.prompt.len(),
                tokens: std::mem::take(&mut out[k]),
                arrival: r.arrival,
                token_times: std::mem::take(&mut times[k]),
                hit_eos,
                preempted: 0,
            });
        }
    }
    finished.sort_by_key(|f| f.id);
    Ok(RunReport {
        mode: "static",
        finished,
        wall: start.elapsed().as_secs_f64(),
        steps,
        preemptions: 0,
        pool_pages: 0,
        page_size: 0,
        batch_size,
    })
}

/// One request at a time, in arrival order, through the llama example's `generate` (dense
/// cache, flashcore attention).
pub fn serve_sequential(
    model: &Model,
    requests: &[Request],
    opt: &Options,
    dtype: DType,
) -> Result<RunReport> {
    let max_seq = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(1);
    let mut cache = KvCache::new(model, 1, max_seq, dtype)?;
    let mut finished = Vec::with_capacity(requests.len());
    let mut progress = Progress::new("sequential", requests.len(), opt.progress);
    let start = Instant::now();
    for (n, r) in requests.iter().enumerate() {
        wait_until(start, r.arrival);
        let mut times = Vec::new();
        let g = generate(
            model,
            &mut cache,
            &r.prompt,
            r.max_new_tokens,
            &opt.eos,
            &mut opt.sampler(r.id),
            &mut |_| {
                times.push(start.elapsed().as_secs_f64());
                Ok(())
            },
        )?;
        finished.push(Finished {
            id: r.id,
            prompt_tokens: r.prompt.len(),
            tokens: g.tokens,
            arrival: r.arrival,
            token_times: times,
            hit_eos: g.stats.hit_eos,
            preempted: 0,
        });
        progress.update(n + 1, String::new);
    }
    Ok(RunReport {
        mode: "sequential",
        finished,
        wall: start.elapsed().as_secs_f64(),
        steps: Vec::new(),
        preemptions: 0,
        pool_pages: 0,
        page_size: 0,
        batch_size: 1,
    })
}
