//! The variant table (kernels/variants.rs, shared with build.rs) and the list of kernels this
//! build compiled.
#![allow(dead_code)]

include!("../../kernels/variants.rs");

mod compiled {
    include!(concat!(env!("OUT_DIR"), "/compiled_variants.rs"));
}
pub use compiled::{fatbin, COMPILED};

/// The variants of `family`/`kind` for this dtype, head dim and mask, in order of preference.
pub fn candidates(
    family: &'static str,
    kind: KKind,
    dtype: KDType,
    head_dim: u32,
    mask: KMask,
) -> impl Iterator<Item = &'static Variant> {
    VARIANTS.iter().filter(move |v| {
        v.family == family
            && v.kind == kind
            && v.dtype == dtype
            && v.head_dim == head_dim
            && v.mask == mask
    })
}

/// Whether this build compiled `v` (see `FLASHCORE_VARIANTS` in build.rs).
pub fn is_compiled(v: &Variant) -> bool {
    let s = v.symbol();
    COMPILED.iter().any(|c| *c == s)
}
