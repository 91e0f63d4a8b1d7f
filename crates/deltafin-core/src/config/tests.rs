//! Config parsing: the fixture parses; every unsupported or missing value names its field.

use super::*;

const FIXTURE: &str = include_str!("../../../../tests/fixtures/tiny-k3-dev/checkpoint/config.json");

fn edit(f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(FIXTURE).unwrap();
    f(&mut v);
    v.to_string()
}

fn err(text: &str) -> String {
    K3Config::from_json(text).unwrap_err().to_string()
}

#[test]
fn fixture_config_parses_with_schedule_from_lists() {
    let c = K3Config::from_json(FIXTURE).unwrap();
    assert_eq!(c.hidden_size, 128);
    assert_eq!(c.num_layers, 10);
    let mla: Vec<usize> = (0..10).filter(|&l| c.attention[l] == AttentionKind::Mla).collect();
    assert_eq!(mla, vec![3, 7, 9]);
    assert_eq!(c.mlp[0], MlpKind::Dense);
    assert_eq!(c.moe_layers(), (1..10).collect::<Vec<_>>());
    assert_eq!((c.bos_token_id, c.eos_token_id, c.pad_token_id), (1000, 1002, 1255));
    assert_eq!(c.expert_shape().total_bytes(), 3 * (96 * 64 / 2 + 96 * 64 / 32));
}

#[test]
fn missing_fields_are_named() {
    let t = edit(|v| {
        v["text_config"].as_object_mut().unwrap().remove("num_experts");
    });
    assert!(err(&t).contains("text_config.num_experts"), "{}", err(&t));
    let t = edit(|v| {
        v["text_config"]["linear_attn_config"].as_object_mut().unwrap().remove("kda_layers");
    });
    assert!(err(&t).contains("text_config.linear_attn_config.kda_layers"));
    let t = edit(|v| {
        v.as_object_mut().unwrap().remove("text_config");
    });
    assert!(err(&t).contains("text_config"));
}

#[test]
fn unsupported_values_are_named_with_value() {
    type Case = (Box<dyn Fn(&mut Value)>, &'static str, &'static str);
    let cases: Vec<Case> = vec![
        (Box::new(|v| v["text_config"]["hidden_act"] = "silu".into()), "text_config.hidden_act", "silu"),
        (Box::new(|v| v["text_config"]["moe_router_activation_func"] = "softmax".into()), "moe_router_activation_func", "softmax"),
        (Box::new(|v| v["text_config"]["mla_use_nope"] = false.into()), "mla_use_nope", "false"),
        (Box::new(|v| v["text_config"]["num_expert_group"] = 4.into()), "topk_group", "1"),
        (Box::new(|v| v["text_config"]["num_experts_per_token"] = 64.into()), "num_experts_per_token", "64"),
        (Box::new(|v| v["text_config"]["quantization_config"]["format"] = "int4".into()), "quantization_config.format", "int4"),
        (
            Box::new(|v| v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16.into()),
            "group_size",
            "16",
        ),
        (Box::new(|v| v["text_config"]["moe_intermediate_size"] = 100.into()), "moe_intermediate_size", "100"),
        (Box::new(|v| v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 4])), "kda_layers", "4"),
        (
            Box::new(|v| v["text_config"]["linear_attn_config"]["full_attn_layers"] = serde_json::json!([4, 8, 11])),
            "full_attn_layers",
            "11",
        ),
        (Box::new(|v| v["text_config"]["hidden_size"] = (-5).into()), "hidden_size", "-5"),
        (Box::new(|v| v["model_type"] = "llama".into()), "model_type", "llama"),
        (Box::new(|v| v["text_config"]["num_nextn_predict_layers"] = 1.into()), "num_nextn_predict_layers", "1"),
    ];
    for (f, field, value) in cases {
        let e = err(&edit(f));
        assert!(e.contains(field) && e.contains(value), "error {e:?} should name {field} and {value}");
    }
    assert!(err("{not json").contains("not valid JSON"));
}

#[test]
fn a_layer_in_neither_list_is_an_error() {
    let t = edit(|v| v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 5, 6, 7]));
    assert!(err(&t).contains("missing 9"), "{}", err(&t));
}

/// The fixture as Kimi K3.1: `kimi_k31` with an indexer on its MLA layers (1-based 4, 8, 10).
fn k31(f: impl FnOnce(&mut Value)) -> String {
    edit(|v| {
        v["model_type"] = "kimi_k31".into();
        v["text_config"]["dsa_config"] = serde_json::json!({
            "layers": [4, 8, 10], "index_topk": 16, "index_num_heads": 4, "index_head_dim": 16,
            "index_rope_dim": 0, "index_k_norm_type": "layernorm", "indexer_use_fp8": true
        });
        f(v)
    })
}

#[test]
fn k31_configs_parse_their_indexer() {
    let c = K3Config::from_json(&k31(|_| {})).unwrap();
    let ix = c.indexer.as_ref().unwrap();
    assert_eq!((ix.topk, ix.heads, ix.head_dim, ix.checkpoint_fp8), (16, 4, 16, true));
    assert_eq!(ix.rounding, IndexerRounding::F32, "the checkpoint's flag never picks the rounding");
    assert_eq!(ix.k_norm_eps, c.rms_norm_eps);
    assert!(K3Config::from_json(FIXTURE).unwrap().indexer.is_none());
    // Other spellings of a LayerNorm are one.
    assert!(K3Config::from_json(&k31(|v| v["text_config"]["dsa_config"]["index_k_norm_type"] = "LayerNorm".into())).is_ok());
}

#[test]
fn k31_fields_the_engine_does_not_implement_are_refused_by_name() {
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|v| v["text_config"]["dsa_config"]["index_rope_dim"] = 64.into()), "text_config.dsa_config.index_rope_dim"),
        (Box::new(|v| v["text_config"]["dsa_config"]["index_k_norm_type"] = "rmsnorm".into()), "text_config.dsa_config.index_k_norm_type"),
        (Box::new(|v| v["text_config"]["dsa_config"]["layers"] = serde_json::json!([4, 8])), "text_config.dsa_config.layers"),
        (Box::new(|v| v["text_config"]["dsa_config"]["index_block_size"] = 64.into()), "text_config.dsa_config.index_block_size"),
        (Box::new(|v| v["text_config"]["dsa_config"]["index_topk"] = 0.into()), "text_config.dsa_config.index_topk"),
        (Box::new(|v| v["text_config"].as_object_mut().unwrap().remove("dsa_config").map(|_| ()).unwrap()), "text_config.dsa_config"),
        (Box::new(|v| v["model_type"] = "kimi_k3".into()), "text_config.dsa_config"),
    ];
    for (f, field) in cases {
        let e = err(&k31(f));
        assert!(e.contains(field), "{field}: {e}");
    }
}
