use super::*;

fn rollout(prompt: usize, generated: usize) -> Rollout {
    Rollout {
        prompt: (0..prompt as u32).map(|t| 3 + t).collect(),
        generated: (0..generated as u32).map(|t| 10 + t).collect(),
    }
}

fn rl(prompts: usize, group: usize) -> RlConfig {
    RlConfig {
        prompts,
        group,
        ..RlConfig::default()
    }
}

#[test]
fn packing_sorts_by_length_and_alternates_short_and_long_chunks() {
    let lens = [5, 1, 9, 3, 7, 2, 8, 4];
    // Sorted: 1(1) 2(5) 3(3) 4(7) 5(0) 7(4) 8(6) 9(2).
    assert_eq!(
        packing(&lens, 2),
        vec![vec![1, 5], vec![6, 2], vec![3, 7], vec![0, 4]]
    );
    assert_eq!(
        packing(&lens, 3),
        vec![vec![1, 5, 3], vec![6, 2], vec![7, 0, 4]]
    );
    assert_eq!(packing(&[4, 4, 4], 1), vec![vec![0], vec![2], vec![1]]);
}

#[test]
fn packed_rows_are_the_plain_rows_padded() {
    let rollouts: Vec<Rollout> = [(2, 3), (1, 1), (3, 4), (2, 2)]
        .iter()
        .map(|&(p, g)| rollout(p, g))
        .collect();
    let adv = [0.5, -0.5, 1.0, -1.0];
    let plain = update_batches(&rollouts, &adv).unwrap();
    let step = update_step(&rl(2, 2), &rollouts, &adv, None, 2).unwrap();
    assert!(step.kl_hook.is_none(), "no KL hook without a reference");
    assert_eq!((step.skipped_sequences, step.skipped_groups), (0, 0));
    let packed = step.step;
    assert_eq!(packed.scales, [1.0, 1.0]);
    // Lengths 4, 1, 6, 3: micro-batch 0 holds sequences 1 and 3, micro-batch 1 0 and 2.
    let want = [[1, 3], [0, 2]];
    for (mb, seqs) in packed.batches.iter().zip(want) {
        assert_eq!(mb.rows, 2);
        let width = seqs
            .iter()
            .map(|&i| plain.batches[i].seq_len)
            .max()
            .unwrap();
        assert_eq!(mb.seq_len, width);
        for (r, &i) in seqs.iter().enumerate() {
            let one = &plain.batches[i];
            let (x, t) = (
                &mb.inputs[r * width..(r + 1) * width],
                &mb.targets[r * width..(r + 1) * width],
            );
            assert_eq!(&x[..one.seq_len], one.inputs.as_slice());
            assert_eq!(&t[..one.seq_len], one.targets.as_slice());
            assert!(x[one.seq_len..].iter().all(|&v| v == tokenizer::PAD));
            assert!(t[one.seq_len..].iter().all(|&v| v == IGNORE_TARGET));
        }
    }
    let err = update_step(&rl(3, 2), &rollouts, &adv, None, 3).unwrap_err();
    assert!(
        err.to_string()
            .contains("4 rollouts for 3 prompts × group 2"),
        "{err}"
    );
}

/// Without KL each row's tokens get `−A_i / (len_i · n)`, the loss is `Σ A_i/n · NLL_i`;
/// with KL each token gets `token_loss`'s derivative over `len_i · n`.
#[test]
fn the_hook_weighs_each_row_by_its_own_sequence() {
    let cfg = GrpoLoss {
        clip: 0.2,
        kl_coef: 0.5,
    };
    let adv = vec![1.0f32, -2.0, 0.5];
    let rows = vec![vec![2, 0], vec![1]];
    let hook = GrpoTokenLoss::new(cfg, adv.clone(), vec![2, 1, 3], None, rows.clone()).unwrap();
    let logp = [-0.1f32, -0.2, -0.3, -0.4, -0.5];
    let (loss, g) = hook.loss(0, &logp).unwrap();
    let want_loss = 0.5 / 9.0 * (0.1 + 0.2 + 0.3) + 1.0 / 6.0 * (0.4 + 0.5);
    assert!(
        (f64::from(loss) - want_loss).abs() < 1e-6,
        "{loss} vs {want_loss}"
    );
    let (a, b) = (-0.5f32 / 9.0, -1.0f32 / 6.0);
    assert_eq!(g, [a, a, a, b, b]);
    assert!(hook.mean_kl().is_none());
    assert!(
        hook.loss(1, &logp)
            .unwrap_err()
            .contains("5 counted targets")
    );
    assert!(
        hook.loss(2, &logp)
            .unwrap_err()
            .contains("no micro-batch 2")
    );

    let refs = vec![vec![-0.3, -0.1], vec![-0.7], vec![-0.2, -0.2, -0.9]];
    let hook =
        GrpoTokenLoss::new(cfg, adv.clone(), vec![2, 1, 3], Some(refs.clone()), rows).unwrap();
    let (loss, g) = hook.loss(1, &[-0.4]).unwrap();
    let (l, d) = token_loss(cfg, -0.4, -0.4, Some(-0.7), -2.0);
    assert!((loss - l / 3.0).abs() < 1e-7 && (g[0] - d / 3.0).abs() < 1e-7);
    assert!(hook.mean_kl().unwrap() > 0.0);

    let bad = |tokens, refs, rows| {
        GrpoTokenLoss::new(cfg, adv.clone(), tokens, refs, rows)
            .unwrap_err()
            .to_string()
    };
    let two = vec![vec![0, 1], vec![2]];
    assert!(bad(vec![2, 1], None, two.clone()).contains("3 advantages for 2 sequences"));
    assert!(
        bad(vec![2, 2, 3], Some(refs), two.clone()).contains("sequence 1: logp_ref has 1 values")
    );
    assert!(
        bad(vec![2, 1, 3], None, vec![vec![0, 1]])
            .contains("sequence 2 is in no micro-batch but has a loss (advantage 0.5)")
    );
    assert!(bad(vec![2, 1, 3], None, vec![vec![0, 1, 2, 3]]).contains("no sequence 3"));
}

/// Without KL the sequences of advantage 0 are left out, the shortest of them kept
/// only as padding for the count asked for; the rows left keep their `A_i / n` weight
/// over all `n` sequences. With KL every sequence stays.
#[test]
fn zero_advantage_sequences_are_left_out_without_changing_the_weights() {
    // Groups of 2: group 0 and 2 uniform (A = 0), group 1 informative.
    let rollouts: Vec<Rollout> = [(2, 3), (1, 1), (3, 4), (2, 2), (1, 5), (2, 6)]
        .iter()
        .map(|&(p, g)| rollout(p, g))
        .collect();
    let adv = [0.0, 0.0, 1.0, -1.0, 0.0, 0.0];
    let job = rl(3, 2);
    assert!(skippable(&job, 0.0) && !skippable(&job, -1.0));
    assert_eq!(needed_micro_batches(&job, &adv), 1);
    assert_eq!(
        needed_micro_batches(&job, &[0.0; 6]),
        1,
        "the optimizer still steps"
    );

    let one = update_step(&job, &rollouts, &adv, None, 1).unwrap();
    assert_eq!((one.skipped_sequences, one.skipped_groups), (4, 2));
    assert_eq!(one.step.batches.len(), 1);
    let mb = &one.step.batches[0];
    // Sequences 3 (inputs of 3) and 2 (6), by length.
    assert_eq!((mb.rows, mb.seq_len), (2, 6));
    let hook = one.step.token_loss.as_ref().unwrap();
    let (_, g) = hook.loss(0, &[-0.5; 6]).unwrap();
    let (a, b) = (1.0f32 / (2.0 * 6.0), -1.0f32 / (4.0 * 6.0));
    assert_eq!(g, [a, a, b, b, b, b], "weights over all 6 sequences");

    // Two micro-batches need 3 rows: the shortest zero-advantage one (sequence 1).
    let two = update_step(&job, &rollouts, &adv, None, 2).unwrap();
    assert_eq!((two.skipped_sequences, two.skipped_groups), (3, 1));
    let rows: Vec<usize> = two.step.batches.iter().map(|mb| mb.rows).collect();
    assert_eq!(rows, [2, 1]);
    assert_eq!(two.step.batches[0].seq_len, 3, "sequences 1 and 3");

    for bad in [0, 4] {
        let err = update_step(&job, &rollouts, &adv, None, bad).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("{bad} micro-batches asked for")),
            "{err}"
        );
    }
    let mut kl = job.clone();
    kl.kl_coef = 0.1;
    assert!(!skippable(&kl, 0.0));
    assert_eq!(needed_micro_batches(&kl, &adv), 3);
    let refs = rollouts
        .iter()
        .map(|r| vec![-1.0; r.generated.len()])
        .collect();
    let all = update_step(&kl, &rollouts, &adv, Some(refs), 3).unwrap();
    assert_eq!((all.skipped_sequences, all.skipped_groups), (0, 0));
    assert!(all.kl_hook.is_some());
}

#[test]
fn the_hook_refuses_to_leave_out_a_sequence_with_a_loss() {
    let cfg = GrpoLoss {
        clip: 0.2,
        kl_coef: 0.0,
    };
    let rows = vec![vec![0]];
    let new = |adv: Vec<f32>, refs| GrpoTokenLoss::new(cfg, adv, vec![1, 1], refs, rows.clone());
    assert!(new(vec![1.0, 0.0], None).is_ok());
    let err = new(vec![1.0, 0.5], None).unwrap_err().to_string();
    assert!(err.contains("sequence 1 is in no micro-batch"), "{err}");
    let err = new(vec![1.0, 0.0], Some(vec![vec![-1.0], vec![-1.0]]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("KL term"), "{err}");
}
