//! `bench --plot`: SVG charts of benchmark rows, from this bench's own run or from JSONL files
//! (its --json output, the anchor scripts' sdpa.jsonl / fa4.jsonl, or any file whose lines carry
//! backend, b, hq, hkv, sq, sk, d, causal and tflops). Two charts per call: TFLOPS per shape
//! with one series per backend, and flashcore's TFLOPS over each other backend's per shape.

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One timed case of one backend.
#[derive(Clone, Debug, Deserialize)]
pub struct Row {
    pub backend: String,
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub causal: bool,
    pub tflops: Option<f64>,
    /// Page size of a paged anchor row (fa4_anchor.py writes 0 for contiguous K/V).
    #[serde(default)]
    pub page: Option<usize>,
    /// A packed variable-length batch (b sequences).
    #[serde(default)]
    pub varlen: Option<bool>,
    /// A causal sliding window's left bound (the `sinks` grid's windowed layers).
    #[serde(default)]
    pub window: Option<usize>,
    /// Learnable sinks were on (the `sinks` grid).
    #[serde(default)]
    pub sinks: Option<bool>,
}

impl Row {
    /// A row of this bench's own output (`None` for a failed case: no TFLOPS).
    pub fn from_value(v: &Value) -> Option<Row> {
        serde_json::from_value::<Row>(v.clone())
            .ok()
            .filter(|r| r.tflops.is_some_and(f64::is_finite))
    }

    /// The chart series: the backend, with the page size for a paged anchor row.
    fn series(&self) -> String {
        match self.page {
            Some(p) if p > 0 && self.backend != "paged" => format!("{} p{p}", self.backend),
            _ => self.backend.clone(),
        }
    }

    /// The x-axis label: head dim, `c` when causal, the length(s) (`16k`; `1x32k` for a
    /// decode), the heads when grouped and the batch when it is not the fa3 grid's.
    fn label(&self) -> String {
        let n = |x: usize| {
            if x >= 1024 && x.is_multiple_of(1024) {
                format!("{}k", x / 1024)
            } else {
                x.to_string()
            }
        };
        let mut s = format!("d{}{}", self.d, if self.causal { " c" } else { "" });
        if self.varlen == Some(true) {
            s += &format!(" varlen {} seqs", self.b);
        } else if self.sq == self.sk {
            s += &format!(" {}", n(self.sk));
        } else {
            s += &format!(" {}x{}", n(self.sq), n(self.sk));
        }
        if self.hq != self.hkv {
            s += &format!(" {}/{}", self.hq, self.hkv);
        }
        if self.varlen != Some(true) && self.b * self.sq != 16384 {
            s += &format!(" b{}", self.b);
        }
        if let Some(w) = self.window {
            s += &format!(" w{w}");
        }
        if self.sinks == Some(true) {
            s += " sinks";
        }
        s
    }

    #[allow(clippy::type_complexity)]
    fn shape_key(
        &self,
    ) -> (
        (usize, usize, usize, usize, usize, usize),
        (bool, bool, Option<usize>, bool),
    ) {
        let (b, sq, sk) = (self.b, self.sq, self.sk);
        let v = self.varlen == Some(true);
        let extra = (self.causal, v, self.window, self.sinks == Some(true));
        ((self.d, self.hq, self.hkv, b, sq, sk), extra)
    }
}

/// The rows of a JSONL file that describe a timed case; other lines (ceilings, errors, blank)
/// are skipped, a line that is not JSON is an error naming the file and line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        if v.get("backend").is_none() || v.get("error").is_some() {
            continue;
        }
        if let Some(r) = Row::from_value(&v) {
            rows.push(r);
        }
    }
    Ok(rows)
}

/// The charts' data: shapes in first-seen order, series (flashcore first), and TFLOPS per
/// (series, shape) (the last row wins when a file repeats a case).
struct Table {
    shapes: Vec<Row>,
    series: Vec<String>,
    tflops: Vec<Vec<Option<f64>>>,
}

fn table(rows: &[Row]) -> Table {
    let mut shapes: Vec<Row> = Vec::new();
    let mut series: Vec<String> = Vec::new();
    for r in rows {
        if !shapes.iter().any(|s| s.shape_key() == r.shape_key()) {
            shapes.push(r.clone());
        }
        if !series.contains(&r.series()) {
            series.push(r.series());
        }
    }
    series.sort_by_key(|s| (s != "flashcore", s.clone()));
    let mut tflops = vec![vec![None; shapes.len()]; series.len()];
    for r in rows {
        let si = series.iter().position(|s| *s == r.series()).unwrap();
        let xi = shapes
            .iter()
            .position(|s| s.shape_key() == r.shape_key())
            .unwrap();
        tflops[si][xi] = r.tflops;
    }
    Table {
        shapes,
        series,
        tflops,
    }
}

/// Writes `<out>.svg` (TFLOPS) and `<out>-ratio.svg` (flashcore over each other backend, when
/// there are flashcore rows and another backend); `out` may end in `.svg`. Returns the paths.
pub fn write_charts(rows: &[Row], out: &str) -> Result<Vec<PathBuf>> {
    if rows.is_empty() {
        bail!("--plot: no rows with a TFLOPS figure to chart");
    }
    let stem = out.strip_suffix(".svg").unwrap_or(out);
    if let Some(dir) = Path::new(stem)
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let t = table(rows);
    let labels: Vec<String> = t.shapes.iter().map(Row::label).collect();
    let mut written = Vec::new();

    let path = PathBuf::from(format!("{stem}.svg"));
    let ymax = t
        .tflops
        .iter()
        .flatten()
        .flatten()
        .fold(0f64, |a, &b| a.max(b));
    // a backend keeps its colour (its series index) in both charts
    let lines: Vec<(String, usize, Vec<Option<f64>>)> = t
        .series
        .iter()
        .cloned()
        .zip(t.tflops.clone())
        .enumerate()
        .map(|(i, (name, v))| (name, i, v))
        .collect();
    chart(
        &path,
        "TFLOPS per shape (higher is better)",
        "TFLOPS",
        &labels,
        &lines,
        (0.0, ymax),
        None,
    )?;
    written.push(path);

    if let Some(fc) = t.series.iter().position(|s| s == "flashcore") {
        let ratios: Vec<(String, usize, Vec<Option<f64>>)> = t
            .series
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != fc)
            .map(|(i, name)| {
                let r = (0..labels.len())
                    .map(|x| match (t.tflops[fc][x], t.tflops[i][x]) {
                        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                        _ => None,
                    })
                    .collect();
                (format!("flashcore / {name}"), i, r)
            })
            .filter(|(_, _, r): &(String, usize, Vec<Option<f64>>)| r.iter().any(Option::is_some))
            .collect();
        if !ratios.is_empty() {
            let vals = ratios.iter().flat_map(|(_, _, r)| r.iter().flatten());
            let (lo, hi) = vals.fold((1f64, 1f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let pad = (hi - lo).max(0.1) * 0.1;
            let path = PathBuf::from(format!("{stem}-ratio.svg"));
            chart(
                &path,
                "flashcore TFLOPS / other backend's (above 1: flashcore faster)",
                "ratio",
                &labels,
                &ratios,
                ((lo - pad).max(0.0), hi + pad),
                Some(1.0),
            )?;
            written.push(path);
        }
    }
    Ok(written)
}

/// Series colours, flashcore's (the first series) red; all dark enough on white.
const COLOURS: [RGBColor; 8] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
    RGBColor(127, 127, 127),
];

/// One line chart over the shapes: a series per entry of `lines` (name, colour index, values;
/// gaps where a value is missing), the shapes' labels under the x axis, an optional horizontal
/// reference line. The y range gets headroom for the legend in the upper left corner.
fn chart(
    path: &Path,
    title: &str,
    y_desc: &str,
    labels: &[String],
    lines: &[(String, usize, Vec<Option<f64>>)],
    (y0, y1): (f64, f64),
    reference: Option<f64>,
) -> Result<()> {
    let n = labels.len();
    let y1 = y1 + (y1 - y0) * (0.05 + 0.07 * lines.len() as f64);
    let width = (160 + 46 * n as u32).max(760);
    let longest = labels.iter().map(String::len).max().unwrap_or(0) as u32;
    let label_area = 24 + 8 * longest;
    let height = 420 + label_area;
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("--plot {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let x_range = -0.5f64..(n as f64 - 0.5);
    let mut ch = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(label_area)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range, y0..y1)
        .map_err(err)?;
    ch.configure_mesh()
        .x_labels(n)
        .x_label_formatter(&|_| String::new())
        .disable_x_mesh()
        .y_max_light_lines(1)
        .y_desc(y_desc)
        .axis_desc_style(("sans-serif", 16))
        .y_label_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    // The shape labels, a quarter turn clockwise, each starting just under its tick.
    let label_style = TextStyle::from(
        ("sans-serif", 15)
            .into_font()
            .transform(FontTransform::Rotate90),
    )
    .pos(Pos::new(HPos::Left, VPos::Center));
    for (i, l) in labels.iter().enumerate() {
        let (px, py) = ch.backend_coord(&(i as f64, y0));
        root.draw_text(l, &label_style, (px, py + 8)).map_err(err)?;
    }
    if let Some(yr) = reference {
        ch.draw_series(LineSeries::new(
            [(-0.5, yr), (n as f64 - 0.5, yr)],
            BLACK.mix(0.6).stroke_width(1),
        ))
        .map_err(err)?;
    }
    for (name, colour, ys) in lines {
        let color = COLOURS[*colour % COLOURS.len()].to_rgba();
        let pts: Vec<(f64, f64)> = ys
            .iter()
            .enumerate()
            .filter_map(|(x, y)| y.map(|y| (x as f64, y)))
            .collect();
        // one polyline per run of consecutive shapes, so a missing case leaves a gap
        let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
        for p in &pts {
            match runs.last_mut() {
                Some(r) if r.last().is_some_and(|q| p.0 - q.0 < 1.5) => r.push(*p),
                _ => runs.push(vec![*p]),
            }
        }
        for r in runs {
            ch.draw_series(LineSeries::new(r, color.stroke_width(2)))
                .map_err(err)?;
        }
        ch.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    ch.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
