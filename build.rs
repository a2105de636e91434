//! Compiles the CUDA kernels (feature `cuda`) into one fatbin per family, driven by the variant
//! table in kernels/variants.rs. Needs nvcc (CUDA_HOME, CUDA_PATH or PATH), never a GPU.
//! `FLASHCORE_VARIANTS=substr[,substr]` compiles only the kernels whose symbol contains one of
//! the substrings (kernel development builds); the others then report "not compiled".

#[allow(dead_code)]
mod variants {
    include!("kernels/variants.rs");
}

#[allow(dead_code)]
mod params {
    include!("kernels/params.rs");
}

use std::path::{Path, PathBuf};
use std::process::Command;
use variants::{KKind, FAMILIES, VARIANTS};

fn find_nvcc() -> Option<PathBuf> {
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Ok(root) = std::env::var(var) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = PathBuf::from("/usr/local/cuda/bin/nvcc");
    p.is_file().then_some(p)
}

fn kind_macro(family: &str, kind: KKind) -> String {
    format!(
        "FC_{}_{}",
        family.to_uppercase(),
        kind.name().to_uppercase()
    )
}

fn kind_header(family: &str, kind: KKind) -> String {
    format!("{family}/{}.cuh", kind.name())
}

/// `static_assert`s that the C parameter block (kernels/common/params.h) has the layout of the
/// Rust one (kernels/params.rs): every field's offset and size, and the whole struct's size.
fn params_layout_asserts() -> String {
    let mut s =
        String::from("// The parameter block's layout, as kernels/params.rs declares it.\n");
    for (field, offset, size) in params::FC_PARAMS_LAYOUT {
        s += &format!(
            "static_assert(offsetof(FcParams, {field}) == {offset} && sizeof(FcParams::{field}) == {size}, \
             \"FcParams.{field}: kernels/params.rs puts it at byte {offset} with {size} bytes; kernels/common/params.h differs\");\n"
        );
    }
    let total = std::mem::size_of::<params::FcParams>();
    s += &format!(
        "static_assert(sizeof(FcParams) == {total}, \"FcParams: kernels/params.rs is {total} bytes; kernels/common/params.h differs\");\n"
    );
    s
}

/// `static_assert`s that the kernel just instantiated states about itself (`fc_facts_<symbol>`,
/// kernels/common/params.h `FcKernelFacts`) what the variant table states about it: a table
/// entry that drifts from its kernel fails the build with a message naming the variant.
fn facts_asserts(v: &variants::Variant) -> String {
    let sym = v.symbol();
    let facts = [
        ("smem_bytes", "smem_bytes()", v.smem_bytes().to_string()),
        (
            "softcap_body",
            "computes_modifiers()",
            v.computes_modifiers().to_string(),
        ),
        ("tma_pages", "tma_pages()", v.tma_pages().to_string()),
        ("paged_twin", "paged", v.paged.to_string()),
        ("kv_split", "kv_split", v.kv_split.to_string()),
        ("width", "width()", v.width().to_string()),
        ("q_stages", "q_stages", v.q_stages.to_string()),
    ];
    // the other families state no V width (their kernels take p.dv up to their head dim)
    let v_width = [("v_width", "v_width()", v.v_width().to_string())];
    let sm90 = if v.family == "sm90" {
        &v_width[..]
    } else {
        &[]
    };
    facts
        .iter()
        .chain(sm90)
        .map(|(field, rust, value)| {
            format!(
                "static_assert(fc_facts_{sym}.{field} == {value}, \"variant {sym}: kernels/variants.rs says {rust} = {value}, the kernel disagrees ({field})\");\n"
            )
        })
        .collect()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/variants.rs");
    println!("cargo:rerun-if-changed=kernels/params.rs");
    println!("cargo:rerun-if-env-changed=FLASHCORE_VARIANTS");
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "NVCC_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // Every kernel source, explicitly.
    for dir in ["kernels/common", "kernels/sm80", "kernels/sm90"] {
        if let Ok(rd) = std::fs::read_dir(dir) {
            let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
            files.sort();
            for f in files {
                if matches!(
                    f.extension().and_then(|e| e.to_str()),
                    Some("cuh" | "h" | "cu")
                ) {
                    println!("cargo:rerun-if-changed={}", f.display());
                }
            }
        }
    }
    let Some(nvcc) = find_nvcc() else {
        eprintln!(
            "flashcore: nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and /usr/local/cuda/bin); \
             install CUDA 13.0 or run scripts/install-cuda-toolkit.sh and eval its exports, or build without the `cuda` feature"
        );
        std::process::exit(1);
    };
    let filter: Vec<String> = std::env::var("FLASHCORE_VARIANTS")
        .ok()
        .map(|s| {
            s.split(',')
                .filter(|x| !x.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let kernels = std::fs::canonicalize("kernels").expect("kernels/ directory");
    let mut compiled = Vec::new();
    let mut jobs = Vec::new();
    for fam in FAMILIES {
        let chosen: Vec<_> = VARIANTS
            .iter()
            .filter(|v| v.family == fam.name)
            .filter(|v| filter.is_empty() || filter.iter().any(|f| v.symbol().contains(f.as_str())))
            .collect();
        let mut src =
            String::from("// Generated by build.rs from kernels/variants.rs; do not edit.\n");
        src += "#include \"common/params.h\"\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <stddef.h>\n";
        src += &params_layout_asserts();
        for h in fam.headers {
            src += &format!("#include \"{h}\"\n");
        }
        let mut kinds: Vec<KKind> = chosen.iter().map(|v| v.kind).collect();
        kinds.dedup();
        for k in [KKind::Fwd, KKind::Decode] {
            if kinds.contains(&k) {
                let h = kind_header(fam.name, k);
                if !fam.headers.contains(&h.as_str()) {
                    src += &format!("#include \"{h}\"\n");
                }
            }
        }
        for v in &chosen {
            // sm90 forward macros take the Q buffers after the stages; a narrow twin's macro
            // takes its width last, a separate-V kernel's its V width
            let q_stages = if fam.name == "sm90" && v.kind == KKind::Fwd {
                format!(", {}", v.q_stages)
            } else {
                String::new()
            };
            let width = if v.narrow > 0 {
                format!(", {}", v.narrow)
            } else if v.v_width > 0 {
                format!(", {}", v.v_width)
            } else {
                String::new()
            };
            src += &format!(
                "{}{}({}, {}, {}, {}, {}, {}, {}, {}{q_stages}{width})\n",
                kind_macro(fam.name, v.kind),
                v.macro_suffix(),
                v.symbol(),
                v.dtype.cuda_type(),
                v.head_dim,
                v.mask.id(),
                v.block_m,
                v.block_n,
                v.warps,
                v.stages
            );
            src += &facts_asserts(v);
            compiled.push(v.symbol());
        }
        // One combine kernel per (dtype, head_dim) of the compiled decode kernels.
        let mut combines: Vec<(String, &str, u32)> = Vec::new();
        for v in chosen.iter().filter(|v| v.kind == KKind::Decode) {
            let sym = variants::combine_symbol(fam.name, v.dtype, v.head_dim);
            if !combines.iter().any(|c| c.0 == sym) {
                combines.push((sym, v.dtype.cuda_type(), v.head_dim));
            }
        }
        for (sym, t, d) in combines {
            src += &format!("FC_{}_COMBINE({sym}, {t}, {d})\n", fam.name.to_uppercase());
            compiled.push(sym);
        }
        let cu = out.join(format!("fc_{}.cu", fam.name));
        std::fs::write(&cu, src).unwrap();
        let fatbin = out.join(format!("fc_{}.fatbin", fam.name));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("--fatbin")
            .arg("-O3")
            .arg("-std=c++17")
            .arg("--threads=0")
            .arg("-Xptxas=-warn-spills")
            .arg("-I")
            .arg(&kernels)
            .arg("-o")
            .arg(&fatbin)
            .arg(&cu);
        for g in fam.gencode {
            cmd.arg(format!("-gencode={g}"));
        }
        if let Ok(extra) = std::env::var("NVCC_FLAGS") {
            cmd.args(extra.split_whitespace());
        }
        jobs.push((fam.name, cmd, cu));
    }
    let start = std::time::Instant::now();
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|(name, mut cmd, cu)| std::thread::spawn(move || (name, cmd.output(), cu)))
        .collect();
    for h in handles {
        let (name, res, cu) = h.join().unwrap();
        let o = res.unwrap_or_else(|e| {
            eprintln!("flashcore: could not run nvcc ({e})");
            std::process::exit(1)
        });
        let stderr = String::from_utf8_lossy(&o.stderr);
        for line in stderr.lines().filter(|l| {
            // ptxas C75xx: wgmma serialised (25-40 % slower, silently:
            // docs/decisions.md#wgmma-serialisation-warnings)
            l.contains("warning") || l.contains("spill") || l.contains("Performance Loss")
        }) {
            if !line.contains(" 0 bytes spill") {
                println!("cargo:warning=nvcc [{name}]: {line}");
            }
        }
        if !o.status.success() {
            eprintln!("{stderr}");
            eprintln!(
                "flashcore: nvcc failed to compile the {name} kernel family ({})",
                cu.display()
            );
            std::process::exit(1);
        }
    }
    println!(
        "cargo:warning=flashcore: compiled CUDA kernels in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    let list = compiled
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rs = format!("pub const COMPILED: &[&str] = &[{list}];\n");
    rs += "pub fn fatbin(family: &str) -> Option<&'static [u8]> {\n    match family {\n";
    for fam in FAMILIES {
        let path = out.join(format!("fc_{}.fatbin", fam.name));
        rs += &format!(
            "        {:?} => Some(include_bytes!({:?})),\n",
            fam.name,
            path.display().to_string()
        );
    }
    rs += "        _ => None,\n    }\n}\n";
    std::fs::write(out.join("compiled_variants.rs"), rs).unwrap();
}
