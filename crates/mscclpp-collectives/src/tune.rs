//! Setup-time tuning of AllReduce: for every power-of-two size from 1 KiB to 16 MiB, every
//! candidate plan (algorithm x blocks x threads) is captured in a CUDA graph of
//! [`CALLS_PER_GRAPH`] calls and timed on the GPU; the ranks gather their times and every rank
//! adopts the plan whose slowest rank was fastest, so all ranks make the same choice (SGLang
//! tunes MSCCL++ the same way, in Python). The table is kept per process for communicators of
//! the same shape, so a second `Collectives` on the same ranks tunes no more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use mscclpp::gpu::{DeviceBuffer, Stream, TimingEvent};
use mscclpp::{Communicator, Error, Result, TransportFlags};

use crate::comm::{CallOptions, Collectives};
use crate::select::{self, Plan};
use crate::types::{Algorithm, Collective, DataType, ReduceOp};

/// Calls per captured graph when timing a candidate.
pub const CALLS_PER_GRAPH: usize = 10;
/// The sizes tuned: 2^10 .. 2^24 bytes (15 sizes).
pub const SIZES: std::ops::RangeInclusive<u32> = 10..=24;

/// The plan per power-of-two size: a size uses the entry of the smallest tuned size at least as
/// large (sizes past the largest are not covered).
#[derive(Clone, Debug, PartialEq)]
pub struct TuneTable {
    /// `(bytes, plan)` by increasing bytes.
    pub entries: Vec<(u64, Plan)>,
    /// GPU time per call of the chosen plans, microseconds (the slowest rank's).
    pub micros: Vec<f32>,
}

impl TuneTable {
    /// A digest of the chosen plans (sizes, algorithms, shapes), to tell whether two ranks hold
    /// the same table (FNV-1a over their fields).
    pub fn digest(&self) -> u64 {
        select::fnv1a_words(
            self.entries.iter().flat_map(|(n, p)| [*n, p.algorithm.code(), u64::from(p.blocks), u64::from(p.threads)]),
        )
    }

    /// The tuned plan for a call of `nbytes`, if the table covers it.
    pub fn lookup(&self, nbytes: u64) -> Option<Plan> {
        self.entries.iter().find(|(b, _)| nbytes <= *b).map(|(_, p)| *p)
    }
}

/// The candidates for a size (the same list on every rank: it depends only on the layout and
/// limits, which every rank shares).
pub fn candidates(nbytes: u64, layout: &select::Layout, max_blocks: u32) -> Vec<Plan> {
    let mut v = Vec::new();
    let c = Collective::AllReduce;
    for algo in Algorithm::ALL {
        let usable = match algo {
            Algorithm::AllPair => nbytes <= 256 << 10,
            Algorithm::Packet => nbytes <= 4 << 20,
            Algorithm::Simple => nbytes >= 64 << 10,
        };
        if !usable || (algo.is_packet() && !layout.packet_fits(c, algo, nbytes)) {
            continue;
        }
        // Packet calls of a few KiB also try 64- and 128-thread blocks: a latency-bound call
        // pays for every warp of its prologue and epilogue, busy or not (1 KiB is 128 units).
        let threads: &[u32] = match algo {
            Algorithm::Simple => &[512],
            _ if nbytes <= 16 << 10 => &[64, 128, 256, 512],
            _ => &[256, 512],
        };
        for &t in threads {
            for b in [1u32, 2, 4, 8, 16, 32, 64, 128] {
                if b > max_blocks {
                    break;
                }
                // Skip shapes with more threads than units of work for packets.
                let units = nbytes.div_ceil(8);
                if algo.is_packet() && (b as u64 * t as u64) > units.max(t as u64) * 2 {
                    continue;
                }
                if (t as usize) < layout.nranks {
                    continue;
                }
                v.push(Plan { algorithm: algo, blocks: b, threads: t });
            }
        }
    }
    v
}

fn key(coll: &Collectives) -> String {
    // Programmatic launches change the timings (back-to-back calls in a graph): a table tuned
    // with them is not reused without them.
    format!(
        "{}x{}:{:?}:{:?}:pdl{}",
        coll.size(),
        coll.device(),
        coll.layout(),
        coll.limits(),
        coll.programmatic_blocks()
    )
}

/// Tunes AllReduce on `coll` (a collective call: every rank of `comm` makes it).
///
/// # Errors
/// Errors of the calls being timed (a rank that never arrives, CUDA errors), naming the peer.
pub fn tune_all_reduce(coll: &Collectives, comm: &Communicator) -> Result<Arc<TuneTable>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<TuneTable>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let k = key(coll);
    // Use the process cache only if every rank has the same table (ranks of other processes may
    // have none, or one tuned with other peers: their plans would then differ, and every call
    // of such a size would fail as a mismatch).
    let have = cache.lock().ok().and_then(|m| m.get(&k).cloned());
    let vote = have.as_ref().map_or_else(|| vec![0u8], |t| [vec![1u8], t.digest().to_le_bytes().to_vec()].concat());
    let votes = comm.bootstrap().all_gather(&vote)?;
    if let Some(t) = have.filter(|_| votes.iter().all(|v| *v == vote)) {
        return Ok(t);
    }
    let start = Instant::now();
    let (entries, micros) = time_candidates(coll, comm)?;
    // Nobody launches again before every rank has freed what tuning allocated: freeing memory
    // waits for the whole GPU, including peers' kernels waiting for this rank.
    comm.bootstrap().barrier()?;
    let table = Arc::new(TuneTable { entries, micros });
    tracing::info!(target: "mscclpp::collectives", "tuned AllReduce for {} sizes in {:?}", table.entries.len(), start.elapsed());
    if let Ok(mut m) = cache.lock() {
        m.insert(k, table.clone());
    }
    Ok(table)
}

/// Times every candidate of every size; returns the chosen plans and their times.
/// The chosen plan per size and its time (microseconds).
type Chosen = (Vec<(u64, Plan)>, Vec<f32>);

fn time_candidates(coll: &Collectives, comm: &Communicator) -> Result<Chosen> {
    let dev = coll.device();
    let stream = Stream::new(dev)?;
    let max = 1u64 << SIZES.end();
    let buf = DeviceBuffer::new(comm.context(), dev, max as usize, TransportFlags::NONE)?;
    let mut entries = Vec::new();
    let mut micros = Vec::new();
    for p in SIZES {
        let nbytes = 1u64 << p;
        let count = (nbytes / 2) as usize; // bf16, the type of inference AllReduce
        let cands = candidates(nbytes, coll.layout(), coll.limits().max_blocks);
        // Capture every candidate, then run them all back to back and synchronize once.
        let captured = (|| -> Result<Vec<_>> {
            let mut runs = Vec::with_capacity(cands.len());
            for plan in &cands {
                let opts = CallOptions::algorithm(plan.algorithm).shape(plan.blocks, plan.threads);
                stream.begin_capture()?;
                let mut r = Ok(());
                for _ in 0..CALLS_PER_GRAPH {
                    // buf outlives every launch of the graph (the stream is synchronized below).
                    r = coll.all_reduce_buffers_with(&buf, &buf, count, DataType::Bf16, ReduceOp::Sum, &stream, &opts);
                    if r.is_err() {
                        break;
                    }
                }
                let graph = stream.end_capture();
                r?;
                runs.push((graph?, TimingEvent::new(dev)?, TimingEvent::new(dev)?));
            }
            Ok(runs)
        })();
        // No rank launches before every rank has instantiated its graphs: instantiation can
        // wait for the GPU, which a peer's kernels spinning for this rank would never free. A
        // rank that could not capture fails every rank here, named, instead of leaving them
        // waiting for it.
        let (runs, _) =
            comm.all_gather_outcome(captured, |_| Vec::new(), "tuning AllReduce: capturing the candidates")?;
        for (graph, e0, e1) in &runs {
            graph.launch(&stream)?; // warm-up; also absorbs the ranks' skew
            e0.record(&stream)?;
            graph.launch(&stream)?;
            graph.launch(&stream)?;
            e1.record(&stream)?;
        }
        coll.synchronize(&stream, std::time::Duration::from_secs(120)).map_err(|e| e.during("tuning AllReduce"))?;
        let mut mine = Vec::with_capacity(cands.len());
        for (_, e0, e1) in &runs {
            mine.push(e1.elapsed_ms_since(e0)? * 1000.0 / (2 * CALLS_PER_GRAPH) as f32);
        }
        let bytes: Vec<u8> = mine.iter().flat_map(|t| t.to_le_bytes()).collect();
        let all = comm.bootstrap().all_gather(&bytes)?;
        let mut worst = vec![0f32; cands.len()];
        for (p, theirs) in all.iter().enumerate() {
            if theirs.len() != bytes.len() {
                return Err(Error::remote(format!(
                    "rank {p} tuned {} candidates, this rank {}",
                    theirs.len() / 4,
                    cands.len()
                ))
                .with_peer(p));
            }
            for (i, w) in theirs.chunks(4).enumerate() {
                worst[i] = worst[i].max(f32::from_le_bytes([w[0], w[1], w[2], w[3]]));
            }
        }
        if let Some(i) = (0..cands.len()).min_by(|&a, &b| worst[a].total_cmp(&worst[b])) {
            entries.push((nbytes, cands[i]));
            micros.push(worst[i]);
        }
    }
    Ok((entries, micros))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::Layout;

    /// Tables that choose differently digest differently, so ranks whose process caches hold
    /// different tables tune again instead of planning apart.
    #[test]
    fn table_digests_tell_tables_apart() {
        let p = |algorithm, blocks, threads| Plan { algorithm, blocks, threads };
        let t = |entries: Vec<(u64, Plan)>| TuneTable { micros: vec![1.0; entries.len()], entries };
        let a = t(vec![(1024, p(Algorithm::AllPair, 1, 128)), (1 << 20, p(Algorithm::Packet, 8, 512))]);
        let same = t(vec![(1024, p(Algorithm::AllPair, 1, 128)), (1 << 20, p(Algorithm::Packet, 8, 512))]);
        assert_eq!(a.digest(), same.digest());
        for other in [
            t(vec![(1024, p(Algorithm::AllPair, 2, 128)), (1 << 20, p(Algorithm::Packet, 8, 512))]),
            t(vec![(1024, p(Algorithm::AllPair, 1, 256)), (1 << 20, p(Algorithm::Packet, 8, 512))]),
            t(vec![(1024, p(Algorithm::AllPair, 1, 128)), (1 << 20, p(Algorithm::Simple, 8, 512))]),
            t(vec![(1024, p(Algorithm::AllPair, 1, 128))]),
        ] {
            assert_ne!(a.digest(), other.digest());
        }
    }

    #[test]
    fn candidates_are_the_same_list_for_the_same_inputs_and_all_serve() {
        let l = Layout::new(8, 8 << 20, 32 << 20).unwrap();
        let mut total = 0;
        for p in SIZES {
            let a = candidates(1 << p, &l, 64);
            assert_eq!(a, candidates(1 << p, &l, 64));
            assert!(!a.is_empty(), "no candidate at 2^{p}");
            for c in &a {
                assert!(c.blocks >= 1 && c.blocks <= 64 && c.threads as usize >= 8);
                if c.algorithm.is_packet() {
                    assert!(l.packet_fits(Collective::AllReduce, c.algorithm, 1 << p));
                }
            }
            total += a.len();
        }
        // Bounded work: the 15 sizes take well under a few hundred captures.
        assert!(total < 400, "{total} candidates");
    }

    #[test]
    fn lookup_takes_the_next_tuned_size() {
        let p = |b| Plan { algorithm: Algorithm::Packet, blocks: b, threads: 256 };
        let t = TuneTable { entries: vec![(1024, p(1)), (2048, p(2))], micros: vec![1.0, 2.0] };
        assert_eq!(t.lookup(1), Some(p(1)));
        assert_eq!(t.lookup(1024), Some(p(1)));
        assert_eq!(t.lookup(1025), Some(p(2)));
        assert_eq!(t.lookup(4096), None);
    }
}
