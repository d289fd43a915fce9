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

/// One point per name, `x` against `y`, both axes from zero to their
/// largest value (labelled with it and the unit), each point a circle with
/// its name beside it. Empty when every point is at zero on both axes.
pub fn scatter(points: &[(String, f64, f64)], x_unit: &str, y_unit: &str) -> String {
    let x_top = points.iter().map(|p| p.1).fold(0.0, f64::max);
    let y_top = points.iter().map(|p| p.2).fold(0.0, f64::max);
    if x_top <= 0.0 && y_top <= 0.0 {
        return String::new();
    }
    let (left, plot_w, plot_h, top_pad) = (64.0, 600.0, 220.0, 12.0);
    let base = top_pad + plot_h;
    let height = base + 40.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {height}" width="{w}" height="{height}" role="img" aria-label="{label}"><line x1="{left}" y1="{base}" x2="{x2}" y2="{base}" stroke="#999"/><line x1="{left}" y1="{top_pad}" x2="{left}" y2="{base}" stroke="#999"/><text x="{tx}" y="{ty}" font-size="11" text-anchor="end" fill="#555">{y_top:.0}</text><text x="{tx}" y="{base}" font-size="11" text-anchor="end" fill="#555">0</text><text x="{x2}" y="{ly}" font-size="11" text-anchor="end" fill="#555">{x_top:.3} {xu}</text><text x="{left}" y="{ly}" font-size="11" fill="#555">{yu} (up) against {xu} (across)</text>"##,
        w = left + plot_w + 120.0,
        label = escaped(&format!("{y_unit} against {x_unit}")),
        x2 = left + plot_w,
        tx = left - 4.0,
        ty = top_pad + 10.0,
        ly = base + 16.0,
        xu = escaped(x_unit),
        yu = escaped(y_unit),
    );
    let at = |v: f64, top: f64, span: f64| {
        if top > 0.0 {
            v.max(0.0) / top * span
        } else {
            0.0
        }
    };
    for (i, (name, x, y)) in points.iter().enumerate() {
        let cx = left + at(*x, x_top, plot_w);
        let cy = base - at(*y, y_top, plot_h);
        let _ = write!(
            svg,
            r##"<circle cx="{cx:.1}" cy="{cy:.1}" r="5" fill="{fill}" data-point="{name}"><title>{name}: {y:.0} {yu}, {x:.3} {xu}</title></circle><text x="{lx:.1}" y="{cy:.1}" font-size="11" fill="#222">{name}</text>"##,
            fill = COLOURS[i % COLOURS.len()],
            name = escaped(name),
            lx = cx + 8.0,
            xu = escaped(x_unit),
            yu = escaped(y_unit),
        );
    }
    svg.push_str("</svg>");
    svg
}

/// One horizontal bar per name, in the order given, each as long against
/// the longest as its value, with the name and the value beside it. Empty
/// when no value is above zero.
pub fn bars(items: &[(String, f64)], unit: &str) -> String {
    let top = items.iter().map(|i| i.1).fold(0.0, f64::max);
    if top <= 0.0 {
        return String::new();
    }
    let (label_w, plot_w, row) = (220.0, 400.0, 20.0);
    let height = row * items.len() as f64 + 8.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {height}" width="{w}" height="{height}" role="img" aria-label="{label}">"#,
        w = label_w + plot_w + 200.0,
        label = escaped(&format!("{unit} by name")),
    );
    for (i, (name, v)) in items.iter().enumerate() {
        let y = 4.0 + row * i as f64;
        let len = v.max(0.0) / top * plot_w;
        let _ = write!(
            svg,
            r##"<text x="{tx}" y="{ty:.1}" font-size="11" text-anchor="end" fill="#222">{name}</text><rect x="{label_w}" y="{y:.1}" width="{len:.1}" height="14" fill="{fill}" data-bar="{name}"><title>{name}: {v:.4} {unit}</title></rect><text x="{vx:.1}" y="{ty:.1}" font-size="11" fill="#555">{v:.4} {unit}</text>"##,
            tx = label_w - 6.0,
            ty = y + 11.0,
            fill = COLOURS[0],
            name = escaped(name),
            vx = label_w + len + 6.0,
            unit = escaped(unit),
        );
    }
    svg.push_str("</svg>");
    svg
}

#[cfg(test)]
mod tests {
    use super::{bars, scatter, stacked_bars};

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

    #[test]
    fn a_scatter_places_each_point_on_both_axes_and_bars_scale_to_the_longest() {
        let points = vec![
            ("acme".to_owned(), 2.0, 100.0),
            ("b&c".to_owned(), 1.0, 25.0),
        ];
        let svg = scatter(&points, "device-seconds", "tokens");
        assert_eq!(svg.matches("data-point=").count(), 2, "{svg}");
        // The largest on each axis reaches the plot's far edge (64 + 600,
        // 12), the other half across and a quarter up (364, 177).
        assert!(svg.contains(r#"cx="664.0" cy="12.0""#), "{svg}");
        assert!(svg.contains(r#"cx="364.0" cy="177.0""#), "{svg}");
        assert!(svg.contains("b&amp;c") && !svg.contains("b&c"), "{svg}");
        assert!(scatter(&[("z".into(), 0.0, 0.0)], "s", "t").is_empty());

        let svg = bars(&[("x".into(), 4.0), ("y".into(), 1.0)], "USD");
        assert!(svg.contains(r#"width="400.0" height="14""#), "{svg}");
        assert!(svg.contains(r#"width="100.0" height="14""#), "{svg}");
        assert_eq!(svg.matches("data-bar=").count(), 2, "{svg}");
        assert!(bars(&[("x".into(), 0.0)], "USD").is_empty());
    }
}
