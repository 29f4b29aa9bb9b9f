//! Bubble filling in launched train jobs (src/launch/train/fill.rs): every rank of the job
//! runs `train_rank` on its own thread, joined by a loopback TCP mesh, as `pipefill launch`
//! runs them in processes. The drafter in the bubbles never touches the target, every
//! rank's drafter replica ends bitwise equal to the others, the merged profile reports the
//! filled bubbles, and the launched checkpoint carries the drafter, which a resumed run
//! continues from.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;

use pipefill::comm::link::PeerLink;
use pipefill::comm::tcp::{MeshOptions, TcpMesh};
use pipefill::config::{Filler, JobConfig};
use pipefill::launch::train::{RankResume, RankRun, train_rank};
use pipefill::model::GptConfig;
use pipefill::model::checkpoint::resume::ResumePoint;
use pipefill::model::checkpoint::sharded::Manifest;
use pipefill::model::checkpoint::{Checkpoint, HostTensor};
use pipefill::pipeline::Clock;
use pipefill::schedules::{Plan, ScheduleKind, build};
use pipefill::tensor::device::Device;

const PP: usize = 3;
const MICRO_BATCHES: usize = 4;

/// A small model over `PP` ranks (1F1B), `filler` in the bubbles, run files under `out`.
fn job(filler: Filler, out: &Path) -> JobConfig {
    let mut job = JobConfig::default();
    job.schedule = "1f1b".into();
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
    let state =
        pipefill::launch::train::drafter_of(&RankResume::load(&point, &job, &plan(), 0).unwrap())
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

#[test]
fn the_planned_placement_is_refused_in_launched_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let mut job = job(Filler::Drafter, dir.path());
    job.drafter.placement = pipefill::model::drafter::Placement::Planned;
    let plan = plan();
    let meshes = meshes(PP);
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = meshes
            .iter()
            .map(|mesh| {
                let (job, plan) = (&job, &plan);
                s.spawn(move || {
                    let run = train_rank(
                        job,
                        plan,
                        mesh,
                        Clock::virtual_free(),
                        1,
                        None,
                        Device::Cpu { threads: 1 },
                    );
                    // A rank that fails leaves the mesh, so its peers end too.
                    let _ = mesh.close();
                    run.map(|_| ()).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        errors[0].contains("placement") && errors[0].contains("planned"),
        "{errors:?}"
    );
}
