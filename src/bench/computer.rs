//! `bmx bench computer`: the latency of `computer_observe` and
//! `computer_action` on a real Xvfb screen, against the bare X call each
//! is built on, measured in the same run:
//! * `observe` (grab, BGRX → RGB, scale to the bounded image, PNG) against
//!   `grab` (one `GetImage` of the whole screen);
//! * `click` (XTEST motion, press, release, waited for) against `motion`
//!   (one XTEST motion, waited for).
//!
//! The screen shows a real picture, not a black one (PNG of a uniform
//! screen is cheap): an `xterm` listing `/usr/bin`, when `xterm` exists.
//! What the tool call adds on the wire (one `tool.call` and one
//! `tool.result`, the image base64 in it) is not in these rows.

use bmx::executor::actors::display::{display_name, xvfb_command, Screen};
use bmx::tools::computer::Action;
use serde::Serialize;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct ComputerOptions {
    pub width: u16,
    pub height: u16,
    pub calls: usize,
}

#[derive(Debug, Serialize)]
pub struct Row {
    pub what: String,
    pub p50_us: f64,
    pub p99_us: f64,
    pub baseline: String,
    pub baseline_p50_us: f64,
    pub baseline_p99_us: f64,
    pub p50_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct ComputerReport {
    pub width: u16,
    pub height: u16,
    pub calls: usize,
    pub png_bytes: usize,
    pub rows: Vec<Row>,
}

impl ComputerReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "computer use on a {}x{} Xvfb screen, {} calls per row (PNG of {} bytes)\n",
            self.width, self.height, self.calls, self.png_bytes
        );
        out.push_str(&format!(
            "{:<8} {:>10} {:>10}   {:<8} {:>10} {:>10} {:>8}\n",
            "row", "p50", "p99", "baseline", "p50", "p99", "p50_x"
        ));
        for r in &self.rows {
            out.push_str(&format!(
                "{:<8} {:>8.0}us {:>8.0}us   {:<8} {:>8.0}us {:>8.0}us {:>8.2}\n",
                r.what,
                r.p50_us,
                r.p99_us,
                r.baseline,
                r.baseline_p50_us,
                r.baseline_p99_us,
                r.p50_ratio
            ));
        }
        out
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Microseconds of each of `n` calls of `f`, sorted.
fn timed(n: usize, mut f: impl FnMut(usize) -> Result<(), String>) -> Result<Vec<f64>, String> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(f64::total_cmp);
    Ok(v)
}

fn row(what: &str, v: &[f64], baseline: &str, b: &[f64]) -> Row {
    let (p50, bp50) = (percentile(v, 0.5), percentile(b, 0.5));
    Row {
        what: what.into(),
        p50_us: p50,
        p99_us: percentile(v, 0.99),
        baseline: baseline.into(),
        baseline_p50_us: bp50,
        baseline_p99_us: percentile(b, 0.99),
        p50_ratio: p50 / bp50.max(1e-9),
    }
}

pub async fn run(opts: &ComputerOptions) -> Result<ComputerReport, String> {
    let mut xvfb = xvfb_command(opts.width, opts.height)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("Xvfb: {e} (install the xvfb package)"))?;
    let name = display_name(&mut xvfb).await.map_err(|e| e.to_string())?;
    // Something to look at.
    let xterm = tokio::process::Command::new("xterm")
        .args([
            "-geometry",
            "200x60+0+0",
            "-e",
            "sh",
            "-c",
            "ls -l /usr/bin; sleep 600",
        ])
        .env("DISPLAY", &name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok();
    let result = tokio::task::spawn_blocking({
        let opts = (opts.width, opts.height, opts.calls);
        move || measure(&name, opts)
    })
    .await
    .map_err(|e| e.to_string())?;
    drop(xterm);
    let _ = xvfb.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), xvfb.wait()).await;
    result
}

fn measure(
    name: &str,
    (width, height, calls): (u16, u16, usize),
) -> Result<ComputerReport, String> {
    let mut screen = None;
    for _ in 0..50 {
        if let Ok(s) = Screen::connect(name) {
            screen = Some(Arc::new(s));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let screen = screen.ok_or("cannot connect to Xvfb")?;
    // Let the xterm draw its listing.
    std::thread::sleep(Duration::from_millis(1500));
    let e = |e: bmx::executor::actors::display::DisplayError| e.to_string();
    let (w, h) = screen.size();
    let png_bytes = screen.observe().map_err(e)?.0.len();
    let grab = timed(calls, |_| screen.grab().map(drop).map_err(e))?;
    let observe = timed(calls, |_| screen.observe().map(drop).map_err(e))?;
    let at = |i: usize| ((i * 37) as u16 % w, (i * 53) as u16 % h);
    let motion = timed(calls, |i| {
        let (x, y) = at(i);
        screen.nudge(x, y).map_err(e)
    })?;
    let click = timed(calls, |i| {
        let (x, y) = at(i);
        // Button 2 on the root or the xterm: no menu, no selection.
        screen.act(&Action::Click { x, y, button: 2 }).map_err(e)
    })?;
    Ok(ComputerReport {
        width,
        height,
        calls,
        png_bytes,
        rows: vec![
            row("observe", &observe, "grab", &grab),
            row("click", &click, "motion", &motion),
        ],
    })
}
