//! The bench's own code (examples/bench/, through `#[path]`) on the CPU: the judge of
//! `bench --verify` passes correct outputs at every dtype and fails wrong ones (shifted by
//! `--perturb-output`, computed with the wrong scale, without the mask, or with a NaN); the
//! charts of `bench --plot` come out of anchor-format JSONL with their labels and series.

#[path = "../examples/bench/judge.rs"]
mod judge;
#[path = "../examples/bench/plot.rs"]
mod plot;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use flashcore::{AttnParams, Mask};

fn inputs(dtype: DType, sq: usize, sk: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let r = |s: usize, h: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., (2, s, h, 64), &dev)?.to_dtype(dtype)?)
    };
    Ok((r(sq, 4)?, r(sk, 2)?, r(sk, 2)?))
}

fn causal() -> AttnParams {
    AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    }
}

#[test]
fn correct_outputs_pass_at_every_dtype() -> Result<()> {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let set = inputs(dtype, 96, 160)?;
        let p = causal();
        let out = flashcore::attention(&set.0, &set.1, &set.2, &p)?;
        let v = judge::check_dense(&out, &set, &p, 0.0)?;
        assert!(v.pass(), "{dtype:?}: {v:?}");
        assert!(v.scale > 0.1, "{dtype:?}: {v:?}");
        // and the margin is real: an output a quarter of the tolerance off still passes
        let v = judge::check_dense(&out, &set, &p, 0.25 * v.tol * v.scale)?;
        assert!(v.pass(), "{dtype:?} with a quarter-tolerance shift: {v:?}");
    }
    Ok(())
}

#[test]
fn perturbed_outputs_fail() -> Result<()> {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let set = inputs(dtype, 96, 160)?;
        let p = causal();
        let out = flashcore::attention(&set.0, &set.1, &set.2, &p)?;
        let clean = judge::check_dense(&out, &set, &p, 0.0)?;
        // twice the tolerance, and the bench's documented example value
        for x in [2.0 * clean.tol * clean.scale, 0.5] {
            let v = judge::check_dense(&out, &set, &p, x)?;
            assert!(!v.pass(), "{dtype:?} shifted by {x}: {v:?}");
        }
    }
    Ok(())
}

#[test]
fn wrong_kernels_fail() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let set = inputs(dtype, 96, 160)?;
        let p = causal();
        // the mask dropped
        let no_mask = flashcore::attention(&set.0, &set.1, &set.2, &AttnParams::default())?;
        let v = judge::check_dense(&no_mask, &set, &p, 0.0)?;
        assert!(!v.pass(), "{dtype:?} without the mask: {v:?}");
        // a softmax scale 10 % off
        let scaled = AttnParams {
            softmax_scale: Some(1.1 / 8.0),
            ..causal()
        };
        let off = flashcore::attention(&set.0, &set.1, &set.2, &scaled)?;
        let v = judge::check_dense(&off, &set, &p, 0.0)?;
        assert!(!v.pass(), "{dtype:?} with the scale 10 % off: {v:?}");
        // one NaN in the compared rows (the last row of batch 0)
        let good = flashcore::attention(&set.0, &set.1, &set.2, &p)?;
        let mut flat = good.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        flat[96 * 4 * 64 - 1] = f32::NAN;
        let nan = Tensor::from_vec(flat, good.shape(), &Device::Cpu)?;
        let v = judge::check_dense(&nan, &set, &p, 0.0)?;
        assert!(!v.pass(), "{dtype:?} with a NaN: {v:?}");
    }
    Ok(())
}

#[test]
fn packed_sequences_are_judged_alone() -> Result<()> {
    let dev = Device::Cpu;
    let lens = [40usize, 72];
    let t: usize = lens.iter().sum();
    let r = |h: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., (t, h, 64), &dev)?.to_dtype(DType::BF16)?)
    };
    let (q, k, v) = (r(4)?, r(2)?, r(2)?);
    let cu = Tensor::new(&[0u32, 40, 112], &dev)?;
    let p = causal();
    let out = flashcore::attention_varlen(&q, &k, &v, &cu, &cu, 72, 72, &p)?;
    for (start, len) in [(0, 40), (40, 72)] {
        let ok = judge::check_packed_seq(&out, (&q, &k, &v), start, len, &p, 0.0)?;
        assert!(ok.pass(), "sequence at {start}: {ok:?}");
        let bad = judge::check_packed_seq(&out, (&q, &k, &v), start, len, &p, 0.5)?;
        assert!(!bad.pass(), "sequence at {start} shifted: {bad:?}");
        assert!(!ok.worst(bad).pass());
    }
    // the packed output judged as one dense sequence (the keys of both) is wrong
    let want_rows = judge::check_packed_seq(&out, (&q, &k, &v), 0, t, &p, 0.0)?;
    assert!(!want_rows.pass(), "{want_rows:?}");
    Ok(())
}

#[test]
fn charts_from_anchor_lines() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("flashcore-bench-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let jsonl = dir.join("rows.jsonl");
    let mut lines = vec![
        // lines without a timed case are skipped
        r#"{"kind":"ceiling","matmul_tflops":700.0,"copy_gbps":3000.0}"#.to_string(),
        r#"{"kind":"sdpa","backend":"cudnn","b":1,"hq":16,"hkv":16,"sq":16384,"sk":16384,"d":128,"causal":true,"error":"oom"}"#.to_string(),
        String::new(),
    ];
    for (backend, f) in [("flashcore", 1.0), ("fa4", 1.25), ("cudnn", 0.8)] {
        for (s, causal) in [(1024, false), (16384, true)] {
            lines.push(format!(
                r#"{{"backend":"{backend}","b":{},"hq":32,"hkv":32,"sq":{s},"sk":{s},"d":64,"causal":{causal},"us":100.0,"tflops":{}}}"#,
                16384 / s,
                400.0 * f
            ));
        }
    }
    std::fs::write(&jsonl, lines.join("\n"))?;
    let rows = plot::read_jsonl(&jsonl)?;
    assert_eq!(rows.len(), 6);
    let written = plot::write_charts(&rows, dir.join("fa3.svg").to_str().unwrap())?;
    assert_eq!(written, [dir.join("fa3.svg"), dir.join("fa3-ratio.svg")]);
    let tflops = std::fs::read_to_string(&written[0])?;
    for text in ["d64 1k", "d64 c 16k", "flashcore", "fa4", "cudnn", "TFLOPS"] {
        assert!(tflops.contains(text), "fa3.svg lacks {text:?}");
    }
    let ratio = std::fs::read_to_string(&written[1])?;
    for text in ["flashcore / fa4", "flashcore / cudnn", "0.8"] {
        assert!(ratio.contains(text), "fa3-ratio.svg lacks {text:?}");
    }
    // a line that is not JSON names its file and line
    std::fs::write(&jsonl, "{\"backend\":\"fa4\"}\nnot json\n")?;
    let e = plot::read_jsonl(&jsonl).unwrap_err();
    assert!(format!("{e:#}").contains("rows.jsonl:2"), "{e:#}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
