//! Per-request output and the summary (throughput, latency percentiles, pool use, decode step
//! time against the bandwidth floor, agreement with the one-at-a-time run).

use anyhow::Result;
use candle_core::{DType, Device};

use crate::engine::{percentile, RunReport};
use crate::model::Config;
use crate::tokenizer::TextTokenizer;
use serde_json::json;

/// Prints each request's result on stdout: a JSON line each with `json`, else one text line
/// each (nothing with `quiet`).
pub fn print_requests(
    r: &RunReport,
    tok: Option<&TextTokenizer>,
    json: bool,
    quiet: bool,
) -> Result<()> {
    if quiet {
        return Ok(());
    }
    for f in &r.finished {
        let text = match tok {
            Some(t) => Some(t.decode(&f.tokens)?),
            None => None,
        };
        let ttft = f.token_times.first().map(|t| (t - f.arrival) * 1e3);
        if json {
            println!(
                "{{\"mode\":\"{}\",\"request\":{},\"prompt_tokens\":{},\"new_tokens\":{},\"ttft_ms\":{},\"hit_eos\":{},\"preempted\":{},\"tokens\":{:?}{}}}",
                r.mode,
                f.id,
                f.prompt_tokens,
                f.tokens.len(),
                ttft.map(|t| format!("{t:.3}")).unwrap_or_else(|| "null".into()),
                f.hit_eos,
                f.preempted,
                f.tokens,
                text.map(|t| format!(",\"text\":{}", json!(&t)))
                    .unwrap_or_default(),
            );
        } else {
            let shown = match text {
                Some(t) => {
                    let t = t.replace('\n', "\\n");
                    let cut: String = t.chars().take(120).collect();
                    format!("{cut:?}{}", if cut.len() < t.len() { "..." } else { "" })
                }
                None => format!(
                    "{:?}{}",
                    &f.tokens[..f.tokens.len().min(12)],
                    if f.tokens.len() > 12 { "..." } else { "" }
                ),
            };
            println!(
                "[{}] #{} {} prompt + {} new{}: {shown}",
                r.mode,
                f.id,
                f.prompt_tokens,
                f.tokens.len(),
                if f.preempted > 0 {
                    format!(" (preempted {}x)", f.preempted)
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(())
}

/// Bytes a decode step must read at least: every weight once (the embedding table only when
/// it doubles as the output head) and every cached K/V row it attends to; over the device's
/// bandwidth that is the step's floor.
pub struct Floor {
    weight_bytes: f64,
    kv_row_bytes: f64,
    /// Bytes per second assumed (3.0 TB/s on a GPU, as the H100's measured copy rate; none on
    /// the CPU).
    bandwidth: Option<f64>,
}

impl Floor {
    /// Weights in `dtype`, K/V rows in `kv_dtype`.
    pub fn new(cfg: &Config, dtype: DType, kv_dtype: DType, device: &Device) -> Floor {
        let size = dtype.size_in_bytes() as f64;
        let embed = if cfg.tie_word_embeddings {
            0.0
        } else {
            (cfg.vocab_size * cfg.hidden_size) as f64
        };
        Floor {
            weight_bytes: (cfg.num_params() as f64 - embed) * size,
            kv_row_bytes: (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim)
                as f64
                * kv_dtype.size_in_bytes() as f64,
            bandwidth: (!device.is_cpu()).then_some(3.0e12),
        }
    }

    fn seconds(&self, kv_rows: usize) -> Option<f64> {
        self.bandwidth
            .map(|bw| (self.weight_bytes + kv_rows as f64 * self.kv_row_bytes) / bw)
    }
}

/// The numbers of one run.
pub struct Summary {
    pub mode: &'static str,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub wall: f64,
    pub ttft_ms: [Option<f64>; 3],
    pub itl_ms: [Option<f64>; 3],
    pub latency_s: [Option<f64>; 3],
    pub steps: usize,
    pub preemptions: usize,
    pub pool_peak: Option<f64>,
    pub pool_mean: Option<f64>,
    /// Sequences decoding in one step (one row each): the most and the median over all steps
    /// with decode rows; with a K/V budget that binds, the sequences the pool keeps resident.
    pub decode_rows_peak: usize,
    pub decode_rows_p50: Option<f64>,
    /// Decode-only steps: how many, median time, median floor, median floor/time.
    pub decode_steps: usize,
    pub decode_step_ms: Option<f64>,
    /// Median host time to enqueue a decode-only step (`Step::host`).
    pub decode_host_ms: Option<f64>,
    pub decode_floor_ms: Option<f64>,
    pub decode_bw_frac: Option<f64>,
    /// Requests also run one at a time: how many, how many with identical tokens, and the
    /// fraction of tokens in the common prefixes.
    pub agreement: Option<(usize, usize, f64)>,
}

impl Summary {
    pub fn new(r: &RunReport, floor: &Floor, alone: Option<&RunReport>) -> Summary {
        let pct = |v: &[f64]| [50.0, 90.0, 99.0].map(|p| percentile(v, p));
        let ttft: Vec<f64> = r
            .finished
            .iter()
            .filter_map(|f| f.token_times.first().map(|t| (t - f.arrival) * 1e3))
            .collect();
        let itl: Vec<f64> = r
            .finished
            .iter()
            .flat_map(|f| f.token_times.windows(2).map(|w| (w[1] - w[0]) * 1e3))
            .collect();
        let latency: Vec<f64> = r
            .finished
            .iter()
            .filter_map(|f| f.token_times.last().map(|t| t - f.arrival))
            .collect();
        let decode: Vec<_> = r
            .steps
            .iter()
            .filter(|s| s.prefill_tokens == 0 && s.decode_tokens > 0)
            .collect();
        let rows: Vec<f64> = r
            .steps
            .iter()
            .filter(|s| s.decode_tokens > 0)
            .map(|s| s.decode_tokens as f64)
            .collect();
        let times: Vec<f64> = decode.iter().map(|s| s.seconds * 1e3).collect();
        let hosts: Vec<f64> = decode.iter().map(|s| s.host * 1e3).collect();
        let floors: Vec<f64> = decode
            .iter()
            .filter_map(|s| floor.seconds(s.kv_rows).map(|f| f * 1e3))
            .collect();
        let fracs: Vec<f64> = decode
            .iter()
            .filter_map(|s| floor.seconds(s.kv_rows).map(|f| f / s.seconds))
            .collect();
        let (pool_peak, pool_mean) = if r.pool_pages > 0 && !r.steps.is_empty() {
            let used = r
                .steps
                .iter()
                .map(|s| s.pages_used as f64 / r.pool_pages as f64);
            let n = r.steps.len() as f64;
            (
                Some(used.clone().fold(0.0, f64::max)),
                Some(used.sum::<f64>() / n),
            )
        } else {
            (None, None)
        };
        let agreement = alone.filter(|a| a.mode != r.mode).map(|a| {
            let (mut n, mut same, mut common, mut total) = (0, 0, 0usize, 0usize);
            for f in &r.finished {
                if let Some(g) = a.finished.iter().find(|g| g.id == f.id) {
                    n += 1;
                    same += usize::from(f.tokens == g.tokens);
                    common += f
                        .tokens
                        .iter()
                        .zip(&g.tokens)
                        .take_while(|(x, y)| x == y)
                        .count();
                    total += f.tokens.len().max(g.tokens.len());
                }
            }
            (n, same, common as f64 / total.max(1) as f64)
        });
        Summary {
            mode: r.mode,
            requests: r.finished.len(),
            prompt_tokens: r.finished.iter().map(|f| f.prompt_tokens).sum(),
            new_tokens: r.finished.iter().map(|f| f.tokens.len()).sum(),
            wall: r.wall,
            ttft_ms: pct(&ttft),
            itl_ms: pct(&itl),
            latency_s: pct(&latency),
            steps: r.steps.len(),
            preemptions: r.preemptions,
            pool_peak,
            pool_mean,
            decode_rows_peak: rows.iter().fold(0.0, |a: f64, &b| a.max(b)) as usize,
            decode_rows_p50: percentile(&rows, 50.0),
            decode_steps: decode.len(),
            decode_step_ms: percentile(&times, 50.0),
            decode_host_ms: percentile(&hosts, 50.0),
            decode_floor_ms: percentile(&floors, 50.0),
            decode_bw_frac: percentile(&fracs, 50.0),
            agreement,
        }
    }

    pub fn output_tok_s(&self) -> f64 {
        self.new_tokens as f64 / self.wall
    }

    pub fn total_tok_s(&self) -> f64 {
        (self.prompt_tokens + self.new_tokens) as f64 / self.wall
    }

    fn json(&self) -> String {
        let o = |x: Option<f64>| {
            x.map(|v| format!("{v:.4}"))
                .unwrap_or_else(|| "null".into())
        };
        let trio = |a: &[Option<f64>; 3]| format!("[{},{},{}]", o(a[0]), o(a[1]), o(a[2]));
        format!(
            "{{\"mode\":\"{}\",\"requests\":{},\"prompt_tokens\":{},\"new_tokens\":{},\"wall_s\":{:.4},\"output_tok_s\":{:.3},\"total_tok_s\":{:.3},\"ttft_ms_p50_p90_p99\":{},\"itl_ms_p50_p90_p99\":{},\"latency_s_p50_p90_p99\":{},\"steps\":{},\"preemptions\":{},\"pool_peak\":{},\"pool_mean\":{},\"decode_rows_peak\":{},\"decode_rows_p50\":{},\"decode_steps\":{},\"decode_step_ms_p50\":{},\"decode_host_ms_p50\":{},\"decode_floor_ms_p50\":{},\"decode_bw_frac_p50\":{},\"agree_requests\":{},\"agree_identical\":{},\"agree_token_frac\":{}}}",
            self.mode,
            self.requests,
            self.prompt_tokens,
            self.new_tokens,
            self.wall,
            self.output_tok_s(),
            self.total_tok_s(),
            trio(&self.ttft_ms),
            trio(&self.itl_ms),
            trio(&self.latency_s),
            self.steps,
            self.preemptions,
            o(self.pool_peak),
            o(self.pool_mean),
            self.decode_rows_peak,
            o(self.decode_rows_p50),
            self.decode_steps,
            o(self.decode_step_ms),
            o(self.decode_host_ms),
            o(self.decode_floor_ms),
            o(self.decode_bw_frac),
            self.agreement.map(|a| a.0.to_string()).unwrap_or_else(|| "null".into()),
            self.agreement.map(|a| a.1.to_string()).unwrap_or_else(|| "null".into()),
            o(self.agreement.map(|a| a.2)),
        )
    }
}

/// The summary table on stderr; with `json` also one line on stdout:
/// `{"summary": {...model, dtype, device}, "runs": [...]}`.
pub fn print_summary(
    reports: &[RunReport],
    floor: &Floor,
    model: &str,
    dtype: DType,
    device: &Device,
    json: bool,
) {
    let alone = reports.iter().find(|r| r.mode == "sequential");
    let sums: Vec<Summary> = reports
        .iter()
        .map(|r| Summary::new(r, floor, alone))
        .collect();
    let f = |x: Option<f64>, prec: usize| {
        x.map(|v| format!("{v:.prec$}"))
            .unwrap_or_else(|| "-".into())
    };
    let trio =
        |a: &[Option<f64>; 3], p: usize| format!("{}/{}/{}", f(a[0], p), f(a[1], p), f(a[2], p));
    eprintln!("\nsummary ({model}, {dtype:?}, {:?})", device.location());
    for (s, r) in sums.iter().zip(reports) {
        eprintln!(
            "[{}] {} requests, {} prompt + {} new tokens in {:.2} s: output {:.1} tok/s, total {:.1} tok/s{}",
            s.mode,
            s.requests,
            s.prompt_tokens,
            s.new_tokens,
            s.wall,
            s.output_tok_s(),
            s.total_tok_s(),
            if r.mode == "static" {
                format!(" (batch {})", r.batch_size)
            } else {
                String::new()
            }
        );
        eprintln!(
            "[{}]   TTFT p50/p90/p99 {} ms; inter-token p50/p90/p99 {} ms; request latency p50/p90/p99 {} s",
            s.mode,
            trio(&s.ttft_ms, 1),
            trio(&s.itl_ms, 2),
            trio(&s.latency_s, 2)
        );
        if let (Some(peak), Some(mean)) = (s.pool_peak, s.pool_mean) {
            eprintln!(
                "[{}]   pool {} pages x {} rows: peak {:.0}%, mean {:.0}% in use; {} preemptions; {} steps; sequences decoding per step: peak {}, median {}",
                s.mode,
                r.pool_pages,
                r.page_size,
                peak * 100.0,
                mean * 100.0,
                s.preemptions,
                s.steps,
                s.decode_rows_peak,
                f(s.decode_rows_p50, 0)
            );
        }
        if s.decode_steps > 0 {
            let floor = match (s.decode_floor_ms, s.decode_bw_frac) {
                (Some(f), Some(x)) => format!(
                    "; bandwidth floor {f:.2} ms (weights + K/V read at 3.0 TB/s): {:.0}% of it",
                    x * 100.0
                ),
                _ => String::new(),
            };
            eprintln!(
                "[{}]   decode-only steps: {}, median {} ms (host enqueue {} ms){floor}",
                s.mode,
                s.decode_steps,
                f(s.decode_step_ms, 2),
                f(s.decode_host_ms, 2),
            );
        }
        if let Some((n, same, frac)) = s.agreement {
            eprintln!(
                "[{}]   vs one at a time: {same}/{n} requests identical, {:.1}% of tokens in common prefixes",
                s.mode,
                frac * 100.0
            );
        }
    }
    let by = |m: &str| sums.iter().find(|s| s.mode == m);
    if let Some(c) = by("continuous") {
        for other in ["static", "sequential"] {
            if let Some(o) = by(other) {
                eprintln!(
                    "continuous / {other}: {:.2}x output tok/s",
                    c.output_tok_s() / o.output_tok_s()
                );
            }
        }
    }
    if json {
        let runs: Vec<String> = sums.iter().map(Summary::json).collect();
        println!(
            "{{\"summary\":{{\"model\":{},\"dtype\":\"{dtype:?}\",\"device\":\"{:?}\"}},\"runs\":[{}]}}",
            json!(model),
            device.location(),
            runs.join(",")
        );
    }
}
