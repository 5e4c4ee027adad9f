//! `umdev pinbench --svg`: ns per pin+unpin call against pages, log-log, for a contiguous
//! array on the 4 KiB memfd: kernel, lock and track modes, each one call per run (solid)
//! and one call per page (dashed); this machine's kernel floor (bare io_uring registration,
//! per run and per page) as thin black lines; kernel mode on THP; and the seeds' figures
//! (Xu's 2020 `vfio_pin_pages` measurements) as points. The legend sits beside the data, each
//! line's sample drawn with the line's own dashes; the caption names the host, the date and
//! the rounds.

use std::path::Path;

use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::Row;

/// The seeds' kernel figures (ns per `vfio_pin_pages` call; /work/shared/BACKGROUND.md
/// section 1): type1 as merged (a page at a time), and with the run-splitting patch that
/// was dropped (a call per run); 4 KiB and THP backings.
/// x is log2 of the pages (0: 1 page, 9: 512).
const SEED_TYPE1_4K: [(f64, f64); 2] = [(0.0, 1638.0), (9.0, 223_651.0)];
const SEED_SPLIT_4K: [(f64, f64); 2] = [(0.0, 1735.0), (9.0, 167_286.0)];
const SEED_TYPE1_THP: [(f64, f64); 2] = [(0.0, 1668.0), (9.0, 222_330.0)];
const SEED_SPLIT_THP: [(f64, f64); 2] = [(0.0, 1934.0), (9.0, 126_900.0)];

/// Dashes of the per-page lines, in pixels: the same in the plot and in the legend.
const DASH: u32 = 10;
const GAP: u32 = 6;

/// How a series is drawn, for the plot and its legend sample.
#[derive(Clone, Copy)]
enum Stroke {
    Solid(u32),
    Dashed(u32),
}

struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    stroke: Stroke,
}

/// What the caption says about the run: the host, the date, the rounds.
pub struct Caption {
    pub host: String,
    pub date: String,
    pub rounds: usize,
}

/// Draws `rows` as an SVG document (for `path`, which errors name).
pub fn draw(rows: &[Row], caption: &Caption, path: &Path) -> Result<String, String> {
    let of = |backing: &str, mode: &str, per_page: bool| -> Vec<(f64, f64)> {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.backing == backing && r.mode == mode && r.pattern == "contiguous")
            .map(|r| ((r.npages as f64).log2(), if per_page { r.per_page_ns } else { r.runs_ns }))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    };
    let blue = RGBColor(31, 90, 200);
    let red = RGBColor(200, 40, 40);
    let green = RGBColor(20, 140, 60);
    let purple = PURPLE;
    let mut series = Vec::new();
    let mut add = |label: &str, points: Vec<(f64, f64)>, color, stroke| {
        if !points.is_empty() {
            series.push(Series { label: label.into(), points, color, stroke });
        }
    };
    add("kernel mode, a call per run", of("4k-memfd", "kernel", false), blue, Stroke::Solid(3));
    add("kernel mode, a call per page", of("4k-memfd", "kernel", true), blue, Stroke::Dashed(2));
    add("lock mode (mlock), a call per run", of("4k-memfd", "lock", false), red, Stroke::Solid(3));
    add("lock mode (mlock), a call per page", of("4k-memfd", "lock", true), red, Stroke::Dashed(2));
    add("track mode, a call per run", of("4k-memfd", "track", false), green, Stroke::Solid(3));
    add("track mode, a call per page", of("4k-memfd", "track", true), green, Stroke::Dashed(2));
    add(
        "kernel floor: bare io_uring, a call per run",
        of("4k-memfd", "uring-floor", false),
        BLACK,
        Stroke::Solid(1),
    );
    add(
        "kernel floor: bare io_uring, a call per page",
        of("4k-memfd", "uring-floor", true),
        BLACK,
        Stroke::Dashed(1),
    );
    add("kernel mode on THP, a call per run", of("2m-thp-memfd", "kernel", false), purple, Stroke::Solid(2));
    if series.is_empty() {
        return Err("no rows of the 4 KiB memfd's contiguous pattern to draw".into());
    }

    let mut svg = String::new();
    paint(SVGBackend::with_string(&mut svg, (1280, 760)).into_drawing_area(), &series, caption, path)?;
    Ok(svg)
}

/// The THP lines' and points' colour.
const PURPLE: RGBColor = RGBColor(140, 60, 170);

/// Paints `series` and the seeds' points on `root`.
fn paint(
    root: DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &[Series],
    caption: &Caption,
    path: &Path,
) -> Result<(), String> {
    let purple = PURPLE;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(56);
    top.draw_text(
        "umdev pinbench: pin+unpin of a contiguous array, 4 KiB memfd (medians)",
        &("sans-serif", 22).into_font().color(&BLACK),
        (24, 8),
    )
    .map_err(|e| err(&e))?;
    top.draw_text(
        &format!("{}, {}, {} rounds per row", caption.host, caption.date, caption.rounds),
        &("sans-serif", 15).into_font().color(&RGBColor(70, 70, 70)),
        (24, 34),
    )
    .map_err(|e| err(&e))?;
    let (plot, legend) = bottom.split_horizontally(860);

    let seeds = [SEED_TYPE1_4K, SEED_SPLIT_4K, SEED_TYPE1_THP, SEED_SPLIT_THP];
    let all =
        series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).chain(seeds.iter().flatten().map(|p| p.1));
    let (lo, hi) = all.fold((f64::MAX, 1.0f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
    let mut chart = ChartBuilder::on(&plot)
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(88)
        // x is log2(pages), so that the ticks fall on the sizes measured.
        .build_cartesian_2d(-0.3f64..9.4f64, (lo / 2.0..hi * 2.0).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("pages in the array")
        .y_desc("time per call")
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 17))
        .x_labels(10)
        .x_label_formatter(&|x| match x.round() as i32 {
            k if (x - x.round()).abs() < 1e-6 && k % 3 == 0 => format!("{}", 1u32 << k),
            _ => String::new(),
        })
        .y_label_formatter(&|y| human_ns(*y))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(&e))?;
    for s in series {
        match s.stroke {
            Stroke::Solid(w) => {
                chart
                    .draw_series(LineSeries::new(s.points.clone(), s.color.stroke_width(w)))
                    .map_err(|e| err(&e))?;
            }
            Stroke::Dashed(w) => {
                chart
                    .draw_series(DashedLineSeries::new(s.points.clone(), DASH, GAP, s.color.stroke_width(w)))
                    .map_err(|e| err(&e))?;
            }
        }
        let mark = if matches!(s.stroke, Stroke::Solid(1) | Stroke::Dashed(1)) { 2 } else { 4 };
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, mark, s.color.filled())))
            .map_err(|e| err(&e))?;
    }
    let marker =
        |p: (f64, f64), triangle: bool, color: RGBColor, filled: bool| -> DynElement<'static, _, _> {
            let style = if filled { color.filled() } else { color.stroke_width(2) };
            if triangle {
                TriangleMarker::new(p, 9, style).into_dyn()
            } else {
                Cross::new(p, 7, color.stroke_width(3)).into_dyn()
            }
        };
    for (points, triangle, color, filled) in [
        (SEED_TYPE1_4K, true, BLACK, true),
        (SEED_SPLIT_4K, false, BLACK, true),
        (SEED_TYPE1_THP, true, purple, false),
        (SEED_SPLIT_THP, false, purple, false),
    ] {
        chart.draw_series(points.iter().map(|&p| marker(p, triangle, color, filled))).map_err(|e| err(&e))?;
    }

    // The legend, beside the data: each entry's sample drawn as its line is.
    let font = ("sans-serif", 15).into_font().color(&BLACK);
    let mut y = 30;
    legend
        .draw_text("Lines (this machine):", &("sans-serif", 16).into_font().color(&BLACK), (8, 6))
        .map_err(|e| err(&e))?;
    for s in series {
        let (x0, x1) = (10, 62);
        match s.stroke {
            Stroke::Solid(w) => legend
                .draw(&PathElement::new(vec![(x0, y + 8), (x1, y + 8)], s.color.stroke_width(w)))
                .map_err(|e| err(&e))?,
            Stroke::Dashed(w) => legend
                .draw(&DashedPathElement::new(
                    vec![(x0, y + 8), (x1, y + 8)],
                    DASH,
                    GAP,
                    s.color.stroke_width(w),
                ))
                .map_err(|e| err(&e))?,
        }
        legend.draw_text(&s.label, &font, (72, y)).map_err(|e| err(&e))?;
        y += 26;
    }
    y += 16;
    legend
        .draw_text(
            "Points: the seeds' kernel (2020, vfio_pin_pages):",
            &("sans-serif", 16).into_font().color(&BLACK),
            (8, y),
        )
        .map_err(|e| err(&e))?;
    y += 26;
    for (text, triangle, color, filled) in [
        ("type1 as merged, a call per page, 4 KiB", true, BLACK, true),
        ("with the run-split patch, per run, 4 KiB", false, BLACK, true),
        ("type1 as merged, a call per page, THP", true, purple, false),
        ("with the run-split patch, per run, THP", false, purple, false),
    ] {
        let style = if filled { color.filled() } else { color.stroke_width(2) };
        if triangle {
            legend.draw(&TriangleMarker::new((36, y + 8), 9, style)).map_err(|e| err(&e))?;
        } else {
            legend.draw(&Cross::new((36, y + 8), 7, color.stroke_width(3))).map_err(|e| err(&e))?;
        }
        legend.draw_text(text, &font, (72, y)).map_err(|e| err(&e))?;
        y += 26;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// `ns` as a tick label: 300 ns, 3 us, 30 us, 3 ms.
fn human_ns(ns: f64) -> String {
    match ns {
        n if n >= 1e6 => format!("{} ms", trim(n / 1e6)),
        n if n >= 1e3 => format!("{} us", trim(n / 1e3)),
        n => format!("{} ns", trim(n)),
    }
}

fn trim(v: f64) -> String {
    if v >= 10.0 || (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
