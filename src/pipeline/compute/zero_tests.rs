//! Tests of the sharded optimizer's layout, norm segments and step (two replicas over
//! in-process links against one unsharded AdamW).

use super::*;
use crate::comm::collective::RingGradSync;
use crate::comm::link::{InProcessLink, PeerLink};
use crate::model::{AdamWConfig, Cut, GptConfig, OptimizerState, SlotState};
use crate::tensor::{CpuBackend, DType};

/// A small model (one chunk of all of it) whose gradients are `seed`'s values.
fn chunks(seed: u32) -> BTreeMap<u32, ModelChunk<CpuBackend>> {
    let config = GptConfig {
        vocab: 40,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 8,
        ..GptConfig::default()
    };
    let be = CpuBackend::new(1).unwrap();
    let mut chunk = ModelChunk::new(&config, be.clone(), &Cut::Even(1), 0).unwrap();
    for (i, p) in chunk.params_mut().into_iter().enumerate() {
        let g: Vec<f32> = (0..p.numel())
            .map(|j| ((j as u32 * 7 + i as u32 * 13 + seed * 101) % 23) as f32 * 0.01 - 0.11)
            .collect();
        p.grad = be.from_host(&g, DType::F32).unwrap();
    }
    BTreeMap::from([(0, chunk)])
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Two replicas step a sharded AdamW twice: each holds the moments of its chunk only,
/// the parameters and the norm's segments are bitwise those of the unsharded step over
/// the all-reduced gradient, and the first replica gathers the whole state.
#[test]
fn two_sharded_replicas_step_as_one_unsharded_optimizer_with_half_the_moments() {
    let (lr, clip) = (1e-2, 0.5);
    let links: Vec<Arc<dyn PeerLink>> = InProcessLink::group(2)
        .into_iter()
        .map(|l| Arc::new(l) as Arc<dyn PeerLink>)
        .collect();
    let handles: Vec<_> = links
        .iter()
        .enumerate()
        .map(|(d, link)| {
            let sync: Arc<dyn GradSync> =
                Arc::new(RingGradSync::new(vec![Arc::clone(link)], 2, 1, 3));
            std::thread::spawn(move || {
                let be = CpuBackend::new(1).unwrap();
                let mut chunks = chunks(d as u32);
                let layout = Layout::of(&chunks);
                let own = sync.owned(0, layout.len).unwrap();
                let mut zero = Zero {
                    layout,
                    sync,
                    count: 2,
                    own: own.clone(),
                    first: d == 0,
                    grads: None,
                };
                let mut adam = AdamW::new(AdamWConfig::default());
                let mut norms = Vec::new();
                for _ in 0..2 {
                    zero.reduce(0, &be, &chunks).unwrap();
                    norms.push(zero.sq_norms(0).unwrap());
                    zero.step(0, (&be, &mut adam), &mut chunks, lr, clip)
                        .unwrap();
                    zero.finish();
                }
                let held: usize = adam
                    .state(&be)
                    .unwrap()
                    .slots
                    .values()
                    .map(|s| s.m.len())
                    .sum();
                assert_eq!(
                    held,
                    own.len(),
                    "replica {d} holds only its chunk's moments"
                );
                let state = zero.gather_state(0, &be, &adam, &chunks).unwrap();
                (flat(&be, &chunks, false).unwrap(), norms, state, own)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0].3.len() + out[1].3.len(), Layout::of(&chunks(0)).len);

    // The unsharded reference: the summed gradient (a sum of two is bitwise the ring's
    // in either order), whole AdamW over it, the same segments.
    let be = CpuBackend::new(1).unwrap();
    let mut reference = chunks(0);
    let mut summed = flat(&be, &reference, true).unwrap();
    let other = flat(&be, &chunks(1), true).unwrap();
    for (s, o) in summed.iter_mut().zip(&other) {
        *s += o;
    }
    let mut adam = AdamW::new(AdamWConfig::default());
    let mut rest = summed.as_slice();
    for p in reference.values_mut().flat_map(|c| c.params_mut()) {
        let n = p.numel();
        p.grad = be.from_host(&rest[..n], DType::F32).unwrap();
        rest = &rest[n..];
    }
    let expected_norms = replica_sq_norms(&reference, &summed, 2);
    for _ in 0..2 {
        let params = reference.values_mut().flat_map(|c| c.params_mut());
        adam.step(&be, params, lr, clip).unwrap();
    }
    let expected = flat(&be, &reference, false).unwrap();
    for (d, (values, norms, _, _)) in out.iter().enumerate() {
        assert_eq!(bits(values), bits(&expected), "replica {d}'s parameters");
        assert_eq!(norms[0], expected_norms, "replica {d}'s norm segments");
    }
    let whole = adam.state(&be).unwrap();
    assert_eq!(out[0].2, whole, "the first replica gathers the whole state");
    assert!(out[1].2.slots.is_empty() && out[1].2.step == 2);
}

fn layout() -> Layout {
    let span = |stage, name: &str, range, tied| Span {
        stage,
        name: name.into(),
        range,
        tied,
        pair: tied,
    };
    Layout {
        spans: vec![
            span(0, "a", 0..5, false),
            span(0, "b", 5..6, false),
            span(1, "c", 6..10, true),
            span(1, "d", 10..13, false),
        ],
        len: 13,
    }
}

#[test]
fn pieces_cut_parameters_at_chunk_boundaries() {
    let l = layout();
    let got: Vec<(&str, Range<usize>)> = l
        .pieces(&(4..11))
        .map(|(s, r)| (s.name.as_str(), r))
        .collect();
    assert_eq!(
        got,
        vec![("a", 4..5), ("b", 5..6), ("c", 6..10), ("d", 10..11)]
    );
}

#[test]
fn segments_of_every_chunk_leave_tied_copies_out_and_sum_to_the_whole() {
    let l = layout();
    let values: Vec<f32> = (0..13).map(|i| i as f32).collect();
    let segs: Vec<(u32, f64)> = chunk_cut(13, 4)
        .into_iter()
        .flat_map(|c| l.chunk_sq_norms(&c, &values[c.clone()]))
        .collect();
    // Chunks 0..4, 4..7, 7..10, 10..13: a's two parts, b, d; c (tied) is left out.
    assert_eq!(
        segs,
        vec![(0, 14.0), (0, 16.0), (0, 25.0), (1, 100.0 + 121.0 + 144.0)]
    );
    let total: f64 = segs.iter().map(|s| s.1).sum();
    let direct: f64 = [0, 1, 2, 3, 4, 5, 10, 11, 12]
        .iter()
        .map(|&i| f64::from(i * i))
        .sum();
    assert_eq!(total, direct);
    assert_eq!(
        by_stage(segs),
        vec![(0, vec![14.0, 16.0, 25.0]), (1, vec![365.0])]
    );
}

#[test]
fn a_resumed_replica_takes_its_piece_of_each_moment_and_refuses_a_wrong_size() {
    let link: Arc<dyn PeerLink> = Arc::new(InProcessLink::group(2).remove(1));
    let zero = Zero {
        layout: layout(),
        sync: Arc::new(RingGradSync::new(vec![link], 2, 1, 3)),
        count: 2,
        own: 4..11,
        first: false,
        grads: None,
    };
    let slot = |n: usize, at: f32| SlotState {
        m: (0..n).map(|i| at + i as f32).collect(),
        v: vec![1.0; n],
        master: None,
    };
    let state = OptimizerState {
        step: 5,
        slots: BTreeMap::from([
            ("a".to_string(), slot(5, 0.0)),
            ("d".to_string(), slot(3, 10.0)),
        ]),
    };
    let own = zero.own_state(0, &state).unwrap();
    assert_eq!(own.step, 5);
    // a: values 4..5 of 0..5; b and c have no state; d: values 10..11 of 10..13.
    assert_eq!(own.slots["a"].m, vec![4.0]);
    assert_eq!(own.slots["d"].m, vec![10.0]);
    assert_eq!(own.slots.len(), 2);
    let mut bad = state;
    bad.slots.insert("b".into(), slot(2, 0.0));
    let err = zero.own_state(0, &bad).unwrap_err().to_string();
    assert!(err.contains("`b`") && err.contains("2 moments"), "{err}");
}
