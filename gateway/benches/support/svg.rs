//! Grouped bar charts as SVG files, for the benchmarks' plots: plain SVG
//! text (rectangles, lines and labels a browser lays out), so no font or
//! plotting library is needed to draw them.

use std::fmt::Write as _;
use std::path::Path;

/// One chart: groups along x, one bar per series in each group.
pub struct Bars<'a> {
    pub title: &'a str,
    pub y_label: &'a str,
    pub groups: Vec<String>,
    /// Each series' name and its value in every group (NaN: not measured
    /// there, no bar).
    pub series: Vec<(String, Vec<f64>)>,
}

/// Distinct colours for up to ten series (then they repeat).
const COLOURS: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#222222",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A round step for about five grid lines up to `max`.
fn step(max: f64) -> f64 {
    let raw = (max / 5.0).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

impl Bars<'_> {
    /// The chart as SVG text.
    pub fn svg(&self) -> String {
        let (left, right, top, bottom, legend_h) = (70.0, 20.0, 40.0, 90.0, 22.0);
        let legend_rows = self.series.len().div_ceil(3) as f64;
        // Wide enough for the title and the legend, however few bars.
        let bars_w = 26.0 * self.series.len() as f64;
        let group_w = (bars_w + 30.0).max(660.0 / self.groups.len().max(1) as f64);
        let plot_w = group_w * self.groups.len() as f64;
        let plot_h = 320.0;
        // Room for the legend's columns too (three of 330 px).
        let legend_w = 330.0 * self.series.len().min(3) as f64;
        let width = (left + plot_w + right).max(left + legend_w);
        let height = top + plot_h + bottom + legend_rows * legend_h;
        let max = self
            .series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .fold(0.0, f64::max);
        let step = step(max);
        let top_value = (max / step).ceil().max(1.0) * step;
        let y = |v: f64| top + plot_h - v / top_value * plot_h;
        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            out,
            r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="24" font-size="15">{}</text>"#,
            escape(self.title)
        );
        let mut v = 0.0;
        while v <= top_value + step / 2.0 {
            let yy = y(v);
            let _ = writeln!(
                out,
                r##"<line x1="{left}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                left + plot_w,
                left - 6.0,
                yy + 4.0,
                if step.fract() == 0.0 {
                    format!("{v:.0}")
                } else {
                    // 2.5, 0.25: no more digits than the step has.
                    let digits = (-step.log10().floor()).max(0.0) as usize + 1;
                    format!("{v:.digits$}")
                }
            );
            v += step;
        }
        let _ = writeln!(
            out,
            r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            top + plot_h / 2.0,
            escape(self.y_label)
        );
        for (g, name) in self.groups.iter().enumerate() {
            let x0 = left + g as f64 * group_w + (group_w - bars_w) / 2.0;
            for (s, (_, values)) in self.series.iter().enumerate() {
                let value = values[g];
                if !value.is_finite() {
                    // Not measured at this group: no bar.
                    continue;
                }
                let x = x0 + 26.0 * s as f64;
                let _ = writeln!(
                    out,
                    r#"<rect x="{x:.1}" y="{:.1}" width="22" height="{:.1}" fill="{}"><title>{}: {value}</title></rect>"#,
                    y(value),
                    top + plot_h - y(value),
                    COLOURS[s % COLOURS.len()],
                    escape(&self.series[s].0)
                );
            }
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x0 + bars_w / 2.0,
                top + plot_h + 18.0,
                escape(name)
            );
        }
        for (s, (name, _)) in self.series.iter().enumerate() {
            let (col, row) = ((s % 3) as f64, (s / 3) as f64);
            let x = left + col * 330.0;
            let yy = top + plot_h + 44.0 + row * legend_h;
            let _ = writeln!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="14" height="14" fill="{}"/><text x="{:.1}" y="{yy:.1}">{}</text>"#,
                yy - 11.0,
                COLOURS[s % COLOURS.len()],
                x + 20.0,
                escape(name)
            );
        }
        out.push_str("</svg>\n");
        out
    }

    /// Writes the chart to `path`, creating its directory.
    pub fn write(&self, path: &Path) {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        }
        std::fs::write(path, self.svg()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("wrote {}", path.display());
    }
}
