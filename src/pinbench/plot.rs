//! `umdev pinbench --svg`: ns per call against pages, log-log, for the track-mode rows of the
//! 4 KiB backing (runs, per-page, translate per pattern), with the kernel's figures as
//! reference points.

use std::path::Path;

use plotters::prelude::*;

use super::Row;

/// The kernel's figures from the seeds (../shared/BACKGROUND.md, 4 KiB backing, ns per
/// `vfio_pin_pages` call): type1 as merged, and with the run-splitting patch that was dropped.
const KERNEL_TYPE1: [(f64, f64); 2] = [(1.0, 1638.0), (512.0, 223_651.0)];
const KERNEL_RUN_SPLIT: [(f64, f64); 2] = [(1.0, 1735.0), (512.0, 167_286.0)];

/// Draws `rows` into `path`.
pub fn draw(rows: &[Row], path: &Path) -> Result<(), String> {
    let track: Vec<&Row> = rows.iter().filter(|r| r.backing == "4k-memfd" && r.mode == "track").collect();
    if track.is_empty() {
        return Err("no track-mode rows to draw".into());
    }
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let max_ns = track
        .iter()
        .flat_map(|r| [r.runs_ns, r.per_page_ns, r.translate_ns])
        .chain(KERNEL_TYPE1.iter().chain(&KERNEL_RUN_SPLIT).map(|p| p.1))
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "umdev pinbench: pin+unpin of an array in one call (track mode, 4 KiB memfd)",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((0.8f64..700.0f64).log_scale(), (1.0f64..max_ns * 2.0).log_scale())
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("pages in the array").y_desc("ns per call").draw().map_err(|e| err(&e))?;
    let patterns = ["contiguous", "scattered", "idaw-mixed", "single"];
    let colors = [BLUE, RED, GREEN, MAGENTA];
    for (pattern, color) in patterns.iter().zip(colors) {
        let of: Vec<&&Row> = track.iter().filter(|r| r.pattern == *pattern).collect();
        let series =
            |f: fn(&Row) -> f64| -> Vec<(f64, f64)> { of.iter().map(|r| (r.npages as f64, f(r))).collect() };
        let runs = series(|r| r.runs_ns);
        let per_page = series(|r| r.per_page_ns);
        let translate = series(|r| r.translate_ns);
        chart
            .draw_series(LineSeries::new(runs.clone(), color.stroke_width(3)))
            .map_err(|e| err(&e))?
            .label(format!("{pattern}: runs (one call)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
        chart.draw_series(runs.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
        chart
            .draw_series(LineSeries::new(per_page, color.mix(0.5).stroke_width(1)))
            .map_err(|e| err(&e))?
            .label(format!("{pattern}: per-page calls"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.mix(0.5).stroke_width(1))
            });
        chart
            .draw_series(DashedLineSeries::new(translate, 6, 4, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("{pattern}: translate (no pins)"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 6, y), (x + 10, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    // One range of the same pages: no array to read, so flat (its floor is contiguous's).
    let range: Vec<(f64, f64)> =
        track.iter().filter(|r| r.pattern == "range").map(|r| (r.npages as f64, r.runs_ns)).collect();
    chart
        .draw_series(LineSeries::new(range.clone(), CYAN.stroke_width(3)))
        .map_err(|e| err(&e))?
        .label("range (pin_range, one call)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], CYAN.stroke_width(3)));
    chart.draw_series(range.iter().map(|&p| Circle::new(p, 4, CYAN.filled()))).map_err(|e| err(&e))?;
    chart
        .draw_series(KERNEL_TYPE1.iter().map(|&p| TriangleMarker::new(p, 8, BLACK.filled())))
        .map_err(|e| err(&e))?
        .label("Linux type1 vfio_pin_pages (seed figures)")
        .legend(|(x, y)| TriangleMarker::new((x + 10, y), 6, BLACK.filled()));
    chart
        .draw_series(KERNEL_RUN_SPLIT.iter().map(|&p| Cross::new(p, 6, BLACK.stroke_width(2))))
        .map_err(|e| err(&e))?
        .label("Linux with the dropped run-split patch")
        .legend(|(x, y)| Cross::new((x + 10, y), 5, BLACK.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
