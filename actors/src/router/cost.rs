//! The router's cost model of one kind of filler work, and the sizing of a slice to the idle
//! time left.
//!
//! A source's slices may come in sizes (`units` of its own work: drafter pairs, tokens to
//! verify). Their measured costs are fitted by a line, `cost ≈ mean + slope · (units −
//! mean units)`, from exponentially weighted moments (the newest slice weighs `ema`), so the
//! fit follows a cost that drifts (a warming cache, a growing buffer). A slice of `u` units
//! is predicted to cost the line at `u` plus `margin` deviations, the deviation being the
//! moving average of `|measured − predicted|`. [`CostEstimate::size`] picks the size the
//! router hands out: the largest that fits the idle time left, and, when one full slice
//! would leave too little for another, a smaller one that leaves exactly room for the
//! smallest slice after it, so a bubble ends filled up to the margin.

/// The running estimate of one kind's slice cost, in seconds of the stages' clock.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostEstimate {
    /// Moving average of the measured cost.
    pub mean: f64,
    /// Moving average of `|cost − predicted cost|` (the predicted cost at the slice's size,
    /// before it was measured).
    pub deviation: f64,
    /// Slices measured (0: `mean` and `slope` are the prior).
    pub samples: u64,
    /// Moving average of the measured slices' sizes (units).
    pub units: f64,
    /// Cost per unit (seconds): the fitted slope, or the prior's while the sizes measured
    /// do not vary enough to fit one.
    pub slope: f64,
    /// The prior's cost per unit, used while the sizes do not vary.
    prior_slope: f64,
    /// Moving variance of the sizes and covariance of sizes and costs.
    var_units: f64,
    cov: f64,
}

impl CostEstimate {
    /// Starts from a prior cost that does not depend on the size (no deviation known yet).
    pub fn prior(cost: f64) -> Self {
        Self::prior_line(1.0, cost, 0.0)
    }

    /// Starts from a prior line: a slice of `units` costs `cost`, each unit more `slope`.
    pub fn prior_line(units: f64, cost: f64, slope: f64) -> Self {
        CostEstimate {
            mean: cost,
            units,
            slope: slope.max(0.0),
            prior_slope: slope.max(0.0),
            ..CostEstimate::default()
        }
    }

    /// Starts from the line through two measured slices, `(small_units, small)` and
    /// `(large_units, large)`; when the sizes do not differ, through the origin and the
    /// larger one (cost proportional to the size).
    pub fn prior_through(small_units: f64, small: f64, large_units: f64, large: f64) -> Self {
        let slope = if large_units > small_units {
            (large - small) / (large_units - small_units)
        } else {
            large / large_units.max(1.0)
        };
        Self::prior_line(large_units, large, slope)
    }

    /// The cost of a slice of `units` units on the line (no margin).
    pub fn line(&self, units: f64) -> f64 {
        (self.mean + self.slope * (units - self.units)).max(0.0)
    }

    /// Folds in one measured slice of `units` units; the first measurement replaces the
    /// prior's level (its slope stays until the sizes vary).
    pub fn observe_sized(&mut self, units: f64, cost: f64, ema: f64) {
        let error = (cost - self.line(units)).abs();
        if self.samples == 0 {
            self.deviation = error * ema;
            self.mean = cost;
            self.units = units;
        } else {
            self.deviation += ema * (error - self.deviation);
            let (dx, dy) = (units - self.units, cost - self.mean);
            self.units += ema * dx;
            self.mean += ema * dy;
            self.var_units = (1.0 - ema) * (self.var_units + ema * dx * dx);
            self.cov = (1.0 - ema) * (self.cov + ema * dx * dy);
        }
        self.samples += 1;
        // Below a tenth of a unit of spread the sizes say nothing about the slope.
        self.slope = if self.var_units > 0.01 {
            (self.cov / self.var_units).max(0.0)
        } else {
            self.prior_slope
        };
    }

    /// Folds in one measured slice of a kind that has one size.
    pub fn observe(&mut self, cost: f64, ema: f64) {
        self.observe_sized(self.units.max(1.0), cost, ema);
    }

    /// The cost a slice of the usual size is predicted to have: mean plus `margin`
    /// deviations.
    pub fn predicted(&self, margin: f64) -> f64 {
        self.mean + margin * self.deviation
    }

    /// The cost a slice of `units` units is predicted to have: the line plus `margin`
    /// deviations.
    pub fn predicted_at(&self, units: f64, margin: f64) -> f64 {
        self.line(units) + margin * self.deviation
    }

    /// The size of the slice to hand out into `idle` seconds, among `min..=max` units, or
    /// `None` when not even `min` fits (see the module docs).
    pub fn size(&self, idle: f64, min: u64, max: u64, margin: f64) -> Option<u64> {
        let fits = |units: u64, idle: f64| self.predicted_at(units as f64, margin) <= idle;
        let min = min.max(1);
        let max = max.max(min);
        if !fits(min, idle) {
            return None;
        }
        let largest = |idle: f64| -> u64 {
            if fits(max, idle) {
                return max;
            }
            // The line is non-decreasing: bisect for the largest fitting size.
            let (mut lo, mut hi) = (min, max);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits(mid, idle) { lo = mid } else { hi = mid }
            }
            lo
        };
        let first = largest(idle);
        if first < max {
            return Some(first);
        }
        let after = idle - self.predicted_at(max as f64, margin);
        if fits(min, after) {
            return Some(max);
        }
        // A full slice would strand the rest: leave room for the smallest one after it.
        let room = idle - self.predicted_at(min as f64, margin);
        Some(if fits(min, room) { largest(room) } else { max })
    }
}
