//! The generated `small` model (8 layers, hidden 1024) gives the same ids at every RAM budget:
//! the whole spine in RAM, then less and less of it, down to the stated minimum where every
//! layer is read each pass and the embedding is read by row; and at each budget `deltafin plan`
//! states the very bytes the engine placed (one budget computation).

use deltafin_sched::{model_sizes, ComputeRates, EngineBuilder, GenerateOptions, Plan, PlanInput};

fn ids(store: &std::path::Path, budget: Option<u64>) -> Result<(Vec<u32>, usize), String> {
    // As `deltafin run` opens a model: one sequence, none kept for a next turn.
    let m = EngineBuilder::new(store).ram_budget(budget).context(128).kept_states(0).open().map_err(|e| e.to_string())?;
    let streamed = m.memory_plan().map_or(0, |p| p.streamed_layers);
    if let Some(b) = budget {
        // Issue 49: `deltafin plan` states the bytes the engine placed, to the byte.
        let rates =
            ComputeRates { expert_token_s: 1e-3, expert_prompt_token_s: 1e-4, spine_decode_bytes_s: 1e10, spine_prompt_bytes_s: 1e11 };
        let input = PlanInput { ram: b, drives: vec![1e9], read_efficiency: None, prompt_tokens: 512, context: 128, compute_scale: 1.0 };
        let plan = Plan::new(&model_sizes(store).map_err(|e| e.to_string())?, &input, &rates);
        assert_eq!(Some(&plan.memory), m.memory_plan(), "budget {b}: plan and open place the budget differently");
        assert!(plan.fits);
    }
    let mut seq = m.new_sequence();
    let mut out = Vec::new();
    let prompt: Vec<u32> = (0..20).map(|i| (i * 397 + 11) % 16000).collect();
    m.engine()
        .generate(&mut seq, &prompt, &GenerateOptions::new(6), |t| {
            out.push(t);
            true
        })
        .map_err(|e| e.to_string())?;
    Ok((out, streamed))
}

#[test]
fn ids_are_identical_from_the_whole_spine_in_ram_down_to_the_minimum() {
    std::env::set_var("DELTAFIN_QUIET", "1");
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("small");
    xtask::gen_k3::generate("small", 0, &ckpt).unwrap();
    let store = tmp.path().join("store");
    deltafin_store::setup(&deltafin_store::SetupOptions::new(&ckpt, &store), &deltafin_store::NoProgress).unwrap();
    let (want, none) = ids(&store, None).unwrap();
    assert_eq!(none, 0);
    let err = ids(&store, Some(1)).unwrap_err();
    let plan_min = Plan::new(
        &model_sizes(&store).unwrap(),
        &PlanInput { ram: 1, drives: vec![1e9], read_efficiency: None, prompt_tokens: 512, context: 128, compute_scale: 1.0 },
        &ComputeRates { expert_token_s: 1e-3, expert_prompt_token_s: 1e-4, spine_decode_bytes_s: 1e10, spine_prompt_bytes_s: 1e11 },
    )
    .minimum_ram;
    assert!(err.contains(&format!("needs at least {plan_min} ")), "plan's minimum {plan_min} is open's: {err}");
    let min: u64 = err
        .split("needs at least ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    let spine = deltafin_store::Store::open(&store).unwrap().spine_bytes();
    let mut streamed = Vec::new();
    for budget in [min + 2 * spine, min + spine, min + spine / 2, min + spine / 4, min] {
        let (got, n) = ids(&store, Some(budget)).unwrap();
        assert_eq!(got, want, "budget {budget} ({n} layers streamed)");
        streamed.push(n);
    }
    assert!(streamed.first() == Some(&0) && streamed.last() == Some(&8), "{streamed:?}");
    assert!(streamed.windows(2).all(|w| w[0] <= w[1]) && streamed.iter().any(|&n| n > 0 && n < 8), "{streamed:?}");
}
