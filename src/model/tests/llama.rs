//! The Llama-family options (rotary positions, SwiGLU, grouped-query attention, q/k/v
//! biases, Llama 3's RoPE scaling) and tied embeddings, on the whole model.

use super::*;

/// [`tiny`] with every Llama-family option: rotary positions, SwiGLU, 4 query heads over
/// 2 key/value heads, q/k/v biases, an explicit intermediate width.
fn tiny_llama() -> GptConfig {
    GptConfig {
        positions: config::Positions::Rope,
        activation: crate::tensor::Activation::Swiglu,
        kv_heads: Some(2),
        qkv_bias: true,
        intermediate: Some(24),
        ..tiny()
    }
}

#[test]
fn llama_shaped_models_cut_bitwise_and_count_their_params() {
    let cfg = tiny_llama();
    let run = |cut: &Cut| {
        let mut gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), cut).unwrap();
        let losses: Vec<f32> = data(&cfg)
            .iter()
            .enumerate()
            .map(|(mb, (ids, t))| gpt.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap())
            .collect();
        let grads: Vec<(String, Vec<f32>)> = gpt
            .param_names()
            .into_iter()
            .map(|n| {
                let g = gpt.grad_values(&n).unwrap();
                (n, g)
            })
            .collect();
        let numel: usize = gpt
            .param_names()
            .iter()
            .map(|n| gpt.param_values(n).unwrap().len())
            .sum();
        (losses, grads, numel)
    };
    let (loss, grads, numel) = run(&Cut::Even(1));
    assert_eq!(numel, cfg.param_count());
    let names: Vec<&str> = grads.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"embed.pos"));
    // tok; per block 2 norms, wq wk wv wo bq bk bv, w1 w2 w3; final norm; head.
    assert_eq!(names.len(), 1 + 4 * 12 + 2);
    assert!(loss.iter().all(|l| l.is_finite()));
    for (n, g) in &grads {
        assert!(g.iter().any(|&v| v != 0.0), "{n} has no gradient");
    }
    for cut in [Cut::Even(2), Cut::Even(4), Cut::Layers(vec![0, 3, 1])] {
        let (l, g, _) = run(&cut);
        assert_eq!(l, loss, "{cut:?}: losses");
        assert_eq!(g, grads, "{cut:?}: gradients");
    }
}

#[test]
fn llama_options_are_validated_and_serialize_only_when_set() {
    let bad = |c: GptConfig| c.validate().unwrap_err().to_string();
    let cfg = tiny_llama();
    assert!(cfg.validate().is_ok());
    assert!(
        bad(GptConfig {
            kv_heads: Some(3),
            ..cfg.clone()
        })
        .contains("`kv_heads`")
    );
    assert!(
        bad(GptConfig {
            kv_heads: Some(0),
            ..cfg.clone()
        })
        .contains("`kv_heads`")
    );
    assert!(
        bad(GptConfig {
            intermediate: Some(0),
            ..cfg.clone()
        })
        .contains("`intermediate`")
    );
    assert!(
        bad(GptConfig {
            rope_theta: -1.0,
            ..cfg.clone()
        })
        .contains("`rope_theta`")
    );
    let odd = GptConfig {
        d_model: 12,
        heads: 4,
        kv_heads: None,
        ..cfg.clone()
    };
    assert!(bad(odd).contains("`positions`"));
    // The default serializes exactly as before the options existed (job fingerprints,
    // checkpoint sidecars); a Llama-shaped one names them and reads back.
    let json = serde_json::to_string(&GptConfig::default()).unwrap();
    assert_eq!(
        json,
        r#"{"vocab":50,"d_model":64,"heads":4,"layers":8,"seq_len":64,"mlp_ratio":4,"activation":"gelu","norm_eps":0.00001,"seed":0}"#
    );
    let json = serde_json::to_string(&cfg).unwrap();
    for key in [
        "\"positions\":\"rope\"",
        "\"kv_heads\":2",
        "\"qkv_bias\":true",
        "\"intermediate\":24",
        "\"activation\":\"swiglu\"",
    ] {
        assert!(json.contains(key), "{key} in {json}");
    }
    assert_eq!(serde_json::from_str::<GptConfig>(&json).unwrap(), cfg);
    let toml_cfg: GptConfig = toml::from_str(
        "positions = \"rope\"\nrope_theta = 500000.0\nkv_heads = 2\nactivation = \"swiglu\"\nqkv_bias = true",
    )
    .unwrap();
    assert_eq!(toml_cfg.kv_heads(), 2);
    assert_eq!(toml_cfg.rope_theta, 500_000.0);
    assert_eq!(toml_cfg.kv_dim(), 32);
}

/// Llama 3.1's scaling (factor 8, low 1, high 4, 8192 original positions, base 500000, head
/// width 128): wavelengths under 2048 keep their frequency, those over 8192 are divided by
/// 8, the band between is interpolated, and the frequencies stay in decreasing order.
#[test]
fn llama3_rope_scaling_keeps_high_and_divides_low_frequencies() {
    let plain = GptConfig {
        d_model: 128 * 4,
        heads: 4,
        positions: config::Positions::Rope,
        rope_theta: 500_000.0,
        ..GptConfig::default()
    };
    let scaled = GptConfig {
        rope_scaling: Some(config::RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        ..plain.clone()
    };
    assert!(scaled.validate().is_ok());
    let (f, g) = (plain.rope_inv_freq(), scaled.rope_inv_freq());
    assert_eq!(f.len(), 64);
    for (i, &fi) in f.iter().enumerate() {
        let want = 500_000f32.powf(-((2 * i) as f32) / 128.0);
        assert!((fi - want).abs() <= 1e-6 * want, "{i}: {fi} vs {want}");
    }
    let mut band = 0;
    for (&fi, &gi) in f.iter().zip(&g) {
        let wavelen = 2.0 * std::f32::consts::PI / fi;
        if wavelen < 2048.0 {
            assert_eq!(gi, fi);
        } else if wavelen > 8192.0 {
            assert_eq!(gi, fi / 8.0);
        } else {
            band += 1;
            assert!(
                gi < fi && gi > fi / 8.0,
                "{gi} not between {fi} and {}",
                fi / 8.0
            );
        }
    }
    assert!(band > 0, "no frequency in the smoothed band");
    assert!(g.windows(2).all(|w| w[0] > w[1]), "{g:?}");
    let bad = GptConfig {
        rope_scaling: Some(config::RopeScaling {
            high_freq_factor: 0.5,
            ..scaled.rope_scaling.unwrap()
        }),
        ..scaled
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("`rope_scaling`")
    );
}

/// A tied model's two copies start equal, and after [`tie::sum_local`] both hold the
/// gradient of the loss with respect to the one shared matrix: checked against central
/// finite differences that move `embed.tok[v, j]` and `head.w[v, j]` together (f64 loss
/// sums over both micro-batches, the perturbation large enough for f32).
#[test]
fn tied_embeddings_get_the_gradient_of_the_shared_matrix() {
    let cfg = GptConfig {
        tie_embeddings: true,
        ..tiny_llama()
    };
    let d = cfg.d_model;
    let mut gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(2)).unwrap();
    let tok = gpt.param_values(tie::EMBED).unwrap();
    assert_eq!(tok, gpt.param_values(tie::HEAD).unwrap());
    let batches = data(&cfg);
    for (mb, (ids, t)) in batches.iter().enumerate() {
        gpt.forward_backward(mb, SHAPE, ids, t, 1.0).unwrap();
    }
    let untied_embed = gpt.grad_values(tie::EMBED).unwrap();
    let be = gpt.chunks()[0].backend().clone();
    tie::sum_local(&be, gpt.chunks_mut().iter_mut()).unwrap();
    let grad = gpt.grad_values(tie::EMBED).unwrap();
    assert_eq!(
        grad,
        gpt.grad_values(tie::HEAD).unwrap(),
        "both copies take the sum"
    );
    assert_ne!(grad, untied_embed, "the head's part was added");
    let total = |gpt: &mut Gpt<CpuBackend>| -> f64 {
        let mut sum = 0.0;
        for (ids, t) in &batches {
            sum += f64::from(gpt.loss(SHAPE, ids, t).unwrap());
        }
        sum
    };
    let h = 1e-2f32;
    // Tokens the data uses (an unused row only gets the head's part).
    for (row, col) in [(0usize, 3usize), (3, 0), (7, 15), (10, 9)] {
        let at = row * d + col;
        let moved = |delta: f32, gpt: &mut Gpt<CpuBackend>| {
            let mut e = tok.clone();
            e[at] += delta;
            gpt.set_param(tie::EMBED, &e).unwrap();
            gpt.set_param(tie::HEAD, &e).unwrap();
            total(gpt)
        };
        let numeric = (moved(h, &mut gpt) - moved(-h, &mut gpt)) / (2.0 * f64::from(h));
        let analytic = f64::from(grad[at]);
        assert!(
            (numeric - analytic).abs() <= 2e-3 + 2e-2 * analytic.abs(),
            "d loss / d E[{row}, {col}]: finite differences {numeric:.6}, tied gradient {analytic:.6}"
        );
    }
}
