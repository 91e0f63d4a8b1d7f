//! Minimal SVG bar charts for the benchmark report (no plotting dependency needed).

/// A grouped bar chart: one group per label, one bar per series.
pub fn bars(title: &str, unit: &str, labels: &[String], series: &[(&str, Vec<f64>)]) -> String {
    let (w, h, left, bottom, top) = (720.0, 360.0, 60.0, 60.0, 40.0);
    let max = series.iter().flat_map(|(_, v)| v.iter().copied()).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let colors = ["#3b6ea8", "#e07b39", "#5a9e4b", "#b5485a", "#7a5aa8"];
    let group_w = (w - left - 20.0) / labels.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<text x="{}" y="20" text-anchor="middle" font-size="14">{title}</text>
<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>
<text x="12" y="{}" transform="rotate(-90 12 {})" text-anchor="middle">{unit}</text>
"#,
        w / 2.0,
        h - bottom,
        w - 20.0,
        h - bottom,
        h - bottom,
        (h - bottom + top) / 2.0,
        (h - bottom + top) / 2.0
    );
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
        let y = h - bottom - (h - bottom - top) * i as f64 / 4.0;
        s += &format!(
            r##"<text x="{}" y="{}" text-anchor="end">{:.2}</text><line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/>"##,
            left - 4.0,
            y + 4.0,
            v,
            w - 20.0
        );
        s.push('\n');
    }
    for (g, label) in labels.iter().enumerate() {
        let gx = left + g as f64 * group_w + group_w * 0.1;
        for (k, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(g).copied().unwrap_or(0.0);
            let bh = (h - bottom - top) * v / max;
            s += &format!(
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                gx + k as f64 * bar_w,
                h - bottom - bh,
                bar_w * 0.95,
                bh,
                colors[k % colors.len()]
            );
            s.push('\n');
        }
        s += &format!(r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#, gx + group_w * 0.4, h - bottom + 16.0);
        s.push('\n');
    }
    for (k, (name, _)) in series.iter().enumerate() {
        let y = h - 18.0;
        let x = left + k as f64 * 170.0;
        s += &format!(
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{y}">{name}</text>"#,
            y - 10.0,
            colors[k % colors.len()],
            x + 16.0
        );
        s.push('\n');
    }
    s + "</svg>\n"
}
