//! Charts the console draws on the server, as inline SVG: no script, no
//! outside font or library, and nothing the page's content policy blocks
//! (colours are presentation attributes, not styles).

use std::fmt::Write;

/// A palette that stays apart on white, cycled by series.
const COLOURS: [&str; 8] = [
    "#2f6fde", "#e0702b", "#3aa55d", "#c83e4d", "#8a5cc7", "#b58a1b", "#2aa3a3", "#7a7a7a",
];

/// `&`, `<`, `>` and quotes as XML entities, for text inside the SVG.
fn escaped(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Bars stacked by series over the `columns` (left to right), each series
/// a name and one value per column, with a legend and the tallest stack's
/// total on the axis. `unit` follows that total. Empty when there is
/// nothing above zero to draw.
pub fn stacked_bars(columns: &[String], series: &[(String, Vec<f64>)], unit: &str) -> String {
    let totals: Vec<f64> = (0..columns.len())
        .map(|c| series.iter().map(|(_, v)| v[c].max(0.0)).sum())
        .collect();
    let top = totals.iter().copied().fold(0.0, f64::max);
    if columns.is_empty() || top <= 0.0 {
        return String::new();
    }
    let (left, plot_w, plot_h, top_pad) = (56.0, 640.0, 200.0, 12.0);
    let legend_h = 18.0 * series.len() as f64;
    let height = top_pad + plot_h + 36.0 + legend_h;
    let step = plot_w / columns.len() as f64;
    let bar = (step * 0.7).max(1.0);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {height}" width="{w}" height="{height}" role="img" aria-label="{label}">"#,
        w = left + plot_w + 8.0,
        label = escaped(&format!("{unit} by column, stacked by series")),
    );
    let base = top_pad + plot_h;
    let _ = write!(
        svg,
        r##"<line x1="{left}" y1="{base}" x2="{x2}" y2="{base}" stroke="#999"/><text x="{tx}" y="{ty}" font-size="11" text-anchor="end" fill="#555">{top:.3}</text><text x="{tx}" y="{base}" font-size="11" text-anchor="end" fill="#555">0</text><text x="4" y="{uy}" font-size="11" fill="#555">{unit}</text>"##,
        x2 = left + plot_w,
        tx = left - 4.0,
        ty = top_pad + 10.0,
        uy = top_pad + plot_h / 2.0,
        unit = escaped(unit),
    );
    for (c, column) in columns.iter().enumerate() {
        let x = left + c as f64 * step + (step - bar) / 2.0;
        let mut y = base;
        for (s, (name, values)) in series.iter().enumerate() {
            let h = values[c].max(0.0) / top * plot_h;
            if h <= 0.0 {
                continue;
            }
            y -= h;
            let _ = write!(
                svg,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{bar:.1}" height="{h:.1}" fill="{fill}" data-series="{series}" data-column="{col}"><title>{series} {col}: {v:.4} {unit}</title></rect>"#,
                fill = COLOURS[s % COLOURS.len()],
                series = escaped(name),
                col = escaped(column),
                v = values[c],
                unit = escaped(unit),
            );
        }
        // A label under every few columns, as many as fit.
        let every = columns.len().div_ceil(8);
        if c % every == 0 {
            let _ = write!(
                svg,
                r##"<text x="{cx:.1}" y="{ly}" font-size="10" text-anchor="middle" fill="#555">{label}</text>"##,
                cx = x + bar / 2.0,
                ly = base + 14.0,
                label = escaped(column),
            );
        }
    }
    for (s, (name, _)) in series.iter().enumerate() {
        let y = base + 30.0 + 18.0 * s as f64;
        let _ = write!(
            svg,
            r##"<rect x="{left}" y="{ry}" width="12" height="12" fill="{fill}"/><text x="{tx}" y="{y}" font-size="12" fill="#222">{name}</text>"##,
            ry = y - 10.0,
            fill = COLOURS[s % COLOURS.len()],
            tx = left + 18.0,
            name = escaped(name),
        );
    }
    svg.push_str("</svg>");
    svg
}

#[cfg(test)]
mod tests {
    use super::stacked_bars;

    #[test]
    fn bars_stack_their_series_and_escape_their_names() {
        let columns = vec!["d1".to_owned(), "d2".to_owned()];
        let series = vec![
            ("a<b".to_owned(), vec![1.0, 0.0]),
            ("c".to_owned(), vec![1.0, 2.0]),
        ];
        let svg = stacked_bars(&columns, &series, "device-hours");
        assert_eq!(svg.matches("data-series=").count(), 3, "{svg}");
        assert!(svg.contains("a&lt;b") && !svg.contains("a<b"), "{svg}");
        // The tallest stack (2) reaches the top: d2's one bar is the full
        // plot's height, and d1's two bars half each.
        assert!(svg.contains(r#"height="200.0" fill"#), "{svg}");
        assert_eq!(svg.matches(r#"height="100.0" fill"#).count(), 2, "{svg}");
        assert!(stacked_bars(&columns, &[("z".into(), vec![0.0, 0.0])], "h").is_empty());
    }
}
