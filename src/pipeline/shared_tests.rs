use std::sync::mpsc::channel;

use super::*;
use crate::comm::CommError;
use crate::config::TrainConfig;
use crate::data::{DataConfig, StepData};

fn shared(ranks: usize) -> (Shared, std::sync::mpsc::Receiver<StepMetrics>) {
    let train = TrainConfig {
        micro_batches: 2,
        micro_batch_size: 1,
        ..TrainConfig::default()
    };
    let data = StepData::new(DataConfig::default(), 8, 0).unwrap();
    let (tx, rx) = channel();
    let feed = Arc::new(StepFeed::new(data, train));
    (Shared::new(ranks, feed, tx), rx)
}

#[test]
fn a_step_is_reported_once_every_rank_has_stepped() {
    let (shared, rx) = shared(2);
    // Rank 1 holds stage 1 and posts first; the norm is still summed stage by stage.
    shared.post_sq_norms(0, vec![(1, vec![16.0])]);
    shared.post_sq_norms(0, vec![(0, vec![4.0, 5.0])]);
    shared.record_loss(0, 1, 3.0);
    shared.record_loss(0, 0, 1.0);
    shared.stepped(0, 0.5);
    assert!(rx.try_recv().is_err(), "one rank of two has stepped");
    shared.stepped(0, 0.5);
    let m = rx.try_recv().unwrap();
    assert_eq!(m.step, 0);
    assert_eq!(m.grad_norm, 5.0);
    assert_eq!(m.lr, 0.5);
    // Two micro-batches of equal size: scales 1/2 each.
    assert_eq!(m.loss, 2.0);
    assert_eq!(m.tokens, 16);
}

#[derive(Debug)]
struct NoSync;
impl GradSync for NoSync {
    fn all_reduce(&self, _: usize, _: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
}

#[test]
fn a_replica_runs_its_share_of_the_step_with_the_whole_batchs_scales() {
    let (whole, _rx) = shared(1);
    let (replica, rx) = shared(1);
    let replica = replica.with_replica(Some(Replica {
        index: 1,
        count: 2,
        sync: Arc::new(NoSync),
    }));
    let (all, own) = (whole.step_data(3), replica.step_data(3));
    assert_eq!(own.batches, all.batches[1..2]);
    assert_eq!(own.scales, all.scales[1..2]);
    assert!(Arc::ptr_eq(&own, &replica.step_data(3)), "built once");
    // The reported loss is the mean over the replica's own micro-batch.
    replica.record_loss(3, 0, 2.5);
    replica.stepped(3, 0.1);
    assert_eq!(rx.try_recv().unwrap().loss, 2.5);
}

#[test]
fn finals_are_given_only_when_every_rank_has_deposited() {
    let (shared, _rx) = shared(2);
    let fin = RankFinal {
        stages: vec![],
        optimizer: OptimizerState::default(),
    };
    shared.deposit_final(1, fin.clone());
    assert!(shared.take_finals().is_none());
    shared.deposit_final(0, fin);
    assert_eq!(shared.take_finals().map(|f| f.len()), Some(2));
}

/// A process that runs one rank takes its own final without the others'.
#[test]
fn a_rank_takes_its_own_final_alone_once() {
    let (shared, _rx) = shared(3);
    assert!(shared.take_own_final(1).is_none(), "not deposited yet");
    shared.deposit_final(
        1,
        RankFinal {
            stages: vec![],
            optimizer: OptimizerState {
                step: 7,
                ..OptimizerState::default()
            },
        },
    );
    assert_eq!(shared.take_own_final(1).map(|f| f.optimizer.step), Some(7));
    assert!(shared.take_own_final(1).is_none(), "taken once");
    assert!(shared.take_own_final(5).is_none(), "no such rank");
}
