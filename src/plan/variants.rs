//! The variant table (kernels/variants.rs, shared with build.rs): every kernel the build can
//! compile, with the tile facts the planner reads. Plain Rust, in every build (the planner needs
//! no `cuda` feature).
#![allow(dead_code)]

include!("../../kernels/variants.rs");

/// The variants of `family`/`kind` for this dtype, K/V type, head dim and mask, in order of
/// preference.
pub fn candidates(
    family: &'static str,
    kind: KKind,
    dtype: KDType,
    kv: KvType,
    head_dim: u32,
    mask: KMask,
) -> impl Iterator<Item = &'static Variant> {
    VARIANTS.iter().filter(move |v| {
        v.family == family
            && v.kind == kind
            && v.dtype == dtype
            && v.kv == kv
            && v.head_dim == head_dim
            && v.mask == mask
    })
}
