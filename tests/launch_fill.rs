//! Bubble filling in launched train jobs (src/launch/train/fill.rs): every rank of the job
//! runs `train_rank` on its own thread, joined by a loopback TCP mesh, as `pipefill launch`
//! runs them in processes. The drafter in the bubbles never touches the target, every
//! rank's drafter replica ends bitwise equal to the others, the merged profile reports the
//! filled bubbles, and the launched checkpoint carries the drafter, which a resumed run
//! continues from.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;

use pipefill::comm::tcp::{MeshOptions, TcpMesh};
use pipefill::config::{Filler, JobConfig};
use pipefill::model::GptConfig;
use pipefill::model::checkpoint::resume::ResumePoint;
use pipefill::model::checkpoint::sharded::{Manifest, step_dir};
use pipefill::model::checkpoint::{Checkpoint, HostTensor};
use pipefill::model::drafter::FillMode;
use pipefill::model::drafter::state::DrafterState;
use pipefill::pipeline::mesh::{RankResume, RankRun, drafter_of, train_rank};
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::{Plan, ScheduleKind, build};
use pipefill::tensor::device::Device;

const PP: usize = 3;
const MICRO_BATCHES: usize = 4;

/// A small model over `PP` ranks (1F1B), `filler` in the bubbles, run files under `out`.
fn job(filler: Filler, out: &Path) -> JobConfig {
    let mut job = JobConfig::default();
    job.schedule = "1f1b".parse().unwrap();
    job.stages = PP;
    job.filler = filler;
    job.out_dir = Some(out.to_path_buf());
    job.model = GptConfig {
        d_model: 32,
        heads: 2,
        layers: PP,
        seq_len: 32,
        mlp_ratio: 2,
        ..job.model
    };
    job.train.micro_batches = MICRO_BATCHES;
    job.train.micro_batch_size = 2;
    job.train.eval_tasks = 0;
    job
}

fn plan() -> Plan {
    build(ScheduleKind::OneFOneB, PP, MICRO_BATCHES, 1).unwrap()
}

/// The mesh of `world` ranks on loopback, each end built on its own thread.
fn meshes(world: usize) -> Vec<Arc<TcpMesh>> {
    let listeners: Vec<TcpListener> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                TcpMesh::connect(rank, l, &addrs, &MeshOptions::new("launch-fill-test")).unwrap()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| Arc::new(h.join().unwrap()))
        .collect()
}

/// Runs `steps` steps of `job` on every rank, from the checkpoint at `resume` when given;
/// the ranks' runs in rank order.
fn launch(job: &JobConfig, steps: u64, resume: Option<&Path>) -> Vec<RankRun> {
    let plan = plan();
    let meshes = meshes(PP);
    std::thread::scope(|s| {
        let handles: Vec<_> = meshes
            .iter()
            .enumerate()
            .map(|(rank, mesh)| {
                let plan = &plan;
                s.spawn(move || {
                    let resume = resume.map(|dir| {
                        let point = ResumePoint::find(dir).unwrap();
                        RankResume::load(&point, job, plan, rank).unwrap()
                    });
                    train_rank(
                        job,
                        plan,
                        mesh,
                        Clock::virtual_free(),
                        steps,
                        resume.as_ref(),
                        Device::Cpu { threads: 1 },
                    )
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn params(run: &RankRun) -> &[HostTensor] {
    let checkpoint: &Checkpoint = run.checkpoint.as_ref().expect("rank 0 assembles it");
    &checkpoint.tensors
}

fn bits(t: &HostTensor) -> Vec<u32> {
    t.data.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn launched_filling_never_touches_the_target_and_keeps_the_replicas_equal() {
    let dir = tempfile::tempdir().unwrap();
    let bare = launch(&job(Filler::None, &dir.path().join("bare")), 3, None);
    let filled = launch(&job(Filler::Drafter, &dir.path().join("filled")), 3, None);

    // The target (parameters and optimizer moments) is the unfilled run's, bit for bit.
    let (a, b) = (params(&bare[0]), params(&filled[0]));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.name, y.name);
        assert!(bits(x) == bits(y), "`{}` differs with filling", x.name);
    }
    assert!(bare.iter().all(|r| r.drafter.is_none()));

    // Every rank trained its replica, and they all stand at the same weights.
    let replicas: Vec<_> = filled
        .iter()
        .map(|r| r.drafter.clone().expect("every rank holds a replica"))
        .collect();
    assert!(replicas[0].version > 0, "no drafter step was taken");
    for (rank, r) in replicas.iter().enumerate().skip(1) {
        assert_eq!(
            r, &replicas[0],
            "rank {rank}'s drafter differs from rank 0's"
        );
    }

    // The merged profile shows the filler's spans and what they filled.
    let merged = filled[0].merged.as_ref().unwrap();
    let filling = merged
        .filling
        .as_ref()
        .expect("the report's filler figures");
    assert!(
        filling.fill_ratio() > 0.0,
        "fill ratio {}",
        filling.fill_ratio()
    );
    assert!(bare[0].merged.as_ref().unwrap().filling.is_none());
}

#[test]
fn the_launched_checkpoint_carries_the_drafter_and_a_resumed_run_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = job(Filler::Drafter, &out);
    let first = launch(&job, 3, None);
    let saved = first[0]
        .checkpoints
        .last()
        .expect("the final checkpoint")
        .clone();
    let manifest = Manifest::read(&saved).unwrap();
    assert!(
        manifest.drafter.is_some(),
        "the manifest names no drafter file"
    );
    let point = ResumePoint::find(&saved).unwrap();
    let state = drafter_of(&RankResume::load(&point, &job, &plan(), 0).unwrap())
        .unwrap()
        .expect("the checkpoint's drafter");
    // The final checkpoint is taken after the replicas settle: it is every rank's drafter.
    assert_eq!(&state.weights, first[0].drafter.as_ref().unwrap());
    assert_eq!(state.samplers.len(), PP);
    assert!(!state.buffer.current.is_empty() || !state.buffer.previous.is_empty());
    let version = state.weights.version;
    assert!(version > 0);

    // One more step: every replica posts one round at the saved version, and the replicas
    // settle by applying it (a fresh drafter would stand at version 1).
    let resumed = launch(&job, 1, Some(&out));
    for (rank, r) in resumed.iter().enumerate() {
        let d = r.drafter.as_ref().unwrap();
        assert_eq!(d.version, version + 1, "rank {rank}");
    }
}

/// The job of `job` with the drafter placed by plan.
fn planned(filler: Filler, out: &Path) -> JobConfig {
    let mut job = job(filler, out);
    job.drafter.placement = FillMode::Planned;
    job
}

/// Every float of a drafter state as bits, by name, and the rest (version, AdamW step,
/// samplers, rows' targets and steps, the kept round's shape) as JSON.
fn state_bits(job: &JobConfig, state: &DrafterState) -> (Vec<(String, Vec<u32>)>, String) {
    let (tensors, meta) = state.to_parts(job.model.d_model);
    let mut t: Vec<_> = tensors.iter().map(|t| (t.name.clone(), bits(t))).collect();
    t.sort();
    (t, serde_json::to_string(&meta).unwrap())
}

/// The drafter `job`'s in-process pipeline trains in `steps` steps.
fn in_process_drafter(job: &JobConfig, steps: u64) -> DrafterState {
    let run = PipelineTrainer::from_job(job)
        .unwrap()
        .filler(Filler::Drafter)
        .run(steps, |_| {})
        .unwrap();
    run.drafter_state().expect("the in-process drafter").clone()
}

/// The drafter state of the checkpoint at `dir` (a run directory: its newest checkpoint).
fn saved_drafter(job: &JobConfig, dir: &Path) -> DrafterState {
    let point = ResumePoint::find(dir).unwrap();
    drafter_of(&RankResume::load(&point, job, &plan(), 0).unwrap())
        .unwrap()
        .expect("the checkpoint's drafter")
}

/// The target's parameters and AdamW moments as bits, by name.
fn target_bits(run: &RankRun) -> Vec<(String, Vec<u32>)> {
    let mut t: Vec<_> = params(run)
        .iter()
        .map(|t| (t.name.clone(), bits(t)))
        .collect();
    t.sort();
    t
}

/// Steps of each half of the planned resume test.
const N: u64 = 3;

#[test]
fn launched_planned_runs_train_the_same_drafter_bit_for_bit_as_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let job_a = planned(Filler::Drafter, &dir.path().join("a"));
    let job_b = planned(Filler::Drafter, &dir.path().join("b"));
    let a = launch(&job_a, 2 * N, None);
    let b = launch(&job_b, 2 * N, None);

    // Every rank holds the same replica, in both runs, and the drafter trained.
    let weights = a[0].drafter.clone().expect("rank 0's replica");
    assert!(weights.version >= 2, "version {}", weights.version);
    for (run, name) in [(&a, "a"), (&b, "b")] {
        for (rank, r) in run.iter().enumerate() {
            assert!(
                r.drafter.as_ref() == Some(&weights),
                "run {name}, rank {rank}: the drafter differs"
            );
        }
    }
    // The whole saved state too (optimizer, samplers, buffers, the kept round).
    let (sa, sb) = (
        saved_drafter(&job_a, &dir.path().join("a")),
        saved_drafter(&job_a, &dir.path().join("b")),
    );
    assert!(sa.round.is_some(), "the last step's round is kept");
    assert_eq!(sa.weights, weights);
    assert!(
        state_bits(&job_a, &sa) == state_bits(&job_a, &sb),
        "two launched runs saved different drafters"
    );

    // The in-process planned run of the same job trains the same drafter, bit for bit.
    let own = &in_process_drafter(&job_a, 2 * N);
    assert_eq!(own.weights, weights, "the in-process drafter differs");
    assert!(
        state_bits(&job_a, own) == state_bits(&job_a, &sa),
        "the in-process drafter's state differs from the launched one's"
    );

    // Slices ran in bubbles: the merged profile reports them.
    let filling = a[0].merged.as_ref().unwrap().filling.as_ref().unwrap();
    assert!(filling.fill_ratio() > 0.0, "fill {}", filling.fill_ratio());
}

#[test]
fn launched_planned_n_steps_resume_n_steps_equal_2n_steps_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let whole_dir = dir.path().join("whole");
    let mut whole_job = planned(Filler::Drafter, &whole_dir);
    whole_job.checkpoint_every = N;
    let whole = launch(&whole_job, 2 * N, None);
    let target = target_bits(&whole[0]);
    let drafter = state_bits(&whole_job, &saved_drafter(&whole_job, &whole_dir));

    // N steps, then N more resumed from its final checkpoint, in the same directory.
    let half_dir = dir.path().join("half");
    let half_job = planned(Filler::Drafter, &half_dir);
    launch(&half_job, N, None);
    let rest = launch(&half_job, N, Some(&half_dir));
    assert!(target_bits(&rest[0]) == target, "the target differs");
    assert!(
        state_bits(&half_job, &saved_drafter(&half_job, &half_dir)) == drafter,
        "the drafter differs after a resume (final checkpoint)"
    );
    for r in &rest {
        assert_eq!(r.drafter, whole[0].drafter, "rank {}", r.rank);
    }

    // And resumed from the whole run's periodic checkpoint after step N.
    let periodic = step_dir(&whole_dir, N);
    let again_dir = dir.path().join("again");
    let again_job = planned(Filler::Drafter, &again_dir);
    let again = launch(&again_job, N, Some(&periodic));
    assert!(target_bits(&again[0]) == target);
    assert!(
        state_bits(&again_job, &saved_drafter(&again_job, &again_dir)) == drafter,
        "the drafter differs after a resume (periodic checkpoint)"
    );
}

#[test]
fn launched_planned_filling_leaves_the_target_of_the_unfilled_run() {
    let dir = tempfile::tempdir().unwrap();
    let bare = launch(&planned(Filler::None, &dir.path().join("bare")), N, None);
    let filled = launch(
        &planned(Filler::Drafter, &dir.path().join("filled")),
        N,
        None,
    );
    assert!(filled[0].drafter.as_ref().is_some_and(|d| d.version > 0));
    assert!(target_bits(&bare[0]) == target_bits(&filled[0]));
}

/// A tied target (`embed.tok` on rank 0, its transposed copy `head.w` on rank 2): the
/// replicas read one frozen table, and the launched planned run still trains the drafter of
/// the in-process run bit for bit, and N steps resumed for N more give the 2N-step run's.
#[test]
fn a_tied_targets_planned_drafter_is_the_same_launched_in_process_and_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let tied = |out: &Path| {
        let mut job = planned(Filler::Drafter, out);
        job.model.tie_embeddings = true;
        job
    };
    let whole_dir = dir.path().join("whole");
    let whole_job = tied(&whole_dir);
    let whole = launch(&whole_job, 2 * N, None);
    let weights = whole[0].drafter.clone().expect("rank 0's replica");
    assert!(weights.version >= 2, "version {}", weights.version);
    for r in &whole {
        assert!(r.drafter.as_ref() == Some(&weights), "rank {}", r.rank);
    }
    let saved = state_bits(&whole_job, &saved_drafter(&whole_job, &whole_dir));

    let own = &in_process_drafter(&whole_job, 2 * N);
    assert_eq!(own.weights, weights, "the in-process drafter differs");
    assert!(
        state_bits(&whole_job, own) == saved,
        "the in-process drafter's state differs from the launched one's"
    );

    let half_dir = dir.path().join("half");
    let half_job = tied(&half_dir);
    launch(&half_job, N, None);
    let rest = launch(&half_job, N, Some(&half_dir));
    assert!(
        target_bits(&rest[0]) == target_bits(&whole[0]),
        "the target differs"
    );
    assert!(
        state_bits(&half_job, &saved_drafter(&half_job, &half_dir)) == saved,
        "the drafter differs after a resume"
    );
}
