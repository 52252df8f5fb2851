//! [`PlanAlgorithm`]: an execution plan registered as an algorithm of `mscclpp-collectives`'
//! selector ([`Collectives::register_algorithm`](mscclpp_collectives::Collectives::register_algorithm)).
//!
//! `unsafe` here is the trait's launch method, which takes the caller's raw device pointers and
//! hands them to [`Executor::execute`].
#![allow(unsafe_code)]

use std::sync::Arc;

use mscclpp::gpu::Stream;
use mscclpp::{Error, Result};
use mscclpp_collectives::{Collective, DataType as CollDataType, ExternalAlgorithm, ReduceOp as CollReduceOp};

use crate::exec::{DataType, ExecError, ExecutionPlan, Executor, PacketType};
use crate::model::ReduceOp;

/// An [`ExecutionPlan`] run by an [`Executor`], as an algorithm of the collectives' selector:
/// its collective is the plan's (`allreduce`, `allgather`, `reducescatter`), its world size the
/// plan's rank count, its size range the plan's `[min_message_size, max_message_size]` (made
/// half-open), its placement the plan's `inplace`; ranks per node default to the world size (one
/// node) and can be set with [`ranks_per_node`](Self::ranks_per_node). It serves the types the
/// executor runs (not f16/bf16 with an f32 accumulation request: those reduce in their own type)
/// and the one reduction the plan's `reduce_op`s name (sum when they name none).
///
/// **The first call for new buffers is a collective host call**: [`Executor::execute`] builds
/// the plan's channels, scratch and device program for those (plan, buffers) on first use, which
/// allocates, copies synchronously and opens and ends with bootstrap barriers. So before a
/// collective call on new buffers that this algorithm will serve, every rank must have finished
/// its earlier kernels (synchronize the stream), and that call must not be inside a CUDA graph
/// capture. Later calls on the same buffers only launch, and can be captured. The buffers are
/// mapped by the peers: keep them allocated while the executor lives.
///
/// ```no_run
/// use std::sync::Arc;
/// use mscclpp_collectives::{Collectives, Config};
/// use mscclpp_executor::{generate, ExecutionPlan, Executor, ExecutorConfig, PlanAlgorithm, Protocol};
/// # fn f(comm: &mscclpp::Communicator) -> Result<(), Box<dyn std::error::Error>> {
/// let coll = Collectives::new(comm, Config::new(0))?;
/// let executor = Arc::new(Executor::new(comm, ExecutorConfig::new(0)));
/// let plan = generate::plan(generate::Algorithm::AllPairAllReduce, comm.size(), Protocol::LL, true)
///     .ok_or("no plan for this size")?;
/// let algo = PlanAlgorithm::new(executor, ExecutionPlan::new(plan))?.size_range(0, 1 << 20);
/// coll.register_algorithm(Arc::new(algo))?; // every rank, same order
/// // From now on, in-place AllReduce below 1 MiB on this communicator runs the plan.
/// # Ok(()) }
/// ```
pub struct PlanAlgorithm {
    executor: Arc<Executor>,
    plan: ExecutionPlan,
    collective: Collective,
    ranks_per_node: usize,
    range: (u64, u64),
    reduce_op: Option<CollReduceOp>,
    packet_type: PacketType,
}

impl PlanAlgorithm {
    /// The plan as an algorithm, run by `executor`.
    ///
    /// # Errors
    /// `InvalidUsage` for a plan whose collective the selector has no call for (only
    /// `allreduce`, `allgather` and `reducescatter`), or whose operations reduce with more than
    /// one operation.
    pub fn new(executor: Arc<Executor>, plan: ExecutionPlan) -> Result<PlanAlgorithm> {
        let p = plan.plan();
        let collective = match p.collective.as_str() {
            "allreduce" => Collective::AllReduce,
            "allgather" => Collective::AllGather,
            "reducescatter" => Collective::ReduceScatter,
            other => {
                return Err(Error::invalid_usage(format!(
                    "plan {:?}: its collective {other:?} is not one the collectives' selector serves (allreduce, \
                     allgather, reducescatter)",
                    p.name
                )));
            }
        };
        let mut ops = p.gpus.iter().flat_map(|g| &g.threadblocks).flat_map(|t| &t.ops).filter_map(|o| o.reduce_op);
        let first = ops.next();
        if let Some(other) = ops.find(|o| Some(*o) != first) {
            return Err(Error::invalid_usage(format!(
                "plan {:?} reduces with both {first:?} and {other:?}: it computes no single reduction",
                p.name
            )));
        }
        let reduce_op = collective.reduces().then_some(match first {
            None | Some(ReduceOp::Sum) => CollReduceOp::Sum,
            Some(ReduceOp::Min) => CollReduceOp::Min,
            Some(ReduceOp::Max) => CollReduceOp::Max,
        });
        let range = (p.min_message_size, p.max_message_size.saturating_add(1));
        let ranks_per_node = p.gpus.len();
        Ok(PlanAlgorithm {
            executor,
            plan,
            collective,
            ranks_per_node,
            range,
            reduce_op,
            packet_type: PacketType::default(),
        })
    }

    /// Sets the ranks per node the plan is written for (default: all of them, one node).
    pub fn ranks_per_node(mut self, n: usize) -> PlanAlgorithm {
        self.ranks_per_node = n;
        self
    }

    /// Narrows the message sizes it serves to `[min, max)` bytes (default: the plan's).
    pub fn size_range(mut self, min: u64, max: u64) -> PlanAlgorithm {
        self.range = (min, max);
        self
    }

    /// Sets the LL packet format (default LL16).
    pub fn packet_type(mut self, t: PacketType) -> PlanAlgorithm {
        self.packet_type = t;
        self
    }

    /// The plan.
    pub fn plan(&self) -> &ExecutionPlan {
        &self.plan
    }

    /// The reduction it computes (`None` for AllGather).
    pub fn reduce_op(&self) -> Option<CollReduceOp> {
        self.reduce_op
    }
}

fn dtype(d: CollDataType) -> Option<DataType> {
    Some(match d {
        CollDataType::F32 => DataType::Float32,
        CollDataType::F16 => DataType::Float16,
        CollDataType::Bf16 => DataType::Bfloat16,
        CollDataType::I32 => DataType::Int32,
        CollDataType::U32 => DataType::Uint32,
        _ => return None,
    })
}

/// An executor error as the core crate's error (what the collectives' calls return).
pub fn to_core_error(e: ExecError) -> Error {
    let peer = e.peer();
    let err = match e {
        ExecError::Mscclpp(e) => return e,
        ExecError::Device { timeout, kind: crate::exec::DeviceFailureKind::Timeout, .. } => {
            Error::timeout(e.to_string(), timeout)
        }
        ExecError::Device { .. } => Error::remote(e.to_string()),
        other => Error::invalid_usage(other.to_string()),
    };
    match peer {
        Some(p) => err.with_peer(p),
        None => err,
    }
}

impl ExternalAlgorithm for PlanAlgorithm {
    fn name(&self) -> &str {
        self.plan.name()
    }
    fn collective(&self) -> Collective {
        self.collective
    }
    fn world_size(&self) -> usize {
        self.plan.plan().gpus.len()
    }
    fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }
    fn size_range(&self) -> (u64, u64) {
        self.range
    }
    fn in_place(&self) -> bool {
        self.plan.plan().inplace
    }
    fn out_of_place(&self) -> bool {
        !self.plan.plan().inplace
    }
    fn supports(&self, dt: CollDataType, op: Option<CollReduceOp>) -> bool {
        dtype(dt).is_some() && op == self.reduce_op
    }
    unsafe fn launch(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        send_bytes: u64,
        recv_bytes: u64,
        dt: CollDataType,
        _op: Option<CollReduceOp>,
        stream: &Stream,
    ) -> Result<()> {
        let dt = dtype(dt).ok_or_else(|| {
            Error::invalid_usage(format!("plan {:?}: the executor has no element type {dt}", self.plan.name()))
        })?;
        // SAFETY: the trait's contract is execute's: device memory of this GPU, of these sizes,
        // valid until the call finishes on the stream, the same call on every rank. (The
        // executor maps the buffers into peers on first use: documented on PlanAlgorithm.)
        unsafe {
            self.executor.execute(rank, send, recv, send_bytes, recv_bytes, dt, &self.plan, stream, self.packet_type)
        }
        .map_err(to_core_error)
    }
    fn check(&self) -> Result<()> {
        self.executor.check().map_err(to_core_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{self, Algorithm};
    use crate::model::Protocol;

    fn algo(plan: crate::Plan) -> Result<PlanAlgorithm> {
        // Metadata only: the executor is never asked to run here. Its communicator needs a
        // bootstrap; one rank over a local root suffices.
        let (root, id) = mscclpp::RootServer::start(1, std::time::Duration::from_secs(10))?;
        let bs = Arc::new(mscclpp::TcpBootstrap::initialize(0, 1, &id)?);
        let comm = mscclpp::Communicator::new(bs);
        let ex = Arc::new(Executor::new(&comm, crate::ExecutorConfig::new(0)));
        drop(root);
        PlanAlgorithm::new(ex, ExecutionPlan::new(plan))
    }

    #[test]
    fn metadata_comes_from_the_plan() {
        let p = generate::plan(Algorithm::AllPairAllReduce, 4, Protocol::LL, true).unwrap();
        let name = p.name.clone();
        let a = algo(p).unwrap();
        assert_eq!(a.name(), name);
        assert_eq!(a.collective(), Collective::AllReduce);
        assert_eq!((a.world_size(), ExternalAlgorithm::ranks_per_node(&a)), (4, 4));
        assert_eq!(ExternalAlgorithm::size_range(&a), (0, u64::MAX));
        assert!(a.in_place() && !a.out_of_place());
        assert!(a.supports(CollDataType::I32, Some(CollReduceOp::Sum)));
        assert!(!a.supports(CollDataType::I32, Some(CollReduceOp::Max)));
        let a = a.ranks_per_node(2).size_range(1024, 1 << 20);
        assert_eq!(ExternalAlgorithm::ranks_per_node(&a), 2);
        assert_eq!(ExternalAlgorithm::size_range(&a), (1024, 1 << 20));

        let mut p = generate::plan(Algorithm::AllGather, 2, Protocol::Simple, false).unwrap();
        p.min_message_size = 16;
        p.max_message_size = 4096;
        let a = algo(p).unwrap();
        assert_eq!(a.collective(), Collective::AllGather);
        assert!(!a.in_place() && a.out_of_place());
        // MSCCL++'s bounds are inclusive; the selector's range is half-open.
        assert_eq!(ExternalAlgorithm::size_range(&a), (16, 4097));
        assert!(a.supports(CollDataType::F32, None) && !a.supports(CollDataType::F32, Some(CollReduceOp::Sum)));

        let a = algo(generate::plan(Algorithm::ReduceScatter, 3, Protocol::LL, false).unwrap()).unwrap();
        assert_eq!(a.collective(), Collective::ReduceScatter);
        assert_eq!(a.reduce_op(), Some(CollReduceOp::Sum));
    }

    #[test]
    fn plans_the_selector_cannot_call_are_refused() {
        let mut p = generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::Simple, true).unwrap();
        p.collective = "alltoall".into();
        let e = algo(p).err().unwrap();
        assert!(e.message().contains("alltoall"), "{e}");
    }
}
