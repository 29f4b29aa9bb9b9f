//! [`Cut`]: how the model's blocks are split over pipeline stage chunks.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::Result;
use crate::model::ModelError;

/// How the blocks are split over stage chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cut {
    /// `S` chunks of as equal size as possible (the earlier chunks take the remainder).
    Even(usize),
    /// Explicit block counts per chunk; they must sum to `layers` (a count may be 0).
    Layers(Vec<usize>),
}

impl Default for Cut {
    fn default() -> Self {
        Cut::Even(1)
    }
}

impl Cut {
    /// The block range of every chunk, or why the cut does not fit `layers` blocks.
    pub fn ranges(&self, layers: usize) -> Result<Vec<Range<usize>>> {
        let err = |reason: String| ModelError::Cut {
            layers,
            cut: format!("{self:?}"),
            reason,
        };
        let counts = match self {
            Cut::Even(0) => return Err(err("at least one chunk is needed".into())),
            Cut::Even(s) if *s > layers => {
                return Err(err(format!("{s} chunks would leave some without a block")));
            }
            Cut::Even(s) => (0..*s)
                .map(|i| layers / s + usize::from(i < layers % s))
                .collect(),
            Cut::Layers(counts) if counts.is_empty() => {
                return Err(err("at least one chunk is needed".into()));
            }
            Cut::Layers(counts) => {
                let total: usize = counts.iter().sum();
                if total != layers {
                    return Err(err(format!("the counts sum to {total}")));
                }
                counts.clone()
            }
        };
        let mut start = 0;
        Ok(counts
            .iter()
            .map(|&c| {
                start += c;
                start - c..start
            })
            .collect())
    }
}
