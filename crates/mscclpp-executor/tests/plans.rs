//! Loading: generated plans, broken plans refused with the JSON path of the fault, and no panic
//! on arbitrary or mutated input.

use mscclpp_executor::generate::{self, Algorithm};
use mscclpp_executor::{BufferLoc, ChannelType, OpKind, Plan, PlanError, Protocol};
use proptest::prelude::*;
use serde_json::{Value, json};

#[test]
fn every_generated_plan_loads_and_round_trips() {
    let mut count = 0;
    for ranks in 2..=8 {
        for plan in generate::all(ranks) {
            let text = plan.to_json();
            let loaded = Plan::from_json_str(&text).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            assert_eq!(loaded, plan, "{}", plan.name);
            assert_eq!(loaded.gpus.len(), ranks);
            count += 1;
        }
    }
    // 4 single-level algorithms x 2 protocols x 2 placements at 2..=8 ranks, the one-hop one in
    // LL only (2 placements), and the two-node one at even counts of 4 and up (4, 6, 8).
    assert_eq!(count, 4 * 4 * 7 + 2 * 7 + 4 * 3);
    assert!(generate::plan(Algorithm::OneHopAllReduce, 2, Protocol::Simple, true).is_none());
    assert!(generate::one_hop_allreduce(2, true, 0, 256).is_none());
    assert!(generate::one_hop_allreduce(2, true, 65, 256).is_none());
    assert!(generate::one_hop_allreduce(2, true, 4, 2048).is_none());
    assert!(generate::plan(Algorithm::HierarchicalAllReduce, 5, Protocol::Simple, true).is_none());
    assert!(generate::plan(Algorithm::RingAllReduce, 1, Protocol::Simple, true).is_none());
    assert!(generate::plan(Algorithm::AllPairAllReduce, 9, Protocol::Simple, true).is_none());
}

#[test]
fn generated_plans_have_the_expected_shape() {
    let ring = generate::plan(Algorithm::RingAllReduce, 4, Protocol::Simple, false).unwrap();
    let s = ring.summary();
    assert_eq!((s.ranks, s.threadblocks_per_rank.clone()), (4, vec![1; 4]));
    // 3 reduce-scatter steps (put, 2 syncs, reduce, 2 syncs) and 3 all-gather steps (put, 2 syncs).
    assert_eq!(s.ops_by_kind[&OpKind::Put], 4 * 6);
    assert_eq!(s.ops_by_kind[&OpKind::Reduce], 4 * 3);
    assert_eq!(s.channels_by_type[&ChannelType::Memory], 8);
    assert!(!ring.inplace && ring.collective == "allreduce");

    let ll = generate::plan(Algorithm::AllGather, 8, Protocol::LL, true).unwrap();
    let s = ll.summary();
    assert_eq!(s.threadblocks_per_rank, vec![7; 8]);
    assert_eq!((s.ops_by_kind[&OpKind::PutPackets], s.ops_by_kind[&OpKind::UnpackPackets]), (56, 56));
    assert!(!s.ops_by_kind.contains_key(&OpKind::Signal), "LL needs no signals");
    assert_eq!(ll.gpus[3].output_chunks, 8);

    let two = generate::plan(Algorithm::HierarchicalAllReduce, 8, Protocol::Simple, true).unwrap();
    let s = two.summary();
    assert_eq!(s.channels_by_type[&ChannelType::Port], 8, "one port channel per rank, to the other node");
    assert_eq!(s.channels_by_type[&ChannelType::Memory], 8 * 3);
    assert_eq!(s.ops_by_kind[&OpKind::PutWithSignalAndFlush], 8);
    // Rank 5 (node 1, position 1) talks to rank 1 over its port channel.
    assert_eq!(two.gpus[5].channel_peer(ChannelType::Port, 0), Some(1));
    let text = s.to_string();
    assert!(text.contains("ranks: 8") && text.contains("pwsf 8") && text.contains("port 8"), "{text}");

    let rs = generate::plan(Algorithm::ReduceScatter, 3, Protocol::Simple, false).unwrap();
    let reduce = rs.gpus[2].threadblocks[0].ops.iter().find(|o| o.kind == OpKind::Reduce).unwrap();
    assert_eq!(reduce.dst_buff[0].loc, BufferLoc::Local(mscclpp_executor::BufferType::Output));
    assert_eq!(reduce.src_buff.len(), 3);
}

#[test]
fn scratch_bytes_follow_mscclpp() {
    let ll = generate::plan(Algorithm::AllPairAllReduce, 4, Protocol::LL, true).unwrap();
    // 4 input chunks of 1024 B, 8 scratch chunks, twice for packets, twice again for the two
    // scratch halves generated LL plans use.
    assert!(ll.use_double_scratch_buffer);
    assert_eq!(ll.scratch_bytes(0, 4096, 4096), Some(1024 * 8 * 2 * 2));
    assert_eq!(ll.scratch_bytes(4, 4096, 4096), None);
    let simple = generate::plan(Algorithm::AllGather, 2, Protocol::Simple, true).unwrap();
    assert_eq!(simple.scratch_bytes(1, 100, 200), Some(0));
    // The two-node Simple plan alternates scratch halves too: a rank's cross-node put of the
    // next launch is not ordered after the other node's reduction of that chunk in this one.
    for ranks in [4, 6, 8] {
        let two = generate::plan(Algorithm::HierarchicalAllReduce, ranks, Protocol::Simple, true).unwrap();
        assert!(two.use_double_scratch_buffer, "{}", two.name);
        let both = two.scratch_bytes(0, 4096, 4096).unwrap();
        let mut one_half = two.clone();
        one_half.use_double_scratch_buffer = false;
        let half = one_half.scratch_bytes(0, 4096, 4096).unwrap();
        // Twice the chunks (MSCCL++'s formula aligns the whole, not each half).
        assert!(both > half && both <= 2 * half, "{}: {both} bytes against {half}", two.name);
    }
}

/// A valid base: 3-rank all-pair AllReduce, Simple, in place. Rank g, block k: ops
/// 0 put, 1 signal, 2 wait, 3 barrier, (block 0: 4 re), barrier, put, signal, wait.
fn base() -> Value {
    let plan = generate::plan(Algorithm::AllPairAllReduce, 3, Protocol::Simple, true).unwrap();
    serde_json::from_str(&plan.to_json()).unwrap()
}

fn refuse(mutate: impl FnOnce(&mut Value)) -> PlanError {
    try_refuse(mutate).unwrap_or_else(|| panic!("a broken plan loaded"))
}

fn try_refuse(mutate: impl FnOnce(&mut Value)) -> Option<PlanError> {
    let mut v = base();
    mutate(&mut v);
    Plan::from_json_str(&v.to_string()).err()
}

fn at<'a>(v: &'a mut Value, pointer: &str) -> &'a mut Value {
    v.pointer_mut(pointer).unwrap_or_else(|| panic!("no {pointer} in the base plan"))
}

fn remove(v: &mut Value, pointer: &str, key: &str) {
    at(v, pointer).as_object_mut().unwrap().remove(key).unwrap_or_else(|| panic!("no {key} at {pointer}"));
}

#[test]
fn broken_plans_are_refused_with_the_json_path() {
    type Case = (&'static str, Box<dyn FnOnce(&mut Value)>, &'static str);
    let op = "/gpus/1/threadblocks/0/ops";
    let cases: Vec<Case> = vec![
        ("missing name", Box::new(|v| remove(v, "", "name")), "name"),
        ("unknown protocol", Box::new(|v| *at(v, "/protocol") = json!("Fast")), "protocol"),
        ("inplace not a boolean", Box::new(|v| *at(v, "/inplace") = json!("yes")), "inplace"),
        ("chunks not a number", Box::new(|v| *at(v, "/gpus/0/input_chunks") = json!("four")), "gpus[0].input_chunks"),
        ("negative chunks", Box::new(|v| *at(v, "/gpus/2/scratch_chunks") = json!(-1)), "gpus[2].scratch_chunks"),
        ("gpu id out of order", Box::new(|v| *at(v, "/gpus/1/id") = json!(5)), "gpus[1].id"),
        (
            "peer outside the world",
            Box::new(|v| *at(v, "/gpus/0/channels/0/connected_to/1") = json!(3)),
            "gpus[0].channels[0].connected_to[1]",
        ),
        (
            "channel to itself",
            Box::new(|v| *at(v, "/gpus/2/channels/0/connected_to/0") = json!(2)),
            "gpus[2].channels[0].connected_to[0]",
        ),
        (
            "remote buffer of a rank outside the world",
            Box::new(|v| *at(v, "/gpus/0/remote_buffers/0/rank") = json!(7)),
            "gpus[0].remote_buffers[0].rank",
        ),
        (
            "unknown buffer type",
            Box::new(|v| *at(v, "/gpus/1/remote_buffers/1/type") = json!("x")),
            "gpus[1].remote_buffers[1].type",
        ),
        (
            "unknown channel type",
            Box::new(|v| *at(v, "/gpus/0/channels/0/channel_type") = json!("nvlink")),
            "gpus[0].channels[0].channel_type",
        ),
        (
            "thread block id out of order",
            Box::new(|v| *at(v, "/gpus/0/threadblocks/1/id") = json!(0)),
            "gpus[0].threadblocks[1].id",
        ),
        (
            "thread block channel beyond the GPU's",
            Box::new(|v| *at(v, "/gpus/0/threadblocks/1/channels/0/channel_ids/0") = json!(2)),
            "gpus[0].threadblocks[1].channels[0].channel_ids[0]",
        ),
        (
            "remote buffer ref beyond the GPU's",
            Box::new(|v| *at(v, "/gpus/2/threadblocks/0/remote_buffer_refs/0/remote_buffer_ids/1") = json!(4)),
            "gpus[2].threadblocks[0].remote_buffer_refs[0].remote_buffer_ids[1]",
        ),
        (
            "remote buffer over the wrong channel type",
            Box::new(|v| *at(v, "/gpus/2/threadblocks/0/remote_buffer_refs/0/access_channel_type") = json!("port")),
            "gpus[2].threadblocks[0].remote_buffer_refs[0].remote_buffer_ids[0]",
        ),
        (
            "unknown operation",
            Box::new(move |v| *at(v, &format!("{op}/3/name")) = json!("teleport")),
            "gpus[1].threadblocks[0].ops[3].name",
        ),
        (
            "operation name not a string",
            Box::new(move |v| *at(v, &format!("{op}/2/name")) = json!(7)),
            "gpus[1].threadblocks[0].ops[2].name",
        ),
        (
            "source chunk past the input",
            Box::new(move |v| *at(v, &format!("{op}/0/src_buff/0/index")) = json!(3)),
            "gpus[1].threadblocks[0].ops[0].src_buff[0].index",
        ),
        (
            "source range past the input",
            Box::new(move |v| *at(v, &format!("{op}/0/src_buff/0/size")) = json!(4)),
            "gpus[1].threadblocks[0].ops[0].src_buff[0].size",
        ),
        (
            "huge size does not wrap",
            Box::new(move |v| *at(v, &format!("{op}/4/src_buff/1/size")) = json!(u64::MAX)),
            "gpus[1].threadblocks[0].ops[4].src_buff[1].size",
        ),
        (
            "remote chunk past the peer's scratch",
            Box::new(move |v| *at(v, &format!("{op}/0/dst_buff/0/index")) = json!(3)),
            "gpus[1].threadblocks[0].ops[0].dst_buff[0].index",
        ),
        (
            "remote buffer id beyond the block's",
            Box::new(move |v| *at(v, &format!("{op}/6/dst_buff/0/buffer_id")) = json!(2)),
            "gpus[1].threadblocks[0].ops[6].dst_buff[0].buffer_id",
        ),
        (
            "buffer without type or buffer_id",
            Box::new(move |v| remove(v, &format!("{op}/4/dst_buff/0"), "type")),
            "gpus[1].threadblocks[0].ops[4].dst_buff[0].type",
        ),
        (
            "buffer without index",
            Box::new(move |v| remove(v, &format!("{op}/4/src_buff/0"), "index")),
            "gpus[1].threadblocks[0].ops[4].src_buff[0].index",
        ),
        (
            "remote buffer on an op without channel type",
            Box::new(move |v| remove(v, &format!("{op}/0"), "channel_type")),
            "gpus[1].threadblocks[0].ops[0].channel_type",
        ),
        (
            "op channel beyond the block's",
            Box::new(move |v| *at(v, &format!("{op}/1/channel_ids/0")) = json!(1)),
            "gpus[1].threadblocks[0].ops[1].channel_ids[0]",
        ),
        (
            "signal without channels",
            Box::new(move |v| remove(v, &format!("{op}/1"), "channel_ids")),
            "gpus[1].threadblocks[0].ops[1].channel_ids",
        ),
        (
            "copy without destination",
            Box::new(move |v| remove(v, &format!("{op}/4"), "dst_buff")),
            "gpus[1].threadblocks[0].ops[4].dst_buff",
        ),
        (
            "unknown reduce op",
            Box::new(move |v| *at(v, &format!("{op}/4/reduce_op")) = json!("avg")),
            "gpus[1].threadblocks[0].ops[4].reduce_op",
        ),
        (
            "barrier without id",
            Box::new(move |v| remove(v, &format!("{op}/3"), "barrier_id")),
            "gpus[1].threadblocks[0].ops[3].barrier_id",
        ),
        (
            "barrier of more blocks than the GPU has",
            Box::new(move |v| *at(v, &format!("{op}/3/num_threadblocks")) = json!(3)),
            "gpus[1].threadblocks[0].ops[3].num_threadblocks",
        ),
        (
            "tbg_info id not below the group size",
            Box::new(move |v| {
                at(v, &format!("{op}/0"))
                    .as_object_mut()
                    .unwrap()
                    .insert("tbg_info".into(), json!({"tb_id": 2, "tbg_size": 2}));
            }),
            "gpus[1].threadblocks[0].ops[0].tbg_info.tb_id",
        ),
        (
            "semaphore the GPU lacks",
            Box::new(move |v| {
                at(v, op).as_array_mut().unwrap().push(json!({"name": "sem_acquire", "semaphore_ids": [0]}))
            }),
            "gpus[1].threadblocks[0].ops[9].semaphore_ids[0]",
        ),
        (
            "pipeline without iter_context",
            Box::new(move |v| {
                at(v, op).as_array_mut().unwrap().push(json!({"name": "pipeline", "ops": [{"name": "nop"}]}))
            }),
            "gpus[1].threadblocks[0].ops[9].iter_context",
        ),
        (
            "fault inside a pipeline body",
            Box::new(move |v| {
                at(v, op).as_array_mut().unwrap().push(json!({"name": "pipeline", "iter_context": {"unit_size": 64, "num_chunks": 1}, "ops": [{"name": "nop"}, {"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}], "dst_buff": [{"type": "s", "index": 9, "size": 1}]}]}))
            }),
            "gpus[1].threadblocks[0].ops[9].ops[1].dst_buff[0].index",
        ),
        (
            "min above max message size",
            Box::new(|v| {
                *at(v, "/min_message_size") = json!(100);
                *at(v, "/max_message_size") = json!(10);
            }),
            "max_message_size",
        ),
        (
            "too many threads per block",
            Box::new(|v| *at(v, "/num_threads_per_block") = json!(2048)),
            "num_threads_per_block",
        ),
        (
            "too many operations in a block",
            Box::new(move |v| {
                let ops = at(v, op).as_array_mut().unwrap();
                for _ in 0..60 {
                    ops.push(json!({"name": "nop"}));
                }
            }),
            "gpus[1].threadblocks[0].ops",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, mutate, path) in cases {
        let e = try_refuse(mutate).unwrap_or_else(|| panic!("{what}: the broken plan loaded"));
        assert_eq!(e.path(), Some(path), "{what}: {e}");
        assert!(e.to_string().starts_with(path), "{what}: the message does not lead with the path: {e}");
    }
}

#[test]
fn error_kinds_are_typed() {
    let e = refuse(|v| *at(v, "/gpus/1/threadblocks/0/ops/3/name") = json!("glre"));
    assert!(matches!(&e, PlanError::UnknownOp { name, .. } if name == "glre"), "{e}");
    assert!(e.to_string().contains("unknown operation \"glre\""), "{e}");

    let e = refuse(|v| *at(v, "/gpus/0/channels/0/channel_type") = json!("switch"));
    assert!(matches!(&e, PlanError::SwitchChannel { path } if path == "gpus[0].channels[0].channel_type"), "{e}");
    assert!(e.to_string().contains("NVLink multicast"), "{e}");

    let e = refuse(|v| {
        let b = at(v, "/gpus/1/threadblocks/0/ops/4/dst_buff/0").as_object_mut().unwrap();
        b.remove("type");
        b.insert("switch_channel_id".into(), json!(0));
    });
    assert!(
        matches!(&e, PlanError::SwitchChannel { path } if path.ends_with("ops[4].dst_buff[0].switch_channel_id")),
        "{e}"
    );

    // A put over a port channel names its channel (the two-node plan's pwsf on block 1 of rank 0).
    let two = generate::plan(Algorithm::HierarchicalAllReduce, 4, Protocol::Simple, true).unwrap();
    let mut v: Value = serde_json::from_str(&two.to_json()).unwrap();
    let ops = v.pointer_mut("/gpus/0/threadblocks/1/ops").unwrap().as_array_mut().unwrap();
    let pwsf = ops.iter_mut().find(|o| o["name"] == "pwsf").unwrap();
    pwsf.as_object_mut().unwrap().remove("channel_ids");
    let e = Plan::from_json_str(&v.to_string()).unwrap_err();
    assert!(matches!(&e, PlanError::Missing { path } if path == "gpus[0].threadblocks[1].ops[2].channel_ids"), "{e}");

    let e = refuse(|v| remove(v, "/gpus/0", "threadblocks"));
    assert!(matches!(&e, PlanError::Missing { path } if path == "gpus[0].threadblocks"), "{e}");
    let e = refuse(|v| *at(v, "/gpus") = json!({}));
    assert!(matches!(&e, PlanError::Type { path, .. } if path == "gpus"), "{e}");
    let e = refuse(|v| *at(v, "/gpus") = json!([]));
    assert_eq!(e.path(), Some("gpus"));

    for text in ["", "{", "[1,2", "null", "\u{0}"] {
        let e = Plan::from_json_str(text).unwrap_err();
        assert!(matches!(e, PlanError::Json { .. } | PlanError::Type { .. }), "{text:?}: {e}");
    }
    let e = Plan::from_json_str("[]").unwrap_err();
    assert!(matches!(&e, PlanError::Type { path, .. } if path == "$"), "{e}");
    assert!(matches!(Plan::from_json_slice(&[0xff, 0xfe]), Err(PlanError::Json { .. })));
    let e = Plan::from_file("/nonexistent/plan.json").unwrap_err();
    assert!(matches!(e, PlanError::Io { .. }) && e.to_string().contains("/nonexistent/plan.json"), "{e}");
}

#[test]
fn unknown_fields_are_ignored_and_defaults_follow_mscclpp() {
    let mut v = base();
    let m = v.as_object_mut().unwrap();
    for k in [
        "reuse_resources",
        "use_double_scratch_buffer",
        "buffer_alignment",
        "min_message_size",
        "max_message_size",
        "num_threads_per_block",
    ] {
        m.remove(k);
    }
    m.insert("a_future_field".into(), json!({"x": 1}));
    let plan = Plan::from_json_str(&v.to_string()).unwrap();
    assert_eq!((plan.buffer_alignment, plan.num_threads_per_block, plan.max_message_size), (16, 1024, u64::MAX));
    assert!(!plan.reuse_resources && !plan.use_double_scratch_buffer);
}

/// Every leaf (number, string, boolean) of `v`, as JSON pointers.
fn leaves(v: &Value, path: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => m.iter().for_each(|(k, x)| leaves(x, format!("{path}/{k}"), out)),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| leaves(x, format!("{path}/{i}"), out)),
        _ => out.push(path),
    }
}

fn replacement() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..20).prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        "[a-z_]{0,10}".prop_map(Value::from),
        Just(json!("switch")),
        Just(json!([])),
        Just(json!({})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Plan::from_json_slice(&bytes);
        mscclpp_executor::fuzz_check(&bytes);
    }

    #[test]
    fn mutated_plans_never_panic(picks in proptest::collection::vec((any::<prop::sample::Index>(), replacement()), 1..4)) {
        let mut v = base();
        let mut paths = Vec::new();
        leaves(&v, String::new(), &mut paths);
        for (i, new) in picks {
            let p = i.get(&paths).clone();
            if let Some(x) = v.pointer_mut(&p) {
                *x = new;
            }
        }
        let text = v.to_string();
        if let Ok(plan) = Plan::from_json_str(&text) {
            // What loads is consistent: it round-trips and summarizes.
            prop_assert_eq!(Plan::from_json_str(&plan.to_json()).ok(), Some(plan.clone()));
            let _ = plan.summary().to_string();
            let _ = mscclpp_executor::sim::simulate(&plan, &[]);
        } else if let Err(e) = Plan::from_json_str(&text) {
            prop_assert!(!e.to_string().is_empty());
        }
        mscclpp_executor::fuzz_check(text.as_bytes());
    }

    #[test]
    fn truncated_plans_never_panic(cut in 0usize..4000) {
        let text = base().to_string();
        let cut = cut.min(text.len());
        prop_assert!(Plan::from_json_slice(&text.as_bytes()[..cut]).is_err() || cut == text.len());
    }
}
