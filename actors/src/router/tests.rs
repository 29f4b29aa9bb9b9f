use std::sync::atomic::{AtomicUsize, Ordering};

use kameo::actor::Spawn;

use super::*;

/// A source that counts the slices it made; each slice records which rank ran it.
struct Counter {
    made: Arc<AtomicUsize>,
    ran: Arc<Mutex<Vec<usize>>>,
}

impl FillerSource for Counter {
    fn kind(&self) -> &str {
        "drafter"
    }

    fn next(&mut self, rank: usize, units: u64) -> Option<Slice> {
        assert_eq!(units, 1, "a source of one size is asked for one unit");
        let n = self.made.fetch_add(1, Ordering::SeqCst);
        let ran = Arc::clone(&self.ran);
        Some(Slice {
            label: format!("drafter {n}"),
            units,
            run: Box::new(move || {
                ran.lock().unwrap().push(rank);
                Ok(())
            }),
        })
    }
}

fn counter() -> (Counter, Arc<AtomicUsize>, Arc<Mutex<Vec<usize>>>) {
    let made = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(Mutex::new(Vec::new()));
    let c = Counter {
        made: Arc::clone(&made),
        ran: Arc::clone(&ran),
    };
    (c, made, ran)
}

fn bubble(rank: usize, idle: Option<f64>, exact: bool) -> Bubble {
    Bubble {
        rank,
        iteration: 0,
        waiting_for: Action::f(rank as u32, 0),
        predicted_idle: idle,
        exact,
    }
}

fn span(rank: usize, cost: f64, error: Option<&str>) -> FillerSpan {
    FillerSpan {
        rank,
        iteration: 0,
        start: 1.0,
        end: 1.0 + cost,
        label: "x".into(),
        predicted_cost: 0.0,
        error: error.map(str::to_string),
    }
}

#[test]
fn the_running_estimate_follows_measured_costs() {
    let mut e = CostEstimate::prior(1.0);
    assert_eq!(e.predicted(2.0), 1.0);
    // The first measurement replaces the prior; its error seeds the deviation.
    e.observe(0.5, 0.2);
    assert_eq!((e.mean, e.samples), (0.5, 1));
    assert!((e.deviation - 0.1).abs() < 1e-12);
    for _ in 0..200 {
        e.observe(0.25, 0.2);
    }
    assert!((e.mean - 0.25).abs() < 1e-9, "{e:?}");
    assert!(
        e.deviation < 1e-9,
        "a constant cost has no deviation: {e:?}"
    );
    // A noisy cost is predicted above its mean.
    for i in 0..200 {
        e.observe(if i % 2 == 0 { 0.2 } else { 0.3 }, 0.2);
    }
    assert!(e.predicted(2.0) > e.mean + 0.05, "{e:?}");
}

#[test]
fn a_slice_is_handed_out_only_when_its_predicted_cost_fits() {
    let router = FillerRouter::default();
    let (source, made, ran) = counter();
    router.add_source(source, Some(0.010));
    let mut filler = router.filler(2);
    assert!(filler.fill(&bubble(2, Some(0.009), true)).is_none());
    assert_eq!(
        made.load(Ordering::SeqCst),
        0,
        "a slice that does not fit is not even made"
    );
    assert!(
        filler.fill(&bubble(2, None, false)).is_none(),
        "no prediction, no filling"
    );
    let work = filler.fill(&bubble(2, Some(0.011), true)).expect("fits");
    assert_eq!(work.label, "drafter 0");
    assert_eq!(work.predicted_cost, 0.010);
    (work.run)().unwrap();
    assert_eq!(*ran.lock().unwrap(), [2]);
    // Measured cheaper than the prior: smaller bubbles fit from now on.
    filler.finished(&span(2, 0.004, None));
    let stats = router.stats();
    let k = &stats.kinds["drafter"];
    assert_eq!((k.slices, k.failed, k.overran), (1, 0, 0));
    assert!((k.seconds - 0.004).abs() < 1e-12);
    let predicted = k.estimate.predicted(RouterConfig::default().margin);
    assert!(predicted < 0.009, "{predicted}");
    assert!(filler.fill(&bubble(2, Some(0.009), true)).is_some());
    // A slice that ran past the idle time it was given is counted as an overrun, an error
    // as a failure.
    filler.finished(&span(2, 0.0095, Some("boom")));
    let k = &router.stats().kinds["drafter"];
    assert_eq!((k.slices, k.failed, k.overran), (2, 1, 1));
}

#[test]
fn a_kind_without_a_cost_waits_for_its_prior() {
    let router = FillerRouter::default();
    let (source, made, _) = counter();
    router.add_source(source, None);
    let mut filler = router.filler(0);
    assert!(filler.fill(&bubble(0, Some(1e9), true)).is_none());
    assert_eq!(made.load(Ordering::SeqCst), 0);
    router.set_prior("drafter", 0.5);
    assert!(filler.fill(&bubble(0, Some(1.0), true)).is_some());
}

#[test]
fn requests_go_first_in_order_and_only_to_their_rank() {
    let router = FillerRouter::default();
    let (source, _, _) = counter();
    router.add_source(source, Some(0.001));
    router.set_prior("verify", 0.002);
    let request = |label: &str, rank| Request {
        kind: "verify".into(),
        label: label.into(),
        rank,
        run: Box::new(|| Ok(())),
    };
    router.submit(request("pinned to 1", Some(1)));
    router.submit(request("any rank", None));
    let mut r0 = router.filler(0);
    let mut r1 = router.filler(1);
    // Rank 0 may not take the pinned request; it takes the next one.
    assert_eq!(
        r0.fill(&bubble(0, Some(0.01), true)).unwrap().label,
        "any rank"
    );
    // Too short for a verification: the source's cheaper slice goes instead.
    assert_eq!(
        r1.fill(&bubble(1, Some(0.0015), true)).unwrap().label,
        "drafter 0"
    );
    assert_eq!(router.stats().queued, 1);
    assert_eq!(
        r1.fill(&bubble(1, Some(0.01), true)).unwrap().label,
        "pinned to 1"
    );
    assert_eq!(router.stats().queued, 0);
}

#[test]
fn wall_clock_predictions_are_corrected_by_observed_arrivals() {
    let mut c = ArrivalCorrection::new(0.5);
    // Exact (virtual) bubbles are never corrected.
    assert_eq!(c.remaining(&bubble(0, Some(2.0), true)), Some(2.0));
    // The inputs came at half the predicted idle time, twice.
    c.observe(Some(2.0), Some(1.0));
    c.observe(Some(4.0), Some(2.0));
    c.observe(Some(4.0), None); // arrival not seen: ignored
    assert!((c.ratio() - 0.5).abs() < 1e-12);
    let mut b = bubble(0, Some(4.0), false);
    assert_eq!(c.remaining(&b), Some(2.0));
    // 1 s later in the same bubble: 2 − 1 left, not 3 · 0.5.
    b.predicted_idle = Some(3.0);
    assert_eq!(c.remaining(&b), Some(1.0));
    assert_eq!(c.remaining(&bubble(0, Some(2.0), true)), Some(2.0));
    // A corrected filler hands out nothing when the corrected idle time is too short.
    let router = FillerRouter::default();
    let (source, _, _) = counter();
    router.add_source(source, Some(1.5));
    let mut filler = router.filler(0);
    filler.bubble_ended(
        &BubbleSpan {
            rank: 0,
            iteration: 0,
            start: 0.0,
            end: 1.0,
            waiting_for: Action::f(0, 0),
        },
        Some(2.0),
        Some(1.0),
    );
    assert!((filler.idle_ratio() - 0.5).abs() < 1e-12);
    let mut late = bubble(0, Some(2.0), false);
    late.iteration = 1;
    assert!(filler.fill(&late).is_none(), "2 s predicted, 1 s expected");
}

#[test]
fn the_weight_board_hands_over_the_newest_version() {
    let board = WeightBoard::default();
    let mut rx = board.subscribe();
    assert!(board.latest().is_none());
    board.publish(1, vec![1.0f32]);
    board.publish(3, vec![3.0f32]);
    board.publish(2, vec![2.0f32]); // older than what is there: ignored
    let latest = board.latest().unwrap();
    assert_eq!(
        (latest.version, latest.value.as_slice()),
        (3, &[3.0f32][..])
    );
    assert!(rx.has_changed().unwrap());
    assert_eq!(rx.borrow_and_update().as_ref().unwrap().version, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_router_actor_queues_requests_and_reports_stats() {
    let router = FillerRouter::default();
    router.set_prior("verify", 0.001);
    let actor = FillerRouter::spawn(router.clone());
    actor
        .tell(Submit(Request {
            kind: "verify".into(),
            label: "verify 8 tokens".into(),
            rank: None,
            run: Box::new(|| Ok(())),
        }))
        .await
        .unwrap();
    let stats = actor.ask(Stats).await.unwrap();
    assert_eq!(stats.queued, 1);
    // The stages' fillers share the actor's queue.
    let mut filler = router.filler(3);
    let work = filler.fill(&bubble(3, Some(0.01), true)).unwrap();
    assert_eq!(work.label, "verify 8 tokens");
    assert_eq!(actor.ask(Stats).await.unwrap().queued, 0);
    actor.kill();
}

/// An estimate fitted to slices costing exactly `fixed + per_unit · units`, sizes 1..=16.
fn fitted_line(fixed: f64, per_unit: f64) -> CostEstimate {
    let mut e = CostEstimate::prior(fixed);
    for i in 0..200u64 {
        let units = 1 + (i * 7) % 16;
        e.observe_sized(units as f64, fixed + per_unit * units as f64, 0.2);
    }
    e
}

#[test]
fn the_cost_line_is_fitted_from_slices_of_several_sizes() {
    let e = fitted_line(40e-6, 7e-6);
    assert!((e.slope - 7e-6).abs() < 1e-9, "{e:?}");
    assert!((e.line(1.0) - 47e-6).abs() < 1e-9, "{e:?}");
    assert!((e.line(16.0) - 152e-6).abs() < 1e-9, "{e:?}");
    assert!(e.deviation < 1e-9, "an exact line has no deviation: {e:?}");
    // Slices of one size keep the prior's slope.
    let mut flat = CostEstimate::prior_line(16.0, 1.0, 0.05);
    for _ in 0..10 {
        flat.observe_sized(16.0, 0.8, 0.2);
    }
    assert_eq!(flat.slope, 0.05);
    assert!((flat.line(6.0) - 0.3).abs() < 1e-9, "{flat:?}");
}

#[test]
fn a_prior_through_two_slices_passes_through_both() {
    let two = CostEstimate::prior_through(16.0, 3e-3, 64.0, 7.8e-3);
    assert!((two.line(16.0) - 3e-3).abs() < 1e-12, "{two:?}");
    assert!((two.line(64.0) - 7.8e-3).abs() < 1e-12, "{two:?}");
    // One size measured: proportional to the size.
    let one = CostEstimate::prior_through(8.0, 2e-3, 8.0, 2e-3);
    assert!((one.line(4.0) - 1e-3).abs() < 1e-12, "{one:?}");
}

#[test]
fn a_sized_slice_fits_its_budget_and_grows_with_it() {
    let mut e = fitted_line(40e-6, 7e-6);
    e.deviation = 3e-6;
    let margin = 2.0;
    let cost = |u: u64| e.predicted_at(u as f64, margin);
    assert_eq!(
        e.size(cost(1) * 0.999, 1, 16, margin),
        None,
        "not even 1 unit fits"
    );
    let mut last = 0;
    for i in 0..2000 {
        let idle = cost(1) + i as f64 * 0.25e-6;
        let u = e.size(idle, 1, 16, margin).expect("one unit fits");
        assert!((1..=16).contains(&u));
        assert!(
            cost(u) <= idle,
            "{u} units predicted {} s > {idle} s",
            cost(u)
        );
        if idle < cost(16) {
            // One slice: the largest that fits, never smaller than for a shorter budget.
            assert!(u >= last, "{u} units for {idle} s, {last} for less");
            assert!(
                cost(u + 1) > idle,
                "{} units fit {idle} s, {u} asked",
                u + 1
            );
            last = u;
        } else if idle - cost(16) >= cost(1) {
            assert_eq!(u, 16, "{idle} s holds a full slice and another");
        } else if idle - cost(1) >= cost(1) {
            // A full slice would strand the rest: leave room for a 1-unit slice.
            assert!(
                cost(u) + cost(1) <= idle,
                "{u} units leave no room in {idle} s"
            );
        }
    }
    assert_eq!(last, 15);
}

/// A source of 1..=16-unit slices that remembers the sizes it was asked for.
struct Sized(Arc<Mutex<Vec<u64>>>);

impl FillerSource for Sized {
    fn kind(&self) -> &str {
        "sized"
    }

    fn sizes(&self) -> (u64, u64) {
        (1, 16)
    }

    fn next(&mut self, _rank: usize, units: u64) -> Option<Slice> {
        self.0.lock().unwrap().push(units);
        Some(Slice {
            label: format!("{units} units"),
            units,
            run: Box::new(|| Ok(())),
        })
    }
}

#[test]
fn the_router_sizes_slices_to_the_idle_time_left() {
    let config = RouterConfig::default();
    let router = FillerRouter::new(config);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let prior = fitted_line(40e-6, 7e-6);
    router.add_sized_source(Sized(Arc::clone(&asked)), Some(prior));
    let mut filler = router.filler(0);
    // 100 µs exact: 8 units (96 µs) fit, 9 (103 µs) do not.
    let work = filler.fill(&bubble(0, Some(100e-6), true)).unwrap();
    assert_eq!(work.label, "8 units");
    assert!((work.predicted_cost - 96e-6).abs() < 1e-9);
    // Too short for one unit: nothing is made.
    assert!(filler.fill(&bubble(0, Some(40e-6), true)).is_none());
    assert_eq!(*asked.lock().unwrap(), [8]);
    // The measured slice is folded in at its size.
    filler.finished(&span(0, 96e-6, None));
    let k = &router.stats().kinds["sized"];
    assert_eq!((k.slices, k.units, k.overran), (1, 8, 0));
}

/// A source of slices fixed in advance: the sizes it will hand out, in order.
struct Fixed(Arc<Mutex<VecDeque<u64>>>);

impl FillerSource for Fixed {
    fn kind(&self) -> &str {
        "sized"
    }

    fn sizes(&self) -> (u64, u64) {
        (1, 16)
    }

    fn fixed_size(&mut self, _rank: usize) -> Option<u64> {
        self.0.lock().unwrap().front().copied()
    }

    fn next(&mut self, _rank: usize, units: u64) -> Option<Slice> {
        let next = self.0.lock().unwrap().pop_front()?;
        assert_eq!(units, next, "asked for the fixed size");
        Some(Slice {
            label: format!("{units} units"),
            units,
            run: Box::new(|| Ok(())),
        })
    }
}

#[test]
fn a_fixed_slice_is_handed_out_only_where_it_fits_and_in_order() {
    let router = FillerRouter::new(RouterConfig::default());
    let queue = Arc::new(Mutex::new(VecDeque::from([12, 2])));
    router.add_sized_source(Fixed(Arc::clone(&queue)), Some(fitted_line(40e-6, 7e-6)));
    let mut filler = router.filler(0);
    // 100 µs fits 8 units but the next slice is 12: the bubble gets nothing, and the smaller
    // slice behind it is not taken out of order.
    assert!(filler.fill(&bubble(0, Some(100e-6), true)).is_none());
    assert_eq!(queue.lock().unwrap().len(), 2);
    // 130 µs fits 12 units (124 µs): it goes, then the 2-unit slice in what is left.
    let work = filler.fill(&bubble(0, Some(130e-6), true)).unwrap();
    assert_eq!(work.label, "12 units");
    filler.finished(&span(0, 124e-6, None));
    let work = filler.fill(&bubble(0, Some(60e-6), true)).unwrap();
    assert_eq!(work.label, "2 units");
    filler.finished(&span(0, 54e-6, None));
    // Nothing left: the source says so and the router does not size one.
    assert!(filler.fill(&bubble(0, Some(1.0), true)).is_none());
    assert_eq!(router.stats().kinds["sized"].units, 14);
}
