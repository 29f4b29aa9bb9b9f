//! One line of a training run's `metrics.jsonl` ([`StepLine`]), the same type for the
//! in-process pipeline and a launched job's rank 0, so that the two files carry the same
//! fields for the same step.

use serde::Serialize;

use crate::pipeline::{DrafterStep, StepView};
use crate::schedules::Timeline;
use crate::train::StepMetrics;

/// One line of `metrics.jsonl`: the step's metrics plus tokens/s and the figures of its
/// measured timeline, and with a filler the share of the waits it used and the drafter's
/// progress.
#[derive(Debug, Serialize)]
pub struct StepLine<'a> {
    #[serde(flatten)]
    metrics: &'a StepMetrics,
    tokens_per_second: f64,
    /// Makespan of the step's measured timeline, in seconds (these three are null only
    /// when no timeline was measured for the step).
    makespan: Option<f64>,
    bubble_ratio: Option<f64>,
    steady_bubble_ratio: Option<f64>,
    /// Seconds the ranks waited for input during the step, and how many of them filler
    /// work used; their ratio (runs with a filler).
    #[serde(skip_serializing_if = "Option::is_none")]
    waited: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    filled: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bubble_fill_ratio: Option<f64>,
    /// Drafter steps so far, slices run during the step and their mean loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    drafter_version: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    drafter_slices: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    drafter_loss: Option<f64>,
    /// Top-1 agreement with the target on held-out rows, on the steps it was measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    drafter_agreement: Option<f64>,
}

impl<'a> StepLine<'a> {
    /// The line of a step with its measured `timeline`, when there is one.
    pub fn new(metrics: &'a StepMetrics, timeline: Option<&Timeline>) -> Self {
        StepLine {
            metrics,
            tokens_per_second: metrics.tokens_per_second(),
            makespan: timeline.map(|t| t.makespan),
            bubble_ratio: timeline.map(|t| t.bubble_ratio),
            steady_bubble_ratio: timeline.map(|t| t.steady_bubble_ratio),
            waited: None,
            filled: None,
            bubble_fill_ratio: None,
            drafter_version: None,
            drafter_slices: None,
            drafter_loss: None,
            drafter_agreement: None,
        }
    }

    /// The line of an in-process step as the runtime handed it over; `filler`: the run
    /// fills its bubbles (the waits and their filled share are reported).
    pub fn of_view(view: &StepView<'a>, filler: bool) -> Self {
        let mut line = StepLine::new(view.metrics, view.profile.map(|p| &p.timeline));
        if let Some(p) = view.profile.filter(|_| filler) {
            line = line.with_fill(p.waited(), p.filled());
        }
        match view.drafter {
            Some(d) => line.with_drafter(d),
            None => line,
        }
    }

    /// With the seconds the ranks `waited` for input and the seconds filler work `filled`.
    pub fn with_fill(mut self, waited: f64, filled: f64) -> Self {
        self.waited = Some(waited);
        self.filled = Some(filled);
        self.bubble_fill_ratio = Some(if waited > 0.0 { filled / waited } else { 0.0 });
        self
    }

    /// With the drafter's progress up to the step.
    pub fn with_drafter(mut self, d: DrafterStep) -> Self {
        self.drafter_version = Some(d.version);
        self.drafter_slices = Some(d.slices);
        self.drafter_loss = d.loss;
        self.drafter_agreement = d.agreement;
        self
    }

    /// The step's metrics.
    pub fn metrics(&self) -> &'a StepMetrics {
        self.metrics
    }

    /// The line as one JSON object, without a newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a step line always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> StepMetrics {
        StepMetrics {
            step: 3,
            loss: 2.5,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens: 100,
            seconds: 0.5,
        }
    }

    #[test]
    fn a_line_without_filler_has_no_filler_fields() {
        let m = metrics();
        let v: serde_json::Value =
            serde_json::from_str(&StepLine::new(&m, None).to_json()).unwrap();
        assert_eq!(v["step"], 3);
        assert_eq!(v["tokens_per_second"], 200.0);
        assert!(v["makespan"].is_null() && v.get("makespan").is_some());
        assert!(v.get("waited").is_none() && v.get("drafter_version").is_none());
    }

    #[test]
    fn fill_and_drafter_figures_are_reported() {
        let m = metrics();
        let d = DrafterStep {
            version: 7,
            slices: 2,
            loss: Some(1.5),
            agreement: None,
        };
        let line = StepLine::new(&m, None).with_fill(0.4, 0.1).with_drafter(d);
        let v: serde_json::Value = serde_json::from_str(&line.to_json()).unwrap();
        assert_eq!(v["bubble_fill_ratio"], 0.25);
        assert_eq!(v["drafter_version"], 7);
        assert!(v.get("drafter_agreement").is_none());
        let idle = StepLine::new(&m, None).with_fill(0.0, 0.0).to_json();
        assert!(idle.contains("\"bubble_fill_ratio\":0.0"), "{idle}");
    }
}
