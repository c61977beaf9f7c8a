//! A small SVG line-plot writer: axes, ticks, one polyline per series, a
//! legend. Enough for "GB/s against block size" and "hit rate against
//! capacity" without a plotting crate.

use std::fmt::Write;

/// One line of a plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// `(x, y)` points; drawn in the given order.
    pub points: Vec<(f64, f64)>,
}

/// A line plot.
#[derive(Debug, Clone, PartialEq)]
pub struct LinePlot {
    /// Title above the plot.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Plot x on a log2 scale (block sizes).
    pub log2_x: bool,
    /// Format x tick values as byte sizes (KiB, MiB).
    pub x_as_bytes: bool,
    /// The lines.
    pub series: Vec<Series>,
}

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 540.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 260.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLOURS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `1.5 MiB`-style text for a byte count.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Round tick positions covering `[lo, hi]`, about `n` of them.
fn linear_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

/// Where the plot's data lands: the axes' ranges and the plot area.
struct Frame {
    /// Whether x is plotted on a log2 axis.
    log2_x: bool,
    /// The x axis' range, in plotted (log2 where asked) units.
    x0: f64,
    x1: f64,
    /// The y axis' top (it starts at 0).
    y1: f64,
    /// Width and height of the plot area.
    pw: f64,
    ph: f64,
}

impl Frame {
    /// `x` in plotted units.
    fn tx(&self, x: f64) -> f64 {
        if self.log2_x { x.log2() } else { x }
    }

    /// The horizontal position of `x`.
    fn px(&self, x: f64) -> f64 {
        LEFT + (self.tx(x) - self.x0) / (self.x1 - self.x0) * self.pw
    }

    /// The vertical position of `y`.
    fn py(&self, y: f64) -> f64 {
        TOP + self.ph - y / self.y1 * self.ph
    }
}

impl LinePlot {
    /// Renders the plot as an SVG document. Empty or non-finite data gives
    /// a plot with axes and no lines.
    pub fn render(&self) -> String {
        let f = self.frame();
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + f.pw / 2.0,
            escape(&self.title)
        );
        self.ticks(&mut s, &f);
        self.axes(&mut s, &f);
        for (i, series) in self.series.iter().enumerate() {
            self.line(&mut s, &f, i, series);
        }
        s.push_str("</svg>\n");
        s
    }

    /// Whether point `p` can be drawn (finite, and positive x on a log axis).
    fn shown(&self, p: &(f64, f64)) -> bool {
        p.0.is_finite() && p.1.is_finite() && (!self.log2_x || p.0 > 0.0)
    }

    /// The axes' ranges that hold every point drawn.
    fn frame(&self) -> Frame {
        let pts: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(|p| self.shown(p)).copied())
            .collect();
        let mut f = Frame {
            log2_x: self.log2_x,
            x0: 0.0,
            x1: 0.0,
            y1: 0.0,
            pw: WIDTH - LEFT - RIGHT,
            ph: HEIGHT - TOP - BOTTOM,
        };
        let (mut x0, mut x1) = pts
            .iter()
            .map(|p| f.tx(p.0))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                (a.min(x), b.max(x))
            });
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let y1 = pts.iter().map(|p| p.1).fold(0.0f64, f64::max);
        f.y1 = if y1 > 0.0 { y1 * 1.08 } else { 1.0 };
        (f.x0, f.x1) = (x0, x1);
        f
    }

    /// The grid with its y ticks, and the x ticks.
    fn ticks(&self, s: &mut String, f: &Frame) {
        for t in linear_ticks(0.0, f.y1, 6) {
            let y = f.py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + f.pw,
                LEFT - 6.0,
                y + 4.0,
                trim_number(t)
            );
        }
        // X ticks: powers of two on a log axis, round numbers otherwise.
        let xticks: Vec<f64> = if self.log2_x {
            (f.x0.ceil() as i64..=f.x1.floor() as i64)
                .map(|e| 2f64.powi(e as i32))
                .collect()
        } else {
            linear_ticks(f.x0, f.x1, 8)
        };
        for t in xticks {
            let x = f.px(t);
            let label = if self.x_as_bytes {
                format_bytes(t)
            } else {
                trim_number(t)
            };
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + f.ph,
                TOP + f.ph + 18.0,
                escape(&label)
            );
        }
    }

    /// The plot area's border and the axes' labels.
    fn axes(&self, s: &mut String, f: &Frame) {
        let (pw, ph) = (f.pw, f.ph);
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            HEIGHT - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
            TOP + ph / 2.0,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
    }

    /// Series number `i`: its line and points, and its legend entry.
    fn line(&self, s: &mut String, f: &Frame, i: usize, series: &Series) {
        let colour = COLOURS[i % COLOURS.len()];
        let line: Vec<String> = series
            .points
            .iter()
            .filter(|p| self.shown(p))
            .map(|&(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y)))
            .collect();
        if !line.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                line.join(" ")
            );
            for p in &line {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>"#);
            }
        }
        let ly = TOP + 10.0 + i as f64 * 18.0;
        let lx = LEFT + f.pw + 14.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            escape(&series.name)
        );
    }
}

fn trim_number(v: f64) -> String {
    if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_series_and_escapes_text() {
        let plot = LinePlot {
            title: "a < b".into(),
            x_label: "block".into(),
            y_label: "GB/s".into(),
            log2_x: true,
            x_as_bytes: true,
            series: vec![
                Series {
                    name: "G2->G3".into(),
                    points: vec![(4096.0, 1.0), (65536.0, 2.5)],
                },
                Series {
                    name: "G3->G2".into(),
                    points: vec![(4096.0, f64::NAN), (65536.0, 1.5)],
                },
            ],
        };
        let svg = plot.render();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt; b") && svg.contains("G2-&gt;G3"));
        assert!(svg.contains("64 KiB"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn empty_plot_still_renders() {
        let plot = LinePlot {
            title: String::new(),
            x_label: String::new(),
            y_label: String::new(),
            log2_x: false,
            x_as_bytes: false,
            series: Vec::new(),
        };
        assert!(plot.render().contains("</svg>"));
    }
}
