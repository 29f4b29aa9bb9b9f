//! The writer of an in-process run's periodic checkpoint: the ranks' deposited states,
//! merged and saved as one sharded checkpoint off the stage threads.

use std::path::PathBuf;

use super::{Checkpointing, RankFinal};
use crate::model::ModelError;
use crate::model::checkpoint::sharded;
use crate::model::checkpoint::sweep;
use crate::model::drafter::state::DrafterState;

/// Writes the ranks' `finals` as the sharded checkpoint of `next_step` (steps done).
pub(super) fn save_finals(
    plan: &Checkpointing,
    next_step: u64,
    finals: Vec<RankFinal>,
    drafter: Option<Result<DrafterState, ModelError>>,
) -> Result<PathBuf, ModelError> {
    let (params, optimizer) = RankFinal::merge(finals);
    let mut checkpoint = sharded::from_owned_state(
        plan.model.clone(),
        plan.data_seed,
        next_step,
        params,
        optimizer,
    );
    let dir = sharded::step_dir(&plan.run_dir, next_step);
    let saved = drafter.transpose().and_then(|d| {
        checkpoint.drafter = d;
        sharded::save_sharded(
            &dir,
            &checkpoint,
            &plan.layout,
            &plan.stage_of,
            &plan.config_hash,
        )
    });
    // What the failed write left goes; the error names the last complete checkpoint.
    let manifest = saved.map_err(|e| sweep::failed_periodic(&plan.run_dir, &dir, next_step, e))?;
    plan.retention.completed(&dir, &manifest)?;
    Ok(dir)
}
