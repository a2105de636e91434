//! What the GPU test binaries share (feature `cuda`): the device with a fresh input seed, and the
//! arch / shared-memory overrides under test.

use candle_core::Device;
use flashcore::cuda::{set_arch_override, set_poison_outputs, set_smem_limit_override, Arch};

/// CUDA device 0 with a fresh generator seed (printed; FLASHCORE_TEST_SEED reproduces one), or
/// `None` after printing "skipped: no CUDA device" (CI greps for it). With
/// FLASHCORE_REQUIRE_GPU set (to anything but 0) a missing device fails the test instead, so a
/// GPU run that quietly found no GPU cannot pass.
pub fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => {
            // candle seeds the device generator with a constant: fresh inputs need a fresh seed.
            let seed = std::env::var("FLASHCORE_TEST_SEED")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(1, |t| t.as_nanos() as u64)
                });
            println!("device input seed {seed} (FLASHCORE_TEST_SEED)");
            d.set_seed(seed).expect("seeding the CUDA generator");
            Some(d)
        }
        Err(e) => {
            if std::env::var_os("FLASHCORE_REQUIRE_GPU").is_some_and(|v| v != "0") {
                panic!("FLASHCORE_REQUIRE_GPU is set but there is no CUDA device: {e}");
            }
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Arch under test: FLASHCORE_TEST_ARCH=sm80|sm90 forces a family (the H100 runs both);
/// FLASHCORE_TEST_SMEM=bytes plans with that much shared memory per block (101376 runs the
/// 99 KB tiles of sm_86/89 on the H100). Turns output poisoning on.
pub fn arch_under_test() {
    let a = std::env::var("FLASHCORE_TEST_ARCH")
        .ok()
        .and_then(|s| Arch::parse(&s));
    set_arch_override(a);
    let smem = std::env::var("FLASHCORE_TEST_SMEM")
        .ok()
        .and_then(|s| s.parse().ok());
    set_smem_limit_override(smem);
    set_poison_outputs(true);
}
