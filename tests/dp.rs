//! Data × pipeline parallel: dp = 2 replicas × pp = 2 stages, run as two pipelines in one
//! process joined by the in-process link, equals dp = 1 (one pipeline, the whole batch).
//!
//! Each replica runs half of every step's micro-batches with the whole batch's loss scales
//! and the ranks ring-all-reduce their gradients before the optimizer step, so the update
//! is the whole batch's. It is not bitwise dp = 1's: dp = 1 accumulates the micro-batch
//! gradients one after the other, `((g0 + g1) + g2) + g3`, while dp = 2 sums each replica's
//! half and then the halves, `(g0 + g1) + (g2 + g3)`; the two differ by float rounding
//! (≈1e-7 relative), which AdamW's normalised update carries into the parameters. Measured:
//! max |Δparam| 1.2e-7 after 3 steps (relative L2 3e-8). Stated tolerance, ~100× that to
//! leave room for AdamW amplifying a near-zero gradient's rounding: every parameter within
//! 1e-5 of dp = 1's and the difference's L2 norm within 1e-6 of the parameters'. The
//! replicas themselves must end bitwise equal (the all-reduce gives every replica the same
//! bits), and the all-reduce over loopback TCP (`TcpMesh`, one mesh end per global rank)
//! gives the in-process link's bits.

use std::sync::Arc;

use pipefill::comm::collective::RingGradSync;
use pipefill::comm::link::{InProcessLink, PeerLink};
use pipefill::comm::tcp::{MeshOptions, TcpMesh};
use pipefill::config::JobConfig;
use pipefill::pipeline::shared::Replica;
use pipefill::pipeline::{PipelineRun, PipelineTrainer};
use pipefill::schedules::{ScheduleKind, build};

mod common;
use common::job::tiny_job;

const STEPS: u64 = 3;
const PP: usize = 2;
const MAX_ABS_DIFF: f32 = 1e-5;
const MAX_REL_L2: f64 = 1e-6;

/// The tiny job over `PP` stages (clipped on some steps).
fn job() -> JobConfig {
    tiny_job(PP, STEPS)
}

/// Runs `dp` replicas of the 1F1B pipeline on threads of this process, joined by the
/// in-process link.
fn run_replicas(job: &JobConfig, dp: usize) -> Vec<PipelineRun> {
    let links: Vec<Arc<dyn PeerLink>> = InProcessLink::group(dp * PP)
        .into_iter()
        .map(|l| Arc::new(l) as Arc<dyn PeerLink>)
        .collect();
    run_replicas_over(job, dp, links)
}

/// Runs `dp` replicas whose gradient all-reduce goes over `links` (one per global rank).
fn run_replicas_over(
    job: &JobConfig,
    dp: usize,
    links: Vec<Arc<dyn PeerLink>>,
) -> Vec<PipelineRun> {
    let plan = build(ScheduleKind::OneFOneB, PP, job.train.micro_batches / dp, 1).unwrap();
    let trainers: Vec<PipelineTrainer> = (0..dp)
        .map(|d| {
            let ends = links[d * PP..(d + 1) * PP].to_vec();
            let replica = Replica {
                index: d,
                count: dp,
                sync: Arc::new(RingGradSync::new(ends, dp, PP, 7)),
            };
            PipelineTrainer::replica(job, plan.clone(), replica).unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = trainers
            .iter()
            .map(|t| s.spawn(move || t.run(STEPS, |_| {}).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn two_replicas_of_two_stages_equal_one_pipeline_with_the_whole_batch() {
    let job = job();
    let whole = PipelineTrainer::builtin(&job, ScheduleKind::OneFOneB, None)
        .unwrap()
        .run(STEPS, |_| {})
        .unwrap();
    let replicas = run_replicas(&job, 2);

    let (mut worst, mut moved, mut off) = (0.0f32, 0.0f64, 0.0f64);
    for name in whole.param_names() {
        let exp = whole.param_values(name).unwrap();
        let a = replicas[0].param_values(name).unwrap();
        let b = replicas[1].param_values(name).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "{name}: the replicas diverged");
        for (&x, &e) in a.iter().zip(exp) {
            worst = worst.max((x - e).abs());
            off += f64::from(x - e).powi(2);
        }
        moved += exp.iter().map(|&e| f64::from(e).powi(2)).sum::<f64>();
    }
    assert!(
        worst <= MAX_ABS_DIFF,
        "dp=2 differs from dp=1 by {worst:.3e}"
    );
    assert!(
        (off / moved).sqrt() <= MAX_REL_L2,
        "relative difference {:.3e}",
        (off / moved).sqrt()
    );
    // Same update norm and steps on both.
    for (w, r) in whole.steps.iter().zip(&replicas[0].steps) {
        assert_eq!(w.step, r.step);
        let rel = (w.grad_norm - r.grad_norm).abs() / w.grad_norm;
        assert!(
            rel <= 1e-5,
            "step {}: grad norm {} vs {}",
            w.step,
            w.grad_norm,
            r.grad_norm
        );
    }
    eprintln!(
        "dp=2 × pp=2 vs dp=1: max |Δparam| = {worst:.3e}, relative L2 = {:.3e}",
        (off / moved).sqrt()
    );
}

#[test]
fn a_batch_that_does_not_split_evenly_is_refused() {
    let job = job();
    let links: Vec<Arc<dyn PeerLink>> = InProcessLink::group(3 * PP)
        .into_iter()
        .map(|l| Arc::new(l) as Arc<dyn PeerLink>)
        .collect();
    let plan = build(ScheduleKind::OneFOneB, PP, 1, 1).unwrap();
    let replica = Replica {
        index: 0,
        count: 3,
        sync: Arc::new(RingGradSync::new(links[..PP].to_vec(), 3, PP, 7)),
    };
    let err = PipelineTrainer::replica(&job, plan, replica)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dp") && err.contains("micro_batches = 4"),
        "{err}"
    );
}

/// The TCP mesh of `world` ranks on loopback, one end per global rank.
fn tcp_links(world: usize) -> Vec<Arc<dyn PeerLink>> {
    TcpMesh::loopback(world, &MeshOptions::new("dp-test"))
        .unwrap()
        .into_iter()
        .map(|m| Arc::new(m) as Arc<dyn PeerLink>)
        .collect()
}

#[test]
fn the_all_reduce_over_tcp_gives_the_same_bits_as_in_process() {
    // Same ring, same chunking, same summation order: the transport must not matter.
    let job = job();
    let local = run_replicas(&job, 2);
    let tcp = run_replicas_over(&job, 2, tcp_links(2 * PP));
    for name in local[0].param_names() {
        let bits = |r: &PipelineRun| {
            r.param_values(name)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&tcp[0]), bits(&local[0]), "{name}");
        assert_eq!(bits(&tcp[1]), bits(&local[0]), "{name}");
    }
}
