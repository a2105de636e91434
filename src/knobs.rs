//! Every `FLASHCORE_*` environment variable the library reads at run time, in one struct read
//! once per process (on first use: [`knobs`]). They are debugging and A/B aids for the CUDA path;
//! none changes a result beyond rounding, and a CPU-only build reads none of them. Programmatic
//! overrides (`flashcore::cuda::set_arch_override`, `set_smem_limit_override`,
//! `set_poison_outputs`) take precedence over the matching variables.
//!
//! Variables read elsewhere, listed here so that this is the one complete list:
//! - build time (build.rs, feature `cuda`): `FLASHCORE_VARIANTS=substr[,substr]` compiles only
//!   the kernels whose symbol contains a substring (the others report "not compiled"); also the
//!   toolkit's `CUDA_HOME` / `CUDA_PATH` / `CUDA_ROOT` and `NVCC_FLAGS`.
//! - tests: `FLASHCORE_REQUIRE_GPU` (a GPU test without a device fails instead of skipping),
//!   `FLASHCORE_REQUIRE_MODEL` (a test without the SmolLM2 GGUF fails instead of skipping),
//!   `FLASHCORE_TEST_SEED` (the GPU tests' input seed), `FLASHCORE_TEST_ARCH` and
//!   `FLASHCORE_TEST_SMEM` (the family / shared memory the GPU tests force),
//!   `FLASHCORE_RANDOM_CASES` (how many random cases the randomised tests draw),
//!   `FLASHCORE_TEST_VERBOSE` (per-case output).
//! - tests, examples and scripts: `FLASHCORE_SMOLLM2_GGUF` (the test model file),
//!   `FLASHCORE_CACHE` (where scripts/fetch-smollm2.sh puts it), `FLASHCORE_CUDA_PREFIX`
//!   (where scripts/install-cuda-toolkit.sh installs the toolkit).

// Without the `cuda` feature nothing reads the knobs (they steer the CUDA dispatcher only).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::path::PathBuf;
use std::sync::OnceLock;

/// The run-time knobs. A boolean "set" knob is on when the variable is present and not `0`.
#[derive(Debug)]
pub(crate) struct Knobs {
    /// `FLASHCORE_ARCH=sm80|sm90`: force a kernel family (sm90 only on compute capability 9.0).
    /// A value that is neither is an error on every CUDA call, naming the variable.
    #[cfg(feature = "cuda")]
    pub arch: Result<Option<crate::cuda::Arch>, String>,
    /// `FLASHCORE_SMEM_LIMIT=bytes`: plan tiles as if a block could use at most this much
    /// shared memory (runs a smaller GPU's tiles on a big one). Not a positive integer: an error
    /// on every CUDA call.
    pub smem_limit: Result<Option<u32>, String>,
    /// `FLASHCORE_POISON` set: fill every output with NaN before its kernel runs, so that
    /// elements a kernel does not write show up (one extra fill per output).
    pub poison: bool,
    /// `FLASHCORE_SYNC` set: synchronise the stream after every launch, so that a kernel fault
    /// is reported by the call that caused it (slow; debugging).
    pub sync: bool,
    /// `FLASHCORE_NO_PDL` set: launch without programmatic dependent launch (plain
    /// stream-ordered launches; debugging).
    pub no_pdl: bool,
    /// `FLASHCORE_FATBIN_DIR=dir`: load `dir/fc_<family>.fatbin` instead of the embedded
    /// kernels when that file exists (kernel development without relinking;
    /// docs/kernel-development.md).
    pub fatbin_dir: Option<PathBuf>,
    /// `FLASHCORE_SKIP_VARIANTS=substr[,substr]`: the dispatcher passes over the kernel variants
    /// whose symbol contains a substring and takes the next candidate (tile A/B tests).
    pub skip_variants: Vec<String>,
    /// `FLASHCORE_SM90_CAUSAL=static`: causal sm90 problems use the static grid instead of the
    /// dynamic tile schedule.
    pub sm90_causal_static: bool,
    /// `FLASHCORE_SM90_KV_SPLITS=1|2|4`: force the sm90 key-split cluster size wherever the
    /// clusters fit in one wave (other values are ignored).
    pub sm90_kv_splits: Option<usize>,
    /// `FLASHCORE_PAGED_GATHER=1`: paged prefill on sm90 gathers the pages into dense scratch
    /// instead of reading the pool through the page table.
    pub paged_gather: bool,
    /// `FLASHCORE_DECODE_EVEN=1`: split-KV decodes split the keys evenly instead of balancing
    /// them over the batch's lengths.
    pub decode_even: bool,
    /// `FLASHCORE_DECODE_OCCUPANCY=full`: split-KV decode grids run as many CTAs per SM as their
    /// shared memory allows (no occupancy cap).
    pub decode_full_occupancy: bool,
    /// `FLASHCORE_DECODE_CLUSTER=1`: split-KV decode grids launch without thread-block
    /// clusters.
    pub decode_cluster_off: bool,
}

impl Knobs {
    /// The knobs from a variable lookup (`std::env::var(..).ok()` in the library; a map in
    /// the tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Knobs {
        let set = |name: &str| get(name).is_some_and(|v| v != "0");
        let is = |name: &str, value: &str| get(name).is_some_and(|v| v == value);
        // unset or empty: None; else `parse` or an error naming the variable and its rule
        fn checked<T>(
            raw: Option<String>,
            name: &str,
            rule: &str,
            parse: impl Fn(&str) -> Option<T>,
        ) -> Result<Option<T>, String> {
            match raw {
                Some(s) if !s.is_empty() => parse(&s)
                    .map(Some)
                    .ok_or_else(|| format!("flashcore: {name} must be {rule}, got {s:?}")),
                _ => Ok(None),
            }
        }
        Knobs {
            #[cfg(feature = "cuda")]
            arch: checked(
                get("FLASHCORE_ARCH"),
                "FLASHCORE_ARCH",
                "sm80 or sm90",
                crate::cuda::Arch::parse,
            ),
            smem_limit: checked(
                get("FLASHCORE_SMEM_LIMIT"),
                "FLASHCORE_SMEM_LIMIT",
                "a positive number of bytes",
                |s| s.trim().parse::<u32>().ok().filter(|&n| n > 0),
            ),
            poison: set("FLASHCORE_POISON"),
            sync: set("FLASHCORE_SYNC"),
            no_pdl: set("FLASHCORE_NO_PDL"),
            fatbin_dir: get("FLASHCORE_FATBIN_DIR").map(PathBuf::from),
            skip_variants: get("FLASHCORE_SKIP_VARIANTS")
                .map(|s| {
                    s.split(',')
                        .filter(|x| !x.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            sm90_causal_static: is("FLASHCORE_SM90_CAUSAL", "static"),
            sm90_kv_splits: get("FLASHCORE_SM90_KV_SPLITS")
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|n| matches!(n, 1 | 2 | 4)),
            paged_gather: is("FLASHCORE_PAGED_GATHER", "1"),
            decode_even: is("FLASHCORE_DECODE_EVEN", "1"),
            decode_full_occupancy: is("FLASHCORE_DECODE_OCCUPANCY", "full"),
            decode_cluster_off: is("FLASHCORE_DECODE_CLUSTER", "1"),
        }
    }
}

/// The process's knobs, read from the environment on first use.
pub(crate) fn knobs() -> &'static Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    KNOBS.get_or_init(|| Knobs::from_lookup(|name| std::env::var(name).ok()))
}

#[cfg(test)]
mod tests {
    use super::Knobs;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Knobs {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Knobs::from_lookup(|name| m.get(name).cloned())
    }

    #[test]
    fn unset_means_off() {
        let k = with(&[]);
        assert!(!k.poison && !k.sync && !k.no_pdl && !k.paged_gather && !k.decode_even);
        assert!(!k.sm90_causal_static && !k.decode_full_occupancy && !k.decode_cluster_off);
        assert!(k.skip_variants.is_empty() && k.fatbin_dir.is_none());
        assert_eq!(k.sm90_kv_splits, None);
        assert_eq!(k.smem_limit, Ok(None));
    }

    #[test]
    fn values_parse_as_documented() {
        let k = with(&[
            ("FLASHCORE_POISON", "1"),
            ("FLASHCORE_SYNC", "0"),
            ("FLASHCORE_NO_PDL", "yes"),
            ("FLASHCORE_SKIP_VARIANTS", "d64_causal,,128x128"),
            ("FLASHCORE_SM90_CAUSAL", "static"),
            ("FLASHCORE_SM90_KV_SPLITS", "3"),
            ("FLASHCORE_PAGED_GATHER", "true"),
            ("FLASHCORE_DECODE_OCCUPANCY", "full"),
            ("FLASHCORE_SMEM_LIMIT", "101376"),
        ]);
        assert!(k.poison && !k.sync && k.no_pdl && k.sm90_causal_static);
        assert_eq!(k.skip_variants, ["d64_causal", "128x128"]);
        assert_eq!(k.sm90_kv_splits, None, "3 is not a cluster size");
        assert!(!k.paged_gather, "only 1 turns the gather on");
        assert!(k.decode_full_occupancy);
        assert_eq!(k.smem_limit, Ok(Some(101376)));
        assert_eq!(
            with(&[("FLASHCORE_SM90_KV_SPLITS", "4")]).sm90_kv_splits,
            Some(4)
        );
    }

    #[test]
    fn a_bad_smem_limit_names_the_variable() {
        let e = with(&[("FLASHCORE_SMEM_LIMIT", "0")])
            .smem_limit
            .unwrap_err();
        assert!(
            e.contains("FLASHCORE_SMEM_LIMIT") && e.contains("positive"),
            "{e}"
        );
        assert_eq!(with(&[("FLASHCORE_SMEM_LIMIT", "")]).smem_limit, Ok(None));
    }
}
