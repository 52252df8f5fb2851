//! What the GPU tests share: integer-valued inputs, a CPU reference, one case runner.
#![allow(dead_code)]

use std::time::Duration;

use mscclpp::TransportFlags;
use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp_collectives::{Algorithm, CallOptions, Collective, Collectives, DataType, ReduceOp};

/// Element `i` of rank `r`'s input: small integers, exact in every type and every sum here.
fn value(r: usize, i: usize, op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Prod => ((i + r) % 3) as i64, // 0, 1, 2: products of up to 8 ranks stay exact
        _ => ((r * 7 + i * 3) % 17) as i64 - 8,
    }
}

fn encode(d: DataType, v: f64) -> Vec<u8> {
    match d {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => f32_to_f16(v as f32).to_le_bytes().to_vec(),
        DataType::Bf16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        DataType::I32 => (v as i32).to_le_bytes().to_vec(),
        DataType::U32 => (v as i64 as u32).to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

pub fn decode(d: DataType, b: &[u8]) -> f64 {
    match d {
        DataType::F32 => f32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DataType::F16 => f16_to_f32(u16::from_le_bytes(b[..2].try_into().unwrap())) as f64,
        DataType::Bf16 => f32::from_bits((u16::from_le_bytes(b[..2].try_into().unwrap()) as u32) << 16) as f64,
        DataType::I32 => i32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DataType::U32 => u32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        _ => unreachable!(),
    }
}

fn f32_to_f16(f: f32) -> u16 {
    // Exact for the small integers used here.
    if f == 0.0 {
        return if f.is_sign_negative() { 0x8000 } else { 0 };
    }
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | man
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 && man == 0 {
        return f32::from_bits(sign);
    }
    f32::from_bits(sign | ((exp + 127 - 15) << 23) | (man << 13))
}

pub fn reduce(op: ReduceOp, d: DataType, vals: impl Iterator<Item = i64>, n: usize) -> f64 {
    let v: Vec<i64> = vals.collect();
    let x = match op {
        ReduceOp::Sum | ReduceOp::Avg => v.iter().sum::<i64>(),
        ReduceOp::Prod => v.iter().product(),
        ReduceOp::Min => *v.iter().min().unwrap(),
        ReduceOp::Max => *v.iter().max().unwrap(),
        _ => unreachable!(),
    };
    if op == ReduceOp::Avg { if d.is_float() { x as f64 / n as f64 } else { (x / n as i64) as f64 } } else { x as f64 }
}

pub fn input_bytes(d: DataType, r: usize, count: usize, op: ReduceOp) -> Vec<u8> {
    let mut v = Vec::with_capacity(count * d.size());
    for i in 0..count {
        let x = value(r, i, op);
        let x = if d == DataType::U32 && op != ReduceOp::Prod { x + 8 } else { x };
        v.extend(encode(d, x as f64));
    }
    v
}

pub fn input_value(d: DataType, r: usize, i: usize, op: ReduceOp) -> i64 {
    let x = value(r, i, op);
    if d == DataType::U32 && op != ReduceOp::Prod { x + 8 } else { x }
}

fn close(d: DataType, op: ReduceOp, got: f64, want: f64) -> bool {
    if op == ReduceOp::Avg && d.is_float() {
        let tol = match d {
            DataType::F32 => 1e-5,
            DataType::F16 => 1e-2,
            _ => 6e-2,
        };
        (got - want).abs() <= tol * want.abs().max(1.0)
    } else {
        got == want
    }
}

/// Every rank's earlier kernels have finished before any rank frees a buffer (freeing waits for
/// the whole GPU): a one-element AllReduce completes on a rank only once every peer launched
/// it, i.e. finished everything before it; peers can then finish theirs without this rank.
pub fn coll_barrier(coll: &Collectives) {
    let ctx = mscclpp::Context::new();
    let one = DeviceBuffer::new(&ctx, 0, 16, TransportFlags::NONE).unwrap();
    let s = Stream::new(0).unwrap();
    coll.all_reduce_buffers(&one, &one, 1, DataType::U32, ReduceOp::Sum, &s).unwrap();
    coll.synchronize(&s, Duration::from_secs(60)).unwrap();
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub coll: Collective,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub count: usize,
    pub algo: Option<Algorithm>,
    pub in_place: bool,
}

/// Runs `case` on every rank and returns the number of wrong elements (with the first few).
pub fn run_case(
    rank: usize,
    n: usize,
    coll: &Collectives,
    stream: &Stream,
    bufs: &(DeviceBuffer, DeviceBuffer),
    c: &Case,
) -> (usize, Vec<String>) {
    let es = c.dtype.size();
    let (in_elems, out_elems) = match c.coll {
        Collective::AllReduce | Collective::Broadcast => (c.count, c.count),
        Collective::AllGather => (c.count, c.count * n),
        Collective::ReduceScatter => (c.count * n, c.count),
        _ => unreachable!(),
    };
    let big = in_elems.max(out_elems) * es;
    let (a, b) = (&bufs.0, &bufs.1);
    assert!(a.len() >= big && b.len() >= big);
    let input = input_bytes(c.dtype, rank, in_elems, c.op);
    // In place: the input sits where NCCL puts it inside the output buffer.
    let (send, recv) = if c.in_place {
        let off = match c.coll {
            Collective::AllGather => rank * c.count * es,
            _ => 0,
        };
        a.write(off, &input).unwrap();
        (a.device_ptr() + off as u64, a.device_ptr())
    } else {
        a.write(0, &input).unwrap();
        b.fill(0, big, 0xee).unwrap();
        (a.device_ptr(), b.device_ptr())
    };
    let (send, recv) = if c.in_place && c.coll == Collective::ReduceScatter {
        (a.device_ptr(), a.device_ptr() + (rank * c.count * es) as u64)
    } else {
        (send, recv)
    };
    let mut opts = c.algo.map(CallOptions::algorithm).unwrap_or_default();
    opts.accumulate_f32 = false;
    // SAFETY: a and b hold `big` bytes and outlive the synchronize below.
    unsafe {
        match c.coll {
            Collective::AllReduce => coll.all_reduce(send, recv, c.count, c.dtype, c.op, stream, &opts),
            Collective::AllGather => coll.all_gather(send, recv, c.count, c.dtype, stream, &opts),
            Collective::ReduceScatter => coll.reduce_scatter(send, recv, c.count, c.dtype, c.op, stream, &opts),
            Collective::Broadcast => coll.broadcast(send, recv, c.count, c.dtype, 1 % n, stream, &opts),
            _ => unreachable!(),
        }
    }
    .unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    coll.synchronize(stream, Duration::from_secs(60)).unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    let mut out = vec![0u8; out_elems * es];
    let src = if c.in_place { a } else { b };
    let off = if c.in_place && c.coll == Collective::ReduceScatter { rank * c.count * es } else { 0 };
    src.read(off, &mut out).unwrap();
    let mut wrong = 0;
    let mut first = Vec::new();
    for (j, chunk) in out.chunks(es).enumerate() {
        let got = decode(c.dtype, chunk);
        let want = match c.coll {
            Collective::AllReduce => reduce(c.op, c.dtype, (0..n).map(|r| input_value(c.dtype, r, j, c.op)), n),
            Collective::ReduceScatter => {
                reduce(c.op, c.dtype, (0..n).map(|r| input_value(c.dtype, r, rank * c.count + j, c.op)), n)
            }
            Collective::AllGather => input_value(c.dtype, j / c.count, j % c.count, c.op) as f64,
            Collective::Broadcast => input_value(c.dtype, 1 % n, j, c.op) as f64,
            _ => unreachable!(),
        };
        if !close(c.dtype, c.op, got, want) {
            wrong += 1;
            if first.len() < 4 {
                first.push(format!("[{j}] = {got}, want {want}"));
            }
        }
    }
    (wrong, first)
}

pub const COUNTS: &[usize] = &[1, 2, 3, 7, 8, 15, 16, 17, 255, 1000, 4097, 65_537, 262_147];

pub fn cases_for(n: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for &count in COUNTS {
        for (i, coll) in
            [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast]
                .into_iter()
                .enumerate()
        {
            for algo in [None, Some(Algorithm::AllPair), Some(Algorithm::Packet), Some(Algorithm::Simple)] {
                if algo.is_some_and(|a| !a.serves(coll)) {
                    continue;
                }
                let dtype = DataType::ALL[(count + i) % 5];
                let op = if coll.reduces() {
                    [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg, ReduceOp::Prod][(count / 3 + i) % 5]
                } else {
                    ReduceOp::Sum
                };
                let packet_too_big = algo.is_some_and(|a| a.is_packet()) && count * n * 4 > (1 << 20);
                if packet_too_big {
                    continue;
                }
                v.push(Case { coll, dtype, op, count, algo, in_place: (count + i) % 2 == 0 });
            }
        }
    }
    // Every type with every op on AllReduce, in and out of place.
    for d in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                v.push(Case { coll: Collective::AllReduce, dtype: d, op, count: 1001, algo: None, in_place });
                v.push(Case {
                    coll: Collective::ReduceScatter,
                    dtype: d,
                    op,
                    count: 333,
                    algo: Some(Algorithm::Simple),
                    in_place,
                });
            }
        }
    }
    // Large: rounds of the staged algorithms (64 MiB of f32 + a tail).
    v.push(Case {
        coll: Collective::AllReduce,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        count: (16 << 20) + 5,
        algo: None,
        in_place: true,
    });
    v.push(Case {
        coll: Collective::AllGather,
        dtype: DataType::Bf16,
        op: ReduceOp::Sum,
        count: (8 << 20) + 3,
        algo: None,
        in_place: false,
    });
    v
}
