use super::*;
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::drafter::FillMode;
use crate::model::{Cut, Gpt, GptConfig, Shape};
use crate::pipeline::fill::RoundPeers;
use crate::schedules::{Plan, ScheduleKind, build};
use crate::tensor::CpuBackend;

#[test]
fn a_failed_exchange_ends_the_wait_for_a_round_with_its_reason() {
    let mut job = JobConfig::default();
    job.drafter.placement = FillMode::Planned;
    let plan = build(ScheduleKind::OneFOneB, 2, job.train.micro_batches, 1).unwrap();
    let slices = SlicePlan::new(&plan, &job).unwrap();
    let planned = Arc::new(Planned::new(slices, 0, vec![SplitMix64::new(1); 2]));
    let waiter = {
        let planned = Arc::clone(&planned);
        std::thread::spawn(move || planned.complete(4).map(|_| ()))
    };
    std::thread::sleep(Duration::from_millis(50));
    planned.abort("rank 1 died: no heartbeat for 10s".into());
    // Far below ROUND_WAIT: the wait ends with the failure, not with its timeout.
    let started = Instant::now();
    while !waiter.is_finished() {
        assert!(started.elapsed() < Duration::from_secs(30), "still waiting");
        std::thread::sleep(Duration::from_millis(5));
    }
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("target step 4")
            && err.contains("replicas 0, 1")
            && err.contains("rank 1 died"),
        "{err}"
    );
    // A wait that begins after the failure ends at once too.
    assert!(planned.complete(5).is_err());
}

/// A process's posts, as its peers would receive them.
#[derive(Default)]
struct Outbox(Mutex<Vec<(u64, RoundPost)>>);

impl RoundPeers for Outbox {
    fn step_end(&self, _: usize, step: u64, post: Option<&RoundPost>) -> Result<(), ModelError> {
        lock(&self.0).extend(post.map(|p| (step, p.clone())));
        Ok(())
    }
}

fn tiny_job() -> JobConfig {
    let mut job = JobConfig::default();
    job.model = GptConfig {
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 16,
        mlp_ratio: 2,
        ..job.model
    };
    job.drafter.placement = FillMode::Planned;
    job
}

/// One process of a two-rank run: its fill trains the replica of `rank` alone.
fn process(job: &JobConfig, plan: &Plan, rank: usize) -> (Arc<DrafterFill>, Arc<Outbox>) {
    let gpt = Gpt::new(&job.model, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let chunk = &gpt.chunks()[0];
    let mut fill = DrafterFill::new(&job.model, &job.drafter, 2, chunk, chunk, 0).unwrap();
    fill.plan_slices(SlicePlan::new(plan, job).unwrap(), 0);
    let fill = Arc::new(fill);
    let outbox = Arc::new(Outbox::default());
    fill.connect(rank, Arc::clone(&outbox) as Arc<dyn RoundPeers>);
    (fill, outbox)
}

/// The rows of target step `step` into `fill`'s buffer (the same on every call).
fn rows(job: &JobConfig, fill: &DrafterFill, step: u64) {
    let shape = Shape {
        batch: 4,
        seq: job.model.seq_len,
    };
    let (n, d, v) = (shape.tokens(), job.model.d_model, job.model.vocab);
    let mut rng = SplitMix64::new(step + 7);
    let hidden: Vec<f32> = (0..n * d).map(|_| rng.next_f64() as f32 - 0.5).collect();
    let targets: Vec<u32> = (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect();
    fill.buffer().begin_step(step);
    fill.buffer()
        .push_micro_batch(shape, &hidden, &targets)
        .unwrap();
}

#[test]
fn a_step_end_waits_for_late_rows_and_posts_and_runs_every_planned_slice() {
    let job = tiny_job();
    let plan = build(ScheduleKind::OneFOneB, 2, job.train.micro_batches, 1).unwrap();
    let slices = SlicePlan::new(&plan, &job).unwrap();
    let late = (0..2)
        .find(|&r| !slices.slices(r, 1).is_empty())
        .expect("a rank with slices in step 1");
    let early = 1 - late;
    let (a, a_out) = process(&job, &plan, early);
    let (b, b_out) = process(&job, &plan, late);
    let none: &[&ModelChunk<CpuBackend>] = &[];
    // Step 0 (no slices: no rows before it): both post round 0; the early process has the
    // step's rows, the late one not yet.
    rows(&job, &a, 0);
    a.step_end(early, 0, none).unwrap();
    b.step_end(late, 0, none).unwrap();
    let (_, post) = lock(&b_out.0).pop().unwrap();
    a.post_remote_at(0, post).unwrap();
    // Step 0's rows, then the early replica's post, reach the late process only after it
    // has ended step 1 (as over a slow mesh): its step end waits for them and then runs
    // every slice the plan gives it, none skipped for want of rows.
    let arriving = {
        let (b, job) = (Arc::clone(&b), job.clone());
        let (_, post) = lock(&a_out.0).pop().unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            rows(&job, &b, 0);
            b.post_remote_at(0, post).unwrap();
        })
    };
    b.take_tally();
    b.step_end(late, 1, none).unwrap();
    arriving.join().unwrap();
    let (ran, _, failed) = b.take_tally();
    assert_eq!(failed, 0);
    assert_eq!(
        ran,
        slices.slices(late, 1).len() as u64,
        "planned slices skipped"
    );
    // The round of step 0 is applied: the replica moved on from version 0.
    assert!(b.checkpoint_round().is_some_and(|r| r.step == 1));
}
