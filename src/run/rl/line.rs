//! What an RL run shows and logs of each step, in one process or launched alike: the plain
//! line ([`step_line`]) and the `metrics.jsonl` line ([`MetricsLine`], written by
//! [`write_line`]), both from the one [`RlStepMetrics`] type.

use std::io::Write;
use std::path::Path;

use crate::rl::calibrate::Calibration;
use crate::rl::step_metrics::RlStepMetrics;
use crate::rl::trainer_spec::ThresholdChoice;
use crate::run::RunError;

/// A line of metrics.jsonl: the step's [`RlStepMetrics`], the live-batch threshold its
/// rollout speculated below (and where it came from), and on the first line the step costs
/// a calibrated threshold was derived from.
#[derive(serde::Serialize)]
pub(super) struct MetricsLine<'a> {
    #[serde(flatten)]
    pub(super) step: &'a RlStepMetrics,
    pub(super) spec_threshold: Option<&'a ThresholdChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) calibration: Option<&'a Calibration>,
}

/// Appends `line` to `metrics.jsonl` (`path`, open as `file`) and flushes it, so that the
/// file follows the run.
pub(super) fn write_line(
    file: &mut impl Write,
    path: &Path,
    line: &MetricsLine<'_>,
) -> Result<(), RunError> {
    serde_json::to_writer(&mut *file, line)
        .map_err(std::io::Error::from)
        .and_then(|()| writeln!(file))
        .and_then(|()| file.flush())
        .map_err(|e| RunError::write(path, e))
}

/// Step `m` of `steps` in one line: reward, the rollout (throughput, share of the step, the
/// stages' idle time and how much of it filler work used, the live batch it speculated
/// below), the drafter, the reference, a launched run's weight sync, and the update.
pub(super) fn step_line(
    m: &RlStepMetrics,
    steps: u64,
    threshold: Option<&ThresholdChoice>,
) -> String {
    format!(
        "step {:>4}/{steps} reward {:.3} | rollout {:.2} s ({:.0} tok/s, {:.0}% of the step, \
         stages idle {}){} | drafter {:.2} s | reference {:.2} s{} | update {:.2} s, loss \
         {:+.4}, grad norm {:.3}",
        m.step + 1,
        m.reward,
        m.rollout_seconds,
        m.tokens_per_s,
        100.0 * m.rollout_share,
        idle_line(m),
        threshold.map_or(String::new(), |t| format!(" speculating ≤ {}", t.threshold)),
        m.drafter_seconds,
        m.reference_seconds,
        m.sync_seconds
            .map_or(String::new(), |s| format!(" | weight sync {s:.3} s")),
        m.update_seconds,
        m.surrogate_loss,
        m.grad_norm
    )
}

/// The run's closing lines: the median step and its parts, then `done:` with the steps, their
/// time (the warm-up and the start excluded) and the rollouts' share of it, and the mean
/// reward of the first and last steps; `ran` says where it ran and what it wrote.
pub(super) fn summary_lines(history: &[RlStepMetrics], ran: &str) -> Vec<String> {
    let seconds: f64 = history.iter().map(|m| m.step_seconds).sum();
    let median = |f: fn(&RlStepMetrics) -> f64| {
        let mut v: Vec<f64> = history.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let window = crate::run::log::summary_window(history.len());
    let mean = |ms: &[RlStepMetrics]| ms.iter().map(|m| m.reward).sum::<f64>() / ms.len() as f64;
    let rollout: f64 = history.iter().map(|m| m.rollout_seconds).sum();
    let mut lines = Vec::new();
    if window > 0 {
        lines.push(format!(
            "median step {:.3} s: rollout {:.3} s, drafter {:.3} s, reference {:.3} s, update \
             {:.3} s",
            median(|m| m.step_seconds),
            median(|m| m.rollout_seconds),
            median(|m| m.drafter_seconds),
            median(|m| m.reference_seconds),
            median(|m| m.update_seconds),
        ));
    }
    let rewards = match window {
        0 => String::new(),
        w => format!(
            "; reward {:.3} → {:.3} (mean of first/last {w} steps)",
            mean(&history[..w]),
            mean(&history[history.len() - w..]),
        ),
    };
    lines.push(format!(
        "done: {} RL steps in {seconds:.1} s (rollouts {:.0}%){rewards}; {ran}",
        history.len(),
        100.0 * rollout / seconds.max(1e-9),
    ));
    lines.extend(crate::run::peak::peak_line());
    lines
}

/// `"1.23 s, 45% filled (6 slices)"`, or `-` without an idle-work router.
fn idle_line(m: &RlStepMetrics) -> String {
    match (m.rollout_idle_seconds, m.rollout_idle_filled_seconds) {
        (Some(idle), Some(filled)) => format!(
            "{idle:.2} s, {:.0}% filled ({} drafter slices)",
            100.0 * filled / idle.max(1e-9),
            m.idle_drafter_slices
        ),
        _ => "-".into(),
    }
}
