//! Tensor parallelism across the GPUs of one host, Megatron-style: every rank holds a slice of
//! the attention heads and of the MLP's intermediate columns, and the partial outputs of
//! `o_proj` and `down_proj` are summed across ranks (one all-reduce after attention, one after
//! the MLP, per layer). Embeddings, norms and the rotary table are replicated; the LM head lives
//! on rank 0 only, which samples.
//!
//! One thread per rank, each with its own communicator: a forward pass runs every rank's layers
//! on scoped threads ([`on_ranks`]) so the ranks' kernel launches (candle launches every op from
//! the host) proceed in parallel, meeting only inside the all-reduces. With one rank there is no
//! thread and no all-reduce: TP=1 is the same code.
//!
//! [`LocalSum`] is an in-process all-reduce over tensors (a barrier and a sum in rank order),
//! used by the CPU tests to show that a sharded forward equals the unsharded one; NCCL
//! ([`crate::nccl`], loaded at run time) does the real one on GPUs.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use std::sync::{Arc, Barrier, Condvar, Mutex};

/// Sums a tensor across the ranks of a group; every rank calls it with the same shape, in the
/// same order of calls.
pub trait AllReduce: Send + Sync {
    fn sum(&self, x: &Tensor) -> Result<Tensor>;

    /// Milliseconds this rank spent in all-reduces since the last call, where they are timed
    /// (NCCL with `--time-allreduce`); 0 otherwise.
    fn take_ms(&self) -> Result<f64> {
        Ok(0.0)
    }

    /// Ends the group after a rank failed: collectives still waiting for the failed rank are
    /// cancelled, so that freeing the other ranks' memory does not wait for them forever.
    fn abort(&self) {}
}

/// This rank's place in the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// This rank's range of `n` items split evenly (the caller checked divisibility).
    pub fn part(&self, n: usize) -> (usize, usize) {
        let len = n / self.size;
        (self.rank * len, len)
    }
}

/// The rule a model must meet to be split across `size` ranks: whole K/V heads (each rank keeps
/// its query heads' K/V heads, so no head is replicated) and whole MLP columns.
pub fn check_divisible(size: usize, kv_heads: usize, q_heads: usize, inter: usize) -> Result<()> {
    if size == 0 {
        bail!("--tp must be at least 1")
    }
    if !kv_heads.is_multiple_of(size) || !q_heads.is_multiple_of(size) {
        bail!(
            "--tp {size}: the model's {q_heads} query / {kv_heads} key-value heads do not split \
             evenly over {size} ranks (tensor parallelism here gives each rank whole K/V heads: \
             use a --tp that divides {kv_heads})"
        )
    }
    if !inter.is_multiple_of(size) {
        bail!("--tp {size}: intermediate_size {inter} does not split evenly over {size} ranks")
    }
    Ok(())
}

/// Runs `f(rank, item)` for every rank: inline for one rank, otherwise on one scoped thread per
/// rank. A rank that fails leaves the others' collectives waiting for it, so a failure is
/// reported at once (stderr), the group is aborted through `comm` (which makes the group
/// unusable: the run ends), and the first error is returned.
pub fn on_ranks<T: Send, R: Send>(
    items: &mut [T],
    comm: Option<&dyn AllReduce>,
    f: impl Fn(usize, &mut T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if items.len() == 1 {
        return Ok(vec![f(0, &mut items[0])?]);
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .iter_mut()
            .enumerate()
            .map(|(rank, item)| s.spawn(move || f(rank, item)))
            .collect();
        let results: Vec<Result<R>> = handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.join() {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("tensor-parallel rank {rank} panicked")),
            })
            .collect();
        if results.iter().any(|r| r.is_err()) {
            for (rank, r) in results.iter().enumerate() {
                if let Err(e) = r {
                    eprintln!("tensor-parallel rank {rank} failed: {e:#}");
                }
            }
            if let Some(c) = comm {
                c.abort();
            }
        }
        results.into_iter().collect()
    })
}

/// An in-process all-reduce for ranks that are threads of one process: each rank deposits its
/// tensor, waits for the others, and every rank sums the deposits in rank order (so all ranks
/// get bit-identical results). For tests on the CPU; any device works.
pub struct LocalSum {
    rank: usize,
    shared: Arc<LocalShared>,
}

struct LocalShared {
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

impl LocalSum {
    /// One handle per rank of a group of `n`.
    pub fn group(n: usize) -> Vec<Arc<dyn AllReduce>> {
        let shared = Arc::new(LocalShared {
            slots: Mutex::new(vec![None; n]),
            barrier: Barrier::new(n),
        });
        (0..n)
            .map(|rank| {
                Arc::new(LocalSum {
                    rank,
                    shared: shared.clone(),
                }) as Arc<dyn AllReduce>
            })
            .collect()
    }
}

impl AllReduce for LocalSum {
    fn sum(&self, x: &Tensor) -> Result<Tensor> {
        let poisoned = |_| anyhow::anyhow!("LocalSum: a rank panicked");
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = Some(x.clone());
        self.shared.barrier.wait();
        let parts: Vec<Tensor> = {
            let slots = self.shared.slots.lock().map_err(poisoned)?;
            slots.iter().flatten().cloned().collect()
        };
        // Everyone has read every slot before anyone deposits the next call's tensor.
        self.shared.barrier.wait();
        let device = x.device();
        let mut acc = parts[0].to_device(device)?;
        for p in &parts[1..] {
            acc = (acc + p.to_device(device)?)?;
        }
        Ok(acc)
    }
}

/// The devices of a TP group of `n` ranks: GPUs `0..n`, or `n` times the CPU (emulated ranks).
///
/// Every GPU of a group has its own stream (`first` must be one too: `RunArgs::device_and_dtype`
/// with `tp > 1`). candle's plain `Device::new_cuda` runs on CUDA's per-thread default stream,
/// whose handle means "the calling thread's stream": a rank's ops would then land on a different
/// stream for every thread that issues them (each step's rank threads, the thread that issues a
/// grouped all-reduce for all ranks), unordered with each other
/// (docs/decisions.md#tensor-parallelism-in-the-examples-threads-whole-heads-nccl-loaded-at-run-time).
pub fn rank_devices(first: &Device, n: usize) -> Result<Vec<Device>> {
    match first {
        Device::Cpu => Ok(vec![Device::Cpu; n]),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let count = crate::nccl::device_count()?;
            if n > count {
                bail!("--tp {n}: this host has {count} GPU(s)")
            }
            let mut v = vec![first.clone()];
            for i in 1..n {
                v.push(Device::new_cuda_with_stream(i)?);
            }
            Ok(v)
        }
        other => bail!("tensor parallelism: unsupported device {other:?}"),
    }
}

/// A meeting point for the ranks' calls of one collective: each rank deposits its call; the last
/// to arrive runs `issue` on all of them (in rank order) and every rank gets its outcome. Used
/// by the NCCL grouped launch (`nccl.rs`), where `issue` makes every rank's `ncclAllReduce`
/// between `ncclGroupStart` and `ncclGroupEnd` from one thread.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // nccl.rs (CUDA builds) and the tests use it
pub struct Meeting<C> {
    state: Mutex<Round<C>>,
    done: Condvar,
    ranks: usize,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // nccl.rs (CUDA builds) and the tests use it
struct Round<C> {
    calls: Vec<Option<C>>,
    /// Rounds completed so far.
    round: u64,
    /// The last round's error (`None`: it succeeded).
    last: Option<String>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // nccl.rs (CUDA builds) and the tests use it
impl<C: Clone> Meeting<C> {
    pub fn new(ranks: usize) -> Meeting<C> {
        Meeting {
            state: Mutex::new(Round {
                calls: vec![None; ranks],
                round: 0,
                last: None,
            }),
            done: Condvar::new(),
            ranks,
        }
    }

    /// Deposits `rank`'s call and returns once the round it joined has been issued. A rank
    /// must not join the next round before every rank has joined this one (each rank makes
    /// one call per collective, in the same order, as tensor parallelism does).
    pub fn meet(&self, rank: usize, call: C, issue: impl FnOnce(&[C]) -> Result<()>) -> Result<()> {
        if rank >= self.ranks {
            bail!("meeting of {} ranks: no rank {rank}", self.ranks)
        }
        let poisoned = |_| anyhow::anyhow!("meeting: a rank panicked");
        let mut g = self.state.lock().map_err(poisoned)?;
        if g.calls[rank].is_some() {
            bail!("meeting: rank {rank} joined twice in one round")
        }
        g.calls[rank] = Some(call);
        let round = g.round;
        if g.calls.iter().all(Option::is_some) {
            let calls: Vec<C> = g.calls.iter_mut().flat_map(Option::take).collect();
            g.last = issue(&calls).err().map(|e| format!("{e:#}"));
            g.round += 1;
            self.done.notify_all();
        } else {
            while g.round == round {
                g = self.done.wait(g).map_err(poisoned)?;
            }
        }
        match &g.last {
            None => Ok(()),
            Some(e) => bail!("{e}"),
        }
    }
}
