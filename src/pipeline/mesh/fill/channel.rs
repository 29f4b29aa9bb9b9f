//! The mesh channel launched filling's frames use, and the lock its shared state is read under.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::comm::link::Channel;

/// Channel of the drafter's seeds, rows and rounds between the ranks of replica 0.
pub const FILL_CHANNEL: Channel = u32::MAX - 19;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
