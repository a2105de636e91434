//! The variant table (src/plan/variants.rs) and the list of kernels this build compiled.
#![allow(dead_code)]

pub use crate::plan::variants::*;

mod compiled {
    include!(concat!(env!("OUT_DIR"), "/compiled_variants.rs"));
}
pub use compiled::{fatbin, COMPILED};

/// `v`'s position in `VARIANTS`, when `v` is one of its entries.
fn index_of(v: &Variant) -> Option<usize> {
    let size = std::mem::size_of::<Variant>();
    let off = (v as *const Variant as usize).wrapping_sub(VARIANTS.as_ptr() as usize);
    (off.is_multiple_of(size) && off / size < VARIANTS.len()).then_some(off / size)
}
/// Per-entry facts of `VARIANTS` computed once: entry-point name, combine kernel name, and
/// whether this build compiled it (the dispatcher asks on every call).
struct Table {
    symbols: Vec<String>,
    combines: Vec<String>,
    compiled: Vec<bool>,
}

fn table() -> &'static Table {
    static T: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let symbols: Vec<String> = VARIANTS.iter().map(Variant::symbol).collect();
        let compiled = symbols
            .iter()
            .map(|s| COMPILED.contains(&s.as_str()))
            .collect();
        let combines = VARIANTS
            .iter()
            .map(|v| combine_symbol(v.family, v.dtype, v.head_dim))
            .collect();
        Table {
            symbols,
            combines,
            compiled,
        }
    })
}

/// `v.symbol()`, without formatting it again for entries of `VARIANTS`.
pub fn symbol(v: &Variant) -> std::borrow::Cow<'static, str> {
    match index_of(v) {
        Some(i) => table().symbols[i].as_str().into(),
        None => v.symbol().into(),
    }
}

/// The combine kernel paired with decode variant `v` ([`combine_symbol`]).
pub fn combine_symbol_of(v: &Variant) -> std::borrow::Cow<'static, str> {
    match index_of(v) {
        Some(i) => table().combines[i].as_str().into(),
        None => combine_symbol(v.family, v.dtype, v.head_dim).into(),
    }
}

/// Whether this build compiled `v` (see `FLASHCORE_VARIANTS` in build.rs).
pub fn is_compiled(v: &Variant) -> bool {
    match index_of(v) {
        Some(i) => table().compiled[i],
        None => {
            let s = v.symbol();
            COMPILED.iter().any(|c| *c == s)
        }
    }
}
